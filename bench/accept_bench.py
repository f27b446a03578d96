"""Durable accept throughput, side by side with Postfix, plus start-up and memory.

    python bench/accept_bench.py [--messages 10000] [--sessions 20] [--size 2048]
                                 [--rounds 3] [--queued 100000]

1. Throughput: `smtp-source -s SESSIONS -m MESSAGES -l SIZE` against a private
   Postfix instance that accepts durably and defers delivery, and against
   mtaqueue, alternately for ROUNDS rounds (the disk of a shared VM drifts; the
   alternation keeps the comparison fair). Both spools live on the same file
   system. Prints msgs/s per run, the medians and their ratio.
2. Start-up: a spool holding QUEUED messages (written with the spool's own
   writer), then the time from starting the daemon to the first 250 reply.
3. Memory: resident memory of the daemon with QUEUED messages minus an empty one.
"""

from __future__ import annotations

import json
import smtplib
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_parser, stop_process, work_directory
from postfix_instance import PostfixInstance, postfix_available, smtp_source

from mtaqueue.ids import IdGenerator
from mtaqueue.model import Message, Recipient
from mtaqueue.spool.layout import SpoolLayout
from mtaqueue.spool.writer import Accept, SpoolWriter

POSTFIX_ADDR = "127.0.0.1:2625"


class Mtaqueue:
    """The daemon as a subprocess on a given spool."""

    def __init__(self, spool: Path, port: int, *overrides: str) -> None:
        self.spool, self.port, self.overrides = spool, port, overrides
        self.proc: subprocess.Popen | None = None

    def start(self) -> float:
        """Start; returns seconds until the first message is acknowledged."""
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "mtaqueue.daemon",
                "-o", f"spool.path={self.spool}",
                "-o", f"listen.address=127.0.0.1:{self.port}",
                "-o", "log.level=warning",
                *(arg for item in self.overrides for arg in ("-o", item)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        while True:
            try:
                with smtplib.SMTP("127.0.0.1", self.port, timeout=30) as client:
                    client.sendmail(
                        "probe@example.com", ["probe@example.org"], b"Subject: p\r\n\r\n"
                    )
                return time.monotonic() - started
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("mtaqueue exited") from None
                time.sleep(0.01)

    def rss_kib(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def queued(self) -> int:
        out = subprocess.run(
            [sys.executable, "-m", "mtaqueue.control.ctl", "-s",
             str(self.spool / "control.sock"), "status", "--json"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        return json.loads(out)["messages"]

    def stop(self) -> None:
        stop_process(self.proc, 60)


def throughput(args, workdir: Path) -> None:
    pf_rates, mq_rates = [], []
    for round_ in range(args.rounds):
        if postfix_available():
            with PostfixInstance(
                workdir / f"postfix{round_}", listen=POSTFIX_ADDR, mode="defer"
            ) as pf:
                seconds = smtp_source(POSTFIX_ADDR, args.sessions, args.messages, args.size)
                assert pf.queue_count() >= args.messages, "postfix lost mail"
            pf_rates.append(args.messages / seconds)
            print(f"round {round_}: postfix  {pf_rates[-1]:8.0f} msgs/s", flush=True)
        # Delivery off, as Postfix defers it: the accept path alone (and no bounce of
        # the test domain turning into suppressions that refuse the rest).
        mq = Mtaqueue(workdir / f"mq{round_}", 2626, "delivery.enabled=false")
        mq.start()
        try:
            seconds = smtp_source("127.0.0.1:2626", args.sessions, args.messages, args.size)
            assert mq.queued() == args.messages + 1, "mtaqueue lost mail"
        finally:
            mq.stop()
        mq_rates.append(args.messages / seconds)
        print(f"round {round_}: mtaqueue {mq_rates[-1]:8.0f} msgs/s", flush=True)
    print_medians(mq_rates, pf_rates, "msgs/s")


def print_medians(mq_rates: list[float], pf_rates: list[float], unit: str) -> None:
    mq_median = statistics.median(mq_rates)
    print(f"mtaqueue median: {mq_median:.0f} {unit}")
    if pf_rates:
        pf_median = statistics.median(pf_rates)
        print(f"postfix median:  {pf_median:.0f} {unit}")
        print(f"ratio mtaqueue/postfix: {mq_median / pf_median:.2f}")


def fill_spool(spool: Path, count: int, size: int, domains: int = 50) -> None:
    """Write `count` queued messages to `domains` domains with the spool's own writer
    (fast, no SMTP)."""
    SpoolLayout(spool).create()
    writer = SpoolWriter(spool, compact_size=1 << 40, dedupe_window=86400)
    ids = IdGenerator()
    content = b"Subject: queued\r\n\r\n" + (b"x" * 62 + b"\r\n") * (size // 64)
    batch = []
    for i in range(count):
        queue_id = ids.next()
        message = Message(
            id=queue_id,
            sender="app@example.com",
            recipients=(Recipient(f"user{i}@example{i % domains}.org"),),
            created=time.time(),
            size=len(content),
            klass=("p0", "p1", "p2")[i % 3],
        )
        batch.append(Accept(message, content))
        if len(batch) == 500:
            assert not any(writer.commit(batch))
            batch = []
    if batch:
        assert not any(writer.commit(batch))
    writer.close()


def startup_and_memory(args, workdir: Path) -> None:
    empty = Mtaqueue(workdir / "empty", 2627)
    empty_start = empty.start()
    time.sleep(1)
    empty_rss = empty.rss_kib()
    empty.stop()

    full_spool = workdir / "full"
    started = time.monotonic()
    fill_spool(full_spool, args.queued, args.size)
    print(f"filled a spool with {args.queued} messages in {time.monotonic() - started:.1f} s")
    full = Mtaqueue(full_spool, 2628)
    first = full.start()  # merges the filler's journal segments on this first start
    full.stop()
    second = full.start()  # a plain restart
    time.sleep(3)  # let the background sweep finish
    full_rss = full.rss_kib()
    full.stop()
    print(f"start to first 250, empty spool:  {empty_start:.2f} s")
    print(
        f"start to first 250, {args.queued} queued: {first:.2f} s (first), {second:.2f} s (restart)"
    )
    per_message = (full_rss - empty_rss) * 1024 / args.queued
    print(f"resident memory: empty {empty_rss} KiB, {args.queued} queued {full_rss} KiB")
    print(f"resident memory per queued message: {per_message:.0f} bytes")


def main() -> None:
    parser = load_parser(__doc__)
    parser.add_argument("--queued", type=int, default=100_000)
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    with work_directory("mtaqueue-bench-") as workdir:
        if not args.skip_throughput:
            throughput(args, workdir)
        startup_and_memory(args, workdir)


if __name__ == "__main__":
    main()
