"""Under a flood, everyone else is still served: mtaqueue's listener and Postfix's smtpd
side by side (issue 23, point 2).

    python bench/listener_stress.py [--scenarios a,b,c,d] [--probes 40] [--skip-postfix]

Each scenario runs against a fresh server with its defaults (mtaqueue: conf/mtaqueue.toml,
listen.max_connections 200; Postfix 3.7 in receive mode: default_process_limit 100,
smtpd_client_connection_count_limit 50 with smtpd_client_event_limit_exceptions empty, so
that the limit applies to loopback clients, which are otherwise exempt as mynetworks):

- a: 2,000 silent connections from one address in mynetworks (127.0.0.1): a leaking
  connection pool (those refused or closed are not opened again).
- b: 2,000 silent connections from 40 addresses (127.0.1.1-40), the same way.
- c: 500 slowloris clients (127.0.2.1): each sends one byte a second, never a whole line,
  and connects again RECONNECT (0.5) seconds after it is cut or refused.
- d: a and c together.

While the flood holds (after FLOOD_SETTLE seconds), a probe every PROBE_EVERY seconds from
an address of its own (127.0.0.200) and one from the flooding address (127.0.0.1), in
turn: a whole transaction (EHLO, MAIL, RCPT, DATA, the message, the final dot). A probe
succeeds with a 250 after the dot within 2 s of its connect. Printed per server and
scenario: the flood's connections open when the probes start and those greeted (220) in
all, successes of each kind with their p50 and max time, and (mtaqueue) the daemon's RSS
(with its writer) at idle and at its peak during the flood, and the messages in its queue
afterwards (every probe answered 250 must be there; "LOST" is printed otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO / "tests"))

from common import free_port, work_directory  # noqa: E402
from daemon_process import DaemonProcess  # noqa: E402
from postfix_instance import PostfixInstance, postfix_available  # noqa: E402

BOUND = 2.0  # seconds: a probe's transaction must be done by then
FLOOD_SETTLE = 4.0  # seconds the flood has before the probes
PROBE_EVERY = 0.25
RECONNECT = 0.5  # seconds a flood connection waits before it is opened again
OTHER = "127.0.0.200"
POOL = "127.0.0.1"
BODY = b"Subject: probe\r\nFrom: app@example.com\r\n\r\nprobe\r\n.\r\n"
SCENARIOS = {
    "a": "2,000 silent connections from one mynetworks address",
    "b": "2,000 silent connections from 40 addresses",
    "c": "500 slowloris clients",
    "d": "a and c together",
}


@dataclass
class Probes:
    times: dict[str, list[float]] = field(default_factory=lambda: {OTHER: [], POOL: []})
    failed: dict[str, list[str]] = field(default_factory=lambda: {OTHER: [], POOL: []})


async def _reply(reader: asyncio.StreamReader) -> bytes:
    """One whole reply (its last line has a space after the code); b"" if closed."""
    data = b""
    while True:
        line = await reader.readline()
        if not line:
            return data
        data += line
        if line[3:4] != b"-":
            return data


async def probe(host: str, port: int, source: str) -> tuple[bool, float, str]:
    started = time.monotonic()
    writer = None
    try:
        async with asyncio.timeout(BOUND):
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
            answer = await _reply(reader)
            for line in (b"EHLO probe.test", b"MAIL FROM:<app@example.com>",
                         b"RCPT TO:<a@example.org>", b"DATA"):  # fmt: skip
                if answer[:1] not in (b"2", b"3"):
                    break
                writer.write(line + b"\r\n")
                answer = await _reply(reader)
            if answer.startswith(b"354"):
                writer.write(BODY)
                answer = await _reply(reader)
        ok = answer.startswith(b"250")
        return ok, time.monotonic() - started, answer.decode(errors="replace").strip()[:60]
    except (TimeoutError, OSError) as exc:
        return False, time.monotonic() - started, type(exc).__name__
    finally:
        if writer is not None:
            writer.close()


FLOOD = {"open": 0, "greeted": 0}  # the flood's connections open now, and greeted in all


async def _hold(host: str, port: int, source: str, trickle: bool, stop: asyncio.Event) -> None:
    """One flood connection until `stop`. A slowloris client (`trickle`) opens another
    RECONNECT seconds after one is closed; a silent one (a leaked connection) does not."""
    while not stop.is_set():
        writer = None
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
            FLOOD["open"] += 1
            greeting = await reader.readline()
            FLOOD["greeted"] += greeting.startswith(b"220")
            while greeting.startswith(b"220") and not stop.is_set():
                if trickle:
                    writer.write(b"E")
                    await writer.drain()
                try:
                    async with asyncio.timeout(1.0):
                        if not await reader.read(4096) and reader.at_eof():
                            break  # closed by the server: open another
                except TimeoutError:
                    pass
        except OSError:
            pass
        finally:
            if writer is not None:
                FLOOD["open"] -= 1
                writer.close()
        if not trickle:
            await stop.wait()
            return
        await asyncio.sleep(RECONNECT)


def flood_tasks(scenario: str, host: str, port: int, stop: asyncio.Event) -> list[asyncio.Task]:
    plan: list[tuple[str, bool]] = []
    if scenario in ("a", "d"):
        plan += [(POOL, False)] * 2000
    if scenario == "b":
        plan += [(f"127.0.1.{1 + i % 40}", False) for i in range(2000)]
    if scenario in ("c", "d"):
        plan += [("127.0.2.1", True)] * 500
    return [asyncio.create_task(_hold(host, port, src, trickle, stop)) for src, trickle in plan]


async def run_scenario(scenario: str, host: str, port: int, probes: int, rss) -> dict:
    stop = asyncio.Event()
    FLOOD.update(open=0, greeted=0)
    tasks = flood_tasks(scenario, host, port, stop)
    peak = rss()
    settle = time.monotonic() + FLOOD_SETTLE
    while time.monotonic() < settle:
        await asyncio.sleep(0.25)
        peak = max(peak, rss())
    result = Probes()
    held = FLOOD["open"]
    for i in range(probes):
        source = OTHER if i % 2 == 0 else POOL
        ok, seconds, answer = await probe(host, port, source)
        (result.times if ok else result.failed)[source].append(seconds if ok else answer)
        peak = max(peak, rss())
        await asyncio.sleep(PROBE_EVERY)
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"probes": result, "rss_peak": peak, "held": held, "greeted": FLOOD["greeted"]}


def fmt_probes(p: Probes, source: str) -> str:
    ok, failed = p.times[source], p.failed[source]
    total = len(ok) + len(failed)
    if not ok:
        return f"0/{total} ({failed[:1]})"
    share = 100 * len(ok) / total
    return (
        f"{len(ok)}/{total} ({share:.0f}%), p50 {statistics.median(ok):.3f} s,"
        f" max {max(ok):.3f} s" + (f"; failed: {failed[0]}" if failed else "")
    )


def rss_of(daemon: int) -> int:
    """Resident KiB of the daemon and its children (the spool writer)."""
    total = 0
    for pid in children(daemon):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total


def children(pid: int) -> list[int]:
    found = [pid]
    with contextlib.suppress(OSError):
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            found.append(int(child))
    return found


def mtaqueue_rows(scenarios: list[str], probes: int) -> list[tuple[str, dict]]:
    rows = []
    config = (REPO / "conf" / "mtaqueue.toml").read_text()
    for scenario in scenarios:
        with work_directory("listener-stress-") as workdir:
            daemon = DaemonProcess(workdir, "delivery.enabled=false", config=config).start()
            try:
                assert daemon.proc is not None
                rss = functools.partial(rss_of, daemon.proc.pid)
                time.sleep(1.0)
                idle = rss()
                out = asyncio.run(run_scenario(scenario, "127.0.0.1", daemon.port, probes, rss))
                out["rss_idle"] = idle
                accepted = sum(len(t) for t in out["probes"].times.values())
                queued = len(daemon.messages())
                if queued != accepted:  # every 250 is a message on disk
                    print(f"LOST: {scenario}: {accepted} accepted, {queued} in the queue")
                out["queued"] = queued
                rows.append((scenario, out))
            finally:
                daemon.kill()
    return rows


def postfix_rows(scenarios: list[str], probes: int) -> list[tuple[str, dict]]:
    rows = []
    for scenario in scenarios:
        with work_directory("listener-stress-pf-") as workdir:
            port = free_port()
            main_cf = {"smtpd_client_event_limit_exceptions": ""}
            with PostfixInstance(
                workdir / "pf",
                listen=f"127.0.0.1:{port}",
                mode="receive",
                domains=("example.org",),
                main_cf=main_cf,
                maillog=False,
            ):
                out = asyncio.run(run_scenario(scenario, "127.0.0.1", port, probes, lambda: 0))
                rows.append((scenario, out))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default="a,b,c,d")
    parser.add_argument("--probes", type=int, default=40, help="per scenario, both kinds")
    parser.add_argument("--skip-postfix", action="store_true")
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    scenarios = [s for s in args.scenarios.split(",") if s]
    servers = [("mtaqueue", mtaqueue_rows(scenarios, args.probes))]
    if not args.skip_postfix:
        if postfix_available():
            servers.append(("Postfix", postfix_rows(scenarios, args.probes)))
        else:
            print("postfix: not available (needs root and Debian's postfix); skipped")
    print(f"\nRLIMIT_NOFILE {hard}; probes every {PROBE_EVERY} s after {FLOOD_SETTLE} s of flood")
    print(
        "| server | scenario | flood: open when probing / greeted in all | probes from another"
        " address | probes from the flooding address (127.0.0.1) | RSS idle -> peak, MiB;"
        " queued after |"
    )
    print("|---|---|---|---|---|---|")
    for name, rows in servers:
        for scenario, out in rows:
            p = out["probes"]
            rss = (
                f"{out['rss_idle'] / 1024:.0f} -> {out['rss_peak'] / 1024:.0f};"
                f" {out['queued']} queued"
                if "rss_idle" in out
                else "-"
            )
            print(
                f"| {name} | {scenario}: {SCENARIOS[scenario]} | {out['held']} / {out['greeted']} |"
                f" {fmt_probes(p, OTHER)} |"
                f" {fmt_probes(p, POOL)} | {rss} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
