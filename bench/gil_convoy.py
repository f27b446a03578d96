"""Why the spool writer is a separate process: fsynced file writes from a thread,
with the main thread idle and with it busy running Python.

    python bench/gil_convoy.py [--files 1000]

A thread that blocks in a syscall gives up the GIL and must win it back after
every call; while another thread keeps the interpreter busy, that takes up to
sys.getswitchinterval() (5 ms) each time.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time


def write_files(directory: str, count: int) -> float:
    data = b"x" * 2048
    started = time.perf_counter()
    for i in range(count):
        path = os.path.join(directory, f"{threading.get_ident()}-{i}")
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, data)
        os.fsync(fd)
        os.close(fd)
        os.rename(path + ".tmp", path)
    return count / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as directory:
        for busy in (False, True, False, True):
            stop = threading.Event()

            def spin(stop: threading.Event = stop) -> None:
                while not stop.is_set():
                    sum(range(1000))

            spinner = threading.Thread(target=spin) if busy else None
            if spinner:
                spinner.start()
            rate: list[float] = []
            writer = threading.Thread(
                target=lambda rate=rate: rate.append(write_files(directory, args.files))
            )
            writer.start()
            writer.join()
            stop.set()
            if spinner:
                spinner.join()
            label = "main thread busy" if busy else "main thread idle"
            print(f"{label}: {rate[0]:7.0f} fsynced files/s from a second thread")


if __name__ == "__main__":
    main()
