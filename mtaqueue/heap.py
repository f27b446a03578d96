"""The C heap of a process of ours: give back to the kernel what it freed.

    trim()      glibc's malloc_trim(0); nothing where the C library has none

CPython hands every block over 512 bytes (message bytes, batch frames, encoded records) to
the C library's malloc. glibc returns freed memory to the kernel by itself only from the top
of its heap: pages freed below a block still in use stay in the process until
malloc_trim. A daemon whose live state is level but whose allocations churn sees its RSS
climb that way (bench/RESULTS.md, "Memory over hours": in a soak, one trim gave back about
25 MB of the daemon's heap and as much of its writer's, an hour in). The spool's two
processes trim after each prune (once a minute as shipped); a trim of a heap of tens of
megabytes takes a few milliseconds.
"""

from __future__ import annotations

import ctypes


def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # (the symbols of the process: its libc's)
    except (OSError, AttributeError):  # no glibc (musl, another system)
        return None


_TRIM = _malloc_trim()


def trim() -> None:
    if _TRIM is not None:
        _TRIM(0)
