"""Providers that slow down instead of saying no (silent throttling, issue 29): shipped config.

    python bench/silent_throttle.py [--providers sessions,rate,dot-only,both,grey,slow]
                                    [--compare sessions] [--skip-postfix] [--span 70]
                                    [--learning 30] [--p0-every 2] [--time-scale 0.01]
                                    [--json FILE] [--keep]

Each provider is a row: a `slow_peer.py` (a subprocess, answering on 127.0.0.2 and
127.0.0.3, the two MX hosts of provider.test in a DNS zone served on loopback by the tests'
DnsServer) that never refuses (no 4xx or 5xx but greylisting) and does not announce its
comfort levels: past them, per client IP, it delays its banner and its reply to the final
dot of DATA, more the harder it is pushed (capped at 8 s). The sender is mtaqueue with
the shipped `conf/mtaqueue.toml`, only its retry, shaping, lifetime and DSN durations
scaled by `--time-scale` as recovery_storm does; for the `--compare` providers a stock
Postfix (its timers scaled the same way) runs beside it against a fresh copy of the
provider. Each run is the recovery storm's: a backlog (2% p0, 18% p1, 80% p2, one mailbox
a message) queued while delivery is off, then released (a restart with delivery on;
Postfix: relay and flush); from the release, a live p0 message is also submitted every
`--p0-every` seconds until 0.8 x `--span`.

| provider | sessions S | rate R | delayed past comfort | every final dot | greylist |
| --- | --- | --- | --- | --- | --- |
| sessions | 3 | - | banner and final reply: 0.2 s a session over S | 0.25 s | - |
| rate | - | 15/s | banner and final reply: 2 s x (rate / R - 1) | 0.1 s | - |
| dot-only | 3 | - | the final reply only: 0.2 s a session over S | 0.25 s | - |
| both | 4 | 10/s | banner and final reply: both terms added | 0.25 s | - |
| grey | 3 | - | banner and final reply: 0.2 s a session over S | 0.25 s | 3 s |
| slow | - | - | never: slow at any load, not throttling | 1 s | - |

The rate is the client's MAILs of the last 3 s over 3 s. The comfort throughput is
min(S / dot delay, R) messages a second, S being 10 when the provider has no session
level (it takes any number; 10 is `shaping.default.max_connections` of the shipped config,
the most it opens to one destination); the comfort minimum for M messages (the backlog and
the live p0) is M / that throughput, plus the greylist window (every first attempt is
greylisted; none can be taken before it passes). The backlog is `--span` (70) seconds of
the comfort throughput, so a row takes one to three minutes when the sender keeps to it.

Per run: the share of messages the provider accepted while the sender was past its comfort
(sessions > S or rate > R at the final dot), counting those accepted from `--learning` (30)
s after the release (target <= 20%); drain (release to the last 250, every message
accepted) / the comfort minimum (target <= 1.5); for `slow`, the throughput over what it
allows (the comfort minimum / drain: target >= 0.8); the p99 latency of the live p0 (its
250 at the sender to the provider's 250) and of the backlog's p0 (from the release);
connections opened, most sessions at once and the median after the learning period; the
throttling delay the provider imposed; for mtaqueue, the learned limits it logged from
latency (`latency_slowed` cuts of the connections, `limit_learned` events whose reply is
"latency ...": the rate's, the lowest rate) and
its concurrency limit
after learning (sampled from `mtaqueue-ctl domains`). The allowance of a provider without a
session level is the shipped sender's cap: a sender opening more (stock Postfix: 20) can
go over 1. Missed targets are marked; exit 1 only when a run breaks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests"))  # postfix_instance, dns_server

from common import port_in_use, work_directory  # noqa: E402
from postfix_instance import postfix_available  # noqa: E402
from recovery_storm import (  # noqa: E402
    DOMAINS,
    MTAQUEUE_PORT,
    POSTFIX_PORT,
    PROVIDER_IPS,
    SINK_IP,
    PeerProcess,
    Planned,
    Run,
    Scenario,
    keep_reports,
    mtaqueue_config,
    plan,
    postfix_sender,
    provider_dns,
    queue_and_release,
    read_daemon_log,
    release_postfix,
    sample_until_drained,
    stop_provider_dns,
    submit,
)
from silent_throttle_figures import figures, print_run, table, targets  # noqa: E402
from synthetic_peer import SyntheticPeer  # noqa: E402

SHIPPED = BENCH.parent / "conf" / "mtaqueue.toml"
SHIPPED_CONFIG = tomllib.loads(SHIPPED.read_text())
SENDER_CAP = SHIPPED_CONFIG["shaping"]["default"]["max_connections"]


@dataclass(frozen=True)
class Provider:
    name: str
    sessions: int | None = None  # comfort level S
    rate: float | None = None  # comfort level R, messages per second
    dot_delay: float = 0.25  # the reply to every final dot, at any load
    dot_only: bool = False
    greylist: float = 0.0  # real seconds
    session_factor: float = 0.2
    rate_factor: float = 2.0
    max_delay: float = 8.0

    @property
    def throughput(self) -> float:
        sessions = self.sessions if self.sessions is not None else SENDER_CAP
        return min(sessions / self.dot_delay, self.rate or math.inf)

    def comfort_min(self, messages: int) -> float:
        return self.greylist + messages / self.throughput

    def peer_args(self, scale: float) -> list[str]:
        args = ["--dot-delay", str(self.dot_delay), "--max-delay", str(self.max_delay)]
        args += ["--session-factor", str(self.session_factor)]
        args += ["--rate-factor", str(self.rate_factor), "--time-scale", str(scale)]
        if self.sessions is not None:
            args += ["--comfort-sessions", str(self.sessions)]
        if self.rate is not None:
            args += ["--comfort-rate", str(self.rate)]
        if self.greylist:
            args += ["--greylist", str(self.greylist / scale)]
        return args + (["--dot-only"] if self.dot_only else [])

    def describe(self) -> str:
        levels = [f"S={self.sessions}" if self.sessions is not None else "",
                  f"R={self.rate:g}/s" if self.rate else ""]  # fmt: skip
        levels = [x for x in levels if x] or ["no comfort level"]
        grey = f", greylist {self.greylist:g} s" if self.greylist else ""
        where = " (final reply only)" if self.dot_only else " (banner and final reply)"
        where = where if self.sessions is not None or self.rate else ""
        return (
            f"{self.name}: {', '.join(levels)}{where}, {self.dot_delay:g} s a final dot"
            f"{grey}; comfort {self.throughput:g} msg/s"
        )


PROVIDERS = {
    p.name: p
    for p in (
        Provider("sessions", sessions=3),
        Provider("rate", rate=15, dot_delay=0.1),
        Provider("dot-only", sessions=3, dot_only=True),
        Provider("both", sessions=4, rate=10),
        Provider("grey", sessions=3, greylist=3.0),
        Provider("slow", dot_delay=1.0),
    )
}


def scenario(messages: int, scale: float, sessions: int, size: int) -> Scenario:
    """recovery_storm's Scenario for its helpers (submission, outage, scaled timers); its
    provider fields are unused: the provider is a slow_peer."""
    return Scenario(
        messages=messages, scale=scale, greylist=0.0, rate_count=1, rate_period=1.0,
        peer_connections=0, slow_banner_at=None, blocklist_after=None, blocklist_for=0.0,
        blocklist_window=1.0, outage=3.0 / scale, admin_fraction=0.0, admin_connections=0,
        sessions=sessions, size=size,
    )  # fmt: skip


class ProviderProcess(PeerProcess):
    """bench/slow_peer.py as a subprocess (its own core and GIL), PeerProcess's start/stop."""

    def __init__(self, workdir: Path, provider: Provider, scale: float, duration: float):
        self.report_path = workdir / "peer-report.json"
        self.err_path = workdir / "peer.stderr"
        self.args = [
            sys.executable, str(BENCH / "slow_peer.py"),
            *(arg for ip in PROVIDER_IPS for arg in ("--listen", f"{ip}:0")),
            *provider.peer_args(scale),
            "--duration", str(int(duration)), "--report", str(self.report_path),
        ]  # fmt: skip
        self.proc = None
        self.port = 0


