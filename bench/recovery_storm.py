"""Outage recovery: a backlog released at a rate-limiting, greylisting mailbox provider.

    python bench/recovery_storm.py [--messages 12000] [--time-scale 0.01]
                                   [--skip-naive] [--skip-postfix] [--quick]

The story of the seeds: a relay was down, 12,000 messages (2% p0, 18% p1, 80% p2) piled up,
and then they all go out at once to one big provider. Time is compressed (`--time-scale`,
0.01 by default: 300 s of greylisting last 3 s) so a run takes minutes. In one run, each
against a fresh synthetic provider (`bench/synthetic_peer.py` as a subprocess, answering on
127.0.0.2 and 127.0.0.3, the two MX hosts of `provider.test`):

1. `mtaqueue` as an admin would run it: pacing for the provider (rate and burst) set a
   bit under its published limit (`[[shaping.destinations]] mx_suffix = ".provider.test"`),
   every
   retry/shaping/lifetime duration of the shipped defaults scaled by `--time-scale`.
2. `naive`: the same daemon with shaping neutralised by config (100 connections from the
   start, no rates, breaker and backoff mode off, retries after 10 ms, no restart spread):
   "resend everything now".
3. `postfix` (when installed and running as root): a private Postfix relaying to the same
   provider (`relayhost = [127.0.0.2]:PORT`), its retry timers scaled the same way and its
   destination concurrency set to the admin's connection count (`--postfix-concurrency`,
   0 for Postfix's stock 20); it has no rate knob that fits (whole seconds per message).

Each run: the MTA is filled while delivery is off (mtaqueue: `delivery.enabled = false`;
Postfix: `defer_transports = smtp`) by an SMTP submitter (20 sessions, one unique
Message-ID and an `X-Mtaqueue-Class` header per message, each message to its own mailbox:
every message is a new greylisting triplet). Release comes when the outage is over
(`--outage` seconds after the first submission, scaled): mtaqueue is restarted with
delivery on (the restart path: due times kept, p0 at once, the rest over
`retry.restart_spread`, then paced), Postfix is switched to relay and flushed. The queue is
sampled every 0.5 s until it is empty (or `--timeout`). Figures come from the provider's
report (every accepted message with its Message-ID and time, every 4xx/5xx) and from our
own records. Bounces (DSNs) go to `app.test`, routed to a separate sink on 127.0.0.4, and
are counted there: every one is a permanent failure caused by the sender's own behaviour
(no recipient in this scenario is invalid).

Theoretical minimum drain time. The provider counts one rate token per MAIL command, the
greylisted first attempt included; with N messages, each a new triplet, the fastest
possible sender needs 2N MAIL commands. A GCRA of rate r (tokens/s) and burst B admits the
k-th MAIL (k = 1, 2, ...) no sooner than max(0, k - B) / r after the release, and a
message's accepted attempt must come at least G (the greylist window) after its first
one, which is itself no sooner than (N - B) / r for the last of the N first attempts:

    T_min = max((2N - B) / r, (N - B) / r + G)

(the first term rules whenever N / r >= G, as here). Drain time / T_min is the ratio.

Unavoidable 4xx: one 450 per greylisting triplet (the provider's `triplets_seen`); every
other 4xx reply (421 rate limit or connection cap, a 450 repeated because a retry came
before the window ended) is "avoidable" and counted per delivered message.

Exit status: non-zero when a run breaks (a daemon dies, the submission fails, the provider
reports internal errors); missed targets are reported, not turned into failures.

Needs `pip install matplotlib` for the plots (`--no-plots` to skip). The plots go to
`--plots-dir` (default bench/results/): one PNG per run with the queue depth, deliveries/s
and rejections/s over time, and one comparing the queue depths.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO / "tests"))  # dns_server.DnsServer: a real DNS server on loopback

from common import free_port, port_in_use, stop_process, work_directory  # noqa: E402
from cpu_use import cpu_seconds  # noqa: E402
from postfix_instance import PostfixInstance, postfix_available  # noqa: E402
from synthetic_peer import SyntheticPeer  # noqa: E402

from mtaqueue.control import protocol  # noqa: E402

PROVIDER_IPS = ("127.0.0.2", "127.0.0.3")  # mx1/mx2.provider.test
SINK_IP = "127.0.0.4"  # app.test: where DSNs and Postfix bounces go
DOMAINS = ("example.org", "example.net", "example.com")  # all hosted by provider.test
SENDER = "app@app.test"
MTAQUEUE_PORT = free_port()  # not fixed: other benchmarks may run on this machine
POSTFIX_PORT = free_port()
SAMPLE = 0.5  # seconds between queue depth samples


# -- the scenario ------------------------------------------------------------------------


@dataclass
class Scenario:
    messages: int
    scale: float
    greylist: float  # unscaled seconds
    rate_count: int
    rate_period: float  # unscaled seconds
    peer_connections: int
    slow_banner_at: int | None
    blocklist_after: int | None  # connections or MAILs after a 421
    blocklist_for: float
    blocklist_window: float
    outage: float  # unscaled seconds
    admin_fraction: float  # mtaqueue's messages_per_minute and burst / the provider's
    admin_connections: int
    sessions: int
    size: int
    blocklist_throttles: int | None = None  # 421s within the window

    @property
    def g(self) -> float:  # greylist window, real seconds
        return self.greylist * self.scale

    @property
    def r(self) -> float:  # provider rate, messages per real second
        return self.rate_count / (self.rate_period * self.scale)

    @property
    def burst(self) -> int:
        return self.rate_count  # synthetic_peer's default burst

    @property
    def admin_burst(self) -> int:  # mtaqueue's bucket size for the provider
        return max(1, int(self.admin_fraction * self.burst))

    @property
    def t_min(self) -> float:
        n, b, r = self.messages, self.burst, self.r
        if not self.g:  # one MAIL a message
            return max(0, n - b) / r
        return max(max(0, 2 * n - b) / r, max(0, n - b) / r + self.g)

    def d(self, seconds: float) -> str:
        """An unscaled duration as a scaled config value."""
        return f"{seconds * self.scale:.6g}s"

    def peer_args(self) -> list[str]:
        optional = {
            "--slow-banner-at": self.slow_banner_at,
            "--blocklist-after": self.blocklist_after,
            "--blocklist-throttles": self.blocklist_throttles,
        }
        return [
            "--greylist", str(self.greylist),
            "--rate", f"{self.rate_count}/{self.rate_period:g}s",
            "--max-connections", str(self.peer_connections),
            *(arg for k, v in optional.items() if v is not None for arg in (k, str(v))),
            "--blocklist-for", str(self.blocklist_for),
            "--blocklist-window", str(self.blocklist_window),
            "--time-scale", str(self.scale),
        ]  # fmt: skip


@dataclass
class Planned:
    index: int
    klass: str
    message_id: str
    rcpt: str


def plan(n: int, tag: str) -> list[Planned]:
    """2% p0, 18% p1, 80% p2, interleaved in submission order; one mailbox per message."""
    out = []
    for i in range(n):
        slot = i % 50
        klass = "p0" if slot == 0 else "p1" if slot <= 9 else "p2"
        out.append(
            Planned(i, klass, f"<storm-{tag}-{i}@app.test>", f"user{i}@{DOMAINS[i % len(DOMAINS)]}")
        )
    return out


# -- submission ----------------------------------------------------------------------------


def _content(p: Planned, size: int) -> bytes:
    head = (
        f"From: App <{SENDER}>\r\nTo: <{p.rcpt}>\r\nSubject: storm {p.index} ({p.klass})\r\n"
        f"Message-ID: {p.message_id}\r\nDate: Mon, 30 Nov 2026 10:00:00 +0000\r\n"
        f"X-Mtaqueue-Class: {p.klass}\r\n\r\n"
    ).encode()
    line = b"x" * 76 + b"\r\n"
    return head + line * max(1, (size - len(head)) // len(line))


async def _reply(reader: asyncio.StreamReader) -> tuple[int, str]:
    lines = []
    while True:
        line = await reader.readline()
        if not line:
            raise ConnectionError("connection closed by the server")
        lines.append(line.decode("utf-8", "replace").rstrip("\r\n"))
        if line[3:4] != b"-":
            return int(line[:3]), "\n".join(lines)


async def _submit_session(host: str, port: int, todo: list[Planned], size: int, ids: dict) -> None:
    reader = writer = None
    while todo:
        p = todo.pop()
        for attempt in range(5):
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection(host, port)
                    code, text = await _reply(reader)
                    if code != 220:
                        raise ConnectionError(f"greeting: {text}")
                    writer.write(b"EHLO submitter.bench.test\r\n")
                    code, text = await _reply(reader)
                    if code != 250:
                        raise ConnectionError(f"EHLO: {text}")
                writer.write(f"MAIL FROM:<{SENDER}>\r\nRCPT TO:<{p.rcpt}>\r\nDATA\r\n".encode())
                replies = [await _reply(reader) for _ in range(3)]
                if [c for c, _ in replies] != [250, 250, 354]:
                    raise RuntimeError(f"refused {p.message_id}: {replies}")
                writer.write(_content(p, size) + b".\r\n")
                code, text = await _reply(reader)
                if code != 250:
                    raise RuntimeError(f"refused {p.message_id}: {text}")
                m = re.search(r"queued as (\S+)", text)
                ids[p.index] = m[1] if m else ""
                break
            except (ConnectionError, OSError) as exc:
                if writer is not None:
                    writer.close()
                reader = writer = None
                if attempt == 4:
                    raise RuntimeError(f"submission failed: {exc}") from exc
                await asyncio.sleep(0.2)
    if writer is not None:
        with contextlib.suppress(Exception):
            writer.write(b"QUIT\r\n")
            await _reply(reader)
        writer.close()


def submit(host: str, port: int, planned: list[Planned], sessions: int, size: int) -> float:
    """Submit every planned message over `sessions` SMTP sessions; returns the seconds."""
    todo = list(reversed(planned))  # pop() from the end: in plan order
    ids: dict[int, str] = {}

    async def run() -> None:
        await asyncio.gather(
            *(_submit_session(host, port, todo, size, ids) for _ in range(sessions))
        )

    started = time.monotonic()
    asyncio.run(run())
    if len(ids) != len(planned):
        raise RuntimeError(f"submitted {len(ids)} of {len(planned)}")
    return time.monotonic() - started


# -- the processes -------------------------------------------------------------------------


class PeerProcess:
    """bench/synthetic_peer.py as a subprocess (its own core and GIL)."""

    def __init__(self, workdir: Path, scenario: Scenario, duration: float) -> None:
        self.report_path = workdir / "peer-report.json"
        self.err_path = workdir / "peer.stderr"
        self.args = [
            sys.executable, str(BENCH / "synthetic_peer.py"),
            *(arg for ip in PROVIDER_IPS for arg in ("--listen", f"{ip}:0")),
            *scenario.peer_args(),
            "--duration", str(int(duration)),
            "--report", str(self.report_path),
        ]  # fmt: skip
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self) -> PeerProcess:
        with self.err_path.open("wb") as err:
            self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = re.search(r"listening on \S+:(\d+)", self.err_path.read_text())
            if m:
                self.port = int(m[1])
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"synthetic_peer exited: {self.err_path.read_text()}")
            time.sleep(0.05)
        raise RuntimeError("synthetic_peer did not start")

    def stop(self) -> dict[str, Any]:
        stop_process(self.proc, 60)
        self.proc = None
        return json.loads(self.report_path.read_text())


class Daemon:
    """mtaqueue as a subprocess, with a config file written for it."""

    def __init__(
        self,
        workdir: Path,
        name: str,
        config: dict[str, Any],
        overrides: tuple[str, ...] | list[str] = (),
    ) -> None:
        self.workdir = workdir
        self.overrides = [arg for item in overrides for arg in ("-o", item)]
        self.config_path = workdir / f"{name}.toml"
        self.config_path.write_text(dump_toml(config))
        self.log_path = workdir / f"{name}.log"
        self.socket = str(Path(config["spool"]["path"]) / "control.sock")
        self.port = int(config["listen"]["address"].rsplit(":", 1)[1])
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> float:
        if port_in_use("127.0.0.1", self.port):  # its 220 would not be ours
            raise RuntimeError(f"127.0.0.1:{self.port} is taken by another process")
        started = time.monotonic()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "mtaqueue.daemon",
                    "-c",
                    str(self.config_path),
                    *self.overrides,
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
                cwd=REPO,
            )
        while time.monotonic() - started < timeout:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock,
            ):
                if sock.recv(512).startswith(b"220"):
                    sock.sendall(b"QUIT\r\n")
                    return time.monotonic() - started
            self.check()
            time.sleep(0.02)
        raise RuntimeError("mtaqueue did not start")

    def check(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            tail = self.log_path.read_text()[-2000:]
            raise RuntimeError(f"mtaqueue exited with {self.proc.returncode}:\n{tail}")

    def ask(self, cmd: str, args: dict | None = None) -> list[dict[str, Any]]:
        with contextlib.closing(protocol.connect(self.socket, timeout=30)) as sock:
            return list(protocol.request(sock, cmd, args or {}))

    def stop(self) -> None:
        stop_process(self.proc, 90)
        self.proc = None


def dump_toml(data: dict[str, Any]) -> str:
    """Enough TOML for our configs: tables, arrays of tables, scalars, lists of scalars."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        raise TypeError(v)

    def table(prefix: str, d: dict[str, Any], out: list[str]) -> None:
        scalars = {k: v for k, v in d.items() if not isinstance(v, dict) and not _tables(v)}
        if prefix and (scalars or not d):
            out.append(f"[{prefix}]")
        for k, v in scalars.items():
            out.append(f"{json.dumps(k)} = {value(v)}")
        for k, v in d.items():
            name = f"{prefix}.{json.dumps(k) if '.' in k else k}" if prefix else k
            if isinstance(v, dict):
                table(name, v, out)
            elif _tables(v):
                for item in v:
                    out.append(f"[[{name}]]")
                    out.extend(f"{json.dumps(ik)} = {value(iv)}" for ik, iv in item.items())

    lines: list[str] = []
    table("", data, lines)
    return "\n".join(lines) + "\n"


