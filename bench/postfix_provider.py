"""A real Postfix as the provider: greylisting (postgrey) and anvil limits, shipped defaults.

    python bench/postfix_provider.py [--messages 300] [--greylist 5] [--connections 3]
                                     [--rate 60] [--rate-unit 10] [--skip-postfix] [--flush]

The recovery storm's backlog (recovery_storm.py: 2% p0, 18% p1, 80% p2, each message to its
own mailbox, queued while delivery is off, then released) sent to a private Postfix 3.7
instance as the receiving provider (`tests/postfix_instance.py`, `receive` mode on
127.0.0.1 (a free port), the MX host of example.org/.net/.com in a DNS server on loopback):

- postgrey as its `check_policy_service` on a loopback port, `--delay` = `--greylist`
  seconds, its own database directory, client auto-whitelisting off (so each new triplet
  is greylisted exactly once: the minimum below holds whoever sends);
- anvil limits for the client, loopback included (`smtpd_client_event_limit_exceptions`
  empty): `--connections` concurrent connections, `--rate` messages (MAIL) and as many
  recipients per `--rate-unit` seconds (`anvil_rate_time_unit`); Postfix's error limits at
  their defaults (1 s delay per reply after 10 errors in a session, hang-up after 20).

Senders, each against a fresh receiver: mtaqueue with the shipped defaults (nothing said
about the provider; every retry, shaping, lifetime and DSN duration scaled by greylist /
300 s, as recovery_storm scales them, so the shipped 5-minute greylist retry meets the
provider's window), and a stock Postfix (default concurrency; its timers scaled the same
way: minimal_backoff_time = the greylist window), filled with delivery deferred and then
relayed to the provider and flushed.

`--flush` adds mtaqueue a second way, the outage as a running daemon meets it
(outage_flush.py does the same with the synthetic providers): delivery on, the provider's
Postfix not running (its port refuses) while the backlog is submitted and for the rest of
the outage, then started, then `mtaqueue-ctl flush --all` (the release). `--hold-bulk`
makes that flush the runbook's step 3 (docs/runbooks.md, outage recovery): p1 and p2 held
before the flush, released and flushed again once no p0 message is left.

Minimum drain time: anvil counts MAILs in windows of `rate_unit` seconds, each starting at
the first MAIL after the previous one ended, `rate` allowed in each (refused ones count
too, within their window); N messages need 2N MAILs (one greylisted first attempt each), so
`T_min = (ceil(2N / rate) - 1) * rate_unit` (the greylist window adds nothing once N >
rate). Figures: delivered, duplicates, drain / T_min (target <= 1.3), the refusals by kind
(anvil's "too much mail" (MAIL), "too many recipients", "too many connections", "too many
errors", greylisting beyond one per triplet) and the refused MAILs per delivered message,
the p0 latency from the release and where the last p0 message came in the delivery order.
Times come from the receiver's maillog (cleanup's `message-id=` line): whole seconds.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO / "tests"))

from common import free_port, work_directory  # noqa: E402
from postfix_instance import PostfixInstance, Postgrey, postfix_available, received  # noqa: E402
from recovery_storm import (  # noqa: E402
    DOMAINS,
    MTAQUEUE_PORT,
    SINK_IP,
    Daemon,
    Run,
    Scenario,
    fmt,
    mtaqueue_config,
    percentile,
    plan,
    postfix_sender,
    queue_and_release,
    read_daemon_log,
    release_postfix,
    sample_until_drained,
    submit,
    wait_outage,
)
from synthetic_peer import SyntheticPeer  # noqa: E402

RECEIVER = f"127.0.0.1:{free_port()}"
POSTGREY = f"127.0.0.1:{free_port()}"


class Receiver:
    """postgrey + a receive-mode Postfix, started and stopped together."""

    def __init__(self, workdir: Path, args) -> None:
        self.postgrey = Postgrey(POSTGREY, workdir / "postgrey", delay=args.greylist)
        main_cf = {
            "smtpd_client_connection_count_limit": str(args.connections),
            "smtpd_client_message_rate_limit": str(args.rate),
            "smtpd_client_recipient_rate_limit": str(args.rate),
            "anvil_rate_time_unit": f"{args.rate_unit}s",
            "myhostname": "mx1.provider.test",
        }
        self.pf = PostfixInstance(
            workdir / "receiver",
            listen=RECEIVER,
            mode="receive",
            domains=DOMAINS,
            policy=POSTGREY,
            main_cf=main_cf,
            cleanup=not args.keep,
        )

    @property
    def port(self) -> int:
        return int(RECEIVER.rsplit(":", 1)[1])

    def __enter__(self) -> Receiver:
        self.postgrey.start()
        try:
            self.pf.start()
        except BaseException:
            self.postgrey.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.log = received(self.pf.maillog)  # before the files go
        self.pf.stop()
        self.postgrey.stop()


def scenario(args) -> Scenario:
    """recovery_storm's Scenario, used for the daemon's scaled config only."""
    return Scenario(
        messages=args.messages,
        scale=args.greylist / 300,
        greylist=300,
        rate_count=args.rate,
        rate_period=args.rate_unit / (args.greylist / 300),
        peer_connections=args.connections,
        slow_banner_at=None,
        blocklist_after=None,
        blocklist_for=0,
        blocklist_window=1,
        outage=3 / (args.greylist / 300),
        admin_fraction=0,
        admin_connections=0,
        sessions=20,
        size=2048,
    )


def t_min(args) -> float:
    return (math.ceil(2 * args.messages / args.rate) - 1) * args.rate_unit


def run_directory(workdir: Path, name: str) -> tuple[Path, SyntheticPeer]:
    """A sender's own directory (readable by Postfix's users) and the sink its DSNs go to."""
    workdir = workdir / name
    workdir.mkdir()
    workdir.chmod(0o755)
    return workdir, SyntheticPeer([f"{SINK_IP}:0"]).start()


def provider_dns():
    """A DNS server on loopback: the backlog's domains' MX is the provider's host."""
    from dns_server import DnsServer

    dns = DnsServer().start()
    for domain in DOMAINS:
        dns.add(domain, "MX", "10 mx1.provider.test")
    dns.add("mx1.provider.test", "A", "127.0.0.1")
    return dns