def shipped_config(s: Scenario, spool: Path, port: int, sink: int, dns: str) -> dict[str, Any]:
    """conf/mtaqueue.toml with recovery_storm's changes for a bench run (addresses, spool,
    DNS, delivery port, the DSN sink's route, scaled timers), nothing about the provider."""
    config = json.loads(json.dumps(SHIPPED_CONFIG))  # a deep copy

    def merge(into: dict[str, Any], changes: dict[str, Any]) -> None:
        for key, value in changes.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                merge(into[key], value)
            else:
                into[key] = value

    merge(config, mtaqueue_config(s, spool, port, sink, dns, naive=False, admin=False))
    return config


class LiveP0(threading.Thread):
    """A p0 message every `every` s from the release (once `run.release` is set and the
    sender listens on `port`): the submission times of those it got a 250 for."""

    def __init__(self, run: Run, port: int, planned: list[Planned], every: float, size: int):
        super().__init__(name="live-p0", daemon=True)
        self.run_, self.port, self.planned, self.every, self.size = run, port, planned, every, size
        self.submitted: dict[str, float] = {}
        self.failed: list[list[str]] = []  # [message_id, error]
        self.halt = threading.Event()

    def pending(self) -> int:
        return len(self.planned) - len(self.submitted) - len(self.failed)

    def run(self) -> None:
        while not self.run_.release and not self.halt.wait(0.05):
            pass
        for i, p in enumerate(self.planned):
            if self.halt.wait(max(0.0, self.run_.release + self.every * (i + 1) - time.time())):
                return
            deadline = time.monotonic() + 60
            while not port_in_use("127.0.0.1", self.port) and time.monotonic() < deadline:
                time.sleep(0.1)
            try:
                submit("127.0.0.1", self.port, [p], 1, self.size)
                self.submitted[p.message_id] = time.time()
            except Exception as exc:
                self.failed.append([p.message_id, str(exc)])

    def finish(self) -> None:
        self.halt.set()
        if self.ident is not None:  # started
            self.join(30)
        self.run_.extra["live"] = {"submitted": self.submitted, "failed": self.failed}
        if self.failed:
            self.run_.notes.append(f"{len(self.failed)} live p0 not submitted: {self.failed[0]}")


