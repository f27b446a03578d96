"""Bulk control commands on a large queue: `hold --all`, then `release --all`.

    python bench/bulk_ctl_bench.py [--queued 100000 [300000 ...]] [--size 2048]
                                   [--settle 15] [--compare-tree DIR]

After a long outage an admin holds or flushes the whole queue. Per size: the spool is
filled with queued messages (accept_bench's `fill_spool`, 50 domains), the daemon started
on it with delivery on and a DNS server that never answers (nothing can be delivered; the
lookups of released mail time out and defer it), and each command run with
`mtaqueue-ctl` while an SMTP session on the daemon sends NOOP in a loop, on for
`--settle` seconds after the command returned (what it set going: released mail is
routed, and deferred when its lookup times out). Printed: the command's wall time, the
daemon's peak RSS growth, and the longest NOOP round trip (how long the event loop was
held). `--compare-tree` runs the same with
the daemon of another checkout (e.g. a `git worktree` of an older commit) on a copy of
each filled spool, so both meet the same queue.
"""

from __future__ import annotations

import argparse
import os
import shutil
import smtplib
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accept_bench import Mtaqueue, fill_spool, rss_kib
from common import free_port, work_directory


class NoopProbe:
    """An SMTP session sending NOOP in a loop; keeps the longest round trip."""

    def __init__(self, port: int) -> None:
        self.client = smtplib.SMTP("127.0.0.1", port, timeout=120)
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.client.noop()
            self.longest = max(self.longest, time.monotonic() - started)
            time.sleep(0.005)

    def __enter__(self) -> NoopProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.client.close()


def run_command(mq: Mtaqueue, settle: float, *args: str) -> tuple[float, float, int, str]:
    """(wall seconds, longest NOOP, peak RSS growth in KiB, the command's output)."""
    assert mq.proc is not None
    base = rss_kib(mq.proc.pid)[0]
    peak = base
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_kib(mq.proc.pid)[0])
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    with NoopProbe(mq.port) as probe:
        sampler.start()
        started = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "mtaqueue.control.ctl.main", "-s",
             str(mq.spool / "control.sock"), *args, "--json"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        seconds = time.monotonic() - started
        time.sleep(settle)
        done.set()
        sampler.join()
    return seconds, probe.longest, peak - base, out.strip()


def measure(label: str, spool: Path, tree: str | None, settle: float) -> None:
    """`tree`: the checkout whose daemon runs (the ctl client is this one's)."""
    mq = Mtaqueue(spool, free_port())
    saved = os.environ.get("PYTHONPATH")
    if tree:
        os.environ["PYTHONPATH"] = tree
    try:
        mq.start()
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    try:
        for command in ("hold", "release"):
            seconds, stall, grew, out = run_command(mq, settle, command, "--all")
            print(
                f"{label:>10} {command:>8}: {seconds:6.2f} s, longest NOOP {stall:6.3f} s,"
                f" RSS +{grew / 1024:6.1f} MiB  ({out})",
                flush=True,
            )
    finally:
        mq.proc.terminate()
        mq.proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queued", type=int, nargs="+", default=[100_000])
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--settle", type=float, default=15.0)
    parser.add_argument("--compare-tree", help="another checkout's root, run beside this one")
    args = parser.parse_args()
    with work_directory("bulk-ctl-bench-") as workdir:
        for count in args.queued:
            spool = workdir / f"spool{count}"
            started = time.monotonic()
            fill_spool(spool, count, args.size)
            print(f"{count} queued in {time.monotonic() - started:.0f} s", flush=True)
            if args.compare_tree:
                other = workdir / f"other{count}"
                shutil.copytree(spool, other, symlinks=True)
                measure("other", other, str(Path(args.compare_tree).resolve()), args.settle)
                shutil.rmtree(other)
            measure("this", spool, None, args.settle)
            shutil.rmtree(spool)


if __name__ == "__main__":
    main()