def run_mtaqueue(args, workdir: Path, timeout: float, flush: bool = False) -> tuple[Run, dict]:
    """mtaqueue with the shipped config: the backlog queued with delivery off, then a
    restart (the release); with `flush`, the outage live instead: the provider's Postfix
    down while the backlog is submitted to a running daemon, then started, then
    `flush --all` (t = 0)."""
    s = scenario(args)
    name, label, tag = (
        ("flush", ", outage then flush --all", "pff") if flush else ("shipped", "", "pfm")
    )
    if flush and args.hold_bulk:
        label += " (bulk held until p0 went)"
    run = Run(name, f"mtaqueue (shipped config){label}", plan(s.messages, tag))
    workdir, sink = run_directory(workdir, f"mtaqueue-{run.name}")
    dns = provider_dns()
    receiver, daemon = Receiver(workdir, args), None
    receiver.postgrey.start()
    try:
        if not flush:
            receiver.pf.start()
        cfg = mtaqueue_config(
            s, workdir / "spool", receiver.port, sink.port, dns.address, False, False
        )
        if flush:
            daemon = outage_then_flush(
                run, s, workdir, cfg, args.mq_option, receiver, args.hold_bulk
            )
        else:
            daemon = queue_and_release(run, s, workdir, cfg, args.mq_option)
        sample_until_drained(
            run, lambda: daemon.ask("status")[0]["messages"], timeout, check=daemon.check
        )
    except Exception as exc:
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        if daemon is not None:
            daemon.stop()
        dns.stop()
        run.dsns = sink.stop()["messages"]["accepted"]
        receiver.__exit__(None)
    run.extra["log"] = read_daemon_log(workdir / "release.log")
    return run, receiver.log


