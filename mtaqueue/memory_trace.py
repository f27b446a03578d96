"""Allocation snapshots, for finding what grows in a long run; off unless asked for.

    install(role, directory)    # with $MTAQUEUE_TRACEMALLOC=N (frames kept per allocation):
                                # tracemalloc starts, and each SIGUSR2 writes a snapshot to
                                # directory/<role>-<pid>-<n>.snap (tracemalloc.Snapshot.load)

The daemon installs it as "daemon", its children (which inherit the environment) as
"writer" (the spool writer) and "listener" (the SMTP listener's process); all write under
the spool's `tracemalloc/`. Tracing costs CPU and memory
(about twice the allocations' size), so it is for a soak or a support case, not for
production: `bench/soak.py` sends the signals and diffs the snapshots.
"""

from __future__ import annotations

import itertools
import os
import signal
import tracemalloc
from pathlib import Path

ENV = "MTAQUEUE_TRACEMALLOC"


def install(role: str, directory: Path) -> bool:
    """Start tracing if the environment asks for it; True when it does."""
    frames = os.environ.get(ENV, "").strip()
    if not frames:
        return False
    tracemalloc.start(max(1, int(frames)))
    directory.mkdir(parents=True, exist_ok=True)
    count = itertools.count(1)

    def dump(_signum, _frame) -> None:
        # Written whole, then renamed: a reader never loads half a snapshot.
        name = f"{role}-{os.getpid()}-{next(count)}.snap"
        partial = directory / f".{name}"
        tracemalloc.take_snapshot().dump(str(partial))
        partial.rename(directory / name)

    signal.signal(signal.SIGUSR2, dump)
    return True
