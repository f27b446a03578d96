"""`mtaqueue-ctl top`: a live view of the busiest destinations, refreshed in the terminal.

API: `options(parser)` adds top's flags (--interval, --count, --rows); `run(args, out)`
writes a screen every --interval seconds, the destinations with the most waiting mail
first, until --count screens. Each screen asks the daemon for status and domains.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, TextIO

from mtaqueue.control import protocol
from mtaqueue.control.ctl import client, render


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    parser.add_argument("--count", type=int, default=0, help="stop after N screens (0: never)")
    parser.add_argument("--rows", type=int, default=20)


def _waiting(destination: dict[str, Any]) -> int:
    """Messages for the destination, ready or deferred."""
    return sum(destination.get("queued", {}).values()) + sum(
        destination.get("deferred", {}).values()
    )


def run(args: argparse.Namespace, out: TextIO) -> None:
    """Until --count screens (0: until ^C, which main answers with exit 130)."""
    path = client.socket_path(args)
    screens = 0
    while True:
        with client.connect(path) as sock:
            status = next(iter(protocol.request(sock, "status", {})))
        with client.connect(path) as sock:
            destinations = list(protocol.request(sock, "domains", {}))
        destinations.sort(key=lambda d: -_waiting(d))
        if out.isatty():
            out.write("\033[H\033[2J")  # home and clear
        out.write(
            f"mtaqueue {status.get('version', '')}  {render.time(time.time())}  "
            f"messages {status.get('messages', 0)}  "
            f"by state {status.get('by_state', {})}\n\n"
        )
        header = f"{'destination':<40} {'waiting':>7} {'conn':>7} {'mode':>8} {'circuit':>9} 4xx"
        out.write(header + "\n")
        for d in destinations[: args.rows]:
            waiting = _waiting(d)
            conns = f"{d.get('active', 0)}/{d.get('limit', '-')}"
            out.write(
                f"{d['destination'][:40]:<40} {waiting:>7} {conns:>7} {d.get('mode') or '-':>8}"
                f" {d.get('circuit') or '-':>9} {d.get('deferral_rate') or 0:.0%}\n"
            )
        out.flush()
        screens += 1
        if args.count and screens >= args.count:
            return
        time.sleep(args.interval)
