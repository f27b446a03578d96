"""The event log on disk: appended by the writer with each change, read back in order."""

from __future__ import annotations

import msgspec

from mtaqueue.events.event import Event, msgpack_encoder
from mtaqueue.model import DELIVERED, Message, Recipient
from mtaqueue.spool import event_log, journal
from mtaqueue.spool.layout import SpoolLayout
from mtaqueue.spool.writer import Accept, Emit, Remove, SpoolWriter, Update

ACTIONS = {"p1": "bounce"}


def event(seq: int, kind: str = "accepted") -> bytes:
    return msgpack_encoder.encode(Event(f"e{seq}", seq, kind, 1.0, "M", None, "p1", None, "a@x"))


def writer(root) -> SpoolWriter:
    layout = SpoolLayout(root)
    layout.create()
    return SpoolWriter(root, compact_size=1 << 30, dedupe_window=3600)


def message(n: int) -> Message:
    return Message(f"66175AA83CCEC{n:03X}", "a@b.org", (Recipient(f"r{n}@x.org"),), 1.0, 5, "p1")


def test_a_reader_gets_every_event_once_across_segments_and_waits_for_a_torn_frame(tmp_path):
    log = event_log.EventLogWriter(tmp_path)
    reader = event_log.EventReader(tmp_path, 0)
    log.append([event(1), event(2)], 1)
    assert [e.seq for e in reader.read(10)] == [1, 2]
    log._size = event_log.SEGMENT_BYTES  # the next append rolls
    log.append([event(3)], 3)
    # A frame half written: not an event yet, and nothing after it is lost.
    path = event_log.segments(tmp_path)[-1][1]
    whole = journal.frame(event(4))
    with open(path, "ab") as f:
        f.write(whole[:7])
    assert [e.seq for e in reader.read(10)] == [3]
    with open(path, "ab") as f:
        f.write(whole[7:])
    assert [e.seq for e in reader.read(1)] == [4]
    assert reader.read(10) == []
    assert len(event_log.segments(tmp_path)) == 2
    # A reader that starts later starts after its cursor.
    assert [e.seq for e in event_log.EventReader(tmp_path, 2).read(10)] == [3, 4]
    log.close()


def test_a_writer_reopening_the_log_cuts_a_torn_tail_and_goes_on_numbering(tmp_path):
    log = event_log.EventLogWriter(tmp_path)
    log.append([event(1), event(2)], 1)
    log.close()
    path = event_log.segments(tmp_path)[-1][1]
    with open(path, "ab") as f:
        f.write(journal.frame(event(3))[:9])
    again = event_log.EventLogWriter(tmp_path)
    assert again.last_seq == 2
    again.append([event(3)], 3)
    again.close()
    assert [e.seq for e in event_log.EventReader(tmp_path, 0).read(10)] == [1, 2, 3]


def test_segments_every_endpoint_is_past_are_removed_but_never_the_newest(tmp_path):
    log = event_log.EventLogWriter(tmp_path)
    for seq in (1, 2, 3):
        log._size = event_log.SEGMENT_BYTES
        log.append([event(seq)], seq)
    assert event_log.EventLog(tmp_path).remove_segments(acked=1, older_than=0) == 1
    assert [first for first, _ in event_log.segments(tmp_path)] == [2, 3]
    assert event_log.EventLog(tmp_path).remove_segments(acked=3, older_than=0) == 1
    assert [first for first, _ in event_log.segments(tmp_path)] == [3]
    log.close()


def test_events_are_journaled_with_their_change_and_rebuild_a_lost_log(tmp_path):
    w = writer(tmp_path)
    m = message(1)
    assert w.commit([Accept(m, b"Subject: x\r\n\r\nhi\r\n")], ACTIONS) == [""]
    done = msgspec.structs.replace(
        m,
        recipients=(
            msgspec.structs.replace(m.recipients[0], state=DELIVERED, last_reply="250 ok"),
        ),
    )
    extra = Event("", 0, "suppressed", 2.0, None, None, None, None, "z@x.org")
    assert w.commit([Remove(m.id, "done", done), Emit([extra])], ACTIONS) == ["", ""]
    w.close()
    events_dir = SpoolLayout(tmp_path).events
    first = event_log.EventReader(events_dir, 0).read(10)
    assert [(e.seq, e.type) for e in first] == [
        (1, "accepted"),
        (2, "delivered"),
        (3, "suppressed"),
    ]
    # The log's tail lost (it is synced lazily): the journal has every event, ids and all.
    for _, path in event_log.segments(events_dir):
        path.unlink()
    w = writer(tmp_path)
    assert w.next_seq == 4
    w.close()
    assert event_log.EventReader(events_dir, 0).read(10) == first


def test_without_events_asked_a_batch_makes_none_and_an_update_diffs_within_the_batch(tmp_path):
    w = writer(tmp_path)
    m = message(2)
    w.commit([Accept(m, b"\r\nx\r\n")], None)
    held = msgspec.structs.replace(m, held=True)
    w.commit([Update(held), Update(held)], ACTIONS)  # the second changes nothing
    w.close()
    evs = event_log.EventReader(SpoolLayout(tmp_path).events, 0).read(10)
    assert [e.type for e in evs] == ["held"]
