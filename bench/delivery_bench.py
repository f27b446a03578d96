"""End-to-end throughput (accept + deliver), side by side with Postfix.

    python bench/delivery_bench.py [--messages 10000] [--sessions 20] [--size 2048] [--rounds 3]

Each round: `smtp-source -s SESSIONS -m MESSAGES -l SIZE` submits to the MTA, which relays
everything to one `smtp-sink`; the clock runs from the first submission until the sink has
counted every message and the MTA's queue is empty. Postfix (relayhost = the sink) and
mtaqueue (delivery.relayhost = the sink) alternate, so both meet the same machine state.

Where the time goes, each round (cpu_use.py): the machine's busy CPU a message and its idle
share, and the CPU a message of smtp-sink, of smtp-source and, for mtaqueue, of its daemon,
its listener's process and its spool writer (Postfix's processes come and go: theirs is the
machine's less the tools'). A process whose CPU is near the round's seconds is bound by its
one thread.

Both log every message, as shipped: Postfix to its maillog, mtaqueue at its shipped level
(info) to a file beside its spool.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # postfix_instance
from accept_bench import Mtaqueue, print_medians
from common import load_parser, mtaqueue_children, work_directory
from cpu_use import CpuMeter
from postfix_instance import PostfixInstance, SmtpSink, postfix_available, smtp_source

SINK = "127.0.0.1:2700"
POSTFIX = "127.0.0.1:2625"
MTAQUEUE_PORT = 2626


def run_timed(submit, drained, timeout: float = 600.0) -> float:
    """Seconds from the start of `submit` until `drained()` holds."""
    started = time.monotonic()
    thread = threading.Thread(target=submit)
    thread.start()
    while not drained():
        if time.monotonic() - started > timeout:
            raise RuntimeError("did not drain in time")
        time.sleep(0.05)
    thread.join()
    return time.monotonic() - started


def mtaqueue_round(args, workdir: Path, sink: SmtpSink) -> tuple[float, str]:
    host, port = SINK.split(":")
    # Its shipped log level, to a file: Postfix logs each message to its maillog too.
    log_file = workdir.parent / f"{workdir.name}.log"
    mq = Mtaqueue(workdir, MTAQUEUE_PORT, f"delivery.relayhost=[{host}]:{port}", log_file=log_file)
    mq.start()  # its probe message goes to the sink too
    base = sink.count()
    assert mq.proc is not None and sink.pid is not None
    pids = {"daemon": mq.proc.pid, **mtaqueue_children(mq.proc.pid)}
    try:
        meter = CpuMeter({**pids, "smtp-sink": sink.pid})
        seconds = run_timed(
            lambda: smtp_source(
                f"127.0.0.1:{MTAQUEUE_PORT}", args.sessions, args.messages, args.size
            ),
            lambda: sink.count() - base >= args.messages and mq.queued() == 0,
        )
        use = meter.read()
    finally:
        mq.stop()
    return args.messages / seconds, use.line(args.messages)


def postfix_round(args, workdir: Path, sink: SmtpSink) -> tuple[float, str]:
    base = sink.count()
    assert sink.pid is not None
    with PostfixInstance(workdir, listen=POSTFIX, mode="relay", relay=SINK) as pf:
        meter = CpuMeter({"smtp-sink": sink.pid})
        seconds = run_timed(
            lambda: smtp_source(POSTFIX, args.sessions, args.messages, args.size),
            lambda: sink.count() - base >= args.messages and pf.queue_count() == 0,
        )
        use = meter.read()
    return args.messages / seconds, use.line(args.messages)


def main() -> None:
    args = load_parser(__doc__).parse_args()
    mq_rates, pf_rates = [], []
    with work_directory("mtaqueue-bench-") as workdir, SmtpSink(SINK) as sink:
        for round_ in range(args.rounds):
            if postfix_available():
                rate, cpu = postfix_round(args, workdir / f"postfix{round_}", sink)
                pf_rates.append(rate)
                print(f"round {round_}: postfix  {rate:7.0f} msgs/s; {cpu}", flush=True)
            rate, cpu = mtaqueue_round(args, workdir / f"mq{round_}", sink)
            mq_rates.append(rate)
            print(f"round {round_}: mtaqueue {rate:7.0f} msgs/s; {cpu}", flush=True)
    print_medians(mq_rates, pf_rates, "msgs/s end to end")


if __name__ == "__main__":
    main()
