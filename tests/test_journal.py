from __future__ import annotations

import errno
import itertools
import os
import tempfile
from bisect import bisect_right
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtaqueue.model import RECIPIENT_STATES, Message, Recipient
from mtaqueue.spool import journal
from mtaqueue.spool import records as spool_records
from mtaqueue.spool.journal import (
    JournalWriter,
    compact,
    decode_frames,
    encode,
    list_segments,
    replay,
)
from mtaqueue.spool.records import (
    Buried,
    Continues,
    Delete,
    JournalState,
    KeyKept,
    Put,
    Record,
    SnapshotDone,
    Stored,
    Suppress,
    Unsuppress,
    dedupe_key,
)

# Few ids and keys, so that sequences update, delete and re-put the same messages.
IDS = [f"{i:016X}" for i in range(1, 6)]
KEYS = ["k1", "k2", "k3"]
times = st.floats(0, 2e9)
# Mostly a few arrival times, so that messages sharing a key tie or reorder often.
created_times = st.sampled_from([10.0, 20.0, 30.0]) | times

recipients = st.builds(
    Recipient,
    address=st.sampled_from(["a@example.com", "b@example.org", "ü@exämple.de"]),
    notify=st.none() | st.just("FAILURE,DELAY"),
    state=st.sampled_from(RECIPIENT_STATES),
    attempts=st.integers(0, 100),
    next_attempt=st.none() | times,
    last_reply=st.none() | st.text(max_size=40),
)
messages = st.builds(
    Message,
    id=st.sampled_from(IDS),
    sender=st.text(max_size=30),
    recipients=st.lists(recipients, min_size=1, max_size=3).map(tuple),
    created=created_times,
    size=st.integers(0, 2**40),
    klass=st.sampled_from(["p0", "p1", "p2"]),
    expires=st.none() | times,
    idempotency_key=st.none() | st.sampled_from(KEYS),
    tenant=st.none() | st.sampled_from(["t1", "t2"]),
    held=st.booleans(),
)
ADDRESSES = ["x@example.com", "y@example.org"]
records: st.SearchStrategy[Record] = st.one_of(
    st.builds(Put, messages),
    st.builds(Delete, st.sampled_from(IDS), st.sampled_from(["delivered", "expired"])),
    st.builds(KeyKept, st.sampled_from(KEYS), st.sampled_from(IDS), created_times),
    st.builds(Suppress, st.sampled_from(ADDRESSES), times, st.just("550 5.1.1")),
    st.builds(Unsuppress, st.sampled_from(ADDRESSES)),
)


def applied(recs: list[Record]) -> JournalState:
    state = JournalState()
    for rec in recs:
        state.apply(rec)
    return state


def full(recs: list[Record | Stored]) -> list[Record]:
    """Records as written: replay reads a Put as a Stored (its Message still encoded)."""
    return [
        Put(msgspec.msgpack.decode(rec.data, type=Message)) if type(rec) is Stored else rec
        for rec in recs
    ]


def same(a: JournalState, b: JournalState) -> bool:
    return (
        a.messages == b.messages
        and a.keys == b.keys
        and a.suppressed == b.suppressed
        and a.deleted == b.deleted
    )


def segment(directory: Path, seq: int) -> Path:
    return directory / f"{seq:016d}.log"


def frame_ends(recs: list[Record]) -> tuple[bytes, list[int]]:
    frames = [encode(rec) for rec in recs]
    return b"".join(frames), list(itertools.accumulate(map(len, frames)))


@contextmanager
def journal_dir() -> Iterator[Path]:
    # Not pytest's tmp_path: hypothesis runs many examples per test function.
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


def message(queue_id: str = IDS[0], key: str | None = None, created: float = 100.0) -> Message:
    return Message(
        id=queue_id,
        sender="app@example.com",
        recipients=(Recipient("a@example.com"),),
        created=created,
        size=10,
        klass="p1",
        idempotency_key=key,
    )