def outage_then_flush(
    run: Run, s: Scenario, workdir: Path, cfg, overrides, receiver, hold_bulk: bool
) -> Daemon:
    """The daemon running while the backlog is submitted and the provider is down, then
    the provider started and `flush --all`: the release. With `hold_bulk`, p1 and p2 are
    held first and let go once p0 is gone (a thread). Returns the running daemon."""
    daemon = Daemon(workdir, "release", cfg, overrides)  # (read_daemon_log's name)
    try:
        daemon.start()
        first = time.time()
        run.submit_s = submit("127.0.0.1", MTAQUEUE_PORT, run.planned, s.sessions, s.size)
        wait_outage(first, s)
        receiver.pf.start()
        for klass in BULK if hold_bulk else ():
            daemon.ask("hold", {"class": klass})
        run.release = time.time()
        [flushed] = daemon.ask("flush", {"all": True})
        run.startup_s = time.time() - run.release  # (how long the flush command took)
        run.notes.append(f"flush --all: {flushed}")
        if hold_bulk:
            threading.Thread(target=release_after_p0, args=(run, daemon), daemon=True).start()
    except BaseException:
        daemon.stop()
        raise
    return daemon


BULK = ("p1", "p2")


def release_after_p0(run: Run, daemon: Daemon) -> None:
    """The runbook's step 3 ended: once no p0 message is queued, the bulk released and
    flushed (it was deferred in the outage)."""
    while daemon.ask("status")[0]["by_class"].get("p0", 0):
        time.sleep(0.2)
    for klass in BULK:
        daemon.ask("release", {"class": klass})
    daemon.ask("flush", {"all": True})
    run.notes.append(f"p0 gone, bulk released and flushed at {time.time() - run.release:.1f} s")


def run_postfix(args, workdir: Path, timeout: float) -> tuple[Run, dict]:
    s = scenario(args)
    run = Run("postfix", "Postfix (stock)", plan(s.messages, "pfp"))
    workdir, sink = run_directory(workdir, "postfix")
    pf = postfix_sender(s, workdir / "sender", sink.port, cleanup=not args.keep)
    with Receiver(workdir, args) as receiver:
        try:
            release_postfix(run, pf, s, RECEIVER, timeout)
        finally:
            run.dsns = sink.stop()["messages"]["accepted"]
    return run, receiver.log


def figures(run: Run, log: dict, args) -> dict[str, Any]:
    by_id = {p.message_id: p for p in run.planned}
    counts: Counter = Counter()
    first: dict[str, float] = {}
    for t, mid in log["accepted"]:
        if mid in by_id:
            counts[mid] += 1
            first.setdefault(mid, t - run.release)
    order = sorted(first, key=first.__getitem__)
    latency: dict[str, list[float]] = {"p0": [], "p1": [], "p2": []}
    for mid, t in first.items():
        latency[by_id[mid].klass].append(t)
    p0_ranks = [i + 1 for i, mid in enumerate(order) if by_id[mid].klass == "p0"]
    last = max(first.values()) if first else None
    drain = last if run.drained_at is not None and last is not None else None
    refusals = log["refusals"]

    def refused(text: str) -> int:
        return sum(n for k, n in refusals.items() if text in k)

    greylisted = refused("Greylisted")
    return {
        "delivered": len(first),
        "duplicates": sum(n - 1 for n in counts.values() if n > 1),
        "failed_dsn": run.dsns,
        "drain_s": drain,
        "ratio": drain / t_min(args) if drain and t_min(args) else None,  # none: one window
        "too_much_mail": refused("Message delivery request rate limit"),
        "too_many_recipients": refused("Recipient address rate limit"),
        "too_many_connections": refused("Connection concurrency limit"),
        "too_many_errors": refused("too many errors"),
        "greylisted": greylisted,
        "greylisted_again": sum(n - 1 for n in log["greylisted"].values()),
        "refused_mail_per_delivered": refused("Message delivery request rate limit") / len(first)
        if first
        else None,
        "p0_delivered": len(latency["p0"]),
        "p0_total": sum(p.klass == "p0" for p in run.planned),
        "p0_p50": percentile(latency["p0"], 50),
        "p0_p99": percentile(latency["p0"], 99),
        "p2_p50": percentile(latency["p2"], 50),
        "last_p0_rank": max(p0_ranks) if p0_ranks else None,
        "refusals": dict(Counter(refusals).most_common(12)),
    }


