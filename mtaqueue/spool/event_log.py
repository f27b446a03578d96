"""The event log: the application's events, in order, on disk until every endpoint has them.

    EventLogWriter(directory): append(events, first_seq), sync_if_due(), close()
    EventLog(directory): reader(after) -> EventReader.read(limit); read_cursors(),
        write_cursors(cursors), remove_segments(acked, older_than)
    last_seq(directory), segments(directory)

Segments `events/NNNNNNNNNNNNNNNN.log` are named by the seq of their first event and
framed as the journal is (length, crc32, msgpack `Event`). The spool writer appends, after
the batch's journal fdatasync, and syncs the log itself at most once a second: every event
is also in the journal, in the frame of the change that made it (records.Noted), and a
writer that starts appends what the log lost. The daemon reads (`EventReader`, a batch at a
time, never the whole log) and removes the segments every endpoint is past, or that are
older than any endpoint keeps events (`EventLog.remove_segments`). Where each endpoint is,
is `events/cursors.json` (`EventLog.write_cursors`), written by the daemon after the
endpoint's answers.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import struct
import time
import zlib
from pathlib import Path
from typing import BinaryIO

import msgspec

from ..events.event import Event, msgpack_decoder
from .durable import fsync_dir, write_all
from .journal import MAX_PAYLOAD, frame
from .statefile import write_atomic

CURSORS_FILE = "cursors.json"
SEGMENT_BYTES = 8 << 20  # a new segment past this: the unit of removal
SYNC_EVERY = 1.0  # seconds between the writer's syncs of the log
_HEADER = struct.Struct("<II")
_SEGMENT = re.compile(r"([0-9]{16})\.log")


def segments(directory: Path) -> list[tuple[int, Path]]:
    """(first seq, path) of every segment, oldest first."""
    found = []
    with contextlib.suppress(FileNotFoundError):
        for path in directory.iterdir():
            if m := _SEGMENT.fullmatch(path.name):
                found.append((int(m[1]), path))
    return sorted(found)


def _frames(data: bytes) -> tuple[list[bytes], int]:
    """The intact payloads at the start of `data`, and where they end."""
    payloads, pos = [], 0
    while pos + _HEADER.size <= len(data):
        length, crc = _HEADER.unpack_from(data, pos)
        stop = pos + _HEADER.size + length
        if not 0 < length <= MAX_PAYLOAD or stop > len(data):
            break
        payload = data[pos + _HEADER.size : stop]
        if zlib.crc32(payload) != crc:
            break
        payloads.append(payload)
        pos = stop
    return payloads, pos


class EventLogWriter:
    """Appends to the newest segment (the spool writer's)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(mode=0o700, exist_ok=True)
        self.directory = directory
        self.last_seq = 0
        self._fd = -1
        self._size = 0
        self._synced = time.monotonic()
        self._dirty = False
        newest = _newest(directory)
        if newest is not None:
            path, self.last_seq, end, size = newest
            if end != size:  # a torn tail: appended after, it would never be read
                os.truncate(path, end)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            self._size = end

    def append(self, events: list[bytes], first_seq: int) -> None:
        """Append encoded events numbered first_seq, first_seq + 1, ... (not synced)."""
        if self._fd < 0 or self._size >= SEGMENT_BYTES:
            self._roll(first_seq)
        data = b"".join(frame(e) for e in events)
        try:
            write_all(self._fd, data)
        except OSError:
            self._size = SEGMENT_BYTES  # maybe a torn frame: the next append starts a segment
            raise
        self._size += len(data)
        self.last_seq = first_seq + len(events) - 1
        self._dirty = True

    def sync_if_due(self) -> None:
        if self._dirty and time.monotonic() - self._synced >= SYNC_EVERY:
            self.sync()

    def sync(self) -> None:
        if self._dirty and self._fd >= 0:
            os.fdatasync(self._fd)
        self._dirty = False
        self._synced = time.monotonic()

    def _roll(self, first_seq: int) -> None:
        self.sync()
        if self._fd >= 0:
            os.close(self._fd)
        path = self.directory / f"{first_seq:016d}.log"
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._size = os.fstat(self._fd).st_size
        fsync_dir(self.directory)

    def close(self) -> None:
        self.sync()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class EventReader:
    """Reads the events after a seq, a batch at a time (the daemon's, one per endpoint).

    The segment being read stays open; a frame the writer has not finished appending is
    left for the next read."""

    def __init__(self, directory: Path, after: int) -> None:
        self.directory = directory
        self.after = after  # the seq of the last event read
        self._file: BinaryIO | None = None
        self._name = ""
        self._offset = 0

    def read(self, limit: int) -> list[Event]:
        events: list[Event] = []
        while len(events) < limit:
            if self._file is None and not self._seek():
                break
            got = self._read_segment(limit - len(events))
            events.extend(got)
            if not got and not self._next_segment():
                break
        return events

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _open(self, path: Path) -> bool:
        self.close()
        try:
            self._file = open(path, "rb")  # noqa: SIM115 (kept open across reads)
        except FileNotFoundError:  # removed (aged out) meanwhile
            return False
        self._name, self._offset = path.name, 0
        return True

    def _seek(self) -> bool:
        """Open the segment holding the event after `after`."""
        found = segments(self.directory)
        before = [path for first, path in found if first <= self.after + 1]
        if not found:
            return False
        return self._open(before[-1] if before else found[0][1])

    def _next_segment(self) -> bool:
        """Move to the next segment if the current one is complete (a newer one exists)."""
        later = [p for _, p in segments(self.directory) if p.name > self._name]
        return bool(later) and self._open(later[0])

    def _read_segment(self, limit: int) -> list[Event]:
        assert self._file is not None
        self._file.seek(self._offset)
        data = self._file.read(min(1 << 20, max(64 << 10, limit * 1024)))
        payloads, end = _frames(data)
        events = []
        used = 0
        for payload in payloads:
            used += _HEADER.size + len(payload)
            try:
                event = msgpack_decoder.decode(payload)
            except msgspec.DecodeError:
                continue
            if event.seq > self.after:
                events.append(event)
                self.after = event.seq
                if len(events) == limit:
                    break
        self._offset += used if len(events) == limit else end
        return events


class EventLog:
    """The log as the daemon reads it: a reader per endpoint, the endpoints' cursors, the
    removal of old segments (what the webhook dispatcher is given: events.dispatch)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def reader(self, after: int) -> EventReader:
        return EventReader(self.directory, after)

    def remove_segments(self, acked: int, older_than: float) -> int:
        """Remove segments whose events are all numbered up to `acked`, or whose last write
        was before `older_than` (epoch seconds); never the newest, which the writer appends
        to. Returns how many were removed."""
        found = segments(self.directory)
        removed = 0
        for (_, path), (next_first, _) in itertools.pairwise(found):
            try:
                old = path.stat().st_mtime < older_than
                if next_first - 1 <= acked or old:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                continue
        return removed

    def read_cursors(self) -> dict[str, int]:
        try:
            data = (self.directory / CURSORS_FILE).read_bytes()
            return msgspec.json.decode(data, type=dict[str, int])
        except (FileNotFoundError, msgspec.DecodeError):
            return {}

    def write_cursors(self, cursors: dict[str, int]) -> None:
        self.directory.mkdir(mode=0o700, exist_ok=True)
        write_atomic(self.directory / CURSORS_FILE, msgspec.json.encode(cursors))


def last_seq(directory: Path) -> int:
    """The seq of the newest event in the log (0 if none)."""
    newest = _newest(directory)
    return 0 if newest is None else newest[1]


def _newest(directory: Path) -> tuple[Path, int, int, int] | None:
    """The newest segment: its path, its last event's seq (its first's - 1 when it has
    none yet), where its intact frames end, and its size."""
    found = segments(directory)
    if not found:
        return None
    first, path = found[-1]
    data = path.read_bytes()
    payloads, end = _frames(data)
    last = msgpack_decoder.decode(payloads[-1]).seq if payloads else first - 1
    return path, last, end, len(data)
