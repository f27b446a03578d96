"""The state journal: append-only segments of length-prefixed, checksummed records.

Segments are files named `%016d.log` in the journal directory; the number only
grows, so names sort in write order. A frame is (payload length, crc32(payload))
then the msgpack payload of one `Record`. A crash can only tear the tail of the
segment being written: replay keeps the complete frames before the tear and cuts
the rest off. Compaction writes the whole state as a snapshot into a fresh segment,
ending with SnapshotDone, then deletes the older ones; replay starts at the newest
segment holding a SnapshotDone.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from pathlib import Path

import msgspec

from mtaqueue.spool.durable import fsync_dir, write_all
from mtaqueue.spool.records import JournalState, Record, SnapshotDone

_HEADER = struct.Struct("<II")  # payload length, crc32(payload)
# A corrupt length field must read as a torn frame, not make us trust gigabytes.
MAX_PAYLOAD = 64 << 20
_SEGMENT_NAME = re.compile(r"[0-9]{16}\.log")

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


class UnreadableJournal(ValueError):
    """A frame is intact (its checksum matches) but is not a record we know.

    That is no torn write but a bug or a journal from a newer version; cutting it
    off like a torn tail would silently drop acknowledged state, so replay stops.
    """


def encode(rec: Record) -> bytes:
    """One framed record."""
    payload = _encoder.encode(rec)
    if len(payload) > MAX_PAYLOAD:
        # Replay would take it for a torn frame and drop every record after it.
        raise ValueError(f"journal record of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def decode_frames(data: bytes) -> tuple[list[Record], int]:
    """Records of the complete, valid frames at the start of data, and the bytes they span.

    Stops at the first torn or corrupt frame; raises UnreadableJournal for an intact one
    that does not decode.
    """
    view = memoryview(data)
    records: list[Record] = []
    append = records.append
    decode = _decoder.decode
    unpack = _HEADER.unpack_from
    crc32 = zlib.crc32
    header = _HEADER.size
    end = len(data)
    pos = 0
    while pos + header <= end:
        length, crc = unpack(data, pos)
        start = pos + header
        stop = start + length
        # encode() never writes an empty payload: zeros are unwritten space.
        if not 0 < length <= MAX_PAYLOAD or stop > end:
            break
        payload = view[start:stop]
        if crc32(payload) != crc:
            break
        try:
            append(decode(payload))
        except msgspec.DecodeError as exc:
            raise UnreadableJournal(f"intact frame at byte {pos} does not decode: {exc}") from exc
        pos = stop
    return records, pos


def list_segments(directory: Path) -> list[Path]:
    """The journal's segments, oldest first."""
    return sorted(p for p in directory.iterdir() if _SEGMENT_NAME.fullmatch(p.name))


class JournalWriter:
    """Appends to the newest segment; every append is on disk when it returns.

    Opening always starts a fresh segment: an older one may end in a torn frame,
    and a record appended after a tear would never be replayed.
    """

    path: Path  # the current segment
    size: int  # bytes in it, all known good

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        existing = list_segments(directory)
        self._seq = int(existing[-1].name[:16]) if existing else 0
        self._fd = -1
        self._broken = False
        self.open_next()

    def open_next(self) -> None:
        self._seq += 1  # never reused, even if this attempt fails half-way
        path = self.directory / f"{self._seq:016d}.log"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        try:
            fsync_dir(self.directory)
        except OSError:
            os.close(fd)
            raise
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self.path, self.size, self._broken = fd, path, 0, False

    def append(self, data: bytes) -> None:
        if self._broken:
            self.open_next()
        try:
            write_all(self._fd, data)
            os.fdatasync(self._fd)
        except OSError:
            self._roll_back()
            raise
        self.size += len(data)

    def _roll_back(self) -> None:
        # Cut the failed bytes off so that the next append, if it succeeds, is
        # not hidden behind a torn frame. If even that fails, stop using the file.
        try:
            os.ftruncate(self._fd, self.size)
            os.fdatasync(self._fd)
        except OSError:
            self._broken = True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def compact(writer: JournalWriter, state: JournalState) -> None:
    """Rewrite the journal as one snapshot of state; later appends follow it."""
    snapshot = b"".join([encode(rec) for rec in state.snapshot()])
    writer.open_next()
    writer.append(snapshot)
    # A crash before this point leaves the old segments whole and the new one
    # without a SnapshotDone, so replay reads both; re-applying a partial
    # snapshot of the state they rebuild changes nothing.
    for path in list_segments(writer.directory):
        if path.name < writer.path.name:
            path.unlink()
    fsync_dir(writer.directory)


class ReplayResult(msgspec.Struct):
    state: JournalState
    segments: int  # segments replayed
    records: int  # records applied
    dropped_bytes: int  # torn or corrupt tails
    last_segment: Path | None
    obsolete: list[Path]  # segments older than the last snapshot: the caller may delete them
    warnings: list[str]


def replay(directory: Path, *, repair: bool = True) -> ReplayResult:
    """Rebuild the state from the journal, cutting a torn tail off the last segment.

    With repair=False nothing on disk is changed (a second reader of a journal
    that its owner has already repaired).
    """
    paths = list_segments(directory)
    # Newest first, so that segments older than the last snapshot are never read.
    decoded: list[tuple[Path, list[Record], int, int]] = []
    for path in reversed(paths):
        data = path.read_bytes()
        try:
            records, valid = decode_frames(data)
        except UnreadableJournal as exc:
            raise UnreadableJournal(f"{path}: {exc}") from None
        decoded.append((path, records, valid, len(data)))
        if any(type(rec) is SnapshotDone for rec in records):
            break
    decoded.reverse()

    state = JournalState()
    apply = state.apply
    count = dropped = 0
    warnings: list[str] = []
    for path, records, valid, size in decoded:
        for rec in records:
            apply(rec)
        count += len(records)
        if valid == size:
            continue
        dropped += size - valid
        if path == paths[-1]:
            if repair:
                _truncate(path, valid)
        else:
            # The writer gave up on this segment after a failed append and moved on.
            warnings.append(
                f"journal segment {path.name}: ignored {size - valid} bytes of torn or"
                f" corrupt records after byte {valid}"
            )
    return ReplayResult(
        state=state,
        segments=len(decoded),
        records=count,
        dropped_bytes=dropped,
        last_segment=paths[-1] if paths else None,
        obsolete=paths[: len(paths) - len(decoded)],
        warnings=warnings,
    )


def _truncate(path: Path, length: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, length)
        os.fsync(fd)
    finally:
        os.close(fd)
