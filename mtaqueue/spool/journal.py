"""The state journal: append-only segments of length-prefixed, checksummed records.

Segments are files named `%016d.log` in the journal directory; the number only
grows, so names sort in write order. A frame is (payload length, crc32(payload))
then the msgpack payload of one `Record`. A crash can only tear the tail of the
segment being written: replay cuts that off. Damage anywhere else (a flipped
byte, a lost block) costs only the frames it hits: replay skips them and finds
the next intact frame. Compaction writes the whole state as a snapshot into a
fresh segment, ending with SnapshotDone, then deletes the older ones; replay
starts at the newest undamaged segment holding a SnapshotDone.

Replay and compaction stream: a segment is read through a memory map whose pages
are dropped behind the reader, a Put is kept as the bytes of its Message (only its
head is decoded: records.Stored), and a snapshot is written a chunk at a time from
those bytes. Neither ever holds a whole segment, nor a decoded queue.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import struct
import typing
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import msgspec

from mtaqueue.spool.durable import fsync_dir, write_all
from mtaqueue.spool.records import (
    PUT_PREFIX,
    JournalState,
    Record,
    Stored,
    stored,
)

_HEADER = struct.Struct("<II")  # payload length, crc32(payload)
# A corrupt length field must read as a torn frame, not make us trust gigabytes.
MAX_PAYLOAD = 64 << 20
_SEGMENT_NAME = re.compile(r"[0-9]{16}\.log")
# Every payload starts [tag, ...]: a msgpack fixarray, then the record's tag as a
# positive fixint. Looking for that pair is how a resync finds frame candidates fast.
_TAGS = bytes(sorted(cls.__struct_config__.tag for cls in typing.get_args(Record)))
_PAYLOAD_START = re.compile(b"[\x91-\x9f][" + re.escape(_TAGS) + b"]")

# Compaction writes its snapshot in pieces of about this size; replay drops the pages
# of a segment it has read past in steps of this size.
CHUNK = 8 << 20

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


def encode(rec: Record | Stored) -> bytes:
    """One framed record (a Stored is framed as the Put it was read from)."""
    return frame(payload_of(rec))


def payload_of(rec: Record | Stored) -> bytes:
    return PUT_PREFIX + rec.data if type(rec) is Stored else _encoder.encode(rec)


def frame(payload: bytes) -> bytes:
    """A payload framed: length, crc32, payload (the event log's frames too)."""
    if len(payload) > MAX_PAYLOAD:
        # Replay would take it for a damaged frame and skip it.
        raise ValueError(f"journal record of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


class Frames(msgspec.Struct):
    records: list[Record | Stored]  # of the intact frames, in order; a Put as a Stored
    end: int  # where the last intact frame ends: anything after it is a torn tail
    skipped: list[tuple[int, int, str]]  # damaged stretches before `end`: start, stop, problem


def decode_record(payload: memoryview) -> Record | Stored:
    """A payload's record; a Put as a Stored (raises msgspec.DecodeError)."""
    if payload[:2] == PUT_PREFIX:
        return stored(bytes(payload[2:]))
    return _decoder.decode(payload)


def decode_frames(data: bytes | mmap.mmap) -> Frames:
    """The records of every intact frame in data.

    A frame that fails its checks is skipped: replay goes on at the next intact frame
    (see `_resync`). Nothing intact after it means a torn tail, which `end` marks. An
    intact frame that does not decode (a bug, or a record of a newer version) is
    skipped too, never cut off: its bytes stay for whoever can read them.
    """
    records: list[Record | Stored] = []
    skipped: list[tuple[int, int, str]] = []

    def sink(payload: memoryview) -> bool:
        records.append(decode_record(payload))
        return False

    end, _, _ = _frames(data, sink, skipped)
    return Frames(records, end, skipped)


def _frames(
    data: bytes | mmap.mmap,
    sink: Callable[[memoryview], bool],
    skipped: list[tuple[int, int, str]],
) -> tuple[int, int, bool]:
    """Give `sink` the payload of every intact frame in data (it raises
    msgspec.DecodeError for one that does not decode, and says whether it was a
    SnapshotDone); note the damaged stretches in `skipped`. Returns where the last
    intact frame ends, how many records were taken, and whether a SnapshotDone was."""
    with memoryview(data) as view:
        return _walk(data, view, sink, skipped)


def _walk(
    data: bytes | mmap.mmap,
    view: memoryview,
    sink: Callable[[memoryview], bool],
    skipped: list[tuple[int, int, str]],
) -> tuple[int, int, bool]:
    unpack = _HEADER.unpack_from
    crc32 = zlib.crc32
    header = _HEADER.size
    size = len(data)
    # A mapped segment's pages behind the reader are dropped (they are never read
    # again): mapped pages count in the resident size.
    release = data.madvise if isinstance(data, mmap.mmap) else None
    released = 0
    pos = good = taken = 0
    snapshot = False
    while pos + header <= size:
        if release is not None and pos - released >= CHUNK:
            upto = pos - pos % mmap.PAGESIZE
            release(mmap.MADV_DONTNEED, released, upto - released)
            released = upto
        length, crc = unpack(data, pos)
        start = pos + header
        stop = start + length
        # encode() never writes an empty payload: zeros are unwritten space.
        if 0 < length <= MAX_PAYLOAD and stop <= size:
            payload = view[start:stop]
            if crc32(payload) == crc:
                try:
                    snapshot = sink(payload) or snapshot
                except msgspec.DecodeError as exc:
                    skipped.append((pos, stop, f"intact frame does not decode: {exc}"))
                else:
                    taken += 1
                pos = good = stop
                continue
        resume = _resync(data, view, pos)
        if resume is None:
            break  # a torn tail
        skipped.append((pos, resume, "frame fails its checksum"))
        pos = good = resume
    return good, taken, snapshot


def _resync(data: bytes | mmap.mmap, view: memoryview, bad: int) -> int | None:
    """Where the first intact frame after the damaged one at `bad` starts, if anywhere.

    Every later position that could start a frame is tried, in order: a frame's own
    length cannot be trusted once it fails its checksum (a flipped length byte can
    point past intact frames). A candidate must decode as a record before its
    checksum is even computed, so garbage costs a failed parse of a few bytes, not a
    CRC over a made-up length; a false match also needs the 32-bit checksum to agree.
    """
    for match in _PAYLOAD_START.finditer(data, bad + 1 + _HEADER.size):
        candidate = match.start() - _HEADER.size
        if _intact(data, view, candidate):
            return candidate
    return None


def _intact(data: bytes | mmap.mmap, view: memoryview, pos: int) -> bool:
    if pos + _HEADER.size > len(data):
        return False
    length, crc = _HEADER.unpack_from(data, pos)
    start = pos + _HEADER.size
    stop = start + length
    if not 0 < length <= MAX_PAYLOAD or stop > len(data):
        return False
    payload = view[start:stop]
    try:
        decode_record(payload)
    except msgspec.DecodeError:
        return False
    return zlib.crc32(payload) == crc


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

    def append(self, data: bytes | Iterable[bytes]) -> None:
        """Append data, or each piece of an iterable in turn (written as it comes,
        then one fdatasync): all of it, or nothing."""
        if self._broken:
            self.open_next()
        written = 0
        try:
            for piece in (data,) if isinstance(data, bytes) else data:
                write_all(self._fd, piece)
                written += len(piece)
            os.fdatasync(self._fd)
        except BaseException:  # not only I/O errors: whatever failed, the batch did
            self._roll_back()
            raise
        self.size += written

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
    writer.open_next()
    writer.append(_chunks(map(encode, state.snapshot())))
    # A crash before this point leaves the old segments whole and the new one
    # without a SnapshotDone, so replay reads both; re-applying a partial
    # snapshot of the state they rebuild changes nothing.
    for path in list_segments(writer.directory):
        if path.name < writer.path.name:
            path.unlink()
    fsync_dir(writer.directory)


def _chunks(frames: Iterable[bytes]) -> Iterator[bytes]:
    """Frames joined into pieces of about CHUNK bytes."""
    piece: list[bytes] = []
    size = 0
    for frame in frames:
        piece.append(frame)
        size += len(frame)
        if size >= CHUNK:
            yield b"".join(piece)
            piece, size = [], 0
    if piece:
        yield b"".join(piece)


class ReplayResult(msgspec.Struct):
    state: JournalState
    segments: int  # segments replayed
    records: int  # records applied
    dropped_bytes: int  # the torn tail of the last segment (a crash mid-append)
    last_segment: Path | None
    obsolete: list[Path]  # segments older than the last snapshot: the caller may delete them
    skipped_frames: int  # damaged stretches passed over, each at least one frame
    skipped_bytes: int
    damage: list[str]  # one line per damaged stretch or unreadable segment
    intact_end: int = 0  # where the last segment's intact frames end (its torn tail starts)


def open_segments(directory: Path) -> list[tuple[Path, BinaryIO | OSError]]:
    """The journal's segments, oldest first, each opened (or why it could not be). A
    segment held open stays readable when the writer deletes it meanwhile (a compaction
    as the daemon starts, while the daemon is still reading)."""
    opened: list[tuple[Path, BinaryIO | OSError]] = []
    for path in list_segments(directory):
        try:
            opened.append((path, path.open("rb")))
        except OSError as exc:
            opened.append((path, exc))
    return opened


def close_segments(opened: list[tuple[Path, BinaryIO | OSError]]) -> None:
    for _, file in opened:
        if not isinstance(file, OSError):
            file.close()


def cut_torn_tail(result: ReplayResult) -> None:
    """Cut off the torn tail a replay with repair=False found, if the segment is still
    there (a compaction may have replaced it meanwhile)."""
    if result.dropped_bytes and result.last_segment is not None:
        with contextlib.suppress(FileNotFoundError):
            _truncate(result.last_segment, result.intact_end)


def replay(
    directory: Path,
    *,
    repair: bool = True,
    segments: list[tuple[Path, BinaryIO | OSError]] | None = None,
    noted_after: int | None = None,
    keys_after: float = 0.0,
) -> ReplayResult:
    """Rebuild the state from the journal, cutting a torn tail off the last segment.

    Damage never stops a replay: it is skipped and described in `damage`. With
    repair=False nothing on disk is changed (a second reader of a journal that its
    owner has already repaired, or one that repairs later: `cut_torn_tail`).
    `segments`: the journal's, opened by `open_segments` (else they are opened here).
    `noted_after`: keep the events numbered above it (JournalState.noted).
    `keys_after`: keep the idempotency keys created since then (JournalState).

    Segments are read newest first, so that those older than the last snapshot are
    never read; each is replayed into a state of its own, on which the state of the
    newer ones is then applied (`JournalState.update`): no segment's records are held.
    """
    opened = open_segments(directory) if segments is None else segments
    try:
        return _replay(opened, repair, lambda: JournalState(noted_after, keys_after))
    finally:
        if segments is None:
            close_segments(opened)


def _replay(
    opened: list[tuple[Path, BinaryIO | OSError]],
    repair: bool,
    new_state: Callable[[], JournalState],
) -> ReplayResult:
    paths = [path for path, _ in opened]
    state: JournalState | None = None  # of the segments read so far
    damage: list[list[str]] = []  # per segment read, newest first
    obsolete: list[Path] = []
    segments = count = dropped = skipped_frames = skipped_bytes = intact_end = 0
    for index in range(len(paths) - 1, -1, -1):
        path, file = opened[index]
        older = new_state()
        if index == 0:
            older.older_ids = ""
        lines: list[str] = []
        damage.append(lines)
        try:
            if isinstance(file, OSError):
                raise file
            read = _read(file, older)
        except OSError as exc:
            lines.append(f"journal segment {path.name}: unreadable: {exc.strerror}")
            skipped_frames += 1
            continue
        segments += 1
        count += read.records
        for start, stop, problem in read.skipped:
            lines.append(f"journal segment {path.name}: bytes {start}-{stop} skipped: {problem}")
            skipped_bytes += stop - start
        skipped_frames += len(read.skipped)
        if read.end != read.size and path == paths[-1]:
            dropped += read.size - read.end
            intact_end = read.end
            if repair:
                _truncate(path, read.end)
        elif read.end != read.size:
            # The writer gave up on this segment after a failed append and moved on,
            # or the disk lost its end.
            lines.append(
                f"journal segment {path.name}: {read.size - read.end} bytes after byte"
                f" {read.end} skipped: no intact frame"
            )
            skipped_frames += 1
            skipped_bytes += read.size - read.end
        if state is not None:
            older.update(state)
        state = older
        # A snapshot with a hole is no base: older segments may hold what it lost (and
        # a message whose tombstone a Buried dropped comes back from them: its file is
        # gone, so its delivery removes it with an error, `message_unreadable`).
        if read.snapshot and not read.skipped:
            obsolete = paths[:index]
            break
    return ReplayResult(
        state=state if state is not None else new_state(),
        segments=segments,
        records=count,
        dropped_bytes=dropped,
        last_segment=paths[-1] if paths else None,
        obsolete=obsolete,
        skipped_frames=skipped_frames,
        skipped_bytes=skipped_bytes,
        damage=[line for lines in reversed(damage) for line in lines],
        intact_end=intact_end,
    )


class _Segment(msgspec.Struct):
    size: int
    end: int  # as Frames.end
    skipped: list[tuple[int, int, str]]
    records: int  # intact records applied
    snapshot: bool  # one of them is a SnapshotDone


def _read(file: BinaryIO, state: JournalState) -> _Segment:
    """Apply a segment's records to state, through a memory map."""
    read = _Segment(0, 0, [], 0, False)
    read.size = os.fstat(file.fileno()).st_size
    if read.size == 0:  # an empty file cannot be mapped
        return read
    with mmap.mmap(file.fileno(), read.size, access=mmap.ACCESS_READ) as data:
        read.end, read.records, read.snapshot = _frames(data, state.apply_payload, read.skipped)
    return read


def _truncate(path: Path, length: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, length)
        os.fsync(fd)
    finally:
        os.close(fd)
