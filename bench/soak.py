"""Soak: memory, files, threads and tasks at a steady mixed load (issue 31).

    python bench/soak.py [--minutes 120] [--rate 25] [--warmup 10] [--tracemalloc N]
                         [--kill-writer-at MINUTES] [--json FILE] [--keep]
                         [--snapshots DIR] [--dedupe-window DURATION]
                         [--suppression-ttl DURATION]
    python bench/soak.py --compare DIR      # diff the snapshots kept by --snapshots

The daemon (a subprocess, the shipped conf/mtaqueue.toml; overridden only: spool.path,
listen.address, dns.nameservers, metrics.address, log.level=warning and delivery.port, the
one port of every loopback MX host; and submission.dedupe_window with --dedupe-window: an
idempotency key is live for the whole window, 24 h as shipped, so a run shorter than that
shows keys forgotten only with a shorter one, as the suppressions' 2-minute TTL does; and
suppression.ttl with --suppression-ttl: a hard-bounced address is suppressed for 30 days as
shipped, and the traffic below bounces a new address ~1.25 times a second, so with the
shipped TTL that list only grows in a run (live state, ~340 bytes an address in each
process); no timer is shortened, so greylisted and deferred mail
waits out the shipped 5/15/30/60 min schedule: the queue is level, not empty) gets mail
from our own SMTP clients (smtplib, 8 threads) at `--rate` messages per second for
`--warmup` + `--minutes` minutes, each with a unique Message-ID and
X-Mtaqueue-Idempotency-Key; a 4xx or a lost connection is retried with the same key.
The mix (bench/soak_traffic.py): 65% to d<N>.accept.test, a new domain per message (an
Unbound redirect zone, all to Postfix's smtp-sink); 10% to a domain that greylists each
triplet once (the synthetic peer's greylisting, not postgrey); 10% to one answering
550 5.1.1 for bad<N>@ (half of those messages have such a recipient; the DSNs go to
app.test, whose MX counts them); 10% to one whose MX is down (421 at connect) every other
minute; 5% to one that answers every command a second late; every 100th to the address
suppressed last. A suppression with a 2-minute TTL is added every 15 s
(`mtaqueue-ctl suppress add ADDRESS --for 2m`), and the spool writer is `kill -9`ed once
(`--kill-writer-at`, default the middle of the measured part).

Every minute: RSS, open files and threads of the daemon, its writer and its listener,
the daemon's asyncio tasks (`mtaqueue_process_tasks` on /metrics, "-" when absent), spool files
(msg/), journal bytes, the queue (`status --json`), and submitted / acked / delivered /
DSN counts. At the end: the samples, growth per hour after the warm-up (least squares;
a child's with one intercept per process of it), the targets (RSS <= 2 MB/h, files,
threads and tasks flat), and the checks: no acked message lost (each one delivered,
bounced with a DSN, or still queued) and none delivered twice. `--tracemalloc N` runs the
daemon with MTAQUEUE_TRACEMALLOC=N, takes snapshots (SIGUSR2) after the warm-up, around
the writer's kill and at the end, and prints the 25 allocation sites that grew most in
each process between its first and last snapshot, and the traced total's growth per hour
(a figure of the Python heap alone). With tracing on, the RSS figures are not the ones
to quote: tracing costs CPU (at 10 frames the daemon, at 100% of a core, took ~17 of the
25 msg/s asked, on 2 cores shared with other work) and memory, and each snapshot leaves
freed memory behind that later growth reuses, so the RSS slope after it understates the
growth; measure RSS in a run without `--tracemalloc`.
`--snapshots DIR` keeps the snapshot files; `--compare DIR` only diffs such a directory.
Needs root, Postfix's smtp-sink and Unbound; everything on 127.0.0.0/8.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accept_bench import Mtaqueue
from common import free_port, mtaqueue_children, work_directory
from soak_traffic import Receivers, Submitter

REPO = Path(__file__).resolve().parent.parent
SERIES = [
    ("daemon_rss_mb", "MB"), ("writer_rss_mb", "MB"), ("listener_rss_mb", "MB"),
    ("daemon_files", ""), ("writer_files", ""), ("listener_files", ""),
    ("daemon_threads", ""), ("writer_threads", ""), ("listener_threads", ""), ("tasks", ""),
    ("spool_files", ""), ("journal_mb", "MB"), ("queue", ""), ("keys", ""),
    ("suppressions", ""),
]  # fmt: skip
# Gauges read from /metrics each sample: the daemon's tasks and its two maps of live state.
GAUGES = {
    "tasks": "mtaqueue_process_tasks ",
    "keys": 'mtaqueue_memory_entries{map="idempotency_keys"}',
    "suppressions": 'mtaqueue_memory_entries{map="suppressions"}',
}
CHILDREN = ("writer", "listener")
# A child's series is fitted with one intercept per process of it (a restarted writer).
PID_OF = {f"{role}_{k}": f"{role}_pid" for role in CHILDREN for k in ("rss_mb", "files", "threads")}


def proc_status(pid: int | None) -> tuple[float, int, int] | None:
    """(VmRSS MB, open files, threads) of a process, None if it is gone."""
    if pid is None:
        return None
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        files = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    values = dict(line.split(":", 1) for line in lines if ":" in line)
    return int(values["VmRSS"].split()[0]) / 1024, files, int(values["Threads"])


def writer_pid(daemon: int) -> int | None:
    return mtaqueue_children(daemon).get("writer")


def ctl(spool: Path, *args: str) -> str:
    cmd = [sys.executable, "-m", "mtaqueue.control.ctl.main", "-s", str(spool / "control.sock")]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120).stdout


def gauges(metrics: str) -> dict[str, float | None]:
    """GAUGES as /metrics shows them now (None: not served)."""
    found: dict[str, float | None] = dict.fromkeys(GAUGES)
    try:
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    except OSError:
        return found
    for line in text.splitlines():
        for name, prefix in GAUGES.items():
            if line.startswith(prefix):
                found[name] = float(line.split()[-1])
    return found


def spool_counts(spool: Path) -> tuple[int, float]:
    files = sum(
        sum(1 for n in names if not n.endswith(".tmp")) for _, _, names in os.walk(spool / "msg")
    )
    journal = sum(p.stat().st_size for p in (spool / "journal").glob("*.log") if p.exists())
    return files, journal / 1e6


def sample(t0: float, mq: Mtaqueue, rx: Receivers, sub: Submitter, metrics: str) -> dict:
    daemon = proc_status(mq.proc.pid)
    pids = mtaqueue_children(mq.proc.pid)
    files, journal = spool_counts(mq.spool)
    try:
        queue = json.loads(ctl(mq.spool, "status", "--json"))["messages"]
    except (ValueError, KeyError, subprocess.TimeoutExpired):
        queue = None
    row = {"minute": round((time.monotonic() - t0) / 60, 2)}
    row |= {f"{role}_pid": pids.get(role) for role in CHILDREN}
    processes = [("daemon", daemon)] + [(role, proc_status(pids.get(role))) for role in CHILDREN]
    for prefix, values in processes:
        rss, fds, threads = values or (None, None, None)
        row |= {f"{prefix}_rss_mb": rss, f"{prefix}_files": fds, f"{prefix}_threads": threads}
    row |= gauges(metrics) | {"spool_files": files, "journal_mb": journal, "queue": queue}
    row |= {"submitted": sub.submitted, "acked": len(sub.acked), "retries": sub.retries}
    row |= {"delivered": rx.delivered(), "dsns": rx.dsns()}
    return row


def fmt(value, width: int = 8) -> str:
    if value is None:
        return "-".rjust(width)
    return (f"{value:.1f}" if isinstance(value, float) else str(value)).rjust(width)


def slope_per_hour(rows: list[dict], key: str) -> float | None:
    """Least-squares slope per hour; a child's with one intercept per process of it."""
    groups: dict = {}
    for r in rows:
        if r[key] is not None:
            groups.setdefault(r.get(PID_OF.get(key, "")), []).append((r["minute"], r[key]))
    num = den = 0.0
    for points in groups.values():
        mt = sum(t for t, _ in points) / len(points)
        my = sum(y for _, y in points) / len(points)
        num += sum((t - mt) * (y - my) for t, y in points)
        den += sum((t - mt) ** 2 for t, _ in points)
    return num / den * 60 if den else None


