"""Providers whose limits the daemon is not told: the recovery storm, shipped config.

    python bench/providers_storm.py [--providers strict,mid,big,fast] [--compare mid]
                                    [--full] [--span 30] [--max-messages 3000] [--again]
                                    [--flush] [--time-scale 0.01 --greylist 3]

The backlog of `recovery_storm.py` (2% p0, 18% p1, 80% p2, each message to its own
mailbox, queued while delivery is off, then released by a restart), sent to several
synthetic providers (`synthetic_peer.py`) with different limits, by mtaqueue with the
*shipped* configuration: no `[[shaping.destinations]]`, no burst or rate for the provider,
only every retry, shaping, lifetime and DSN duration scaled by `--time-scale` as
recovery_storm does. For the `--compare` provider, the naive configuration ("resend
everything now") and a stock Postfix (its default concurrency, timers scaled) run beside it
against fresh copies of the same provider.

`--again` runs each provider a second time, against a fresh copy of it and with a fresh
backlog, the daemon starting with the learned.json the first run left: the next outage's
recovery at a destination it knows (what was learned survives restarts), not the first
contact with it.

`--flush` also runs each provider the way an outage meets a running daemon
(`outage_flush.py`): delivery on, the provider refusing every connection while the backlog
is submitted and for the rest of the outage, then back, then `mtaqueue-ctl flush --all`
(the release). Its row adds the idle seconds between the flush and the provider's first
MAIL: a host suspension or breaker the flush did not lift shows there.

A provider's limits are given as the daemon sees them, in real seconds at the time scale
(the provider's windows are the unscaled ones times `--time-scale`):

| provider | rate per client IP | burst | connections | greylist | blocklisted after |
| --- | --- | --- | --- | --- | --- |
| strict | 5/s | 5 | 2 | 3 s | 5 throttle replies (421) within 5 s |
| mid | 50/s | 50 | 5 | 3 s | 5 throttle replies within 5 s |
| big | 200/s | 200 | 10 | off | 10 throttle replies within 5 s |
| fast | 300/s | 300 | 20 | 3 s | 10 throttle replies within 5 s |

A listing lasts 6 s (600 s unscaled), and a blocklisted client gets 550 5.7.1 at the
greeting and at MAIL, which a sender that keeps going turns into bounces.

The providers' windows are compressed with the daemon's policy durations, but not the
daemon's own fixed times (slow start's 0.25 s round, a throttle's 2-5 s cool-down): a 3 s
greylisting stands for postgrey's 300 s. `--time-scale 1 --greylist 300` runs a provider
in real time instead (the shipped greylist_min against the same window; T_min then about
six minutes).

Messages per provider: as many as the provider takes in `--span` seconds at its rate (the
backlog of a 30 s outage at full speed), at most `--max-messages` (3000); `--full` makes it
120 s and 12,000. So each run's provider minimum (T_min, as in recovery_storm: one rate token
per MAIL, the greylisted first attempt included) is about a minute.

Per provider: blocklistings (target 0), permanent failures caused by the sender (DSNs; no
recipient is invalid: 0), duplicate deliveries (0), throttle replies (every 4xx beyond one
greylist 450 per triplet: 421 rate or connection cap, a 450 repeated too early) per 1,000
delivered (<= 5), drain / T_min (<= 1.3; no figure when the queue did not empty) and the p0
p99 latency from the release (<= greylist window + 2 s). Missed targets are marked, not
turned into an exit status; exit 1 when a run breaks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests"))  # postfix_instance: a private Postfix

from common import work_directory  # noqa: E402
from outage_flush import run_mtaqueue_flush  # noqa: E402
from postfix_instance import postfix_available  # noqa: E402
from recovery_storm import (  # noqa: E402
    Run,
    Scenario,
    figures,
    fmt,
    print_run,
    run_mtaqueue,
    run_postfix,
)


@dataclass(frozen=True)
class Provider:
    name: str
    rate: float  # MAILs per real second per client IP
    connections: int
    greylist: float  # real seconds, 0 = off
    throttles: int  # blocklisted after more than this many 421s within `window`
    window: float = 5.0  # real seconds
    listed_for: float = 6.0  # real seconds

    def scenario(self, messages: int, scale: float, sessions: int, size: int) -> Scenario:
        """The provider as recovery_storm's Scenario: unscaled windows (real / scale), a
        rate of `rate` per second after scaling, a burst of one second's worth."""
        count = max(1, round(self.rate))
        return Scenario(
            messages=messages,
            scale=scale,
            greylist=self.greylist / scale,
            rate_count=count,
            rate_period=count / self.rate / scale,
            peer_connections=self.connections,
            slow_banner_at=None,
            blocklist_after=None,
            blocklist_for=self.listed_for / scale,
            blocklist_window=self.window / scale,
            outage=3.0 / scale,  # long enough to queue everything before the release
            admin_fraction=0.0,  # unused: the shipped config says nothing of the provider
            admin_connections=0,
            sessions=sessions,
            size=size,
            blocklist_throttles=self.throttles,
        )


