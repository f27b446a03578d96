"""Issue 31: the spool's maps forget what has ended (idempotency keys past the dedupe
window, ended suppressions, buried tombstones), in the daemon and in the writer, without
waiting for a compaction; the DNS cache forgets expired answers."""

from __future__ import annotations

import time

from hypothesis import given
from hypothesis import strategies as st

from mtaqueue.model import Message, Recipient
from mtaqueue.routing.dnscache import DnsCache
from mtaqueue.spool import journal
from mtaqueue.spool.expiring import SLICE, Expiring, prune_period
from mtaqueue.spool.key_index import KeyIndex
from mtaqueue.spool.layout import SpoolLayout
from mtaqueue.spool.records import (
    Buried,
    Continues,
    Delete,
    JournalState,
    Put,
    SnapshotDone,
    Suppress,
)
from mtaqueue.spool.writer import OK, Accept, Remove, SpoolWriter

IDS = iter(f"{0x77175AA83CCEC000 + i:016X}" for i in range(1000))


def test_keys_created_before_a_time_go_and_the_rest_stay():
    keys = KeyIndex()
    keys.keep("old", "A", 10.0)
    keys.keep("edge", "B", 2 * SLICE)  # exactly at t: stays
    keys.keep("new", "C", 5 * SLICE)
    assert keys.forget_before(2 * SLICE) == 1
    assert keys == {"edge": ("B", 2 * SLICE), "new": ("C", 5 * SLICE)}
    assert keys.forget_before(2 * SLICE + 1) == 1  # inside the slice that holds t
    assert keys == {"new": ("C", 5 * SLICE)}


def test_each_update_of_a_keyed_message_files_its_key_once():
    keys = KeyIndex()
    for _ in range(5):  # the accept, then one Put per update of the same message
        keys.keep("k", "A", 10.0)
    assert sum(map(len, keys._slices.values())) == 1


def test_a_key_kept_again_later_outlives_its_first_slice():
    keys = KeyIndex()
    keys.keep("k", "A", 10.0)
    keys.keep("k", "B", 3 * SLICE)  # the window passed: a new message holds it
    keys.keep("k", "A", 20.0)  # a later update of the older message does not take it back
    assert keys.forget_before(2 * SLICE) == 0
    assert keys == {"k": ("B", 3 * SLICE)}


times = st.floats(0, 10 * SLICE, allow_nan=False)


@given(st.lists(st.tuples(st.sampled_from("abcdef"), times)), st.lists(times, max_size=4))
def test_forgetting_is_a_filter_whatever_the_order(entries, cutoffs):
    expiring: Expiring[str, float] = Expiring(lambda at: at)
    for key, at in entries:
        expiring[key] = at
    expected = dict(expiring)
    for t in sorted(cutoffs):  # the clock only goes forward
        expiring.forget_before(t)
        expected = {k: at for k, at in expected.items() if at >= t}
        assert dict(expiring) == expected
    assert sum(map(len, expiring._slices.values())) <= len(entries)


def test_pruned_at_least_once_a_minute_and_twice_a_short_window():
    assert prune_period(86400.0) == 60.0
    assert prune_period(10.0) == 5.0


def message(created: float, key: str) -> Message:
    return Message(
        id=next(IDS),
        sender="app@example.com",
        recipients=(Recipient("a@example.org"),),
        created=created,
        size=5,
        klass="p1",
        idempotency_key=key,
    )


def test_the_writer_forgets_ended_state_as_batches_come_not_at_compaction(tmp_path):
    """Its memory must not depend on how far the journal is from its compaction size."""
    layout = SpoolLayout(tmp_path / "spool")
    layout.create()
    writer = SpoolWriter(layout.root, compact_size=1 << 30, dedupe_window=2.0)
    now = time.time()
    old, live = message(now - 3600, "old-key"), message(now + 5, "live-key")
    ops = [
        Accept(old, b"x\r\n"),
        Accept(live, b"y\r\n"),
        Suppress("gone@example.org", now - 1, "550 5.1.1"),
        Suppress("kept@example.org", now + 3600, "550 5.1.1"),
    ]
    assert writer.commit(ops) == [OK] * 4
    # The first batch's prune: the key whose window closed and the ended suppression go.
    assert set(writer.state.keys) == {"live-key"}
    assert set(writer.state.suppressed) == {"kept@example.org"}
    assert writer.commit([Remove(old.id, "delivered")]) == [OK]
    assert old.id in writer.state.deleted  # until the next prune (half the window here)
    time.sleep(prune_period(2.0) + 0.1)
    size = writer.journal.size
    assert writer.commit([Accept(message(now + 5, "another"), b"z\r\n")]) == [OK]
    assert writer.state.deleted == {}  # its file is gone for good: the tombstone too
    assert writer.journal.size > size  # appended to, not compacted
    writer.close()
    # The journal says the file is gone (a Buried): a replay holds no tombstone for it.
    # It still holds the key, unless told where the window starts (as both processes do).
    state = journal.replay(layout.journal, repair=False).state
    assert state.deleted == {} and "old-key" in state.keys
    state = journal.replay(layout.journal, repair=False, keys_after=now - 2.0).state
    assert set(state.keys) == {"live-key", "another"}


