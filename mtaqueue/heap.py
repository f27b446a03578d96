"""The C heap of a process of ours: one arena, and what it freed given back to the kernel.

    one_arena()  every thread allocates from the main arena (glibc's M_ARENA_MAX = 1);
                 call it before the process starts a thread
    trim()       glibc's malloc_trim(0)
    Both do nothing where the C library is not glibc.

CPython hands every block over 512 bytes (message bytes, batch frames, encoded records) to
the C library's malloc. glibc returns freed memory to the kernel by itself only from the top
of its heap: pages freed below a block still in use stay in the process until
malloc_trim. A daemon whose live state is level but whose allocations churn sees its RSS
climb that way (bench/RESULTS.md, "Memory over hours": in a soak, one trim gave back about
25 MB of the daemon's heap and as much of its writer's, an hour in). The spool's two
processes trim after each prune (once a minute as shipped); a trim of a heap of tens of
megabytes takes a few milliseconds.

glibc also gives a thread that allocates an arena of its own (up to 8 per core), and an
arena holds on to what its churn left in it: the writer's four I/O threads grew two of
theirs to ~2 MB each within an hour (bench/RESULTS.md, issue 31). Our threads allocate
Python objects, so only while holding the GIL: never two at once, and arenas of their own
buy them nothing.
"""

from __future__ import annotations

import ctypes

M_ARENA_MAX = -8  # mallopt's parameter (malloc.h)


def _libc(name: str):
    try:
        return getattr(ctypes.CDLL(None), name)  # (the symbols of the process: its libc's)
    except (OSError, AttributeError):  # no glibc (musl, another system)
        return None


_TRIM = _libc("malloc_trim")
_MALLOPT = _libc("mallopt")


def one_arena() -> None:
    if _MALLOPT is not None:
        _MALLOPT(M_ARENA_MAX, 1)


def trim() -> None:
    if _TRIM is not None:
        _TRIM(0)
