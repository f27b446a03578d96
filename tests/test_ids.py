"""Queue ids: the daemon's and the listener's lanes never issue the same id."""

from mtaqueue.ids import DAEMON_LANE, LISTENER_LANE, IdGenerator, id_time


def test_two_lanes_in_the_same_microsecond_never_meet_and_stay_in_order():
    daemon, listener = IdGenerator(DAEMON_LANE), IdGenerator(LISTENER_LANE)
    now = 1_800_000_000.123456
    ours = [daemon.next(now) for _ in range(500)]
    theirs = [listener.next(now) for _ in range(500)]
    assert len(set(ours) | set(theirs)) == 1000
    assert ours == sorted(ours) and theirs == sorted(theirs)
    assert all(int(i, 16) % 2 == 0 for i in ours) and all(int(i, 16) % 2 == 1 for i in theirs)
    assert abs(id_time(ours[0]) - now) < 1e-5 and abs(id_time(theirs[0]) - now) < 1e-5


def test_a_lane_never_goes_back_past_an_id_it_was_shown():
    listener = IdGenerator(LISTENER_LANE)
    seen = IdGenerator(DAEMON_LANE).next(2_000_000_000.0)
    listener.advance_past(seen)
    later = listener.next(1_000_000_000.0)  # the clock stepped back
    assert later > seen and int(later, 16) % 2 == 1