def _tables(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


# -- mtaqueue configs ------------------------------------------------------------------------


def mtaqueue_config(
    s: Scenario,
    spool: Path,
    peer_port: int,
    sink_port: int,
    dns_address: str,
    naive: bool,
    admin: bool = True,
) -> dict[str, Any]:
    """The shipped defaults with every policy duration scaled; plus, for the shaped run, the
    provider's pacing as an admin would set it (unless not `admin`: the shipped config as it
    is, nothing said about the provider); for the naive run, shaping neutralised."""
    d = s.d
    cfg: dict[str, Any] = {
        "listen": {"address": f"127.0.0.1:{MTAQUEUE_PORT}", "hostname": "mtaqueue.bench.test"},
        "spool": {"path": str(spool)},
        "log": {"level": "info"},
        "dns": {"nameservers": [dns_address]},
        "delivery": {
            "enabled": True,
            "port": peer_port,
            "helo_name": "mtaqueue.bench.test",
            "host_suspend": d(60),
            "host_suspend_max": d(3600),
        },
        "routes": {"app.test": f"[{SINK_IP}]:{sink_port}"},
        "retry": {
            "schedule": [d(300), d(900), d(1800), d(3600)],
            "then": [d(4 * 3600), d(6 * 3600)],
            "greylist_min": d(300),
            "restart_spread": d(60),
        },
        "shaping": {
            "backoff_duration": d(900),
            "breaker_window": d(60),
            "breaker_cooldown": d(30),
            "breaker_cooldown_max": d(1800),
            "release_spread": d(30),
            "destinations": [
                {
                    "mx_suffix": ".provider.test",
                    # The provider publishes rate_count per rate_period; the admin sets a bit
                    # under it (per real minute, since the run is time-compressed), and the
                    # same fraction of the burst it allows (a window's worth of messages).
                    "messages_per_minute": round(s.admin_fraction * s.r * 60, 1),
                    "burst": s.admin_burst,
                    "max_connections": s.admin_connections,
                }
            ],
        },
        "dsn": {"delay_after": d(4 * 3600), "lifetime": d(2 * 86400)},
        "classes": {
            "p0": {"lifetime": d(4 * 3600)},
            "p1": {"lifetime": d(5 * 86400)},
            "p2": {"lifetime": d(2 * 86400)},
        },
    }
    if not admin:
        del cfg["shaping"]["destinations"]
    if naive:
        cfg["delivery"].update({"host_suspend": "0s", "host_suspend_max": "0s"})
        cfg["retry"].update(
            {"schedule": ["10ms"], "then": ["10ms", "10ms"], "greylist_min": "0s",
             "jitter": 0.0, "restart_spread": "0s"}
        )  # fmt: skip
        cfg["shaping"] = {
            "latency_factor": 1e9,
            "backoff_rate_factor": 1.0,
            "backoff_retry_factor": 1.0,
            "breaker_failures": 1_000_000,
            "default": {
                "max_connections": 100,
                "initial_connections": 100,
                "messages_per_minute": 0,
                "connections_per_minute": 0,
                "reserved_p0": 0,
            },
        }
    return cfg


# -- one run -----------------------------------------------------------------------------


@dataclass
class Run:
    name: str
    label: str
    planned: list[Planned]
    release: float = 0.0  # epoch seconds
    submit_s: float = 0.0
    startup_s: float = 0.0  # release -> the MTA is up again
    drained_at: float | None = None  # seconds after release, queue first seen empty
    depth: list[tuple[float, int]] = field(default_factory=list)  # (s after release, queued)
    states: list[tuple[float, dict]] = field(default_factory=list)  # mtaqueue `domains`
    # (t, seconds the depth query took, CPU s of the MTA, CPU s of the provider, I/O stall s)
    probes: list[tuple] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)  # the provider's
    dsns: int = 0  # failure notices received at app.test
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def wait_outage(first_submit: float, s: Scenario) -> None:
    left = first_submit + s.outage * s.scale - time.time()
    if left > 0:
        time.sleep(left)


