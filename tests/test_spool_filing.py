"""Files that wait (spool/filing.py): a small accept is durable in the journal with its
content, and its file is written only if it is still queued `file_after` later, at stop,
or by the next writer after a crash. Nothing is lost on the way, and a message that left
first never had a file."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import msgspec
from dkim_keys import pem, signing_key
from test_spool_writer import message

from mtaqueue.dkim.signer import Signer
from mtaqueue.model import Message
from mtaqueue.spool import journal
from mtaqueue.spool.filing import WAIT_MAX_BYTES, WAIT_MAX_SIZE
from mtaqueue.spool.layout import SpoolLayout
from mtaqueue.spool.message_file import read_message_file
from mtaqueue.spool.records import Delete, Filed, JournalState, Put, Unfiled
from mtaqueue.spool.store import Spool
from mtaqueue.spool.writer import (
    OK,
    Accept,
    Adopt,
    Batch,
    BatchResult,
    Remove,
    SpoolWriter,
    Update,
    frame,
    serve,
    split_frames,
)

CONTENT = b"Subject: hi\r\n\r\nhello\r\n"


def sized(size: int) -> Message:
    return msgspec.structs.replace(message(), size=size)


def writer(layout: SpoolLayout, file_after: float = 5.0) -> SpoolWriter:
    return SpoolWriter(layout.root, compact_size=1 << 30, dedupe_window=60.0, file_after=file_after)


def replayed(layout: SpoolLayout) -> JournalState:
    return journal.replay(layout.journal, repair=False).state


def test_a_small_accept_is_durable_in_the_journal_before_it_has_a_file(layout):
    spool_writer = writer(layout)
    record = message()
    ops = [Accept(record, CONTENT)]
    outcomes = spool_writer.commit(ops)
    assert outcomes == [OK]
    assert spool_writer.waiting_files(ops, outcomes) == [record.id]
    assert not layout.message_path(record.id).exists()
    assert not layout.tmp_path(record.id).exists()
    # What a crash now would find: the message, and its content, from the journal alone.
    state = replayed(layout)
    assert state.messages[record.id] == record
    accepted, content = state.unfiled[record.id]
    assert content == CONTENT
    assert msgspec.msgpack.decode(accepted, type=Message) == record


def test_a_message_that_leaves_before_its_file_is_due_never_has_one(layout):
    spool_writer = writer(layout)
    record = message()
    assert spool_writer.commit([Accept(record, CONTENT)]) == [OK]
    assert spool_writer.commit([Remove(record.id, "delivered")]) == [OK]
    assert spool_writer.filing.waiting_bytes == 0
    # No file, so no tombstone to keep until its removal is made sure of.
    assert record.id not in spool_writer.state.deleted
    spool_writer.close()  # at stop every waiting file is written: there is none
    assert not layout.message_path(record.id).exists()
    state = replayed(layout)
    assert record.id not in state.messages
    assert not state.unfiled and record.id not in state.deleted


def test_a_file_still_queued_when_due_is_written_and_journaled_as_filed(layout):
    spool_writer = writer(layout, file_after=5.0)
    record, younger = message(), message()
    assert spool_writer.commit([Accept(record, CONTENT)]) == [OK]
    changed = msgspec.structs.replace(record, held=True)
    assert spool_writer.commit([Update(changed)]) == [OK]  # an update files nothing
    assert not layout.message_path(record.id).exists()
    time.sleep(0.05)
    assert spool_writer.commit([Accept(younger, CONTENT)]) == [OK]
    spool_writer.file_due(time.monotonic() + 5.0 - 0.01)  # due for the first only
    # The file holds the record as accepted (the journal holds the current one).
    assert read_message_file(layout.message_path(record.id)) == (record, CONTENT)
    assert not layout.message_path(younger.id).exists()
    assert spool_writer.filed == [record.id]
    state = replayed(layout)
    assert set(state.unfiled) == {younger.id}
    assert state.messages[record.id] == changed
    # Removed now, it has a file: the tombstone stays until its removal is durable.
    assert spool_writer.commit([Remove(record.id, "delivered")]) == [OK]
    assert not layout.message_path(record.id).exists()
    assert record.id in spool_writer.state.deleted


def test_the_next_writer_writes_the_files_a_crash_left_waiting(layout):
    crashed = writer(layout)  # never closed: its waiting files stay unwritten
    kept, gone = message(), message()
    assert crashed.commit([Accept(kept, CONTENT), Accept(gone, b"gone\r\n")]) == [OK, OK]
    assert crashed.commit([Remove(gone.id, "delivered")]) == [OK]
    assert not layout.message_path(kept.id).exists()
    restarted = writer(layout)
    assert restarted.filed == [kept.id]  # its first answer says so (BatchResult.filed)
    assert read_message_file(layout.message_path(kept.id)) == (kept, CONTENT)
    assert not layout.message_path(gone.id).exists()
    # An accept of the dead writer's batch comes back as an adopt: taken as journaled.
    assert restarted.commit([Adopt(kept)]) == [OK]
    restarted.close()
    state = replayed(layout)
    assert set(state.messages) == {kept.id} and not state.unfiled


def test_a_compaction_keeps_the_content_of_files_that_wait(layout):
    spool_writer = writer(layout)
    record = message()
    assert spool_writer.commit([Accept(record, CONTENT)]) == [OK]
    changed = msgspec.structs.replace(record, held=True)
    assert spool_writer.commit([Update(changed)]) == [OK]
    spool_writer.compact()
    assert len(journal.list_segments(layout.journal)) == 1  # the snapshot alone
    state = replayed(layout)
    assert state.messages[record.id] == changed
    assert state.unfiled[record.id][1] == CONTENT
    restarted = writer(layout)
    assert read_message_file(layout.message_path(record.id)) == (record, CONTENT)
    restarted.close()


def test_large_or_signed_mail_and_mail_past_the_budget_get_their_files_at_once(layout):
    spool_writer = writer(layout)
    large = sized(WAIT_MAX_SIZE + 1)
    assert spool_writer.commit([Accept(large, b"x" * (WAIT_MAX_SIZE + 1))]) == [OK]
    assert layout.message_path(large.id).exists()

    key = signing_key(selector="f")
    presigned = Signer({"example.com": (key,)}).prepare(
        b"From: <app@example.com>\r\nSubject: hi\r\n\r\nhello\r\n", time.time()
    )
    assert presigned is not None
    spool_writer.filing.add_keys({key.key_id: pem(key.private)})
    signed = sized(len(presigned.fields + presigned.content))
    stored = presigned.fields + presigned.content
    assert spool_writer.commit([Accept(signed, stored, presigned.pending)]) == [OK]
    assert layout.message_path(signed.id).exists()  # its signature is made as it is written

    size = WAIT_MAX_SIZE
    count = WAIT_MAX_BYTES // size + 3
    batch = [Accept(sized(size), b"y" * size) for _ in range(count)]
    assert spool_writer.commit(batch) == [OK] * count
    on_disk = [op.message.id for op in batch if layout.message_path(op.message.id).exists()]
    assert len(on_disk) == count - WAIT_MAX_BYTES // size
    assert spool_writer.filing.waiting_bytes <= WAIT_MAX_BYTES


def test_file_after_zero_writes_every_file_before_the_answer(layout):
    spool_writer = writer(layout, file_after=0.0)
    record = message()
    assert spool_writer.commit([Accept(record, CONTENT)]) == [OK]
    assert read_message_file(layout.message_path(record.id)) == (record, CONTENT)
    assert not replayed(layout).unfiled


def test_replay_merges_a_later_segments_filed_and_delete_under_an_earlier_unfiled():
    first, second = message(), message()
    older = JournalState()
    for record in (first, second):
        older.apply(Unfiled(msgspec.Raw(msgspec.msgpack.encode(record)), CONTENT))
    newer = JournalState()  # a later segment: one filed, the other delivered
    newer.apply(Filed([first.id]))
    newer.apply(Put(first))
    newer.apply(Delete(second.id, "delivered"))
    older.update(newer)
    assert set(older.messages) == {first.id}
    assert not older.unfiled
    assert second.id in older.deleted  # (its Delete could not know: harmless)


def test_the_idle_writer_writes_its_due_files_and_says_so_with_the_next_answer(layout):
    spool_writer = writer(layout, file_after=0.2)
    ours, theirs = socket.socketpair()
    thread = threading.Thread(target=serve, args=(theirs, spool_writer), daemon=True)
    thread.start()
    record = message()

    def ask(*ops) -> BatchResult:
        ours.sendall(frame(msgspec.msgpack.encode(Batch(list(ops)))))
        buffer = bytearray()
        while not (frames := split_frames(buffer)):
            buffer += ours.recv(1 << 16)
        return msgspec.msgpack.decode(frames[0], type=BatchResult)

    first = ask(Accept(record, CONTENT))
    assert first.outcomes == [OK] and first.unfiled == [record.id] and first.filed == []
    deadline = time.monotonic() + 10
    while not layout.message_path(record.id).exists():  # no batch comes meanwhile
        assert time.monotonic() < deadline, "the idle writer never wrote the due file"
        time.sleep(0.02)
    later = ask(Update(msgspec.structs.replace(record, held=True)))
    assert later.outcomes == [OK] and later.filed == [record.id]
    ours.close()
    thread.join(10)
    spool_writer.close()


def test_the_daemon_keeps_the_content_of_a_file_that_waits_until_it_is_written(tmp_path):
    """What the daemon reads for a delivery while the journal holds the only copy on disk:
    the content it accepted, pinned until the writer's answer says the file is written."""

    async def main() -> None:
        spool = Spool(tmp_path / "spool", min_free=lambda _: 0, compact_size=1 << 30,
                      dedupe_window=60.0, file_after=0.3)  # fmt: skip
        await spool.open()
        now = time.time()
        record = msgspec.structs.replace(message(), id=spool.ids.next(now), created=now)
        queue_id = await asyncio.wait_for(spool.accept(record, CONTENT), 10)
        assert spool.fresh.waits(queue_id)
        assert len(spool.fresh) == 1  # kept and pinned: one message held
        spool.fresh.max_bytes = 24  # newer content pushes it out: the pin alone keeps it
        spool.fresh.keep("0" * 16, b"new")
        assert spool.fresh.bytes == 3
        assert spool.content(queue_id) == CONTENT
        assert not spool.layout.message_path(queue_id).exists()
        await asyncio.sleep(0.6)  # due: the idle writer writes it
        assert spool.layout.message_path(queue_id).exists()
        assert spool.fresh.waits(queue_id)  # told with the next answer
        await asyncio.wait_for(spool.update(msgspec.structs.replace(record, held=True)), 10)
        assert not spool.fresh.waits(queue_id) and spool.fresh.pinned_bytes == 0
        assert spool.content(queue_id) == CONTENT  # from its file now
        assert await spool.close(5) is True

    asyncio.run(main())


