"""Small durable-write helpers shared by the journal and the message files."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make renames and new entries in `path` durable."""
    fsync_path(path, os.O_DIRECTORY)


def fsync_path(path: Path, flags: int = 0) -> None:
    """Make a file written by someone else (a writer that died) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, *parts: bytes) -> None:
    """Write every byte; a short write near a full disk is followed until ENOSPC."""
    written = os.writev(fd, parts)
    if written == sum(map(len, parts)):
        return
    rest = memoryview(b"".join(parts))[written:]
    while rest:
        rest = rest[os.write(fd, rest) :]


def is_disk_full(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)