def io_stall_total() -> float | None:
    """Seconds all non-idle tasks were stalled on I/O since boot (PSI "full"), or None."""
    try:
        for line in Path("/proc/pressure/io").read_text().splitlines():
            if line.startswith("full"):
                return int(line.rsplit("total=", 1)[1]) / 1e6
    except (OSError, ValueError, IndexError):
        pass
    return None


def sample_until_drained(
    run: Run, count, timeout: float, states=None, check=None, pids=(), settle: int = 2
) -> None:
    """Sample the queue depth every SAMPLE s until it is 0 twice or `timeout` passes. Each
    sample also keeps, for the diagnosis of pauses: how long the query took, the CPU seconds
    of `pids` (the MTA, the provider) and the machine's I/O stall seconds (PSI)."""
    zeros = 0
    while True:
        if check is not None:
            check()
        now = time.time()
        t = now - run.release
        n = count()
        asked = time.time() - now
        run.depth.append((round(t, 3), n))
        run.probes.append(
            (round(t, 3), round(asked, 4), *(cpu_seconds(pid) for pid in pids), io_stall_total())
        )
        if states is not None:
            with contextlib.suppress(Exception):
                run.states.append((round(t, 3), states()))
        zeros = zeros + 1 if n == 0 else 0
        if zeros == 1:
            run.drained_at = t
        if zeros >= settle:
            return
        if t > timeout:
            run.notes.append(f"not drained after {timeout:.0f} s: {n} messages left")
            return
        time.sleep(max(0.0, SAMPLE - (time.time() - now)))