def live_plan(count: int, tag: str) -> list[Planned]:
    return [
        Planned(i, "p0", f"<live-{tag}-{i}@app.test>", f"live{i}@{DOMAINS[i % len(DOMAINS)]}")
        for i in range(count)
    ]


def run_mtaqueue(
    p: Provider, s: Scenario, workdir: Path, timeout: float, tag: str, live: int, every: float
) -> Run:
    """One run: the backlog queued, released, `live` p0 sent every `every` s, drained."""
    run = Run("mtaqueue", "mtaqueue (shipped config)", plan(s.messages, tag))
    here = workdir / "mtaqueue"
    here.mkdir()
    peer = ProviderProcess(here, p, s.scale, s.outage * s.scale + timeout + 600).start()
    sink = SyntheticPeer([f"{SINK_IP}:0"]).start()
    dns = provider_dns(peer.port)
    feeder = LiveP0(run, MTAQUEUE_PORT, live_plan(live, tag), every, s.size)
    daemon = None
    try:
        cfg = shipped_config(s, here / "spool", peer.port, sink.port, dns.address)
        daemon = queue_and_release(run, s, here, cfg)
        feeder.start()
        sample_until_drained(
            run,
            lambda: daemon.ask("status")[0]["messages"] + feeder.pending(),
            timeout,
            states=lambda: daemon.ask("domains"),
            check=daemon.check,
            pids=(daemon.proc.pid if daemon.proc else None, peer.proc.pid),
        )
    except Exception as exc:  # the run broke: keep what we have
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        feeder.finish()
        if daemon is not None:
            daemon.stop()
        stop_provider_dns(dns)
        keep_reports(run, sink, peer)
    run.extra["log"] = read_daemon_log(here / "release.log")
    run.extra["latency_lessons"] = latency_lessons(here / "release.log")
    return run


def run_postfix(
    p: Provider, s: Scenario, workdir: Path, timeout: float, tag: str, live: int, every: float
) -> Run:
    """One run: the backlog queued, released, `live` p0 sent every `every` s, drained."""
    run = Run("postfix", "Postfix (stock)", plan(s.messages, tag))
    here = workdir / "postfix"
    here.mkdir()
    here.chmod(0o755)
    peer = ProviderProcess(here, p, s.scale, s.outage * s.scale + timeout + 600).start()
    sink = SyntheticPeer([f"{SINK_IP}:0"]).start()
    pf = postfix_sender(s, here / "pfx", sink.port)
    feeder = LiveP0(run, POSTFIX_PORT, live_plan(live, tag), every, s.size)
    count = pf.queue_count  # drained: the queue empty and every live p0 submitted
    pf.queue_count = lambda: count() + (feeder.pending() if run.release else 0)
    feeder.start()
    try:
        relay = f"{PROVIDER_IPS[0]}:{peer.port}"
        release_postfix(run, pf, s, relay, timeout, pids=(None, peer.proc.pid))
    finally:
        feeder.finish()
        keep_reports(run, sink, peer)
    return run


