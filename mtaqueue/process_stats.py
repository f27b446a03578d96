"""What the kernel says of a process of ours: its resident memory.

    resident_bytes(pid) -> int     # RSS from /proc/PID/statm; 0 if gone (or no /proc)

`pid` may be "self".
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