def test_a_restarted_writer_holds_what_is_live_not_what_the_journal_saw(tmp_path):
    """Replay after much traffic: no tombstone of a buried message, no key of a closed
    window, however far the journal is from its compaction; also over a restart (a
    segment that continues an older one)."""
    layout = SpoolLayout(tmp_path / "spool")
    layout.create()

    def traffic(writer: SpoolWriter) -> Message:
        for _ in range(3):
            batch = [message(time.time() - 3600, f"k{i}") for i in range(100)]
            assert writer.commit([Accept(m, b"x\r\n") for m in batch]) == [OK] * 100
            assert writer.commit([Remove(m.id, "delivered") for m in batch]) == [OK] * 100
            writer.prune()  # as a minute later: buries them
        live = message(time.time(), "live")
        assert writer.commit([Accept(live, b"y\r\n")]) == [OK]
        return live

    writer = SpoolWriter(layout.root, compact_size=1 << 30, dedupe_window=60.0)
    carried = traffic(writer)  # live across the restart: its tombstone is kept over it
    writer.close()
    writer = SpoolWriter(layout.root, compact_size=1 << 30, dedupe_window=60.0)
    assert writer.commit([Remove(carried.id, "delivered")]) == [OK]
    live = traffic(writer)
    writer.close()
    assert len(journal.list_segments(layout.journal)) == 2  # never compacted
    state = journal.replay(layout.journal, repair=False, keys_after=time.time() - 60).state
    assert list(state.messages) == [live.id]
    assert set(state.deleted) == {carried.id}  # of 601 deleted
    assert set(state.keys) == {"live"}
    restarted = SpoolWriter(layout.root, compact_size=1 << 30, dedupe_window=60.0)
    assert list(restarted.state.messages) == [live.id] and restarted.state.deleted == {}
    restarted.close()


def merged(older: list, newer: list) -> JournalState:
    """Two segments' records, each replayed into a state of its own, the newer merged on."""
    states = JournalState(), JournalState()
    for state, records in zip(states, (older, newer), strict=True):
        for record in records:
            state.apply(record)
    states[0].update(states[1])
    return states[0]


def test_a_burial_read_after_the_delete_in_a_newer_segment_still_removes_the_message():
    """Segments replay into states of their own, merged oldest first: a Delete and its
    Buried in a newer segment must drop a message put in an older one."""
    live = message(time.time(), "k")
    put, delete, buried = Put(live), Delete(live.id, "delivered"), Buried([live.id])
    state = merged([put], [delete, buried])
    assert live.id not in state.messages and live.id in state.deleted
    # A Buried whose Delete the segment did not hold stands as a tombstone for the merge.
    state = merged([put, delete], [buried])
    assert live.id not in state.messages and live.id in state.deleted
    # In the oldest segment, or after a snapshot, nothing is merged under: it goes.
    assert merged([], [SnapshotDone(), put, delete, buried]).deleted == {}
    # After a Continues, only the ids it says may be in older segments keep theirs.
    state = merged([], [Continues(live.id), Buried([live.id, "FFFFFFFFFFFFFFFF"])])
    assert set(state.deleted) == {live.id}


def test_expired_dns_answers_go_without_being_asked_for_again():
    cache = DnsCache(negative_ttl_max=60.0)
    cache.put_positive(("a.example", "MX"), ["mx"], 30.0, now=1000.0)
    cache.put_negative(("b.example", "MX"), "NXDOMAIN", 30.0, now=1000.0)
    cache.put_positive(("c.example", "MX"), ["mx"], 3600.0, now=1000.0)
    assert len(cache) == 3
    # A minute later, the next answer stored sweeps the expired ones out.
    cache.put_positive(("d.example", "MX"), ["mx"], 3600.0, now=1061.0)
    assert len(cache) == 2
    assert cache.get(("c.example", "MX"), 1061.0) is not None