@given(st.lists(records, max_size=30), st.data())
def test_a_cut_anywhere_keeps_exactly_the_complete_frames(recs, data):
    blob, ends = frame_ends(recs)
    cut = data.draw(st.integers(0, len(blob)), label="cut")
    complete = bisect_right(ends, cut)
    valid = ends[complete - 1] if complete else 0
    with journal_dir() as d:
        path = segment(d, 1)
        path.write_bytes(blob[:cut])
        result = replay(d)
        assert same(result.state, applied(recs[:complete]))
        assert result.records == complete
        assert result.dropped_bytes == cut - valid
        assert result.damage == [] and result.skipped_frames == 0
        assert path.stat().st_size == valid  # the torn tail is gone from disk


@given(st.lists(records, min_size=1, max_size=20), st.data())
def test_a_corrupt_byte_costs_only_its_frame(recs, data):
    blob, ends = frame_ends(recs)
    corrupt = bytearray(blob)
    at = data.draw(st.integers(0, len(blob) - 1), label="at")
    corrupt[at] ^= data.draw(st.integers(1, 255), label="xor")
    hit = bisect_right(ends, at)  # index of the frame holding the byte
    begin = ends[hit - 1] if hit else 0
    frames = decode_frames(bytes(corrupt))
    # Replay resynchronises on the next intact frame: only the hit one is lost.
    assert full(frames.records) == recs[:hit] + recs[hit + 1 :]
    if hit == len(recs) - 1:  # damage in the last frame looks like a torn write
        assert (frames.end, frames.skipped) == (begin, [])
    else:
        assert frames.end == len(blob)
        assert [(start, stop) for start, stop, _ in frames.skipped] == [(begin, ends[hit])]


@settings(max_examples=50)
@given(st.lists(records, min_size=2, max_size=20), st.data())
def test_garbage_in_the_middle_costs_only_the_frames_it_covers(recs, data):
    blob, ends = frame_ends(recs)
    first = data.draw(st.integers(0, len(recs) - 2), label="first damaged frame")
    last = data.draw(st.integers(first, len(recs) - 2), label="last damaged frame")
    begin, stop = (ends[first - 1] if first else 0), ends[last]
    noise = data.draw(st.binary(min_size=stop - begin, max_size=stop - begin), label="noise")
    frames = decode_frames(blob[:begin] + noise + blob[stop:])
    # Whatever the noise decodes to, every intact frame after it is read again.
    records = full(frames.records)
    assert records[:first] == recs[:first]
    assert records[len(records) - (len(recs) - last - 1) :] == recs[last + 1 :]
    assert frames.end == len(blob)


@settings(max_examples=50)
@given(st.lists(records, max_size=40), st.lists(records, max_size=10))
def test_compaction_keeps_the_state_and_drops_older_segments(before, after):
    with journal_dir() as d:
        writer = JournalWriter(d)
        state = applied(before)
        writer.append(b"".join(map(encode, before)))
        writer.open_next()
        compact(writer, state)
        assert list_segments(d) == [writer.path]
        assert same(replay(d).state, state)
        for rec in after:
            state.apply(rec)
        writer.append(b"".join(map(encode, after)))
        writer.close()
        result = replay(d)
        assert same(result.state, state)
        assert result.obsolete == []


@settings(max_examples=50)
@given(st.lists(records, max_size=30), st.data())
def test_a_crash_during_compaction_loses_nothing(recs, data):
    state = applied(recs)
    blob, _ = frame_ends(state.snapshot())
    cut = data.draw(st.integers(0, len(blob)), label="cut")
    with journal_dir() as d:
        segment(d, 1).write_bytes(b"".join(map(encode, recs)))
        segment(d, 2).write_bytes(blob[:cut])  # the snapshot, written up to the crash
        result = replay(d)
        assert same(result.state, state)
        # Only a complete snapshot (ending in SnapshotDone) makes the old segment dead.
        assert result.obsolete == ([segment(d, 1)] if cut == len(blob) else [])

        # The restarted daemon appends to a fresh segment; the partial snapshot stays
        # in the middle of the journal and must still replay to the right state.
        writer = JournalWriter(d)
        extra = Delete(IDS[0], "delivered")
        writer.append(encode(extra))
        writer.close()
        state.apply(extra)
        assert same(replay(d).state, state)


