"""Run a private Postfix instance (tests/postfix_instance.py) from the command line, and
measure it.

    python bench/postfix_measure.py [--workdir DIR] [--listen ADDR] [--mode MODE]
        [--relay ADDR] [--sink] [--set PARAM=VALUE]... [--measure N | --delivery N]
    measure(pf, sessions, messages, size, sink=None) -> figures (dict)
    measure_delivery(pf, sink, sessions, messages, size) -> figures (dict)

Without ``--measure`` or ``--delivery`` it starts an instance and keeps it up until
Ctrl-C/SIGTERM; with them it injects N messages with ``smtp-source``, prints the figures
and stops (see ``--help``). Needs root and Debian's ``postfix`` package.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from postfix_instance import (
    MODES,
    PostfixInstance,
    SmtpSink,
    postfix_available,
    smtp_source,
)

# -- measurements --------------------------------------------------------------------------------


def measure(
    pf: PostfixInstance,
    sessions: int,
    messages: int,
    size: int,
    sink: SmtpSink | None = None,
    drain_timeout: float = 600.0,
) -> dict[str, float]:
    """Inject ``messages`` into a started instance and time it.

    defer and hold modes: ``accept_s``/``accept_rate`` (smtp-source time) and ``queued``.
    relay mode: also ``total_s``/``total_rate`` (start of injection until the queue is
    empty, i.e. accepted and relayed) and ``delivered`` (the sink's count, given a sink).
    """
    before = pf.queue_count()
    base = sink.count() if sink is not None else 0
    start = time.monotonic()
    accept_s = smtp_source(pf.listen, sessions, messages, size)
    result = {"messages": messages, "accept_s": accept_s, "accept_rate": messages / accept_s}
    if pf.mode != "relay":
        pf.wait_settled(drain_timeout)
        result["queued"] = pf.queue_count() - before
    else:
        pf.wait_drained(drain_timeout)
        total = time.monotonic() - start
        result |= {"total_s": total, "total_rate": messages / total}
    if sink is not None:
        result["delivered"] = sink.count() - base
    return result


def measure_delivery(
    pf: PostfixInstance,
    sink: SmtpSink,
    sessions: int,
    messages: int,
    size: int,
    drain_timeout: float = 600.0,
) -> dict[str, float]:
    """Delivery alone: fill the queue in defer mode, switch to relay to sink, flush, drain."""
    pf.set_mode("defer")
    base = sink.count()
    accept_s = smtp_source(pf.listen, sessions, messages, size)
    pf.wait_settled(drain_timeout)
    queued = pf.queue_count()
    pf.set_mode("relay", sink.listen)
    start = time.monotonic()
    pf.flush()
    pf.wait_drained(drain_timeout)
    deliver_s = time.monotonic() - start
    return {
        "messages": messages,
        "accept_s": accept_s,
        "queued": queued,
        "deliver_s": deliver_s,
        "deliver_rate": queued / deliver_s,
        "delivered": sink.count() - base,
    }


# -- command line --------------------------------------------------------------------------------


@contextlib.contextmanager
def _maybe_sink(listen: str | None) -> Iterator[SmtpSink | None]:
    if listen is None:
        yield None
    else:
        with SmtpSink(listen) as sink:
            yield sink


def _fmt(result: Mapping[str, float]) -> str:
    return " ".join(
        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()
    )


def _raise_interrupt(signum: int, frame: object) -> None:
    # Once: a second signal must not interrupt the stop and cleanup it started.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Run a private Postfix instance (loopback only) for benchmarks."
    )
    p.add_argument(
        "--workdir",
        default=None,
        help="directory for conf/, queue/, data/, maillog (default: a temp dir)",
    )
    p.add_argument("--listen", default="127.0.0.1:2625", help="smtpd address (default %(default)s)")
    p.add_argument("--mode", choices=MODES, default="defer")
    p.add_argument(
        "--relay",
        default="127.0.0.1:2700",
        help="relay mode: where mail goes (default %(default)s)",
    )
    p.add_argument(
        "--sink",
        action="store_true",
        help="also run smtp-sink on the relay address (implied by --measure/--delivery)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PARAM=VALUE",
        help="extra main.cf parameter (repeatable)",
    )
    p.add_argument("--no-maillog", action="store_true", help="log to /dev/null")
    p.add_argument("--keep", action="store_true", help="keep the workdir after stopping")
    p.add_argument(
        "--measure",
        type=int,
        metavar="N",
        help="inject N messages with smtp-source, print the figures, stop",
    )
    p.add_argument(
        "--delivery",
        type=int,
        metavar="N",
        help="queue N messages deferred, then time relaying them all to the sink",
    )
    p.add_argument("--sessions", type=int, default=20)
    p.add_argument("--size", type=int, default=2048)
    args = p.parse_args(argv)

    if not postfix_available():
        print("postfix_instance: needs root and Debian's postfix package", file=sys.stderr)
        return 2
    if bad := [kv for kv in args.set if "=" not in kv]:
        p.error(f"--set wants PARAM=VALUE, got {bad[0]!r}")
    extra = dict(kv.split("=", 1) for kv in args.set)
    workdir = args.workdir or tempfile.mkdtemp(prefix="pfbench-")
    measuring = args.measure is not None or args.delivery is not None
    relay = args.relay if args.mode == "relay" else None
    sink_at = args.relay if (args.sink or measuring) and (relay or args.delivery) else None

    # SIGTERM (and SIGINT, even where a shell ignores it for background jobs) end the run
    # like Ctrl-C in a terminal does, so the context managers stop everything.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        with (
            _maybe_sink(sink_at) as sink,
            PostfixInstance(
                workdir,
                args.listen,
                args.mode,
                relay,
                main_cf=extra,
                maillog=not args.no_maillog,
                cleanup=not args.keep,
            ) as pf,
        ):
            print(
                f"postfix instance {pf.name}: {args.mode} mode, smtpd on {pf.listen}, "
                f"workdir {pf.workdir}" + (f", relaying to {relay}" if relay else ""),
                flush=True,
            )
            if args.measure is not None:
                res = measure(pf, args.sessions, args.measure, args.size, sink)
                print(f"{args.mode}: {_fmt(res)}", flush=True)
            if args.delivery is not None:
                assert sink is not None
                res = measure_delivery(pf, sink, args.sessions, args.delivery, args.size)
                print(f"delivery: {_fmt(res)}", flush=True)
            if not measuring:
                print("running; Ctrl-C or SIGTERM stops it", flush=True)
                while True:
                    signal.pause()
    except KeyboardInterrupt:
        pass
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