def test_a_restarted_daemon_finds_mail_whose_file_waited_when_it_crashed(tmp_path, layout):
    crashed = writer(layout, file_after=60.0)
    record = message()
    assert crashed.commit([Accept(record, CONTENT)]) == [OK]  # then the power went

    async def main() -> None:
        spool = Spool(tmp_path / "spool", min_free=lambda _: 0, compact_size=1 << 30,
                      dedupe_window=60.0, file_after=60.0)  # fmt: skip
        report = await spool.open()
        assert report.messages == 1 and record.id in spool.messages
        assert spool.content(record.id) == CONTENT
        assert read_message_file(spool.layout.message_path(record.id)) == (record, CONTENT)
        assert await spool.close(5) is True

    asyncio.run(main())


def test_a_file_whose_filed_record_fails_is_not_left_behind(layout, monkeypatch):
    """A Delete of a message whose file waits names no tombstone: a file written for it
    but never journaled as Filed must not stay, or the next start would re-adopt it."""
    spool_writer = writer(layout, file_after=5.0)
    record = message()
    assert spool_writer.commit([Accept(record, CONTENT)]) == [OK]
    real = spool_writer.journal.append

    def fail(data) -> None:
        raise OSError(5, "injected I/O error")

    monkeypatch.setattr(spool_writer.journal, "append", fail)
    spool_writer.file_due(time.monotonic() + 10)
    assert not layout.message_path(record.id).exists()
    assert record.id in spool_writer.state.unfiled and spool_writer.filed == []
    monkeypatch.setattr(spool_writer.journal, "append", real)
    spool_writer.file_due(time.monotonic() + 10)  # tried again: written and recorded
    assert read_message_file(layout.message_path(record.id)) == (record, CONTENT)
    assert spool_writer.filed == [record.id] and not replayed(layout).unfiled
