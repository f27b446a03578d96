"""Small state files beside the spool (learned.json): replaced whole, atomically.

A reader sees the old file or the new one, never a torn one, even across a crash: the
new content goes to a temporary file in the same directory, is fsynced, renamed over the
old one, and the directory is fsynced so that the rename itself is durable.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

from .layout import TMP_SUFFIX


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read(path: Path) -> bytes | None:
    """The file's content; None if there is none yet."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


async def save_changed(
    path: Path, data: bytes, saved: bytes, failed: Callable[[OSError], None]
) -> bytes:
    """Write `data` (in a thread) unless it is what was last written (`saved`); what is
    written now. A failure goes to `failed` (to log) and leaves `saved`: the state is
    still in memory, and the next save tries again."""
    if data == saved:
        return saved
    try:
        await asyncio.to_thread(write_atomic, path, data)
    except OSError as exc:
        failed(exc)
        return saved
    return data
