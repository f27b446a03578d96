"""What the kernel says of a process of ours: resident memory, open files, threads.

    resident_bytes(pid) -> int     # VmRSS; 0 if the process is gone (or no /proc)
    open_files(pid) -> int         # entries of /proc/PID/fd; 0 if gone
    threads(pid) -> int            # 0 if gone

Read from /proc (Linux, where the daemon runs); `pid` may be "self".
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


def open_files(pid: int | str) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def threads(pid: int | str) -> int:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Threads:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0