PROVIDERS = {
    p.name: p
    for p in (
        Provider("strict", rate=5, connections=2, greylist=3, throttles=5),
        Provider("mid", rate=50, connections=5, greylist=3, throttles=5),
        Provider("big", rate=200, connections=10, greylist=0, throttles=10),
        Provider("fast", rate=300, connections=20, greylist=3, throttles=10),
    )
}


def describe(p: Provider, s: Scenario) -> str:
    grey = f"greylist {s.g:g} s" if s.g else "no greylisting"
    return (
        f"{p.name}: {s.messages} messages; {p.rate:g} msg/s per client IP (burst {s.burst}), "
        f"{p.connections} connections, {grey}, blocklisted for {p.listed_for:g} s after more "
        f"than {p.throttles} throttle replies within {p.window:g} s; T_min {s.t_min:.1f} s"
    )


def provider_figures(run: Run, s: Scenario) -> dict:
    f = figures(run, s)
    throttle = f["avoidable_4xx"]  # every 4xx beyond one greylist 450 per triplet
    f["throttle_per_1000"] = 1000 * throttle / f["delivered"] if f["delivered"] else None
    return f


def provider_targets(f: dict, s: Scenario) -> dict[str, bool]:
    p0_all = f["p0_delivered"] == f["p0_total"]
    return {
        "blocklist": f["blocklistings"] == 0,
        "failed": f["failed_dsn"] == 0 and f["not_delivered"] == 0,
        "duplicates": f["duplicates"] == 0,
        "throttle": f["throttle_per_1000"] is not None and f["throttle_per_1000"] <= 5,
        "ratio": f["ratio"] is not None and f["ratio"] <= 1.3,
        "p0": p0_all and f["p0_p99"] is not None and f["p0_p99"] <= s.g + 2.0,
    }


ROWS = [
    ("blocklistings (hits)", lambda f: f"{f['blocklistings']} ({f['blocklist_hits']})",
     "blocklist"),
    ("permanent failures we caused (DSNs); undelivered",
     lambda f: f"{f['failed_dsn']}; {f['not_delivered']}", "failed"),
    ("duplicate deliveries", lambda f: fmt(f["duplicates"]), "duplicates"),
    ("throttle replies per 1,000 delivered (421 rate / 421 conn / early 450)",
     lambda f: f"{fmt(f['throttle_per_1000'], 1)} ({f['rate_421']} / {f['conn_421']} / "
     f"{f['greylist_450'] - f['greylist_triplets']})", "throttle"),
    ("drain / T_min", lambda f: f"{fmt(f['ratio'])} ({fmt(f['drain_s'], 1)} s)", "ratio"),
    ("p0 p50 / p99, s", lambda f: f"{fmt(f['p0_p50'])} / {fmt(f['p0_p99'])}"
     + ("" if f["p0_delivered"] == f["p0_total"]
        else f", {f['p0_total'] - f['p0_delivered']} p0 undelivered"), "p0"),
    ("delivered", lambda f: f"{f['delivered']}", None),
    ("connections opened (peak)", lambda f: f"{f['connections']} ({f['max_concurrent']})", None),
    ("first MAIL after release, s", lambda f: fmt(f["first_attempt_s"]), None),
]  # fmt: skip