def run_mtaqueue(
    s: Scenario,
    workdir: Path,
    naive: bool,
    timeout: float,
    tag: str,
    overrides: tuple[str, ...] | list[str] = (),
    admin: bool = True,
    learned: Path | None = None,
) -> Run:
    """`learned`: the learned.json of an earlier run at this provider, which the daemon
    starts with (the next outage's recovery, at a destination it knows)."""

    name = "naive" if naive else "mtaqueue" if admin else "shipped"
    label = (
        "mtaqueue, shaping off (naive)"
        if naive
        else "mtaqueue (shaped)"
        if admin
        else "mtaqueue (shipped config)"
    )
    if learned is not None:
        name, label = f"{name}-again", label.replace(")", ", again with what it learned)")
    run = Run(name, label, plan(s.messages, tag))
    workdir = workdir / name
    workdir.mkdir()
    peer = PeerProcess(workdir, s, duration=s.outage * s.scale + timeout + 600).start()
    sink = SyntheticPeer([f"{SINK_IP}:0"]).start()
    dns = provider_dns(peer.port)
    daemon = None
    try:
        cfg = mtaqueue_config(s, workdir / "spool", peer.port, sink.port, dns.address, naive, admin)
        if learned is not None:
            carry_learned(learned, workdir / "spool", peer.port)
        daemon = queue_and_release(run, s, workdir, cfg, overrides)
        drain_mtaqueue(run, daemon, peer, timeout)
    except Exception as exc:  # the run broke: keep what we have
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        if daemon is not None:
            daemon.stop()
        stop_provider_dns(dns)
        keep_reports(run, sink, peer)
    run.extra["log"] = read_daemon_log(workdir / "release.log")
    return run


# MTAQUEUE_BENCH_PATH_DELAY_MS=N puts a delay proxy (delay_proxy.py, N ms each way) in
# front of each provider host: the MX records name 127.0.0.1x instead (mtaqueue's runs).
PATH_DELAY_MS = float(os.environ.get("MTAQUEUE_BENCH_PATH_DELAY_MS", "0"))
PATH_PROXIES: list = []


def provider_dns(port: int | None = None):
    """A DNS server on loopback: DOMAINS hosted at mx1, mx2.provider.test (PROVIDER_IPS),
    or at delay proxies in front of them (PATH_DELAY_MS, given the provider's `port`)."""
    from dns_server import DnsServer

    dns = DnsServer().start()
    for domain in DOMAINS:
        for i in range(len(PROVIDER_IPS)):
            dns.add(domain, "MX", f"10 mx{i + 1}.provider.test")
    for i, ip in enumerate(PROVIDER_IPS):
        if PATH_DELAY_MS and port is not None:
            from delay_proxy import DelayProxy

            front = ip.rsplit(".", 1)[0] + f".1{ip.rsplit('.', 1)[1]}"
            proxy = DelayProxy(f"{front}:{port}", f"{ip}:{port}", PATH_DELAY_MS / 1000)
            PATH_PROXIES.append(proxy.__enter__())
            ip = front
        dns.add(f"mx{i + 1}.provider.test", "A", ip)
    return dns


def stop_provider_dns(dns) -> None:
    """The DNS server of `provider_dns` stopped, and its delay proxies (if any)."""
    dns.stop()
    for proxy in PATH_PROXIES:
        proxy.__exit__()
    PATH_PROXIES.clear()


def keep_reports(run: Run, sink: SyntheticPeer, peer) -> None:
    """A run's end: the DSN sink's and the provider's reports kept, both stopped."""
    run.dsns = sink.stop()["messages"]["accepted"]
    run.report = peer.stop()


def drain_mtaqueue(run: Run, daemon: Daemon, peer: PeerProcess, timeout: float) -> None:
    """Sample mtaqueue's queue until it is empty (or `timeout`); what is left, if any."""
    sample_until_drained(
        run,
        lambda: daemon.ask("status")[0]["messages"],
        timeout,
        states=lambda: daemon.ask("domains"),
        check=daemon.check,
        pids=(daemon.proc.pid if daemon.proc else None, peer.proc.pid if peer.proc else None),
    )
    if run.drained_at is None:
        left: Counter = Counter()
        for msg in daemon.ask("list"):
            for rcpt in msg["recipients"]:
                left[(msg["class"], rcpt["state"], rcpt.get("last_reply") or "")] += 1
        run.extra["left"] = left.most_common(10)


def carry_learned(learned: Path, spool: Path, port: int) -> None:
    """Put an earlier run's learned.json in `spool`, its destinations (keyed by the MX
    hosts and the delivery port) moved to this run's provider port."""
    data = json.loads(learned.read_text())
    data["destinations"] = {
        re.sub(r":\d+$", f":{port}", key): lesson for key, lesson in data["destinations"].items()
    }
    spool.mkdir(parents=True, exist_ok=True)
    (spool / "learned.json").write_text(json.dumps(data))


def queue_and_release(
    run: Run,
    s: Scenario,
    workdir: Path,
    cfg: dict[str, Any],
    overrides: tuple[str, ...] | list[str] = (),
) -> Daemon:
    """The storm's first steps with mtaqueue: the backlog queued with delivery off (the
    outage), then the daemon started again with delivery on (the release). Returns the
    running daemon; after an error none is left running."""
    cfg["delivery"]["enabled"] = False
    daemon = Daemon(workdir, "outage", cfg)
    try:
        daemon.start()
        first = time.time()
        run.submit_s = submit("127.0.0.1", MTAQUEUE_PORT, run.planned, s.sessions, s.size)
        queued = daemon.ask("status")[0]["messages"]
        if queued != s.messages:
            raise RuntimeError(f"mtaqueue queued {queued} of {s.messages}")
    finally:
        daemon.stop()
    wait_outage(first, s)
    cfg["delivery"]["enabled"] = True
    daemon = Daemon(workdir, "release", cfg, overrides)
    run.release = time.time()
    try:
        run.startup_s = daemon.start()
    except BaseException:
        daemon.stop()
        raise
    return daemon


def postfix_sender(
    s: Scenario, workdir: Path, sink_port: int, extra: dict[str, str] | None = None, **options
) -> PostfixInstance:
    """A stock Postfix as the sender, deferring everything (the outage): its retry timers
    scaled like mtaqueue's (defaults 300 s, 4000 s, 300 s, 5 d; whole seconds, as Postfix
    takes them), bounces to the DSN sink rather than the provider; `extra` main.cf."""

    def d(seconds: float) -> str:
        return f"{max(1, round(seconds * s.scale))}s"

    main_cf = {
        "minimal_backoff_time": d(300),
        "maximal_backoff_time": d(4000),
        "queue_run_delay": d(300),
        "maximal_queue_lifetime": d(5 * 86400),
        "bounce_queue_lifetime": d(5 * 86400),
        "transport_maps": f"inline:{{ app.test=smtp:[{SINK_IP}]:{sink_port} }}",
        "smtp_helo_name": "postfix.bench.test",
        **(extra or {}),
    }
    listen = f"127.0.0.1:{POSTFIX_PORT}"
    return PostfixInstance(workdir, listen=listen, mode="defer", main_cf=main_cf, **options)


