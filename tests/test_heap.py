"""heap.trim: what the C heap freed below a live block goes back to the kernel;
heap.one_arena: threads allocate from one arena."""

from __future__ import annotations

import subprocess
import sys

from mtaqueue import heap
from mtaqueue.process_stats import resident_bytes


def test_a_trim_gives_back_what_was_freed_below_a_live_block():
    blocks = [bytes(2048) for _ in range(20_000)]  # ~40 MB of malloc'd blocks (over 512 B)
    above = [bytes(2048) for _ in range(10)]  # still live, above them: the top stays put
    del blocks
    before = resident_bytes("self")
    heap.trim()
    after = resident_bytes("self")
    assert before - after > 20e6, (before, after)
    assert len(above) == 10


ARENAS = """
import ctypes, os, sys, tempfile, threading
from mtaqueue import heap
if sys.argv[1] == "one":
    heap.one_arena()
def churn():
    for _ in range(200):
        bytes(100_000)  # malloc'd (over 512 bytes), under the mmap threshold: from an arena
threads = [threading.Thread(target=churn) for _ in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
path = os.path.join(tempfile.mkdtemp(), "info")
stream = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, ctypes.c_void_p(stream))
libc.fclose(ctypes.c_void_p(stream))
print(open(path).read().count("<heap nr="))  # one per arena (malloc_info's XML)
"""


def arenas(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", ARENAS, mode], check=True, capture_output=True, text=True
    )
    return int(out.stdout)


def test_threads_that_allocate_share_the_main_arena():
    assert arenas("default") > 1  # glibc: an arena per thread that allocates
    assert arenas("one") == 1
