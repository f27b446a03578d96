"""Memory with large messages in flight: many concurrent big submissions, peak resident memory.

    python bench/memory_bench.py [--clients 200] [--size BYTES] [--rounds 1]

`smtp-source -s CLIENTS -m CLIENTS -l SIZE` opens CLIENTS connections at once, each sending
one message of SIZE bytes (default 25 MiB less 64 KiB for the headers, so it fits the default
`listen.max_message_size`). While it runs, the memory of the whole process tree (mtaqueue:
the daemon and its spool writer; Postfix: master, smtpd, cleanup, ...) is summed every 50 ms,
as RSS and as PSS; the peaks are reported, with the same load against a private Postfix
instance that accepts durably and defers delivery. Both spools live on the same file system; the run
needs about 2 x CLIENTS x SIZE bytes of free disk.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # postfix_instance
from accept_bench import Mtaqueue
from common import tree_pids, work_directory
from postfix_instance import PostfixInstance, postfix_available, smtp_source

POSTFIX_ADDR = "127.0.0.1:2635"
MTAQUEUE_PORT = 2636
MiB = 1 << 20


def tree_memory_kib(root: int) -> tuple[int, int]:
    """(RSS, PSS) of a process tree, KiB. RSS counts shared pages (libraries) once per
    process, which inflates a tree of many small processes like Postfix's; PSS shares them
    out, so it is the fair comparison between the two designs."""
    rss = pss = 0
    for pid in tree_pids(root):
        try:
            lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if line.startswith("Rss:"):
                rss += int(line.split()[1])
            elif line.startswith("Pss:"):
                pss += int(line.split()[1])
    return rss, pss


class PeakSampler:
    """Samples tree_memory_kib(pid) in a thread until stopped; keeps the peaks."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.pid, self.interval = pid, interval
        self.rss = self.pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, pss = tree_memory_kib(self.pid)
            self.rss, self.pss = max(self.rss, rss), max(self.pss, pss)
            self._stop.wait(self.interval)


class Run(NamedTuple):
    idle_rss: int
    idle_pss: int
    peak_rss: int
    peak_pss: int
    seconds: float


def measure(target: str, pid: int, args) -> Run:
    """Memory before the load and at its peak, KiB, and the load's seconds."""
    idle_rss, idle_pss = tree_memory_kib(pid)
    with PeakSampler(pid) as sampler:
        seconds = smtp_source(target, args.clients, args.clients, args.size, timeout=1800)
    return Run(idle_rss, idle_pss, sampler.rss, sampler.pss, seconds)


def report(name: str, run: Run, args) -> None:
    growth = (run.peak_pss - run.idle_pss) / 1024
    print(
        f"{name:9s} peak RSS {run.peak_rss / 1024:7.1f} MiB  peak PSS {run.peak_pss / 1024:7.1f}"
        f" MiB (idle {run.idle_pss / 1024:5.1f}, {growth * 1024 / args.clients:6.0f} KiB per"
        f" client)  {args.clients} x {args.size / MiB:.1f} MiB in {run.seconds:.1f} s",
        flush=True,
    )


def postfix_master_pid(pf: PostfixInstance) -> int:
    return int((pf.queue_dir / "pid" / "master.pid").read_text().split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--size", type=int, default=25 * MiB - 64 * 1024)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    with work_directory("mtaqueue-memory-") as workdir:
        for round_ in range(args.rounds):
            mq = Mtaqueue(
                workdir / f"mq{round_}",
                MTAQUEUE_PORT,
                "delivery.enabled=false",
                f"listen.max_connections={args.clients + 10}",
                f"listen.max_connections_per_client={args.clients + 10}",
            )
            mq.start()
            try:
                assert mq.proc is not None
                mq_run = measure(f"127.0.0.1:{MTAQUEUE_PORT}", mq.proc.pid, args)
                assert mq.queued() == args.clients + 1, "mtaqueue lost mail"
            finally:
                mq.stop()
            report("mtaqueue", mq_run, args)
            if not postfix_available():
                continue
            settings = {
                "message_size_limit": str(args.size + MiB),
                "default_process_limit": str(args.clients + 10),
                "smtpd_client_connection_count_limit": "0",
            }
            with PostfixInstance(
                workdir / f"postfix{round_}", listen=POSTFIX_ADDR, mode="defer", main_cf=settings
            ) as pf:
                pf_run = measure(POSTFIX_ADDR, postfix_master_pid(pf), args)
                assert pf.queue_count() >= args.clients, "postfix lost mail"
            report("postfix", pf_run, args)
            print(f"peak PSS ratio mtaqueue/postfix: {mq_run.peak_pss / pf_run.peak_pss:.2f}")


if __name__ == "__main__":
    main()
