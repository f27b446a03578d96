"""Whether a flush of a deep queue lets the first class go first, wherever it was queued.

    python bench/flush_order.py [--bulk 300000] [--first 100] [--compare-tree DIR]

An outage's queue: `--bulk` p2 messages deferred for an hour, then `--first` p0 ones
behind them, all to one provider (a scriptable SMTP peer on loopback, the test DNS
server), written straight into the spool (tests/queue_fill.py). The daemon starts on it
(delivery on, shipped defaults otherwise), and two seconds later `mtaqueue-ctl flush
--all` runs. Printed: how long the flush took, when the first and the last p0 message
reached the provider (seconds from the flush), and how many p2 messages it got before the
first p0. `--compare-tree` runs the same with another checkout's daemon (e.g. a `git
worktree` of an older commit), on a queue written the same way.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent / "tests")]
from common import byte_compiled, work_directory  # noqa: E402
from daemon_process import DaemonProcess  # noqa: E402
from e2e_helpers import MailNet, ctl_json, wait_for  # noqa: E402
from queue_fill import waiting_queue  # noqa: E402


def run(workdir: Path, bulk: int, first: int, tree: str | None) -> str:
    with MailNet(["127.0.0.2"]) as net:
        net.add_domain("example.org", "127.0.0.2", host="mx.provider.test")
        waiting_queue(workdir / "spool", bulk, first, held=False)
        daemon = DaemonProcess(workdir, *net.daemon_overrides(), "delivery.enabled=true")
        if tree:
            daemon.env["PYTHONPATH"] = tree
        daemon.start()
        try:
            time.sleep(2)
            peer = net.peers[0]
            start = time.time()
            [reply] = ctl_json(daemon, "flush", "--all")
            took = time.time() - start

            def p0() -> list:
                return [m for m in list(peer.messages) if m.rcpt_tos[0].startswith("reset")]

            wait_for(lambda: len(p0()) >= first, timeout=600, what="every p0 message")
            got = list(peer.messages)
            before = next(i for i, m in enumerate(got) if m.rcpt_tos[0].startswith("reset"))
            arrived = [m.time - start for m in p0()]
        finally:
            daemon.kill()
    return (
        f"flushed {reply['flushed']} in {took:.2f} s; p0 first {arrived[0]:.2f} s, "
        f"last {arrived[-1]:.2f} s after the flush; p2 delivered before the first p0: {before}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bulk", type=int, default=300_000)
    parser.add_argument("--first", type=int, default=100)
    parser.add_argument("--compare-tree", metavar="DIR")
    args = parser.parse_args()
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    trees = [("this tree", None)]
    if args.compare_tree:
        trees.append((args.compare_tree, str(Path(args.compare_tree).resolve())))
    for name, tree in trees:
        if tree:
            byte_compiled(Path(tree) / "mtaqueue")
        with work_directory("flush-order-") as workdir:
            print(f"{name}: {run(workdir, args.bulk, args.first, tree)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
