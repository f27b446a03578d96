"""process_stats: what the kernel says of our processes, read from /proc."""

from __future__ import annotations

import multiprocessing
import os
import time

from mtaqueue.process_stats import cpu_waited, resident_bytes


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def test_resident_bytes_of_a_live_process_and_of_a_gone_one():
    assert resident_bytes("self") > 1 << 20
    assert resident_bytes(2**22 + 12345) == 0  # (past pid_max's default: no such process)


def test_cpu_waited_grows_when_the_thread_competes_for_a_cpu():
    # Two spinning processes a core and this thread busy too: the kernel has it wait, runnable.
    stop = multiprocessing.Event()
    hogs = [multiprocessing.Process(target=_spin, args=(stop,)) for _ in range(2 * os.cpu_count())]
    for hog in hogs:
        hog.start()
    try:
        before, start = cpu_waited(), time.monotonic()
        while time.monotonic() < start + 1.0:
            pass
        waited, elapsed = cpu_waited() - before, time.monotonic() - start
    finally:
        stop.set()
        for hog in hogs:
            hog.join(10)
    assert 0.1 < waited <= elapsed
