"""The daemon's side of the spool with its real writer process: what one bad change,
a dead writer or a stop may and may not do to everything else."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import msgspec
import pytest

from mtaqueue.model import Message, Recipient
from mtaqueue.spool import journal, writer_link
from mtaqueue.spool.errors import WRITER_DOWN, StorageError
from mtaqueue.spool.layout import SpoolLayout
from mtaqueue.spool.store import Spool


def new_spool(root) -> Spool:
    return Spool(root, min_free=lambda total: 0, compact_size=1 << 20, dedupe_window=86400.0)


def message(spool: Spool, **fields) -> Message:
    now = time.time()
    record = Message(
        id=spool.ids.next(now),
        sender="app@example.com",
        recipients=(Recipient("a@example.org"),),
        created=now,
        size=5,
        klass="p1",
    )
    return msgspec.structs.replace(record, **fields)


async def started(root) -> Spool:
    spool = new_spool(root)
    await spool.open()
    return spool


def queued_after_restart(root) -> set[str]:
    return set(journal.replay(SpoolLayout(root).journal, repair=False).state.messages)


def test_a_change_msgpack_cannot_encode_fails_alone_and_the_spool_goes_on(tmp_path):
    # A lone surrogate (what a lax xtext decoder produced): msgpack refuses the string.
    async def main() -> tuple[str, str]:
        spool = await started(tmp_path)
        bad = spool.accept(message(spool, envid="\udcff"), b"bad\r\n")
        with pytest.raises(StorageError, match="cannot be stored"):
            await asyncio.wait_for(bad, 10)
        after = await asyncio.wait_for(spool.accept(message(spool), b"after\r\n"), 10)
        # The same in the middle of a batch: the others in it commit.
        first = spool.accept(message(spool), b"first\r\n")  # sent at once
        worse = spool.accept(message(spool, sender="\udcff@example.com"), b"x\r\n")
        same_batch = spool.accept(message(spool), b"same batch\r\n")
        results = await asyncio.wait_for(
            asyncio.gather(first, worse, same_batch, return_exceptions=True), 10
        )
        assert isinstance(results[1], StorageError)
        assert await spool.close(5) is True
        return after, results[2]

    after, same_batch = asyncio.run(main())
    assert {after, same_batch} <= queued_after_restart(tmp_path)  # durable


def test_a_bulk_change_goes_to_the_writer_in_bounded_batches(tmp_path, monkeypatch):
    """`release --all` at a million queued: the writer gets at most MAX_BATCH changes at
    a time (each step's encode and answer is short), `drained` waits until what is left
    is under it, and every change is durable."""
    monkeypatch.setattr(writer_link, "MAX_BATCH", 4)

    async def main() -> tuple[list[int], int, set[str]]:
        spool = await started(tmp_path)
        records = [message(spool) for _ in range(10)]
        await asyncio.gather(*(spool.accept(r, b"x\r\n") for r in records))
        sizes, send = [], spool._writer._send

        def recorded(hold: bool = True) -> None:
            before = spool._writer._inflight
            send(hold)
            if spool._writer._inflight is not None and spool._writer._inflight is not before:
                sizes.append(len(spool._writer._inflight))  # a batch went

        spool._writer._send = recorded  # type: ignore[method-assign]
        held = [spool.update(msgspec.structs.replace(r, held=True)) for r in records]
        await spool.drained()
        left = len(spool._writer._queue)
        await asyncio.gather(*held)
        assert await spool.close(5) is True
        return sizes, left, {r.id for r in records}

    sizes, left, ids = asyncio.run(main())
    assert max(sizes) <= 4 and sum(sizes) == 10
    assert left < 4
    state = journal.replay(SpoolLayout(tmp_path).journal, repair=False).state
    assert ids <= set(state.messages)


def test_close_ends_within_its_timeout_when_the_writer_hangs(tmp_path):
    async def main() -> None:
        spool = await started(tmp_path)
        os.kill(spool._writer._process.pid, signal.SIGSTOP)  # a writer stuck in an fsync, say
        pending = spool.accept(message(spool), b"never answered\r\n")
        began = time.monotonic()
        assert await spool.close(1.0) is False
        assert time.monotonic() - began < 1.0 + 3.0  # the timeout, and some slack
        with pytest.raises(StorageError):
            await pending

    asyncio.run(main())


def test_a_dead_writer_is_restarted_and_nothing_waiting_is_lost(tmp_path):
    async def main() -> None:
        spool = await started(tmp_path)
        kept = message(spool)
        await spool.accept(kept, b"kept\r\n")
        first = spool._writer._process.pid
        os.kill(first, signal.SIGSTOP)  # hold the next batch in flight
        inflight = spool.accept(message(spool), b"in flight\r\n")
        held = msgspec.structs.replace(kept, held=True)
        update = spool.update(held)  # queued behind it
        await asyncio.sleep(0.2)
        os.kill(first, signal.SIGKILL)
        while spool.refusal != WRITER_DOWN:
            await asyncio.sleep(0.01)
        with pytest.raises(StorageError, match="restarting"):
            await spool.accept(message(spool), b"refused while restarting\r\n")
        # Whether the in-flight accept reached the disk decides its answer; the writer
        # was stopped before it could write, so: not on disk, 451.
        with pytest.raises(StorageError, match="not on disk"):
            await asyncio.wait_for(inflight, 30)
        assert await asyncio.wait_for(update, 30) == kept.id
        assert spool._writer._process.pid != first and spool.refusal is None
        later = await asyncio.wait_for(spool.accept(message(spool), b"later\r\n"), 10)
        assert await spool.close(5) is True
        queued = journal.replay(SpoolLayout(tmp_path).journal, repair=False).state.messages
        assert set(queued) == {kept.id, later}
        assert queued[kept.id].held  # the re-sent update

    asyncio.run(main())


def test_spool_directories_are_private(tmp_path):
    legacy = tmp_path / "old"
    (legacy / "journal").mkdir(parents=True, mode=0o755)
    legacy.chmod(0o755)
    for root in (tmp_path / "new", legacy):
        layout = SpoolLayout(root)
        layout.create()
        dirs = [root, *(p for p in root.rglob("*") if p.is_dir())]
        assert len(dirs) == 1 + 4 + 16 + 4096  # root, journal quarantine msg events, msg/*, msg/*/*
        if root == legacy:
            # An older spool is closed at its top (nobody can traverse into it).
            assert {p.stat().st_mode & 0o777 for p in dirs[:1]} == {0o700}
            assert (root / "journal").stat().st_mode & 0o777 == 0o700
        else:
            assert {p.stat().st_mode & 0o777 for p in dirs} == {0o700}


def test_an_idempotency_key_dedupes_within_its_tenant_only(tmp_path):
    async def main() -> tuple[list[str], list[str]]:
        spool = await started(tmp_path)
        records = [
            message(spool, idempotency_key="order-42", tenant="shop"),
            message(spool, idempotency_key="order-42", tenant="blog"),
            message(spool, idempotency_key="order-42", tenant="shop"),
            message(spool, idempotency_key="order-42"),
        ]
        ids = [await asyncio.wait_for(spool.accept(r, b"x\r\n"), 10) for r in records]
        assert spool.key_holder("order-42", "blog") == ids[1]
        assert spool.key_holder("order-42", "news") is None
        assert await spool.close(5) is True
        return [r.id for r in records], ids

    sent, ids = asyncio.run(main())
    assert ids == [sent[0], sent[1], sent[0], sent[3]]
    assert queued_after_restart(tmp_path) == {sent[0], sent[1], sent[3]}


def tmp_files(root) -> list:
    return list(SpoolLayout(root).messages.glob("*/*/*.tmp"))


def test_an_incoming_message_is_written_as_it_comes_and_committed_like_an_accept(tmp_path):
    pieces = [b"Subject: big\r\n\r\n", b"x" * 100_000 + b"\r\n", b"y" * 50_000 + b"\r\n"]

    async def main() -> tuple[str, str]:
        spool = await started(tmp_path)
        incoming = spool.incoming(message(spool, idempotency_key="k1"))
        for piece in pieces[:-1]:
            await asyncio.wait_for(incoming.write(piece), 10)
        assert tmp_files(tmp_path)  # written as it came
        queue_id = await asyncio.wait_for(incoming.commit(pieces[-1]), 10)
        assert queue_id == incoming.message.id and spool.messages[queue_id].size == 150_020
        assert spool.content(queue_id) == b"".join(pieces)
        # The same idempotency key again: answered with the first id, its file dropped.
        again = spool.incoming(message(spool, idempotency_key="k1"))
        await asyncio.wait_for(again.write(b"again\r\n"), 10)
        assert await asyncio.wait_for(again.commit(b""), 10) == queue_id
        # One given up (the client went away): nothing of it stays.
        dropped = spool.incoming(message(spool))
        await asyncio.wait_for(dropped.write(b"half a message"), 10)
        dropped.discard()
        for _ in range(100):
            if not tmp_files(tmp_path):
                break
            await asyncio.sleep(0.02)
        assert await spool.close(5) is True
        return queue_id, again.message.id

    queue_id, duplicate = asyncio.run(main())
    assert queued_after_restart(tmp_path) == {queue_id}
    assert not SpoolLayout(tmp_path).message_path(duplicate).exists()
    assert tmp_files(tmp_path) == []


def test_an_incoming_message_in_flight_when_the_writer_dies_is_committed_by_the_next(tmp_path):
    async def main() -> str:
        spool = await started(tmp_path)
        first = spool._writer._process.pid
        os.kill(first, signal.SIGSTOP)  # the Place waits in flight
        incoming = spool.incoming(message(spool))
        await asyncio.wait_for(incoming.write(b"Subject: s\r\n\r\n"), 10)
        committed = incoming.commit(b"body\r\n")
        while spool._writer._inflight is None:
            await asyncio.sleep(0.01)
        os.kill(first, signal.SIGKILL)
        # Its file is whole, but not in place: the new writer places it (an accept
        # would have become an adopt, and "not on disk", 451).
        queue_id = await asyncio.wait_for(committed, 30)
        assert spool._writer._process.pid != first
        assert spool.content(queue_id) == b"Subject: s\r\n\r\nbody\r\n"
        assert await spool.close(5) is True
        return queue_id

    queue_id = asyncio.run(main())
    assert queued_after_restart(tmp_path) == {queue_id}
    assert tmp_files(tmp_path) == []


def test_the_writer_reads_the_journal_while_the_daemon_does(tmp_path, monkeypatch):
    # At a large queue each reading takes seconds: side by side, not one after the other.
    # Here the writer even compacts (two segments) and deletes the segments the daemon
    # is about to read: the daemon opened them first, so it still reads them whole.
    layout = SpoolLayout(tmp_path)

    async def fill() -> set[str]:
        ids = set()
        for _ in range(2):  # two runs: two segments
            spool = await started(tmp_path)
            ids.add(await spool.accept(message(spool), b"x\r\n"))
            assert await spool.close(5)
        return ids

    ids = asyncio.run(fill())
    old = journal.list_segments(layout.journal)
    assert len(old) == 2
    real = journal.replay
    deleted_first: list[bool] = []

    def replay(*args, **kwargs):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(path.exists() for path in old):
            time.sleep(0.01)
        deleted_first.append(not any(path.exists() for path in old))
        return real(*args, **kwargs)

    monkeypatch.setattr(journal, "replay", replay)

    async def restart() -> set[str]:
        spool = new_spool(tmp_path)
        await spool.open()
        try:
            return set(spool.messages)
        finally:
            assert await spool.close(5)

    assert asyncio.run(restart()) == ids
    assert deleted_first == [True]  # the writer had read, compacted and deleted meanwhile


def test_content_kept_for_delivery_is_what_the_file_holds_and_goes_with_the_message(tmp_path):
    """spool/fresh.py serves an accepted message's content without reading its file: only
    if the two agree, and never after the message left the queue."""
    from mtaqueue.spool.message_file import read_content

    async def main() -> None:
        spool = await started(tmp_path)
        record = message(spool)
        content = b"Subject: kept\r\n\r\n.a line with a dot\r\nend\r\n"
        queue_id = await asyncio.wait_for(spool.accept(record, content), 10)
        assert spool.fresh.get(queue_id) is content  # held, not read back
        assert spool.content(queue_id) == read_content(spool.layout.message_path(queue_id))
        await asyncio.wait_for(spool.remove(queue_id, "delivered"), 10)
        assert spool.fresh.get(queue_id) is None and spool.fresh.bytes == 0
        assert await spool.close(5) is True

    asyncio.run(main())
