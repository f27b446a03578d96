"""What the kernel says of a process of ours: its resident memory, and CPU it waited for.

    resident_bytes(pid) -> int     # RSS from /proc/PID/statm; 0 if gone (or no /proc)
    cpu_waited() -> float          # seconds this thread waited, runnable, for a CPU

`pid` may be "self". `cpu_waited` reads the thread's schedstat (0.0 where the kernel keeps
none): on a loaded machine a thread woken by a reply may wait tens of milliseconds for a
CPU before it reads it, time a timer's lateness samples only once.
"""

from __future__ import annotations

import os

_PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes(pid: int | str) -> int:
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def cpu_waited() -> float:
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0