def release_postfix(
    run: Run, pf: PostfixInstance, s: Scenario, relay: str, timeout: float, pids=()
) -> None:
    """The storm with a Postfix sender (`postfix_sender`): the backlog queued while it
    defers, then relayed to `relay` and flushed at once (the release), sampled until
    drained. An error is kept in run.error; `pf` is stopped either way."""
    try:
        pf.start()
        first = time.time()
        run.submit_s = submit("127.0.0.1", POSTFIX_PORT, run.planned, s.sessions, s.size)
        pf.wait_settled(120)
        queued = pf.queue_count()
        if queued != s.messages:
            raise RuntimeError(f"postfix queued {queued} of {s.messages}")
        wait_outage(first, s)
        # pf.set_mode("relay", ...) with the release taken between "stop" and "start": once
        # started in relay mode, qmgr may send deferred mail before postqueue -f comes.
        pf.mode, pf.relay = "relay", relay
        pf._write_config()
        pf._postfix("stop", timeout=30)
        pf._waitport_free()
        run.release = time.time()
        pf._postfix("start", timeout=60)
        pf.flush()
        run.startup_s = time.time() - run.release
        sample_until_drained(run, pf.queue_count, timeout, pids=pids)
        run.extra["log"] = read_postfix_log(pf.maillog)
    except Exception as exc:
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(Exception):
            if "log" not in run.extra and pf.maillog.exists():
                run.extra["log"] = read_postfix_log(pf.maillog)
        pf.stop()


def run_postfix(s: Scenario, workdir: Path, timeout: float, tag: str, concurrency: int) -> Run:
    label = f"Postfix (concurrency {concurrency})" if concurrency else "Postfix (stock)"
    run = Run("postfix", label, plan(s.messages, tag))
    workdir = workdir / "postfix"
    workdir.mkdir()
    workdir.chmod(0o755)
    peer = PeerProcess(workdir, s, duration=s.outage * s.scale + timeout + 600).start()
    sink = SyntheticPeer([f"{SINK_IP}:0"]).start()
    extra = {}
    if concurrency:
        # The one pacing knob Postfix has that fits here: the admin's connection count. Its
        # rate knob (smtp_destination_rate_delay) counts whole seconds between deliveries.
        extra["smtp_destination_concurrency_limit"] = str(concurrency)
        extra["smtp_initial_destination_concurrency"] = str(min(5, concurrency))
    pf = postfix_sender(s, workdir / "pfx", sink.port, extra)
    try:
        relay = f"{PROVIDER_IPS[0]}:{peer.port}"
        release_postfix(run, pf, s, relay, timeout, pids=(None, peer.proc.pid))
    finally:
        keep_reports(run, sink, peer)
    return run