@given(st.lists(st.lists(records, max_size=8), min_size=1, max_size=5))
def test_replay_runs_across_segments(groups):
    with journal_dir() as d:
        for seq, group in enumerate(groups, 1):
            segment(d, seq).write_bytes(b"".join(map(encode, group)))
        result = replay(d)
        assert same(result.state, applied(list(itertools.chain(*groups))))
        assert result.segments == len(groups)
        assert result.last_segment == segment(d, len(groups))


def test_a_torn_tail_in_an_older_segment_is_reported_and_skipped(tmp_path):
    first, lost, second = Put(message(IDS[0])), Put(message(IDS[1])), Put(message(IDS[2]))
    torn = encode(lost)[:-3]
    segment(tmp_path, 1).write_bytes(encode(first) + torn)
    segment(tmp_path, 2).write_bytes(encode(second))
    result = replay(tmp_path)
    assert same(result.state, applied([first, second]))
    assert (result.dropped_bytes, result.skipped_frames, result.skipped_bytes) == (0, 1, len(torn))
    assert len(result.damage) == 1 and segment(tmp_path, 1).name in result.damage[0]
    assert segment(tmp_path, 1).stat().st_size == len(encode(first)) + len(torn)  # left alone


@pytest.mark.parametrize("zeros", [1, 8, 100])
def test_a_zero_filled_tail_is_cut_off(tmp_path, zeros):
    # What a crash can leave when the file's size reached the disk before its data.
    good = encode(Put(message()))
    path = segment(tmp_path, 1)
    path.write_bytes(good + bytes(zeros))
    result = replay(tmp_path)
    assert result.state.messages == {IDS[0]: message()}
    assert path.stat().st_size == len(good)


def test_replay_of_an_empty_journal(tmp_path):
    result = replay(tmp_path)
    assert result.state.messages == {} and result.state.keys == {}
    assert (result.segments, result.records, result.last_segment) == (0, 0, None)


def test_an_intact_but_unknown_frame_is_skipped_not_cut(tmp_path):
    payload = b"\x92\x09\xc0"  # [9, nil]: a record tag this version does not know
    frame = journal._HEADER.pack(len(payload), journal.zlib.crc32(payload)) + payload
    path = segment(tmp_path, 1)
    first, later = Put(message(IDS[0])), Put(message(IDS[1]))
    path.write_bytes(encode(first) + frame + encode(later) + frame)
    result = replay(tmp_path)  # the start goes on: no exception
    assert same(result.state, applied([first, later]))
    assert result.skipped_frames == 2 and result.dropped_bytes == 0
    assert all("does not decode" in line and path.name in line for line in result.damage)
    assert path.stat().st_size == 2 * len(frame) + len(encode(first)) + len(encode(later))


def test_oversized_records_are_refused_and_lengths_capped(monkeypatch):
    monkeypatch.setattr(journal, "MAX_PAYLOAD", 64)
    with pytest.raises(ValueError, match="exceeds"):
        encode(Put(message()))
    small = encode(Delete(IDS[0], "x"))
    frame = journal._HEADER.pack(1 << 31, 0) + bytes(100)
    assert decode_frames(small + frame) == journal.Frames([Delete(IDS[0], "x")], len(small), [])


def test_writer_continues_numbering_in_a_fresh_segment(tmp_path):
    writer = JournalWriter(tmp_path)
    assert writer.path == segment(tmp_path, 1)
    writer.append(encode(Put(message())))
    writer.close()
    writer = JournalWriter(tmp_path)
    assert writer.path == segment(tmp_path, 2) and writer.size == 0
    assert (writer.path.stat().st_mode & 0o777) == 0o600
    writer.close()
    assert replay(tmp_path).state.messages == {IDS[0]: message()}