def latency_lessons(path: Path) -> list[list]:
    """mtaqueue's lessons from latency: `latency_slowed` events (cuts of the connection
    limit, and of the rate ceiling, a minute: "rate", 0 for none before) and
    `limit_learned` events taught by latency: [time, what, old, new]."""
    cuts = []
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            if '"limit_learned"' not in line and '"latency_slowed"' not in line:
                continue
            with contextlib.suppress(ValueError):
                e = json.loads(line)
                at = e.get("timestamp") or e.get("ts")
                if e.get("event") == "latency_slowed" and e["new"] < e["old"]:
                    cuts.append([at, "connections", e["old"], e["new"]])
                elif e.get("event") == "latency_slowed":
                    cuts.append([at, "rate", e.get("rate_old"), e.get("rate_new")])
                elif str(e.get("reply", "")).startswith("latency"):
                    cuts.append([at, e["what"], e["old"], e["new"]])
    return cuts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--providers", default=",".join(PROVIDERS), help="comma-separated, in order")
    add("--compare", default="sessions", help="providers also sent to by a stock Postfix")
    add("--skip-postfix", action="store_true")
    add("--span", type=float, default=70.0, help="seconds of comfort throughput (70)")
    add("--learning", type=float, default=30.0, help="seconds not counted for the share (30)")
    add("--p0-every", type=float, default=2.0, help="a live p0 every N s (2)")
    add("--time-scale", type=float, default=0.01)
    add("--sessions", type=int, default=20, help="submission sessions")
    add("--size", type=int, default=2048)
    add("--timeout", type=float, help="per-run drain timeout, s (4 x comfort min + 60)")
    add("--json", metavar="FILE", help="write the figures as JSON")
    add("--keep", action="store_true", help="keep the work directory (reports, logs)")
    args = parser.parse_args()
    names = [n for n in args.providers.split(",") if n]
    compare = [n for n in args.compare.split(",") if n]
    unknown = [n for n in [*names, *compare] if n not in PROVIDERS]
    if unknown:
        parser.error(f"unknown provider {unknown[0]!r}; known: {', '.join(PROVIDERS)}")
    live_count = int(0.8 * args.span / args.p0_every)
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    results: list[tuple[Provider, Run]] = []
    tag = time.strftime("%H%M%S")
    with work_directory("silent-throttle-", keep=args.keep) as workdir:
        for name in names:
            p = PROVIDERS[name]
            n = max(50, round(args.span * p.throughput))
            s = scenario(n, args.time_scale, args.sessions, args.size)
            timeout = args.timeout or 4 * p.comfort_min(n + live_count) + 60
            print(f"\n### {p.describe()}; {n} + {live_count} messages", flush=True)
            here = workdir / name
            here.mkdir()
            here.chmod(0o755)
            senders = [run_mtaqueue]
            if name in compare and not args.skip_postfix:
                if postfix_available():
                    senders.append(run_postfix)
                else:
                    print("postfix: not available (needs root and Debian's postfix); skipped")
            for sender in senders:
                run_tag = f"{tag}{name.replace('-', '')}{len(results)}"
                run = sender(p, s, here, timeout, run_tag, live_count, args.p0_every)
                print_run(run, p, args.learning)
                results.append((p, run))
                load = os.getloadavg()
                print(f"  load average: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    print()
    for p in dict.fromkeys(p for p, _ in results):
        print(f"- {p.describe()}")
    print()
    print(table(results, args.learning))
    if args.json:
        data = [
            {
                "provider": p.name,
                "describe": p.describe(),
                "run": r.name,
                "figures": figures(r, p, args.learning),
                "targets": targets(figures(r, p, args.learning), p),
                "error": r.error,
                "notes": r.notes,
                "latency_lessons": r.extra.get("latency_lessons"),
                "log": r.extra.get("log"),
                "depth": r.depth,
                "destination": [  # seconds after release, concurrency limit, rate per minute
                    [t, e["limit"], e["messages_per_minute"]]
                    for t, entries in r.states
                    for e in entries
                    if e["destination"].startswith("mx1.provider.test")
                ],
            }
            for p, r in results
        ]
        Path(args.json).write_text(json.dumps(data, indent=1, default=str))
    broken = [(p, r) for p, r in results if r.error or figures(r, p, args.learning)["peer_errors"]]
    for p, r in broken:
        print(f"BROKEN: {p.name}: {r.label}: {r.error or r.report.get('errors')}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