ROWS = [
    ("delivered", lambda f, a: f"{f['delivered']} / {a.messages}"),
    ("permanent failures (DSNs); duplicates", lambda f, a: f"{f['failed_dsn']}; {f['duplicates']}"),
    ("drain, s / T_min (target <= 1.3)",
     lambda f, a: f"{fmt(f['drain_s'], 1)} / {fmt(f['ratio'])}"
     + ("" if f["ratio"] is None else " ✓" if f["ratio"] <= 1.3 else " ✗")),
    ("refused MAILs (too much mail) per delivered",
     lambda f, a: f"{fmt(f['refused_mail_per_delivered'], 3)} ({f['too_much_mail']})"),
    ("too many recipients / connections / errors",
     lambda f, a: f"{f['too_many_recipients']} / {f['too_many_connections']} / "
     f"{f['too_many_errors']}"),
    ("greylisted (beyond one per triplet)",
     lambda f, a: f"{f['greylisted']} ({f['greylisted_again']})"),
    ("p0 p50 / p99 from release, s; p2 p50",
     lambda f, a: f"{fmt(f['p0_p50'], 0)} / {fmt(f['p0_p99'], 0)}; {fmt(f['p2_p50'], 0)}"
     + ("" if f["p0_delivered"] == f["p0_total"]
        else f" ({f['p0_total'] - f['p0_delivered']} p0 undelivered)")),
    ("last p0 message delivered as number (of delivered)",
     lambda f, a: f"{fmt(f['last_p0_rank'])} ({f['delivered']})"),
]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--messages", type=int, default=300)
    add("--greylist", type=int, default=5, help="postgrey --delay, s (5)")
    add("--connections", type=int, default=3, help="smtpd_client_connection_count_limit")
    add("--rate", type=int, default=60, help="messages (and recipients) per --rate-unit")
    add("--rate-unit", type=int, default=10, help="anvil_rate_time_unit, s (10)")
    add("--timeout", type=float, help="drain timeout per run, s (default 4 x T_min + 60)")
    add("--skip-mtaqueue", action="store_true")
    add("--skip-postfix", action="store_true")
    add("--flush", action="store_true", help="also mtaqueue with the outage live, then a flush")
    add("--hold-bulk", action="store_true", help="--flush holds p1, p2 until p0 is gone")
    add("--mq-option", action="append", default=[], metavar="SECTION.KEY=VALUE")
    add("--keep", action="store_true")
    args = parser.parse_args()
    if not postfix_available():
        print("needs root and Debian's postfix (and postgrey)", file=sys.stderr)
        return 2
    timeout = args.timeout or 4 * t_min(args) + 60
    load = os.getloadavg()
    print(
        f"{args.messages} messages; provider: Postfix, postgrey {args.greylist} s, "
        f"{args.connections} connections, {args.rate} messages and recipients per "
        f"{args.rate_unit} s; T_min {t_min(args):.0f} s; load {load[0]:.2f} {load[1]:.2f}",
        flush=True,
    )
    results = []
    with work_directory("postfix-provider-", keep=args.keep) as workdir:
        if not args.skip_mtaqueue:
            results.append(run_mtaqueue(args, workdir, timeout))
        if args.flush:
            results.append(run_mtaqueue(args, workdir, timeout, flush=True))
        if not args.skip_postfix:
            results.append(run_postfix(args, workdir, timeout))
    figs = []
    for run, log in results:
        f = figures(run, log, args)
        figs.append(f)
        print(f"\n== {run.label}: submitted in {run.submit_s:.1f} s, up {run.startup_s:.2f} s")
        for note in run.notes:
            print(f"note: {note}")
        if run.error:
            print(f"ERROR: {run.error}")
        print(f"refusals: {f['refusals']}")
        for row in ((run.extra.get("log") or {}).get("attempts") or [])[:10]:
            print(f"  attempts {row}")
        for row in ((run.extra.get("log") or {}).get("reasons") or [])[:8]:
            print(f"  postfix {row}")
    print("\n| | " + " | ".join(r.label for r, _ in results) + " |")
    print("|---" * (len(results) + 1) + "|")
    for title, get in ROWS:
        print(f"| {title} | " + " | ".join(get(f, args) for f in figs) + " |")
    load = os.getloadavg()
    print(f"\nload average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return 1 if any(r.error for r, _ in results) else 0


if __name__ == "__main__":
    sys.exit(main())