def _fail_once(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    real = getattr(os, name)

    def fail(*args: object) -> None:
        monkeypatch.setattr(os, name, real)
        raise OSError(errno.EIO, f"injected {name} failure")

    monkeypatch.setattr(os, name, fail)


def _write_half_then_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first write stores half its bytes (a short write), the next says ENOSPC."""
    real_writev, real_write = os.writev, os.write

    def writev(fd: int, parts) -> int:
        data = b"".join(parts)
        monkeypatch.setattr(os, "writev", real_writev)
        return real_write(fd, data[: len(data) // 2])

    def write(fd: int, data) -> int:
        monkeypatch.setattr(os, "write", real_write)
        raise OSError(errno.ENOSPC, "injected: disk full")

    monkeypatch.setattr(os, "writev", writev)
    monkeypatch.setattr(os, "write", write)


FIRST, FAILED, LATER = (Put(message(queue_id)) for queue_id in IDS[:3])


@pytest.mark.parametrize(
    "inject",
    [lambda mp: _fail_once(mp, "fdatasync"), _write_half_then_fail],
    ids=["sync-fails", "write-fails-half-way"],
)
def test_a_failed_append_is_cut_off(tmp_path, monkeypatch, inject):
    writer = JournalWriter(tmp_path)
    writer.append(encode(FIRST))
    inject(monkeypatch)
    with pytest.raises(OSError):
        writer.append(encode(FAILED))
    assert writer.path.stat().st_size == writer.size == len(encode(FIRST))
    writer.append(encode(LATER))
    writer.close()
    result = replay(tmp_path)
    assert same(result.state, applied([FIRST, LATER]))
    assert result.dropped_bytes == 0


def test_when_the_cut_fails_too_the_writer_moves_to_a_new_segment(tmp_path, monkeypatch):
    writer = JournalWriter(tmp_path)
    writer.append(encode(FIRST))
    _write_half_then_fail(monkeypatch)
    _fail_once(monkeypatch, "ftruncate")
    with pytest.raises(OSError):
        writer.append(encode(FAILED))
    writer.append(encode(LATER))
    assert writer.path == segment(tmp_path, 2)
    writer.close()
    result = replay(tmp_path)
    assert same(result.state, applied([FIRST, LATER]))
    assert len(result.damage) == 1  # the half frame, stranded in segment 1


def test_segments_before_the_last_snapshot_are_not_read(tmp_path):
    payload = b"\x92\x09\xc0"  # unreadable, but never looked at
    frame = journal._HEADER.pack(len(payload), journal.zlib.crc32(payload)) + payload
    segment(tmp_path, 1).write_bytes(frame)
    state = applied([Put(message(key="k")), Delete(IDS[0], "delivered")])
    segment(tmp_path, 2).write_bytes(b"".join(map(encode, state.snapshot())))
    result = replay(tmp_path)
    assert same(result.state, state) and result.state.keys == {"k": (IDS[0], 100.0)}
    assert result.obsolete == [segment(tmp_path, 1)] and result.segments == 1


def test_a_key_stays_with_the_newest_message_holding_it():
    old, new = message(IDS[0], "k", 10.0), message(IDS[1], "k", 20.0)
    state = applied([Put(old), Put(new), Put(msgspec.structs.replace(old, held=True))])
    assert state.keys == {"k": (IDS[1], 20.0)}
    state.apply(Delete(IDS[1], "delivered"))
    assert state.keys == {"k": (IDS[1], 20.0)}  # a key outlives its message


def test_a_key_is_its_tenants_own(tmp_path):
    """Two tenants' "k" are two keys; replay (heads only) and a snapshot agree."""
    a = msgspec.structs.replace(message(IDS[0], "k"), tenant="a")
    b = msgspec.structs.replace(message(IDS[1], "k", 20.0), tenant="b")
    recs = [Put(a), Put(b), Put(message(IDS[2], "k", 30.0)), Delete(IDS[1], "delivered")]
    expected = {
        dedupe_key("k", "a"): (IDS[0], 100.0),
        dedupe_key("k", "b"): (IDS[1], 20.0),
        "k": (IDS[2], 30.0),
    }
    assert len(expected) == 3 and applied(recs).keys == expected
    segment(tmp_path, 1).write_bytes(b"".join(map(encode, recs)))
    assert replay(tmp_path).state.keys == expected
    assert applied(applied(recs).snapshot()).keys == expected


def test_forget_keys_created_before_a_time():
    old, new = Put(message(IDS[0], "old", 10.0)), Put(message(IDS[1], "new", 20.0))
    state = applied([old, new, Delete(IDS[0], "delivered"), KeyKept("kept", IDS[2], 30.0)])
    state.forget_before(0.0, 20.0)
    assert state.keys == {"new": (IDS[1], 20.0), "kept": (IDS[2], 30.0)}
    assert SnapshotDone() == list(state.snapshot())[-1]


@given(st.lists(records, max_size=30), created_times)
def test_a_snapshot_after_forgetting_brings_back_only_stale_keys(recs, t):
    state = applied(recs)
    state.forget_before(0.0, t)
    rebuilt = applied(state.snapshot())
    assert rebuilt.messages == state.messages
    rebuilt.forget_before(0.0, t)
    assert rebuilt.keys == state.keys


def test_suppression_list_survives_replay_and_compaction(tmp_path):
    writer = JournalWriter(tmp_path)
    for rec in (
        Suppress("gone@example.org", 2000.0, "550 5.1.1 user unknown"),
        Suppress("old@example.org", 500.0, "550 5.1.1 user unknown"),
        Suppress("back@example.org", 2000.0, "550 5.1.1 user unknown"),
        Unsuppress("back@example.org"),
    ):
        writer.append(encode(rec))
    state = replay(tmp_path).state
    assert set(state.suppressed) == {"gone@example.org", "old@example.org"}
    state.forget_before(1000.0, 0.0)  # old@ ended before then
    journal.compact(writer, state)
    writer.close()
    after = replay(tmp_path).state
    assert list(after.suppressed) == ["gone@example.org"]
    assert after.suppressed["gone@example.org"].reason == "550 5.1.1 user unknown"


def test_the_queue_is_held_as_the_messages_encodings(tmp_path):
    first, second = message(IDS[0], "k"), message(IDS[1])
    updated = msgspec.structs.replace(first, held=True)
    segment(tmp_path, 1).write_bytes(encode(Put(first)) + encode(Put(second)))
    segment(tmp_path, 2).write_bytes(encode(Put(updated)) + encode(Delete(IDS[1], "x")))
    state = replay(tmp_path).state
    # The later Put replaces the earlier one, the Delete removes its message; what is held
    # is the Message's msgpack, byte for byte as the journal has it, decoded when read.
    assert state.messages.encoding(IDS[0]) == msgspec.msgpack.encode(updated)
    assert IDS[0] in state.messages and IDS[1] not in state.messages
    assert len(state.messages) == 1 and list(state.messages) == [IDS[0]]
    assert state.messages[IDS[0]] == state.messages.get(IDS[0]) == updated
    assert state.messages.get(IDS[1]) is None
    assert state.keys == {"k": (IDS[0], 100.0)} and state.deleted == {IDS[1]: "x"}


def test_replay_decodes_only_the_head_of_a_put(tmp_path, monkeypatch):
    # Recipients that are not Recipients: a full decode would fail, the head's does not
    # look at them (they are checked when the message is read).
    payload = spool_records.PUT_PREFIX + msgspec.msgpack.encode(
        [IDS[0], "", ["not", "recipients"], 5.0, 10, "p1", None, "k"]
    )
    frame = journal._HEADER.pack(len(payload), journal.zlib.crc32(payload)) + payload
    segment(tmp_path, 1).write_bytes(frame)
    result = replay(tmp_path)
    assert result.damage == [] and result.state.keys == {"k": (IDS[0], 5.0)}
    assert IDS[0] in result.state.messages
    with pytest.raises(msgspec.ValidationError):
        result.state.messages[IDS[0]]


def test_a_put_whose_head_does_not_decode_is_skipped(tmp_path):
    payload = spool_records.PUT_PREFIX + msgspec.msgpack.encode([1, 2, 3])  # id not a string
    frame = journal._HEADER.pack(len(payload), journal.zlib.crc32(payload)) + payload
    segment(tmp_path, 1).write_bytes(frame + encode(Put(message(IDS[1]))))
    result = replay(tmp_path)
    assert list(result.state.messages) == [IDS[1]]
    assert result.skipped_frames == 1 and "does not decode" in result.damage[0]


def test_compaction_never_decodes_a_message(tmp_path, monkeypatch):
    state = applied([Put(message(IDS[0], "k")), Put(message(IDS[1])), Delete(IDS[2], "x")])
    monkeypatch.setattr(spool_records, "_message_decoder", None)  # any full decode would fail
    writer = JournalWriter(tmp_path)
    compact(writer, state)
    writer.close()
    monkeypatch.undo()
    assert same(replay(tmp_path).state, state)
    data = list_segments(tmp_path)[0].read_bytes()
    assert data.startswith(encode(Put(message(IDS[0], "k"))) + encode(Put(message(IDS[1]))))


def test_compaction_writes_its_snapshot_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(journal, "CHUNK", 200)
    state = applied([Put(message(queue_id)) for queue_id in IDS])
    writes: list[int] = []
    real = journal.write_all
    monkeypatch.setattr(
        journal, "write_all", lambda fd, data: writes.append(len(data)) or real(fd, data)
    )
    writer = JournalWriter(tmp_path)
    compact(writer, state)
    writer.close()
    assert len(writes) > 1 and max(writes) < 200 + len(encode(Put(message())))
    assert same(replay(tmp_path).state, state)


def test_a_replayed_segment_is_read_through_a_map_whose_pages_are_dropped(tmp_path, monkeypatch):
    monkeypatch.setattr(journal, "CHUNK", 4096)
    recs = [Put(message(f"{i:016X}")) for i in range(1, 400)]
    segment(tmp_path, 1).write_bytes(b"".join(map(encode, recs)))
    dropped: list[tuple[int, int]] = []
    real = journal.mmap.mmap

    class Watched(real):
        def madvise(self, option, start=0, length=None):
            assert option == journal.mmap.MADV_DONTNEED
            dropped.append((start, length))
            return super().madvise(option, start, length)

    monkeypatch.setattr(journal.mmap, "mmap", Watched)
    result = replay(tmp_path)
    assert same(result.state, applied(recs))
    assert len(dropped) > 1 and dropped[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(dropped))


@given(st.data())
def test_burials_never_bring_a_message_back(data):
    """Buried records (the writer's, after a Delete) and the Continues a starting writer
    puts first in its segment: across any segments, replay keeps exactly the live
    messages, and of the tombstones only those not yet buried (plus, where a segment may
    have older ones under it, those it cannot tell)."""
    live: set[str] = set()
    pending: set[str] = set()  # deleted, not yet buried
    gone: set[str] = set()
    groups: list[list[Record]] = [[]]
    for step in data.draw(st.lists(st.sampled_from(["put", "delete", "bury", "segment"]))):
        if step == "put":
            fresh = [i for i in IDS if i not in gone and i not in pending]
            if fresh:
                queue_id = data.draw(st.sampled_from(fresh))
                groups[-1].append(Put(message(queue_id)))
                live.add(queue_id)
        elif step == "delete" and live:
            queue_id = data.draw(st.sampled_from(sorted(live)))
            groups[-1].append(Delete(queue_id, "delivered"))
            live.discard(queue_id)
            pending.add(queue_id)
        elif step == "bury" and pending:
            groups[-1].append(Buried(sorted(pending)))
            gone |= pending
            pending = set()
        elif step == "segment":  # a writer's start, with a Continues or (an older one) without
            continues = data.draw(st.booleans())
            groups.append([Continues(max(live, default=""))] if continues else [])
    with journal_dir() as d:
        for seq, group in enumerate(groups, 1):
            segment(d, seq).write_bytes(b"".join(map(encode, group)))
        state = replay(d).state
    assert set(state.messages) == live
    assert pending <= set(state.deleted) <= pending | gone
    if len(groups) == 1:
        assert set(state.deleted) == pending