def residual_spread(rows: list[dict], key: str) -> float:
    """Standard deviation of the points around the fitted line(s)."""
    slope = (slope_per_hour(rows, key) or 0.0) / 60
    groups: dict = {}
    for r in rows:
        if r[key] is not None:
            groups.setdefault(r.get(PID_OF.get(key, "")), []).append((r["minute"], r[key]))
    squares, n = 0.0, 0
    for points in groups.values():
        mt = sum(t for t, _ in points) / len(points)
        my = sum(y for _, y in points) / len(points)
        squares += sum((y - my - slope * (t - mt)) ** 2 for t, y in points)
        n += len(points)
    return (squares / n) ** 0.5 if n else 0.0


def snapshot(pid: int, spool: Path, role: str, timeout: float = 120) -> Path | None:
    """SIGUSR2 to `pid`; the snapshot file it writes (None if none came)."""
    directory = spool / "tracemalloc"
    before = set(directory.glob(f"{role}-{pid}-*.snap")) if directory.exists() else set()
    try:
        os.kill(pid, signal.SIGUSR2)
    except ProcessLookupError:
        return None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = set(directory.glob(f"{role}-{pid}-*.snap")) - before if directory.exists() else ()
        if new:
            return max(new, key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        time.sleep(0.5)
    return None


def short(filename: str) -> str:
    for marker in ("/mtaqueue/", "/site-packages/", "/lib/python3"):
        if marker in filename:
            return filename[filename.rindex(marker) + 1 :]
    return filename


def growth_sites(old, new, key: str, top: int) -> list[dict]:
    rows = []
    for stat in new.compare_to(old, key)[:top]:
        frames = [f"{short(f.filename)}:{f.lineno}" for f in stat.traceback]
        rows.append(
            {"site": frames[-1] if frames else "?",
             "size_diff_kib": round(stat.size_diff / 1024, 1), "count_diff": stat.count_diff,
             "size_kib": round(stat.size / 1024, 1), "traceback": frames}
        )  # fmt: skip
    return rows


def compare_snapshots(groups: dict[str, list[Path | None]]) -> dict:
    """For each process, its first snapshot against its last: the traced total's growth
    per hour (by the files' times) and the sites that grew most; printed, and returned."""
    ignore = [
        tracemalloc.Filter(False, tracemalloc.__file__),
        tracemalloc.Filter(False, "<frozen importlib._bootstrap*>"),
    ]
    tops: dict = {}
    for name, files in groups.items():
        files = [f for f in files if f is not None]
        if len(files) < 2:
            continue
        old, new = (
            tracemalloc.Snapshot.load(str(f)).filter_traces(ignore) for f in (files[0], files[-1])
        )
        hours = (files[-1].stat().st_mtime - files[0].stat().st_mtime) / 3600
        before, after = (sum(t.size for t in snap.traces) / 1e6 for snap in (old, new))
        tops[f"{name} traced MB"] = {"first": before, "last": after, "hours": hours}
        print(f"\ntraced by tracemalloc, {name}: {before:.1f} -> {after:.1f} MB in "
              f"{hours * 60:.0f} min: {(after - before) / max(hours, 1e-9):+.1f} MB/h")  # fmt: skip
        for key, top in (("lineno", 25), ("traceback", 10)):
            tops[f"{name} by {key}"] = sites = growth_sites(old, new, key, top)
            print(f"top growing allocation sites by {key}, {name} "
                  f"({files[0].name} -> {files[-1].name}):")  # fmt: skip
            print(f"  {'size diff KiB':>13} {'count diff':>10} {'size KiB':>9}  site")
            for t in sites:
                callers = " < ".join(reversed(t["traceback"][:-1]))[:160]
                print(f"  {t['size_diff_kib']:>13} {t['count_diff']:>10} {t['size_kib']:>9}  "
                      f"{t['site']}" + (f"  (< {callers})" if callers else ""))  # fmt: skip
    return tops


def snapshot_groups(directory: Path) -> dict[str, list[Path]]:
    """Snapshot files (role-pid-n.snap) by process, in order."""
    groups: dict[str, list[Path]] = {}
    for path in directory.glob("*.snap"):
        role, pid, _ = path.stem.split("-")
        groups.setdefault(f"{role} {pid}", []).append(path)
    return {k: sorted(v, key=lambda p: int(p.stem.split("-")[2])) for k, v in groups.items()}


def periodic(stop: threading.Event, every: float, action) -> threading.Thread:
    def run() -> None:
        while not stop.wait(every):
            action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def lost_and_duplicates(mq: Mtaqueue, rx: Receivers, sub: Submitter) -> dict:
    deadline = time.monotonic() + 30  # DSNs still queued: let them reach their sink
    while True:
        queued_keys, null_sender = set(), 0
        for line in ctl(mq.spool, "list", "--json").splitlines():
            if line.strip():
                row = json.loads(line)
                queued_keys.add(row.get("idempotency_key"))
                null_sender += row.get("sender") in ("", "<>")
        if not null_sender or time.monotonic() > deadline:
            break
        time.sleep(2)
    delivered = rx.delivered_keys()
    dsn = rx.dsn.dsn_keys
    lost = [k for k in sub.acked if k not in delivered and k not in dsn and k not in queued_keys]
    with_bad = [k for k, rcpts in sub.acked.items() if any(r.startswith("bad") for r in rcpts)]
    no_dsn = [k for k in with_bad if k not in dsn and k not in queued_keys]
    return {
        "acked": len(sub.acked), "delivered_keys": len(delivered), "dsn_keys": len(dsn),
        "queued": len(queued_keys), "dsns_queued": null_sender, "lost": len(lost),
        "lost_examples": lost[:20], "bad_recipient_without_dsn": len(no_dsn),
        "duplicates": sum(1 for c in delivered.values() if c > 1),
        "duplicate_examples": [k for k, c in delivered.items() if c > 1][:20],
        "duplicate_dsns": sum(1 for c in dsn.values() if c > 1),
        "unknown_delivered": sum(1 for k in delivered if k not in sub.acked),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=120, help="measured, after the warm-up")
    parser.add_argument("--rate", type=float, default=25, help="messages per second")
    parser.add_argument("--warmup", type=float, default=10, help="minutes")
    parser.add_argument("--tracemalloc", type=int, default=0, metavar="N", help="frames")
    parser.add_argument("--kill-writer-at", type=float, help="minute (default: the middle)")
    parser.add_argument("--sample-every", type=float, default=60, help="seconds")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--snapshots", type=Path, help="copy the tracemalloc snapshots here")
    parser.add_argument("--compare", type=Path, metavar="DIR", help="only diff saved snapshots")
    parser.add_argument(
        "--dedupe-window",
        metavar="DURATION",
        help="submission.dedupe_window (default: the shipped 24h, longer than any run: the"
        " keys then only grow; a window shorter than the run shows them forgotten)",
    )
    parser.add_argument(
        "--suppression-ttl",
        metavar="DURATION",
        help="suppression.ttl (default: the shipped 30d: the bounced addresses then only grow)",
    )
    args = parser.parse_args()
    if args.compare:
        compare_snapshots(snapshot_groups(args.compare))
        return 0
    total = args.warmup + args.minutes
    kill_at = (
        args.kill_writer_at if args.kill_writer_at is not None else args.warmup + args.minutes / 2
    )
    planned = int(total * 60 * args.rate) + 1
    bad = [f"bad{i}@bounce.test" for i in range(15, planned, 20)]
    env = os.environ.copy()
    if args.tracemalloc:
        env["MTAQUEUE_TRACEMALLOC"] = str(args.tracemalloc)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    os.chdir(REPO)  # `python -m mtaqueue.daemon` of this tree
    with work_directory("mtaqueue-soak-", args.keep) as workdir, Receivers(workdir, bad) as rx:
        metrics = f"127.0.0.1:{free_port()}"
        mq = Mtaqueue(
            workdir / "spool", free_port(),
            f'dns.nameservers=["{rx.dns.address}"]', f"metrics.address={metrics}",
            f"delivery.port={rx.port}",
            *([f"submission.dedupe_window={args.dedupe_window}"] if args.dedupe_window else []),
            *([f"suppression.ttl={args.suppression_ttl}"] if args.suppression_ttl else []),
        )  # fmt: skip
        os.environ.update(env)  # the daemon inherits it (and its writer)
        try:
            return run(args, rx, mq, metrics, total, kill_at)
        finally:
            mq.stop()


def run(args, rx: Receivers, mq: Mtaqueue, metrics: str, total: float, kill_at: float) -> int:
    mq.launch()
    mq.wait_accepting(120)  # its probe goes to example.org: refused by Unbound, stays queued
    window = args.dedupe_window or "24h (shipped)"
    ttl = args.suppression_ttl or "30d (shipped)"
    print(f"soak: {args.warmup:g} + {args.minutes:g} min at {args.rate:g} msg/s, "
          f"writer killed at minute {kill_at:g}, dedupe window {window}, "
          f"suppression TTL {ttl}", flush=True)  # fmt: skip
    t0 = time.monotonic()
    sub = Submitter(mq.port, args.rate, t0 + total * 60)
    stop = threading.Event()
    n_supp = iter(range(10**9))

    def suppress() -> None:
        address = f"x{next(n_supp)}@supp.accept.test"
        ctl(mq.spool, "suppress", "add", address, "--for", "2m", "--reason", "soak")
        sub.suppressed = address

    periodic(stop, 15, suppress)
    periodic(stop, 60, rx.flip_down)
    rows, snaps, events = [], {}, []
    header = ["min", *[k for k, _ in SERIES], "subm", "acked", "retry", "deliv", "dsns"]
    print(" ".join(h[:10].rjust(8) for h in header), flush=True)
    keys = [
        "minute",
        *[k for k, _ in SERIES],
        "submitted",
        "acked",
        "retries",
        "delivered",
        "dsns",
    ]
    warm_snapped = killed = False
    next_sample = t0
    while True:
        now = time.monotonic()
        minute = (now - t0) / 60
        if mq.proc.poll() is not None:
            events.append(f"daemon exited at minute {minute:.1f}")
            break
        if not warm_snapped and minute >= args.warmup:
            warm_snapped = True
            if args.tracemalloc:
                snaps["daemon"] = [snapshot(mq.proc.pid, mq.spool, "daemon")]
                for role, pid in mtaqueue_children(mq.proc.pid).items():
                    snaps[f"{role} {pid}"] = [snapshot(pid, mq.spool, role)]
        if not killed and minute >= kill_at:
            killed = True
            wpid = writer_pid(mq.proc.pid)
            if args.tracemalloc and wpid:
                snaps.setdefault(f"writer {wpid}", []).append(snapshot(wpid, mq.spool, "writer"))
            if wpid:
                os.kill(wpid, signal.SIGKILL)
            events.append(f"writer {wpid} killed at minute {(time.monotonic() - t0) / 60:.1f}")
            print(events[-1], flush=True)
            if args.tracemalloc:

                def first_of_new() -> None:
                    time.sleep(60)
                    new = writer_pid(mq.proc.pid)
                    if new:
                        snaps[f"writer {new}"] = [snapshot(new, mq.spool, "writer")]

                threading.Thread(target=first_of_new, daemon=True).start()
        if now >= next_sample:
            rows.append(sample(t0, mq, rx, sub, metrics))
            print(" ".join(fmt(rows[-1][k]) for k in keys), flush=True)
            next_sample += args.sample_every
        if minute >= total:
            break
        time.sleep(min(1.0, max(0.05, next_sample - time.monotonic())))
    stop.set()
    sub.join()
    if mq.proc.poll() is None:
        rows.append(sample(t0, mq, rx, sub, metrics))
        print(" ".join(fmt(rows[-1][k]) for k in keys), flush=True)
        if args.tracemalloc:
            snaps.setdefault("daemon", []).append(snapshot(mq.proc.pid, mq.spool, "daemon"))
            for role, pid in mtaqueue_children(mq.proc.pid).items():
                snaps.setdefault(f"{role} {pid}", []).append(snapshot(pid, mq.spool, role))
        if args.snapshots:
            args.snapshots.mkdir(parents=True, exist_ok=True)
            for path in (mq.spool / "tracemalloc").glob("*.snap"):
                shutil.copy2(path, args.snapshots)
        time.sleep(5)
        checks = lost_and_duplicates(mq, rx, sub)
    else:
        checks = {"lost": None, "duplicates": None, "note": "the daemon died"}
    mq.stop()
    report(args, rows, checks, snaps, sub, events)
    return 0 if checks.get("lost") == 0 and checks.get("duplicates") == 0 else 1


def report(args, rows, checks, snaps, sub, events) -> None:
    measured = [r for r in rows if r["minute"] >= args.warmup - 0.01]
    growth = {k: slope_per_hour(measured, k) for k, _ in SERIES}
    print(f"\ngrowth per hour after the warm-up ({len(measured)} samples):")
    targets = {f"{p}_rss_mb": 2.0 for p in ("daemon", *CHILDREN)}
    flat = {f"{p}_{k}" for p in ("daemon", *CHILDREN) for k in ("files", "threads")} | {"tasks"}
    verdicts = {}
    for key, unit in SERIES:
        value = growth[key]
        if key in targets:
            ok = value is not None and value <= targets[key]
            verdicts[key], target = ok, f"target <= {targets[key]:g} {unit}/h"
        elif key in flat:
            # flat: what the slope adds over the run is within the noise around the line
            span = (measured[-1]["minute"] - measured[0]["minute"]) / 60 if measured else 0
            noise = residual_spread(measured, key)
            ok = value is None or abs(value) * span <= max(1.0, 2 * noise)
            verdicts[key], target = ok, f"target: flat (rise <= max(1, 2 x {noise:.1f}))"
        else:
            target = ""
        shown = "-" if value is None else f"{value:+.2f}"
        mark = "" if key not in verdicts or value is None else ("ok" if verdicts[key] else "FAIL")
        print(f"  {key:<16} {shown:>10} {unit}/h  {target} {mark}")
    span = rows[-1]["minute"] - rows[0]["minute"] if rows else 0
    print(f"submitted {sub.submitted} in {span:.1f} min: {sub.submitted / max(span, 0.01) / 60:.1f}"
          f" msg/s (asked {args.rate:g})")  # fmt: skip
    print(f"kinds acked: {dict(sub.kinds)}; refused (5xx): {dict(sub.refused)}; "
          f"retries: {sub.retries}")  # fmt: skip
    for event in events:
        print(event)
    print("checks:", json.dumps(checks))
    tops = compare_snapshots(snaps)
    if args.json:
        figures = {"args": vars(args), "samples": rows, "growth_per_hour": growth,
                   "verdicts": verdicts, "checks": checks, "events": events,
                   "kinds": dict(sub.kinds), "refused": dict(sub.refused),
                   "retries": sub.retries, "errors": sub.errors, "tracemalloc": tops}  # fmt: skip
        Path(args.json).write_text(json.dumps(figures, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