def read_daemon_log(path: Path) -> dict[str, Any]:
    """Counts from mtaqueue's JSON log: attempts at the provider by outcome/kind/reply, the
    attempts to deliver the DSNs (to the sender at app.test, the DSN sink) apart, and other
    events."""
    attempts: Counter = Counter()
    dsn_attempts: Counter = Counter()
    events: Counter = Counter()
    permanent: set[str] = set()
    if not path.exists():
        return {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        name = e.get("event")
        events[name] += 1
        if name == "delivery":
            code = f"{e.get('code')} {e.get('enhanced') or ''}".strip()
            key = (e.get("outcome"), e.get("kind"), e.get("phase"), code)
            if e.get("rcpt", "").endswith("@app.test"):
                dsn_attempts[key] += 1  # a bounce on its way to the sender, not the backlog
                continue
            attempts[key] += 1
            if e.get("outcome") == "permanent":
                permanent.add(e["id"])
        elif name == "expired":
            permanent.add(e.get("id"))
    return {
        "attempts": [[*k, n] for k, n in attempts.most_common()],
        "dsn_attempts": [[*k, n] for k, n in dsn_attempts.most_common()],
        "events": dict(events.most_common()),
        "permanent_messages": len(permanent),
    }


def read_postfix_log(path: Path) -> dict[str, Any]:
    statuses: Counter = Counter()
    reasons: Counter = Counter()
    for line in path.read_text(errors="replace").splitlines():
        m = re.search(r" to=<[^>]*@([^>]*)>.* status=(\w+) \((.*)\)", line)
        if not m or m[1] == "app.test" or m[3] == "deferred transport":
            continue  # bounces to the sender; the outage (defer mode)
        statuses[m[2]] += 1
        reason = re.sub(r"\d+", "N", m[3])[:110]
        reasons[(m[2], reason)] += 1
    return {"statuses": dict(statuses), "reasons": [[*k, n] for k, n in reasons.most_common(8)]}


# -- figures -------------------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float | None:
    """Nearest rank."""
    if not values:
        return None
    values = sorted(values)
    return values[max(0, math.ceil(p / 100 * len(values)) - 1)]


def figures(run: Run, s: Scenario) -> dict[str, Any]:
    rep = run.report
    by_id = {p.message_id: p for p in run.planned}
    first: dict[str, float] = {}
    fields = rep.get("timeline_fields", [])
    t_i, id_i = fields.index("time"), fields.index("message_id")
    for row in rep.get("timeline", []):
        mid = row[id_i]
        if mid in by_id and mid not in first:
            first[mid] = row[t_i] - run.release
    latency: dict[str, list[float]] = {"p0": [], "p1": [], "p2": []}
    for mid, t in first.items():
        latency[by_id[mid].klass].append(t)
    delivered = len(first)
    replies = rep.get("replies", {})
    fourxx = rep.get("reply_classes", {}).get("4xx", 0)
    triplets = rep.get("greylist", {}).get("triplets_seen", 0)
    avoidable = fourxx - triplets
    last = max(first.values()) if first else None
    drain = last if run.drained_at is not None and last is not None else None
    failed = run.dsns
    log = run.extra.get("log", {})
    if run.name == "postfix":
        failed_log = sum(
            n for k, n in log.get("statuses", {}).items() if k in ("bounced", "expired")
        )
    else:
        failed_log = log.get("permanent_messages")
    p0_count = sum(p.klass == "p0" for p in run.planned)
    first_attempt, pause = sending_pause(run)
    return {
        "delivered": delivered,
        "not_delivered": s.messages - delivered,
        "failed_dsn": failed,
        "failed_log": failed_log,
        "blocklist_hits": rep.get("blocklist", {}).get("hits", 0),
        "blocklistings": rep.get("blocklist", {}).get("listings", 0),
        "duplicates": rep.get("messages", {}).get("duplicate_deliveries", 0),
        "drain_s": drain,
        "last_delivery_s": last,
        "drained_at_s": run.drained_at,
        "ratio": drain / s.t_min if drain else None,
        "fourxx": fourxx,
        "greylist_triplets": triplets,
        "greylist_450": replies.get("450 4.2.0", 0),
        "rate_421": replies.get("421 4.7.28", 0),
        "conn_421": rep.get("connection_limited", 0),
        "blocked_550": replies.get("550 5.7.1", 0),
        "avoidable_4xx": avoidable,
        "avoidable_per_delivered": avoidable / delivered if delivered else None,
        "p0_delivered": len(latency["p0"]),
        "p0_total": p0_count,
        "p0_p50": percentile(latency["p0"], 50),
        "p0_p99": percentile(latency["p0"], 99),
        "p0_max": max(latency["p0"]) if latency["p0"] else None,
        "p1_p50": percentile(latency["p1"], 50),
        "p2_p50": percentile(latency["p2"], 50),
        "p2_p99": percentile(latency["p2"], 99),
        "connections": rep.get("connections", {}).get("total", 0),
        "max_concurrent": rep.get("connections", {}).get("max_concurrent_per_client", 0),
        "peer_errors": len(rep.get("errors", [])),
        "first_attempt_s": first_attempt,
        "longest_pause": pause,
    }


def sending_pause(run: Run) -> tuple[float | None, dict | None]:
    """When the provider saw the first MAIL of the run (accepted or refused), and the
    longest stretch without any (after the first, before the last), with what the probes
    saw meanwhile: the slowest depth query, the MTA's and the provider's CPU seconds, and
    the machine's I/O stall seconds."""
    rep = run.report
    times = sorted(
        [row[0] for row in rep.get("timeline", [])]
        + [row[0] for row in rep.get("rejections", []) if row[1] != "550 5.7.1"]
    )
    if not times:
        return None, None
    gaps = [(b - a, a) for a, b in itertools.pairwise(times)]
    if not gaps:
        return times[0] - run.release, None
    length, start = max(gaps)
    start -= run.release
    end = start + length
    inside = [p for p in run.probes if start - SAMPLE <= p[0] <= end + SAMPLE]
    pause: dict[str, Any] = {"from_s": round(start, 2), "seconds": round(length, 2)}
    if inside:
        pause["slowest_query_s"] = max(p[1] for p in inside)

        def used(i: int) -> float | None:
            values = [p[i] for p in inside if p[i] is not None]
            return round(values[-1] - values[0], 2) if len(values) > 1 else None

        pause["mta_cpu_s"] = used(2)
        pause["provider_cpu_s"] = used(3)
        pause["io_stall_s"] = used(4)
    return times[0] - run.release, pause


def targets(f: dict[str, Any], s: Scenario) -> dict[str, bool | None]:
    def le(value, limit):
        return None if value is None else value <= limit

    p99 = f["p0_p99"] if f["p0_delivered"] == f["p0_total"] else math.inf
    return {
        "failed": f["failed_dsn"] == 0 and f["not_delivered"] == 0,
        "blocklist": f["blocklist_hits"] == 0,
        "duplicates": f["duplicates"] == 0,
        "ratio": le(f["ratio"], 1.15) if f["ratio"] is not None else False,
        "avoidable": le(f["avoidable_per_delivered"], 0.05),
        "p0": le(p99, s.g + 2.0),
    }


def fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def table(runs: list[Run], s: Scenario) -> str:
    rows = [
        ("delivered", lambda f: f"{f['delivered']} / {s.messages}", None),
        ("permanently failed, our behaviour (DSNs)", lambda f: fmt(f["failed_dsn"]), "failed"),
        ("blocklist hits (550 5.7.1) / listings",
         lambda f: f"{f['blocklist_hits']} / {f['blocklistings']}", "blocklist"),
        ("duplicate deliveries", lambda f: fmt(f["duplicates"]), "duplicates"),
        ("drain time, s (release -> last delivery)", lambda f: fmt(f["drain_s"], 1), None),
        (f"drain / T_min ({s.t_min:.1f} s)", lambda f: fmt(f["ratio"]), "ratio"),
        ("4xx replies, all", lambda f: fmt(f["fourxx"]), None),
        ("  of which unavoidable (1 greylist 450 per triplet)",
         lambda f: fmt(f["greylist_triplets"]), None),
        ("  avoidable: repeated 450 / 421 4.7.28 rate / 421 4.7.0 connections",
         lambda f: f"{f['greylist_450'] - f['greylist_triplets']} / {f['rate_421']}"
         f" / {f['conn_421']}", None),
        ("avoidable 4xx per delivered message", lambda f: fmt(f["avoidable_per_delivered"], 3),
         "avoidable"),
        ("p0 latency from release, p50 / p99 (max), s",
         lambda f: f"{fmt(f['p0_p50'])} / {fmt(f['p0_p99'])} ({fmt(f['p0_max'])})"
         + ("" if f["p0_delivered"] == f["p0_total"]
            else f", {f['p0_total'] - f['p0_delivered']} p0 undelivered"), "p0"),
        ("p1 p50, p2 p50 / p99, s",
         lambda f: f"{fmt(f['p1_p50'], 1)}, {fmt(f['p2_p50'], 1)} / {fmt(f['p2_p99'], 1)}", None),
        ("connections opened (peak concurrent)",
         lambda f: f"{f['connections']} ({f['max_concurrent']})", None),
        ("first MAIL at the provider after release, s", lambda f: fmt(f["first_attempt_s"]),
         None),
        ("longest pause in sending, s (from)",
         lambda f: "-" if not f["longest_pause"] else
         f"{f['longest_pause']['seconds']:.2f} ({f['longest_pause']['from_s']:.1f})", None),
    ]  # fmt: skip
    figs = [(figures(r, s), r) for r in runs]
    marks = [targets(f, s) for f, _ in figs]
    out = ["| | " + " | ".join(r.label for r in runs) + " |", "|---" * (len(runs) + 1) + "|"]
    for title, get, target in rows:
        cells = []
        for (f, _), m in zip(figs, marks, strict=True):
            cell = get(f)
            if target is not None and m[target] is not None:
                cell += " ✓" if m[target] else " ✗"
            cells.append(cell)
        out.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(out)


# -- plots ---------------------------------------------------------------------------------


def per_second(times: list[float], end: float) -> tuple[list[float], list[int]]:
    bins = [0] * (int(end) + 1)
    for t in times:
        if 0 <= t <= end:
            bins[int(t)] += 1
    return [i + 0.5 for i in range(len(bins))], bins


def plot(runs: list[Run], s: Scenario, outdir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)
    paths = []
    end = max(
        [r.depth[-1][0] for r in runs if r.depth] + [f["last_delivery_s"] or 0 for f in
         (figures(r, s) for r in runs)] + [s.t_min]
    ) + 2  # fmt: skip
    for run in runs:
        f = figures(run, s)
        run_end = max([run.depth[-1][0] if run.depth else 0, f["last_delivery_s"] or 0, s.t_min])
        run_end = run_end * 1.03 + 2
        rep = run.report
        ids = {p.message_id for p in run.planned}
        fields = rep.get("timeline_fields", [])
        t_i, id_i = fields.index("time"), fields.index("message_id")
        seen: set[str] = set()
        delivered = []
        for row in rep.get("timeline", []):
            if row[id_i] in ids and row[id_i] not in seen:
                seen.add(row[id_i])
                delivered.append(row[t_i] - run.release)
        rejections: dict[str, list[float]] = {}
        for t, reply, _ in rep.get("rejections", []):
            rejections.setdefault(reply, []).append(t - run.release)
        fig, (ax, ax2) = plt.subplots(
            2, 1, figsize=(8, 5.6), dpi=80, sharex=True, height_ratios=[1, 1.15]
        )
        if run.depth:
            ax.plot(*zip(*run.depth, strict=True), color="tab:blue", lw=1.8)
        ax.set_ylabel("messages queued")
        ax.set_ylim(0, s.messages * 1.05)
        ax.set_xlim(0, run_end)
        for a in (ax, ax2):
            a.axvline(s.t_min, color="grey", ls=":", lw=1)
            a.grid(alpha=0.3)
        ax.text(s.t_min, s.messages * 1.0, " T_min", color="grey", fontsize=8, va="top")
        x, y = per_second(delivered, run_end)
        ax2.step(x, y, where="mid", color="tab:green", lw=1.2, label="delivered (ours)")
        colors = {"450 4.2.0": "0.6", "421 4.7.28": "tab:red", "421 4.7.0": "tab:orange",
                  "550 5.7.1": "black"}  # fmt: skip
        for reply, color in colors.items():
            if rejections.get(reply):
                x, y = per_second(rejections[reply], run_end)
                ax2.step(x, y, where="mid", color=color, lw=0.9, label=reply)
        ax2.axhline(s.r, color="tab:green", ls="--", lw=0.8, label="provider rate")
        ax2.set_yscale("symlog", linthresh=10)
        ax2.set_ylim(0, None)
        ax2.set_ylabel("per second")
        ax2.set_xlabel("seconds after release")
        ax2.legend(loc="upper right", fontsize=7, ncol=3)
        ratio = f"{f['ratio']:.2f}" if f["ratio"] else "n/a"
        ax.set_title(
            f"{run.label}: {f['delivered']}/{s.messages} delivered, {f['failed_dsn']} bounced\n"
            f"drain/T_min {ratio}, avoidable 4xx {f['avoidable_4xx']},"
            f" blocklist hits {f['blocklist_hits']}, p0 p99 {fmt(f['p0_p99'])} s",
            fontsize=9,
        )
        fig.tight_layout()
        path = outdir / f"recovery_storm_{run.name}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    series = []
    for run in runs:
        f = figures(run, s)
        label = f"{run.label}: {f['delivered']} delivered, {f['failed_dsn']} bounced"
        series.append((label, run.depth))
    paths.append(plot_depth(series, s, end, outdir / "recovery_storm_depth.png"))
    return paths


def plot_depth(series: list[tuple[str, list]], s: Scenario, end: float, path: Path) -> Path:
    """The queue depths of the runs in one figure: (label, [(t, depth), ...]) each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=80)
    for (label, depth), color in zip(series, ("tab:blue", "tab:red", "tab:purple"), strict=False):
        if depth:
            ax.plot(*zip(*depth, strict=True), color=color, lw=1.6, label=label)
    ax.axvline(s.t_min, color="grey", ls=":", lw=1, label="T_min")
    ax.set_xlabel("seconds after release")
    ax.set_ylabel("messages queued (delivered or bounced)")
    ax.set_xlim(0, end)
    ax.set_ylim(0, s.messages * 1.05)
    ax.legend(fontsize=8)
    ax.set_title(f"Queue depth after the outage: {s.messages} messages", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


# -- main ----------------------------------------------------------------------------------


def describe(s: Scenario) -> str:
    return (
        f"{s.messages} messages (2% p0, 18% p1, 80% p2), each to its own mailbox, time scale "
        f"{s.scale:g}; provider: greylist {s.greylist:g} s (= {s.g:g} s), rate "
        f"{s.rate_count}/{s.rate_period:g} s (= {s.r:g} msg/s, burst {s.burst}), max "
        f"{s.peer_connections} connections, slow replies above {s.slow_banner_at}, blocklist "
        f"after {s.blocklist_after} connections or MAILs within {s.blocklist_window:g} s "
        f"(= {s.blocklist_window * s.scale:g} s) of a 421, for {s.blocklist_for:g} s "
        f"(= {s.blocklist_for * s.scale:g} s); outage {s.outage:g} s "
        f"(= {s.outage * s.scale:g} s); mtaqueue pacing "
        f"{s.admin_fraction * s.r * 60:g}/min, burst {s.admin_burst} ({s.admin_fraction:.0%} "
        f"of the provider's), {s.admin_connections} connections; T_min = {s.t_min:.1f} s"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--messages", type=int, default=12000)
    add("--quick", action="store_true", help="smoke run: --messages 1200 unless given")
    add("--time-scale", type=float, default=0.01, help="policy windows x this (default 0.01)")
    add("--greylist", type=float, default=300, help="provider greylist window, unscaled s")
    add("--rate", default="120/60", help="provider rate COUNT/SECONDS, unscaled (120/60)")
    add("--peer-connections", type=int, default=10, help="provider's per-IP connection cap")
    add("--blocklist-after", type=int, default=60)
    add("--blocklist-for", type=float, default=600, help="unscaled seconds")
    add("--blocklist-window", type=float, default=60, help="unscaled seconds")
    add("--outage", type=float, default=2400, help="unscaled seconds (40 min)")
    add(
        "--admin-fraction",
        type=float,
        default=0.95,
        help="mtaqueue messages_per_minute as a fraction of the provider's rate (0.95)",
    )
    add("--admin-connections", type=int, default=5)
    add("--sessions", type=int, default=20)
    add("--size", type=int, default=2048)
    add("--timeout", type=float, help="per-run drain timeout, s (default 5 x T_min + 60)")
    add(
        "--postfix-concurrency",
        type=int,
        help="smtp_destination_concurrency_limit (default: --admin-connections; 0: stock 20)",
    )
    add(
        "--mq-option",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="extra -o for the shaped mtaqueue run after the release (experiments)",
    )
    add("--skip-mtaqueue", action="store_true")
    add("--skip-naive", action="store_true")
    add("--skip-postfix", action="store_true")
    add("--plots-dir", default=str(BENCH / "results"))
    add("--no-plots", action="store_true")
    add("--json", metavar="FILE", help="write the figures (not the raw reports) as JSON")
    add("--keep", action="store_true", help="keep the work directory (reports, logs)")
    args = parser.parse_args()  # fmt: skip
    if args.quick and "--messages" not in sys.argv:
        args.messages = 1200
    count, _, period = args.rate.partition("/")
    s = Scenario(
        messages=args.messages,
        scale=args.time_scale,
        greylist=args.greylist,
        rate_count=int(count),
        rate_period=float(period or 60),
        peer_connections=args.peer_connections,
        slow_banner_at=max(1, args.peer_connections - 2),
        blocklist_after=args.blocklist_after,
        blocklist_for=args.blocklist_for,
        blocklist_window=args.blocklist_window,
        outage=args.outage,
        admin_fraction=args.admin_fraction,
        admin_connections=args.admin_connections,
        sessions=args.sessions,
        size=args.size,
    )
    timeout = args.timeout or 5 * s.t_min + 60
    print(describe(s), flush=True)
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    tag = time.strftime("%H%M%S")
    runs: list[Run] = []
    with work_directory("recovery-storm-", keep=args.keep) as workdir:
        if not args.skip_mtaqueue:
            runs.append(run_mtaqueue(s, workdir, False, timeout, tag + "m", args.mq_option))
            print_run(runs[-1], s)
        if not args.skip_naive:
            runs.append(run_mtaqueue(s, workdir, True, timeout, tag + "n"))
            print_run(runs[-1], s)
        if not args.skip_postfix:
            if postfix_available():
                concurrency = args.postfix_concurrency
                if concurrency is None:
                    concurrency = args.admin_connections
                runs.append(run_postfix(s, workdir, timeout, tag + "p", concurrency))
                print_run(runs[-1], s)
            else:
                print("postfix: not available (needs root and Debian's postfix); skipped")
    if not runs:
        return 0
    print()
    print(table(runs, s))
    load = os.getloadavg()
    print(f"\nload average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if not args.no_plots:
        for path in plot(runs, s, Path(args.plots_dir)):
            print(f"plot: {path} ({path.stat().st_size // 1024} KiB)")
    if args.json:
        data = {
            "scenario": describe(s),
            "t_min": s.t_min,
            "runs": {
                r.name: {
                    "figures": figures(r, s),
                    "targets": targets(figures(r, s), s),
                    "submit_s": r.submit_s,
                    "startup_s": r.startup_s,
                    "notes": r.notes,
                    "error": r.error,
                    "log": r.extra.get("log"),
                    "states": summarize_states(r),
                    "depth": r.depth,
                    "probes": r.probes,
                    "destination_samples": [
                        [
                            t,
                            *(
                                [e["queued"], e["active"], e["limit"], e["mode"], e["circuit"]]
                                for e in entries
                                if e["destination"].startswith("mx1.provider.test")
                            ),
                        ]
                        for t, entries in r.states
                    ],
                }
                for r in runs
            },
        }
        Path(args.json).write_text(json.dumps(data, indent=1, default=str))
    broken = [r for r in runs if r.error or figures(r, s)["peer_errors"]]
    for r in broken:
        print(f"BROKEN: {r.label}: {r.error or r.report.get('errors')}", file=sys.stderr)
    return 1 if broken else 0


def summarize_states(run: Run) -> dict[str, Any]:
    """From the sampled `mtaqueue-ctl domains`: time in backoff, breaker trips, concurrency."""
    if not run.states:
        return {}
    backoff, circuit, limits, rates = [], Counter(), [], []
    trips = 0
    for t, entries in run.states:
        for e in entries:
            if not e["destination"].startswith("mx1.provider.test"):
                continue
            if e.get("mode") != "normal":
                backoff.append(t)
            circuit[e.get("circuit")] += 1
            limits.append(e.get("limit"))
            rates.append(e.get("messages_per_minute"))
            trips = max(trips, e.get("trips") or 0)
    return {
        "samples_in_backoff": len(backoff),
        "backoff_from_to": [min(backoff), max(backoff)] if backoff else None,
        "circuit_samples": dict(circuit),
        "max_trips": trips,
        "concurrency_limit_median_max": [statistics.median(limits), max(limits)]
        if limits
        else None,
        "rate_per_minute_min": min(rates) if rates else None,
    }


def print_run(run: Run, s: Scenario) -> None:
    f = figures(run, s)
    print(f"\n== {run.label}", flush=True)
    print(f"submitted {s.messages} in {run.submit_s:.1f} s; release -> up {run.startup_s:.2f} s")
    if run.error:
        print(f"ERROR: {run.error}")
    for note in run.notes:
        print(f"note: {note}")
    print(
        f"delivered {f['delivered']}, failed (DSNs) {f['failed_dsn']} (log: {f['failed_log']}), "
        f"drained at {fmt(f['drained_at_s'], 1)} s, last delivery {fmt(f['last_delivery_s'], 1)}"
        f" s, ratio {fmt(f['ratio'])}"
    )
    print(
        f"4xx {f['fourxx']} (greylist triplets {f['greylist_triplets']}, 450s "
        f"{f['greylist_450']}, 421 rate {f['rate_421']}, 421 conn {f['conn_421']}), "
        f"550 blocked {f['blocked_550']}, blocklistings {f['blocklistings']}, duplicates "
        f"{f['duplicates']}"
    )
    print(
        f"p0 p50 {fmt(f['p0_p50'])} p99 {fmt(f['p0_p99'])} max {fmt(f['p0_max'])} "
        f"({f['p0_delivered']}/{f['p0_total']}); p2 p50 {fmt(f['p2_p50'], 1)} p99 "
        f"{fmt(f['p2_p99'], 1)}"
    )
    print(
        f"first MAIL at the provider {fmt(f['first_attempt_s'])} s after release; longest "
        f"pause in sending: {f['longest_pause']}"
    )
    log = run.extra.get("log") or {}
    for row in (log.get("attempts") or [])[:8]:
        print(f"  attempts {row}")
    for row in (log.get("dsn_attempts") or [])[:3]:
        print(f"  DSN attempts (to the sink) {row}")
    for row in (log.get("reasons") or [])[:6]:
        print(f"  postfix {row}")
    if log.get("statuses"):
        print(f"  postfix statuses {log['statuses']}")
    if run.extra.get("left"):
        print(f"  left in queue: {run.extra['left']}")
    states = summarize_states(run)
    if states:
        print(f"  destination state: {states}")


if __name__ == "__main__":
    sys.exit(main())
