"""Delivery over a real path: a delay proxy between the sender and smtp-sink, the destination
held to C connections, Postfix's smtp client beside mtaqueue's in the same run.

    python bench/pipelining_bench.py [--messages 600] [--delays 25] [--connections 1,4]
                                     [--rcpts 1,5] [--size 2048]

`--delays` are one-way milliseconds (25 = a 50 ms round trip). Each row: messages with R
recipients each, submitted at once with smtp-source (10 sessions) to the sender, which
relays them all through the proxy to smtp-sink over C connections. The rate is messages
over the time from the first message's end of data to the last's, as the proxy saw them
(smtp-sink's own counter comes in buffered bursts); round trips a message are the proxy's
turns (a client write after the server spoke) over the messages. smtp-sink offers PIPELINING, not
CHUNKING: a one-trip transaction needs the next message written behind the final dot.

Both senders are held to C: Postfix by its destination concurrency limits (initial
included), mtaqueue by shaping.default (max and initial connections = C, no p0 reserve).
Both log each message: Postfix to its maillog, mtaqueue at its shipped level to a file.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # postfix_instance
from accept_bench import Mtaqueue
from common import free_port, load_parser, work_directory
from delay_proxy import DelayProxy
from postfix_instance import PostfixInstance
from postfix_tools import SMTP_SOURCE, SmtpSink

SOURCE_SESSIONS = 10


def submit(target: str, messages: int, rcpts: int, size: int) -> None:
    cmd = [SMTP_SOURCE, "-s", str(SOURCE_SESSIONS), "-m", str(messages), "-l", str(size)]
    cmd += ["-r", str(rcpts), "-f", "bench@example.com", "-t", "rcpt@example.org", target]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)


def drain_rate(
    sink: SmtpSink, base: int, proxy: DelayProxy, dots: int, messages: int, timeout: float = 900
) -> float:
    """Messages a second through the proxy, from the first new end of data to the last,
    once the sink has every message."""
    started = time.monotonic()
    while sink.count() - base < messages:
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"only {sink.count() - base} of {messages} delivered")
        time.sleep(0.05)
    seen = proxy.dots[dots:]
    if len(seen) != messages:
        raise RuntimeError(f"the proxy saw {len(seen)} ends of data for {messages} messages")
    return (messages - 1) / max(seen[-1] - seen[0], 1e-6)


def postfix_row(args, workdir: Path, sink: SmtpSink, delay: float, c: int, rcpts: int):
    proxy_at = f"127.0.0.1:{free_port()}"
    limits = {
        "default_destination_concurrency_limit": str(c),
        "smtp_destination_concurrency_limit": str(c),
        "initial_destination_concurrency": str(c),
    }
    listen = f"127.0.0.1:{free_port()}"
    with (
        DelayProxy(proxy_at, sink.listen, delay) as proxy,
        PostfixInstance(workdir, listen=listen, mode="relay", relay=proxy_at, main_cf=limits),
    ):
        base = sink.count()
        submit(listen, args.messages, rcpts, args.size)
        rate = drain_rate(sink, base, proxy, 0, args.messages)
        return rate, proxy.turns / args.messages, proxy.connections


def mtaqueue_row(args, workdir: Path, sink: SmtpSink, delay: float, c: int, rcpts: int):
    proxy_at = f"127.0.0.1:{free_port()}"
    port = free_port()
    with DelayProxy(proxy_at, sink.listen, delay) as proxy:
        mq = Mtaqueue(
            workdir,
            port,
            f"delivery.relayhost=[{proxy_at.split(':')[0]}]:{proxy_at.split(':')[1]}",
            f"shaping.default.max_connections={c}",
            f"shaping.default.initial_connections={c}",
            "shaping.default.reserved_p0=0",
            "shaping.default.messages_per_connection=100000",
            # Its shipped log level, to a file, as Postfix logs each message to its maillog.
            log_file=workdir.with_name(f"{workdir.name}.log"),
        )
        mq.start()  # its probe message goes through the proxy too
        deadline = time.monotonic() + 60
        while sink.count() == 0 or mq.queued():
            if time.monotonic() > deadline:
                raise RuntimeError("the probe message did not arrive")
            time.sleep(0.05)
        turns0, conns0, dots0 = proxy.turns, proxy.connections, len(proxy.dots)
        try:
            base = sink.count()
            submit(f"127.0.0.1:{port}", args.messages, rcpts, args.size)
            rate = drain_rate(sink, base, proxy, dots0, args.messages)
        finally:
            mq.stop()
        return rate, (proxy.turns - turns0) / args.messages, proxy.connections - conns0


def main() -> None:
    parser = load_parser(__doc__)
    parser.add_argument("--delays", default="25")
    parser.add_argument("--connections", default="1,4")
    parser.add_argument("--rcpts", default="1,5")
    parser.set_defaults(messages=600)
    args = parser.parse_args()
    rows = []
    with (
        work_directory("mtaqueue-pipelining-") as workdir,
        SmtpSink(f"127.0.0.1:{free_port()}") as sink,
    ):
        for delay_ms in (int(d) for d in args.delays.split(",")):
            for c in (int(x) for x in args.connections.split(",")):
                for rcpts in (int(x) for x in args.rcpts.split(",")):
                    d = delay_ms / 1000
                    tag = f"d{delay_ms}c{c}r{rcpts}"
                    pf = postfix_row(args, workdir / f"pf-{tag}", sink, d, c, rcpts)
                    mq = mtaqueue_row(args, workdir / f"mq-{tag}", sink, d, c, rcpts)
                    rows.append((2 * delay_ms, c, rcpts, mq, pf))
                    print(
                        f"rtt {2 * delay_ms} ms, C={c}, {rcpts} rcpt: mtaqueue {mq[0]:6.1f} msg/s"
                        f" ({mq[1]:.2f} trips/msg), postfix {pf[0]:6.1f} msg/s"
                        f" ({pf[1]:.2f} trips/msg), ratio {mq[0] / pf[0]:.2f}",
                        flush=True,
                    )
    print()
    print("| RTT | C | rcpts | mtaqueue msg/s | trips/msg | Postfix msg/s | trips/msg | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for rtt, c, rcpts, mq, pf in rows:
        print(
            f"| {rtt} ms | {c} | {rcpts} | {mq[0]:.1f} | {mq[1]:.2f} | {pf[0]:.1f} | "
            f"{pf[1]:.2f} | {mq[0] / pf[0]:.2f} |"
        )


if __name__ == "__main__":
    main()