def table(results: list[tuple[Provider, Scenario, Run]]) -> str:
    heads = [f"{p.name}: {r.label}" for p, _, r in results]
    out = ["| | " + " | ".join(heads) + " |", "|---" * (len(results) + 1) + "|"]
    out.append(
        "| T_min, s (messages) | "
        + " | ".join(f"{s.t_min:.1f} ({s.messages})" for _, s, _ in results)
        + " |"
    )
    figs = [(provider_figures(r, s), s) for _, s, r in results]
    for title, get, target in ROWS:
        cells = []
        for f, s in figs:
            cell = get(f)
            if target is not None:
                cell += " ✓" if provider_targets(f, s)[target] else " ✗"
            cells.append(cell)
        out.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--providers", default=",".join(PROVIDERS), help="comma-separated, in order")
    add("--compare", default="mid", help="provider also run with naive and stock Postfix")
    add("--skip-naive", action="store_true")
    add("--skip-postfix", action="store_true")
    add(
        "--again",
        action="store_true",
        help="run each provider a second time, starting with what the first run learned",
    )
    add("--flush", action="store_true", help="also: the outage live, then flush --all")
    add("--full", action="store_true", help="--span 120 --max-messages 12000")
    add("--span", type=float, help="seconds of the provider's rate in the backlog (30)")
    add("--max-messages", type=int, help="at most this many messages per provider (3000)")
    add("--time-scale", type=float, default=0.01)
    add(
        "--greylist",
        type=float,
        help="the greylisting providers' window, real seconds (each one's own: 3); "
        "with --time-scale 1, 300 is postgrey's default against the shipped greylist_min",
    )
    add("--sessions", type=int, default=20)
    add("--size", type=int, default=2048)
    add("--timeout", type=float, help="per-run drain timeout, s (default 3 x T_min + 30)")
    add("--mq-option", action="append", default=[], metavar="SECTION.KEY=VALUE")
    add("--json", metavar="FILE", help="write the figures as JSON")
    add("--keep", action="store_true", help="keep the work directory (reports, logs)")
    args = parser.parse_args()
    span = args.span or (120 if args.full else 30)
    cap = args.max_messages or (12000 if args.full else 3000)
    names = [n for n in args.providers.split(",") if n]
    unknown = [n for n in [*names, args.compare] if n not in PROVIDERS]
    if unknown:
        parser.error(f"unknown provider {unknown[0]!r}; known: {', '.join(PROVIDERS)}")
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    results: list[tuple[Provider, Scenario, Run]] = []
    tag = time.strftime("%H%M%S")
    with work_directory("providers-storm-", keep=args.keep) as workdir:
        for name in names:
            p = PROVIDERS[name]
            if args.greylist is not None and p.greylist:
                p = replace(p, greylist=args.greylist)
            n = max(50, min(cap, math.ceil(p.rate * span)))
            s = p.scenario(n, args.time_scale, args.sessions, args.size)
            timeout = args.timeout or 3 * s.t_min + 30
            print(f"\n### {describe(p, s)}", flush=True)
            here = workdir / name
            here.mkdir()
            here.chmod(0o755)
            run = run_mtaqueue(
                s, here, False, timeout, f"{tag}{name}s", args.mq_option, admin=False
            )
            print_run(run, s)
            results.append((p, s, run))
            if args.again:
                learned = here / "shipped" / "spool" / "learned.json"
                run = run_mtaqueue(
                    s, here, False, timeout, f"{tag}{name}a", args.mq_option, False, learned
                )
                print_run(run, s)
                results.append((p, s, run))
            if args.flush:
                run = run_mtaqueue_flush(s, here, timeout, f"{tag}{name}f", args.mq_option)
                print_run(run, s)
                results.append((p, s, run))
            if name != args.compare:
                continue
            if not args.skip_naive:
                run = run_mtaqueue(s, here, True, timeout, f"{tag}{name}n")
                print_run(run, s)
                results.append((p, s, run))
            if not args.skip_postfix:
                if postfix_available():
                    run = run_postfix(s, here, timeout, f"{tag}{name}p", 0)
                    print_run(run, s)
                    results.append((p, s, run))
                else:
                    print("postfix: not available (needs root and Debian's postfix); skipped")
    print()
    for name in dict.fromkeys(p.name for p, _, _ in results):
        p, s = next((p, s) for p, s, _ in results if p.name == name)
        print(f"- {describe(p, s)}")
    print()
    print(table(results))
    load = os.getloadavg()
    print(f"\nload average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.json:
        data = [
            {
                "provider": p.name,
                "scenario": describe(p, s),
                "t_min": s.t_min,
                "run": r.name,
                "figures": provider_figures(r, s),
                "targets": provider_targets(provider_figures(r, s), s),
                "notes": r.notes,
                "error": r.error,
                "log": r.extra.get("log"),
            }
            for p, s, r in results
        ]
        Path(args.json).write_text(json.dumps(data, indent=1, default=str))
    broken = [r for _, s, r in results if r.error or provider_figures(r, s)["peer_errors"]]
    for r in broken:
        print(f"BROKEN: {r.label}: {r.error or r.report.get('errors')}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
