"""A restarted spool writer's memory against the journal's distance to its compaction.

    python bench/replay_memory.py [--sizes 0,25000,50000,100000,200000] [--peer-tree DIR]
                                  [--window 600] [--queue 300] [--rate 25]

For each size N, a journal segment as a steady queue leaves it (never compacted: the
shipped `spool.journal_compact_size` is 64 MiB, about 200,000 such messages): N messages
put and deleted, `--queue` of them live at any time, created `--rate` a second up to now
(so the `--window` dedupe window holds the keys of the last window x rate), each with an
idempotency key; every minute's worth of removals the writer's prune, which journals a
`Buried` for what it buried. Then a spool writer starts on it in a process of
its own (`SpoolWriter(root)`: the replay, the bury of what was not yet buried) and reports
its RSS once started and its peak (VmHWM), in this tree and, with `--peer-tree`, in
another checkout (say `git worktree add /tmp/peer 58f293f`: before the replay forgot
buried tombstones and closed keys; it skips the Buried frames, as any unknown record).
Target (issue 31): RSS after start independent of N.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from mtaqueue.model import Message, Recipient
from mtaqueue.spool import journal
from mtaqueue.spool.layout import SpoolLayout
from mtaqueue.spool.records import Buried, Delete, Put

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import work_directory

REPO = Path(__file__).resolve().parent.parent


# Run in a fresh interpreter with the tree to measure first on sys.path.
START = """
import sys, time
from pathlib import Path
from mtaqueue.spool.writer import SpoolWriter
def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
started = time.monotonic()
writer = SpoolWriter(Path(sys.argv[1]), compact_size=64 << 20, dedupe_window=float(sys.argv[2]))
print(status("VmRSS"), status("VmHWM"), time.monotonic() - started, len(writer.state.messages))
"""


def write_journal(root: Path, count: int, queue: int, rate: float) -> int:
    """The segment as described above; its size in bytes."""
    layout = SpoolLayout(root)
    layout.create()
    writer = journal.JournalWriter(layout.journal)
    now = time.time()
    base = int(now * 1_000_000) << 12  # ids as mtaqueue/ids.py makes them: time, then a seq
    ids = [f"{base - ((count - i) << 12):016X}" for i in range(count + queue)]
    frames: list[bytes] = []
    buried: list[str] = []
    for i in range(count + queue):
        created = now - (count + queue - i) / rate
        message = Message(
            id=ids[i],
            sender="app@example.com",
            recipients=(Recipient(f"user{i}@d{i}.accept.test"),),
            created=created,
            size=2048,
            klass="p1",
            idempotency_key=f"order-{i}",
        )
        frames.append(journal.encode(Put(message)))
        if i >= queue:  # a steady queue: the message put `queue` earlier is done
            frames.append(journal.encode(Delete(ids[i - queue], "delivered")))
            buried.append(ids[i - queue])
            if len(buried) >= 60 * rate:
                frames.append(journal.encode(Buried(buried)))
                buried = []
        if len(frames) > 10_000:
            writer.append(b"".join(frames))
            frames = []
    writer.append(b"".join(frames))
    writer.close()
    return writer.size


def start(tree: Path, root: Path, window: float) -> tuple[float, float, float, int]:
    code = f"import sys; sys.path.insert(0, {str(tree)!r})\n" + START
    out = subprocess.run(
        [sys.executable, "-c", code, str(root), str(window)],
        check=True, capture_output=True, text=True, cwd=tree,
    ).stdout.split()  # fmt: skip
    return float(out[0]), float(out[1]), float(out[2]), int(out[3])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="0,25000,50000,100000,200000")
    parser.add_argument("--peer-tree", type=Path, help="another checkout to measure alike")
    parser.add_argument("--window", type=float, default=600.0, help="dedupe window, seconds")
    parser.add_argument("--queue", type=int, default=300, help="messages live at any time")
    parser.add_argument("--rate", type=float, default=25.0, help="messages a second")
    args = parser.parse_args()
    trees = [("this tree", REPO)] + ([("peer", args.peer_tree.resolve())] if args.peer_tree else [])
    print(f"{'messages':>9} {'journal MB':>10}", end="")
    for name, _ in trees:
        print(f" | {name + ': RSS':>16} {'peak':>6} {'start s':>7}", end="")
    print(" | RSS ratio" if len(trees) == 2 else "")
    for count in map(int, args.sizes.split(",")):
        with work_directory("mtaqueue-replay-") as workdir:
            size = write_journal(workdir / "spool", count, args.queue, args.rate)
            print(f"{count:>9} {size / 1e6:>10.1f}", end="")
            figures = []
            for n, (_, tree) in enumerate(trees):
                # A start changes the journal (a new segment): each tree gets a copy.
                spool = workdir / f"spool-{n}"
                shutil.copytree(workdir / "spool", spool)
                rss, peak, seconds, live = start(tree, spool, args.window)
                assert live == args.queue, f"{live} messages live, expected {args.queue}"
                figures.append(rss)
                print(f" | {rss:>16.1f} {peak:>6.1f} {seconds:>7.2f}", end="")
            print(f" | {figures[0] / figures[1]:>9.2f}" if len(figures) == 2 else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
