"""A damaged journal loses nothing that is on disk: properties over real spools.

One spool is built with the real writer (accepts, updates, removals, a snapshot, a
second segment); every example restores its journal, damages it (flipped bytes, cuts,
overwritten stretches, deleted segments) and recovers it as the daemon does: replay,
start a writer, sweep the files, re-adopt what the journal lost, remove what lost its
file. Every message whose file is intact must still be queued, no removed message may
come back, and nothing may raise.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtaqueue.model import Message, Recipient
from mtaqueue.spool import journal
from mtaqueue.spool.layout import SpoolLayout
from mtaqueue.spool.sweep import sweep
from mtaqueue.spool.writer import OK, Accept, Adopt, Remove, SpoolWriter, Update


class Built(msgspec.Struct):
    layout: SpoolLayout
    segments: dict[str, bytes]  # the journal as written
    live: set[str]
    removed: set[str]


def new_writer(layout: SpoolLayout) -> SpoolWriter:
    return SpoolWriter(layout.root, compact_size=1 << 30, dedupe_window=86400.0)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    layout = SpoolLayout(tmp_path_factory.mktemp("recovery") / "spool")
    layout.create()
    ids = (f"{0x66175AA83CCEC000 + (i << 16):016X}" for i in range(1000))
    live: dict[str, Message] = {}
    removed: set[str] = set()
    writer = new_writer(layout)

    def accept(count: int) -> None:
        batch = []
        for i in range(count):
            queue_id = next(ids)
            message = Message(
                id=queue_id,
                sender=f"app{i}@example.com",
                recipients=(Recipient("a@example.org"), Recipient("b@example.net")),
                created=time.time() - 60,
                size=20,
                klass="p1",
                idempotency_key=f"key-{queue_id}" if i % 3 == 0 else None,
            )
            live[queue_id] = message
            batch.append(Accept(message, f"Subject: {queue_id}\r\n\r\nbody\r\n".encode()))
        assert writer.commit(batch) == [OK] * count

    def update(count: int) -> None:
        for queue_id in sorted(live)[:count]:
            live[queue_id] = msgspec.structs.replace(live[queue_id], held=True)
            assert writer.commit([Update(live[queue_id])]) == [OK]

    def remove(count: int) -> None:
        for queue_id in sorted(live)[-count:]:
            del live[queue_id]
            removed.add(queue_id)
            assert writer.commit([Remove(queue_id, "delivered")]) == [OK]

    for _ in range(3):
        accept(10)
    update(8)
    remove(6)
    writer.compact()  # a snapshot, then more appends in its segment
    accept(10)
    update(4)
    remove(4)
    writer.journal.open_next()  # and a second segment
    accept(8)
    remove(3)
    writer.close()
    segments = {p.name: p.read_bytes() for p in journal.list_segments(layout.journal)}
    assert len(segments) == 2
    return Built(layout, segments, set(live), removed)


def recover(layout: SpoolLayout) -> tuple[set[str], journal.ReplayResult]:
    """What the daemon does at start-up, minus the sockets."""
    result = journal.replay(layout.journal)  # Spool.open
    for path in result.obsolete:
        path.unlink()
    known = set(result.state.messages)
    writer = new_writer(layout)  # Spool.start
    report = sweep(layout, known, result.state.deleted, time.time() + 1)  # SpoolUpkeep.sweep
    assert report.quarantined == []  # no file was touched
    changes = [Adopt(message) for message in report.adopt]
    changes += [Remove(queue_id, "message file missing") for queue_id in report.missing]
    assert writer.commit(changes) == [OK] * len(changes)
    writer.close()
    return set(journal.replay(layout.journal, repair=False).state.messages), result


def restore(built: Built) -> list[Path]:
    for path in journal.list_segments(built.layout.journal):
        path.unlink()
    paths = []
    for name, data in built.segments.items():
        path = built.layout.journal / name
        path.write_bytes(data)
        paths.append(path)
    return paths


damages = st.lists(
    st.tuples(
        st.sampled_from(["flip", "cut", "overwrite", "delete"]),
        st.integers(0, 1),  # which segment
        st.floats(0, 1),  # where in it
        st.integers(1, 255),  # xor
        st.binary(min_size=1, max_size=300),  # garbage
    ),
    min_size=1,
    max_size=3,
)


@settings(max_examples=150)
@given(damages)
def test_journal_damage_never_loses_a_message_whose_file_is_intact(built, damage):
    paths = restore(built)
    for kind, which, where, xor, garbage in damage:
        path = paths[which]
        if not path.exists():
            continue
        data = bytearray(path.read_bytes())
        at = int(where * max(len(data) - 1, 0))
        if kind == "delete":
            path.unlink()
            continue
        if kind == "flip" and data:
            data[at] ^= xor
        elif kind == "cut":
            del data[at:]
        elif kind == "overwrite":
            data[at : at + len(garbage)] = garbage[: len(data) - at]
        path.write_bytes(bytes(data))

    queued, result = recover(built.layout)
    assert built.live <= queued, f"lost {sorted(built.live - queued)} after {result.damage}"
    assert not queued & built.removed, "a removed message came back"
    # The start repaired the journal: the next one finds it whole, with the same queue.
    again, second = recover(built.layout)
    assert again == queued
    assert (second.skipped_frames, second.dropped_bytes) == (0, 0)


def test_a_missing_journal_is_rebuilt_from_the_files(built):
    for path in restore(built):
        path.unlink()
    queued, result = recover(built.layout)
    assert result.segments == 0
    assert queued == built.live
