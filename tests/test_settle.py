"""Settling a delivery attempt onto the records (mtaqueue.policy.settle).

settle() is pure: records, replies and a clock in; new records, notices, suppressions and
log events out. The replies go through the real classify(), as in the delivery manager.
"""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
from fake_random import HIGH, LOW
from hypothesis import given
from hypothesis import strategies as st

from mtaqueue.model import (
    BOUNCED,
    DEFERRED,
    DELIVERED,
    EXPIRED,
    FINAL_STATES,
    MAX_HISTORY,
    QUEUED,
    Attempt,
    Message,
    Recipient,
)
from mtaqueue.policy.backoff import RetryPolicy
from mtaqueue.policy.classify import classify
from mtaqueue.policy.replies import Reply
from mtaqueue.policy.settle import (
    THROTTLE_REQUEUES,
    Result,
    Settlement,
    SettleSettings,
    bounce_now,
    expire_due,
    flushed,
    settle,
    throttle_refused,
)
from mtaqueue.policy.verdict import Verdict

M, H, D = 60.0, 3600.0, 86400.0
T0 = 1_700_000_000.0  # every message arrives then
MX = "mx1.example.net"
SENDER = "alice@example.org"


# No jitter, so due times are exact. The first step (1 min) is under the greylist window
# (5 min), so a greylisted retry shows the floor.
POLICY = RetryPolicy(schedule=(1 * M, 15 * M), then=(4 * H, 6 * H), jitter=0.0, greylist_min=5 * M)


def settings(
    *,
    retry: RetryPolicy = POLICY,
    lifetime: float = 5 * D,
    expire_action: str = "bounce",
    delay_after: float = 4 * H,
    delay_without_notify: bool = False,
) -> SettleSettings:
    return SettleSettings(retry, lifetime, expire_action, delay_after, delay_without_notify)


def rcpt(address: str = "bob@example.net", **fields) -> Recipient:
    return Recipient(address, **fields)


def message(*recipients: Recipient, sender: str = SENDER, **fields) -> Message:
    return Message(
        "m1",
        sender,
        recipients or (rcpt(),),
        created=T0,
        size=1000,
        klass="p1",
        **fields,
    )


# Replies, each standing for one classification (checked in the first test).
OK = Reply("rcpt", 250, "2.1.5", "OK")
NO_USER = Reply("rcpt", 550, "5.1.1", "<bob@example.net>: no such user")
REFUSED = Reply("mail", 550, "5.7.1", "sender rejected by policy")
TEMP = Reply("rcpt", 451, "4.3.0", "temporary failure")
GREY = Reply("rcpt", 450, "4.2.0", "greylisted, see postgrey")
FULL = Reply("rcpt", 552, "5.2.2", "mailbox full")
LOST = Reply("data_end", 0, network="lost")  # ambiguous, retried under the default policy


def got(index: int, reply: Reply, *, mx: str | None = MX, **fields) -> Result:
    return Result(index, reply, classify(reply), mx, **fields)


def run(msg: Message, *results: Result, now: float, **kwargs) -> Settlement:
    """settle() with the default settings and a jitter-free rng unless given."""
    opts = {"rng": LOW, "settings": settings()} | kwargs
    return settle(msg, list(results), now, **opts)


def test_the_replies_classify_as_these_tests_assume():
    # If classify's table moves, the failures below would be confusing; fail here first.
    assert (classify(OK).outcome, classify(OK).kind) == ("delivered", "ok")
    assert classify(NO_USER) == Verdict("permanent", "recipient", "mailbox", None, True, "5.1.1")
    assert (classify(REFUSED).outcome, classify(REFUSED).suppress) == ("permanent", False)
    assert (classify(TEMP).outcome, classify(TEMP).kind, classify(TEMP).status) == (
        "transient",
        "other",
        "4.3.0",
    )
    assert (classify(GREY).kind, classify(GREY).retry_after) == ("greylisting", None)
    assert (classify(FULL).outcome, classify(FULL).status) == ("transient", "4.2.2")
    assert classify(LOST).outcome == "ambiguous"


# -- refused by the site's throttle -------------------------------------------------------------

RATE = Reply("mail", 421, "4.7.28", "unusual rate of mail; temporarily rate limited")
ANVIL = Reply("mail", 450, "4.7.1", "Error: too much mail from 192.0.2.1")
BUSY = Reply("banner", 421, "4.7.0", "Error: too many connections from 192.0.2.1")
MAILBOX_RATE = Reply("rcpt", 450, "4.2.1", "The user is receiving mail at a rate that prevents")


def test_throttle_refused_recipients_go_back_uncharged_the_rest_is_settled():
    results = [got(0, RATE), got(1, OK), got(2, GREY), got(3, ANVIL), got(4, BUSY)]
    back, settled = throttle_refused(results, 0)
    assert [r.index for r in back] == [0, 3, 4]
    # Greylisting keeps its own retry (the window); a mailbox's rate is the mailbox's.
    assert [r.index for r in settled] == [1, 2]
    assert throttle_refused([got(0, MAILBOX_RATE)], 0)[0] == []


def test_a_message_throttle_refused_too_often_in_a_row_is_charged():
    results = [got(0, RATE)]
    assert throttle_refused(results, THROTTLE_REQUEUES - 1)[0] == results
    assert throttle_refused(results, THROTTLE_REQUEUES) == ([], results)


# -- delivered ---------------------------------------------------------------------------------


def test_a_delivered_recipient():
    now = T0 + 60
    out = run(message(), got(0, OK), now=now)
    (new,) = out.message.recipients
    assert new.state == DELIVERED
    assert new.attempts == 1
    assert new.last_reply == "250 2.1.5 OK"
    assert new.last_attempt == now
    assert new.remote_mta == MX
    assert new.next_attempt is None
    assert new.history == (Attempt(now, "250 2.1.5 OK", MX, "delivered", "ok"),)
    assert out.finished
    assert (out.failed, out.delayed, out.succeeded, out.suppress) == ([], [], [], [])
    (event,) = out.events
    assert event["event"] == "delivery"
    assert (event["rcpt"], event["domain"], event["mx"]) == ("bob@example.net", "example.net", MX)
    assert (event["outcome"], event["kind"], event["state"]) == ("delivered", "ok", DELIVERED)
    assert (event["code"], event["enhanced"], event["attempt"], event["age"]) == (
        250,
        "2.1.5",
        1,
        60,
    )


def test_the_input_record_is_not_modified():
    msg = message()
    run(msg, got(0, OK), now=T0 + 60)
    assert msg.recipients[0].state == QUEUED and msg.recipients[0].attempts == 0


def test_a_network_event_keeps_the_last_remote_mta():
    # No host answered this time: the DSN's Remote-MTA stays the last one that did,
    # while the history records that this attempt had none.
    old = rcpt(state=DEFERRED, attempts=1, remote_mta="mx0.example.net", last_reply="451 x")
    out = run(message(old), got(0, LOST, mx=None), now=T0 + 60)
    (new,) = out.message.recipients
    assert new.remote_mta == "mx0.example.net"
    assert new.history[-1].mx is None
    assert new.state == DEFERRED  # ambiguous under "retry": tried again


@pytest.mark.parametrize(
    ("notify", "relayed", "wanted"),
    [
        ("SUCCESS,FAILURE", True, True),
        ("success", True, True),  # keywords are case-insensitive
        (None, True, False),  # no NOTIFY: successes are never reported
        ("FAILURE", True, False),
        ("SUCCESS", False, False),  # the next hop passes DSNs on: it reports, not us
    ],
)
def test_a_relayed_notice_only_when_asked_for(notify, relayed, wanted):
    out = run(message(rcpt(notify=notify)), got(0, OK, dsn_relayed=relayed), now=T0 + 60)
    if not wanted:
        assert out.succeeded == []
        return
    (report,) = out.succeeded
    assert (report.action, report.status) == ("relayed", "2.1.5")
    assert report.recipient == out.message.recipients[0]
    assert (report.diagnostic, report.remote_mta) == ("250 2.1.5 OK", MX)


# -- permanent ---------------------------------------------------------------------------------


def test_a_permanent_no_such_user_bounces_and_suppresses():
    now = T0 + 60
    out = run(message(), got(0, NO_USER), now=now)
    (new,) = out.message.recipients
    line = "550 5.1.1 <bob@example.net>: no such user"
    assert (new.state, new.attempts, new.last_reply, new.next_attempt) == (BOUNCED, 1, line, None)
    assert new.history == (Attempt(now, line, MX, "permanent", "mailbox"),)
    assert out.suppress == [("bob@example.net", line)]
    assert out.finished
    (report,) = out.failed
    assert (report.action, report.status, report.diagnostic) == ("failed", "5.1.1", line)
    assert (report.remote_mta, report.last_attempt) == (MX, now)
    assert report.will_retry_until is None


@pytest.mark.parametrize(
    ("notify", "sender", "wanted"),
    [
        (None, SENDER, True),  # no NOTIFY: failures are always reported
        ("FAILURE", SENDER, True),
        ("DELAY,FAILURE", SENDER, True),
        ("NEVER", SENDER, False),
        ("SUCCESS,DELAY", SENDER, False),
        (None, "", False),  # never a bounce to the null sender
    ],
)
def test_a_failure_report_only_when_notify_wants_it(notify, sender, wanted):
    out = run(message(rcpt(notify=notify), sender=sender), got(0, NO_USER), now=T0 + 60)
    assert out.message.recipients[0].state == BOUNCED
    assert len(out.failed) == (1 if wanted else 0)
    # Suppression is about the address, not about who hears of it.
    assert out.suppress == [("bob@example.net", NO_USER.line())]


def test_a_permanent_refusal_that_is_not_the_mailbox_is_not_suppressed():
    out = run(message(), got(0, REFUSED), now=T0 + 60)
    assert out.message.recipients[0].state == BOUNCED
    assert out.suppress == []
    assert [r.status for r in out.failed] == ["5.7.1"]


# -- transient ---------------------------------------------------------------------------------


def test_a_transient_failure_defers_to_the_schedule():
    now = T0 + 60
    out = run(message(), got(0, TEMP), now=now)
    (new,) = out.message.recipients
    assert (new.state, new.attempts, new.last_attempt) == (DEFERRED, 1, now)
    assert new.next_attempt == now + 1 * M  # the first step
    assert new.history == (Attempt(now, TEMP.line(), MX, "transient", "other"),)
    assert not out.finished
    assert (out.failed, out.delayed, out.suppress) == ([], [], [])
    assert out.events[0]["next_attempt"] == new.next_attempt


def test_the_attempt_count_picks_the_step():
    old = rcpt(state=DEFERRED, attempts=1)
    new = run(message(old), got(0, TEMP), now=T0 + 60).message.recipients[0]
    assert new.attempts == 2
    assert new.next_attempt == T0 + 60 + 15 * M  # the second step
    # Past the schedule, the then range: the rng picks within it.
    old = rcpt(state=DEFERRED, attempts=2)
    assert run(message(old), got(0, TEMP), now=T0).message.recipients[0].next_attempt == T0 + 4 * H
    high = run(message(old), got(0, TEMP), now=T0, rng=HIGH).message.recipients[0]
    assert high.next_attempt == T0 + 6 * H


def test_jitter_comes_from_the_rng():
    jittery = settings(retry=RetryPolicy((10 * M,), (4 * H, 6 * H), 0.1, 5 * M))
    due = [
        run(message(), got(0, TEMP), now=T0, rng=rng, settings=jittery)
        .message.recipients[0]
        .next_attempt
        for rng in (LOW, HIGH)
    ]
    assert due == [pytest.approx(T0 + 9 * M), pytest.approx(T0 + 11 * M)]


@pytest.mark.parametrize("factor", [1.0, 2.0, 3.5])
def test_retry_factor_stretches_the_interval(factor):
    out = run(message(), got(0, TEMP), now=T0, retry_factor=factor)
    assert out.message.recipients[0].next_attempt == pytest.approx(T0 + 1 * M * factor)


def test_an_ambiguous_outcome_is_retried():
    out = run(message(), got(0, LOST, mx=None), now=T0)
    (new,) = out.message.recipients
    assert (new.state, new.next_attempt) == (DEFERRED, T0 + 1 * M)
    assert (new.history[-1].outcome, new.history[-1].kind) == ("ambiguous", "network")


# -- greylisting -------------------------------------------------------------------------------


def test_greylisting_waits_at_least_the_window():
    now = T0 + 60
    out = run(message(), got(0, GREY), now=now)
    (new,) = out.message.recipients
    assert new.state == DEFERRED
    # The first step says 1 min; the greylist window says 5.
    assert new.next_attempt == now + 5 * M
    assert new.history[-1] == Attempt(now, GREY.line(), MX, "transient", "greylisting")


def test_greylisting_a_server_hint_longer_than_the_window_wins():
    hinted = Reply("rcpt", 450, "4.2.0", "greylisted, please try again in 10 minutes")
    assert classify(hinted).retry_after == 10 * M
    new = run(message(), got(0, hinted), now=T0).message.recipients[0]
    assert new.next_attempt == T0 + 10 * M


def test_greylisting_after_an_outage_comes_back_at_the_window_not_the_outages_step():
    # Two attempts spent on a host that was down: a third failure of that kind would wait
    # 4 h (the schedule's third step); the greylisted first contact waits for the window.
    down = Attempt(T0, "421 4.3.2 Service not available", MX, "transient", "other")
    old = rcpt(state=DEFERRED, attempts=2, history=(down, down))
    now = T0 + 20 * M
    new = run(message(old), got(0, GREY), now=now).message.recipients[0]
    assert new.attempts == 3 and new.next_attempt == now + 5 * M
    assert run(message(old), got(0, TEMP), now=now).message.recipients[0].next_attempt == (
        now + 4 * H
    )


def test_a_site_that_greylists_again_and_again_climbs_the_schedule():
    grey = Attempt(T0, GREY.line(), MX, "transient", "greylisting")
    old = rcpt(state=DEFERRED, attempts=2, history=(grey, grey))
    now = T0 + 20 * M
    new = run(message(old), got(0, GREY), now=now).message.recipients[0]
    assert new.next_attempt == now + 4 * H  # the third greylisting in a row: step 3


# -- expiry: look-ahead ------------------------------------------------------------------------


def test_a_retry_after_the_lifetime_expires_now():
    # Lifetime 4 h; after the schedule the next retry (4-6 h) would pass it.
    now = T0 + 2 * H
    old = rcpt(state=DEFERRED, attempts=2, last_reply="451 4.4.1 earlier")
    out = run(message(old), got(0, TEMP), now=now, settings=settings(lifetime=4 * H))
    (new,) = out.message.recipients
    assert (new.state, new.next_attempt, new.attempts) == (EXPIRED, None, 3)
    assert new.last_reply == TEMP.line()
    assert out.finished
    (report,) = out.failed
    # The report carries this attempt's reply and status, not 4.4.7.
    assert (report.action, report.status, report.diagnostic) == ("failed", "4.3.0", TEMP.line())
    assert [e["event"] for e in out.events] == ["expired", "delivery"]
    assert out.events[0]["last_reply"] == TEMP.line()
    assert out.events[1]["state"] == EXPIRED and out.events[1]["next_attempt"] is None


def test_look_ahead_reports_the_classified_status():
    # This attempt's verdict (552 5.2.2 at RCPT is transient: 4.2.2), not the reply line's.
    out = run(message(), got(0, FULL), now=T0, settings=settings(lifetime=30))
    (report,) = out.failed
    assert (report.status, report.diagnostic) == ("4.2.2", FULL.line())


def test_a_retry_right_at_the_expiry_still_happens():
    now = T0 + 100
    at_expiry = run(message(), got(0, TEMP), now=now, settings=settings(lifetime=100 + 1 * M))
    assert at_expiry.message.recipients[0].state == DEFERRED
    just_after = run(message(), got(0, TEMP), now=now, settings=settings(lifetime=99 + 1 * M))
    assert just_after.message.recipients[0].state == EXPIRED


def test_the_retry_factor_counts_for_the_look_ahead():
    s = settings(lifetime=1 * H)
    assert run(message(), got(0, TEMP), now=T0, settings=s).message.recipients[0].state == DEFERRED
    stretched = run(message(), got(0, TEMP), now=T0, settings=s, retry_factor=61)
    assert stretched.message.recipients[0].state == EXPIRED


def test_an_expires_header_overrides_the_lifetime():
    msg = message(expires=T0 + 30)  # the class allows 5 days; the sender 30 s
    out = run(msg, got(0, TEMP), now=T0)
    assert out.message.recipients[0].state == EXPIRED
    assert len(out.failed) == 1


def test_look_ahead_discard_sends_nothing():
    out = run(
        message(), got(0, TEMP), now=T0, settings=settings(lifetime=30, expire_action="discard")
    )
    assert out.message.recipients[0].state == EXPIRED
    assert out.failed == []
    assert out.events[0]["event"] == "expired" and out.events[0]["action"] == "discard"


def test_look_ahead_hold_holds_the_message():
    out = run(message(), got(0, TEMP), now=T0, settings=settings(lifetime=30, expire_action="hold"))
    (new,) = out.message.recipients
    assert out.message.held
    assert (new.state, new.next_attempt) == (DEFERRED, None)  # kept, but not scheduled
    assert out.failed == []
    assert (out.message.held_reason, out.message.held_at) == ("expired", T0)  # for review
    assert out.events[0] == {
        "event": "expired_held",
        "id": "m1",
        "rcpt": "bob@example.net",
        "action": "hold",
        "last_reply": new.last_reply,
    }
    assert not out.finished


def test_look_ahead_notify_sends_no_dsn_and_says_so_in_its_event():
    s = settings(lifetime=30, expire_action="notify")
    out = run(message(), got(0, TEMP), now=T0, settings=s)
    (new,) = out.message.recipients
    assert new.state == EXPIRED and not out.message.held
    assert out.failed == [] and out.delayed == []
    expired = [e for e in out.events if e["event"] == "expired"]
    assert expired[0]["action"] == "notify" and expired[0]["last_reply"] == new.last_reply
    assert out.finished


def test_expiry_at_the_sweep_with_notify_sends_no_dsn():
    msg = message(rcpt(state=DEFERRED, attempts=1, last_reply="451 4.3.0 busy"))
    out = expire_due(msg, T0 + 31, settings(lifetime=30, expire_action="notify"))
    assert out is not None and out.failed == []
    assert out.events[0]["action"] == "notify" and out.events[0]["last_reply"] == "451 4.3.0 busy"


# -- several recipients ------------------------------------------------------------------------


def test_only_the_settled_recipients_change():
    a, b, c = rcpt("a@example.net"), rcpt("b@example.com", state=DEFERRED, attempts=1), rcpt("c@x")
    msg = message(a, b, c)
    out = run(msg, got(0, OK), got(2, NO_USER), now=T0 + 60)
    new_a, new_b, new_c = out.message.recipients
    assert (new_a.state, new_c.state) == (DELIVERED, BOUNCED)
    assert new_b is b  # not touched at all
    assert not out.finished  # b is still pending
    assert [e["rcpt"] for e in out.events] == ["a@example.net", "c@x"]
    assert [r.recipient.address for r in out.failed] == ["c@x"]


def test_finished_once_every_recipient_is_final():
    a = rcpt("a@example.net", state=BOUNCED, attempts=1)
    out = run(message(a, rcpt("b@example.net")), got(1, OK), now=T0)
    assert out.finished
    assert {r.state for r in out.message.recipients} <= FINAL_STATES


def test_one_reply_for_several_recipients():
    # A DATA-phase reply concerns every recipient of the transaction.
    lost = Reply("data_end", 451, "4.3.0", "local error")
    msg = message(rcpt("a@example.net"), rcpt("b@example.net"))
    out = run(msg, got(0, lost), got(1, lost), now=T0)
    assert [r.state for r in out.message.recipients] == [DEFERRED, DEFERRED]
    assert [r.attempts for r in out.message.recipients] == [1, 1]


# -- history -----------------------------------------------------------------------------------


def test_history_keeps_the_last_max_history_attempts():
    history = tuple(
        Attempt(T0 + i, f"451 4.3.0 try {i}", MX, "transient") for i in range(MAX_HISTORY)
    )
    old = rcpt(state=DEFERRED, attempts=MAX_HISTORY, history=history)
    now = T0 + D
    new = run(message(old), got(0, TEMP), now=now).message.recipients[0]
    assert len(new.history) == MAX_HISTORY
    assert new.history[:-1] == history[1:]  # the oldest dropped
    assert new.history[-1].time == now
    assert new.attempts == MAX_HISTORY + 1  # the count is not capped


def test_history_grows_below_the_cap():
    old = rcpt(state=DEFERRED, attempts=1, history=(Attempt(T0, "451 x", MX, "transient"),))
    new = run(message(old), got(0, TEMP), now=T0 + 60).message.recipients[0]
    assert [a.time for a in new.history] == [T0, T0 + 60]


# -- delay notices -----------------------------------------------------------------------------


def test_a_delay_notice_once_after_delay_after():
    s = settings(delay_after=4 * H, delay_without_notify=True)
    msg = message()
    early = run(msg, got(0, TEMP), now=T0 + 3 * H, settings=s)
    assert early.delayed == []
    assert not early.message.recipients[0].delay_notified

    late = run(early.message, got(0, TEMP), now=T0 + 4 * H, settings=s)
    (report,) = late.delayed
    (new,) = late.message.recipients
    assert new.delay_notified
    assert (report.action, report.status, report.diagnostic) == ("delayed", "4.3.0", TEMP.line())
    assert report.will_retry_until == T0 + 5 * D  # the expiry
    assert report.last_attempt == T0 + 4 * H

    again = run(late.message, got(0, TEMP), now=T0 + 5 * H, settings=s)
    assert again.delayed == []
    assert again.message.recipients[0].delay_notified


@pytest.mark.parametrize(
    ("notify", "without_notify", "sender", "wanted"),
    [
        (None, True, SENDER, True),
        (None, False, SENDER, False),  # no NOTIFY: delays at our option
        ("DELAY", False, SENDER, True),
        ("FAILURE", True, SENDER, False),
        ("NEVER", True, SENDER, False),
        ("DELAY", True, "", False),
    ],
)
def test_a_delay_notice_only_when_wanted(notify, without_notify, sender, wanted):
    s = settings(delay_after=1 * H, delay_without_notify=without_notify)
    msg = message(rcpt(notify=notify), sender=sender)
    out = run(msg, got(0, TEMP), now=T0 + 2 * H, settings=s)
    assert len(out.delayed) == (1 if wanted else 0)
    # The flag records that the delay moment has passed, notice or not: it is when the
    # application's one "delayed" event is told.
    assert out.message.recipients[0].delay_notified


def test_no_delay_notice_for_a_final_recipient():
    s = settings(delay_after=0, delay_without_notify=True)
    out = run(message(), got(0, NO_USER), now=T0 + H, settings=s)
    assert out.delayed == []


def test_a_delay_notice_reports_the_classified_status():
    # 552 5.2.2 is transient at RCPT; a "delayed" DSN needs a 4.x.x status.
    s = settings(delay_after=0, delay_without_notify=True)
    (report,) = run(message(), got(0, FULL), now=T0 + H, settings=s).delayed
    assert report.status == "4.2.2"
    assert report.diagnostic == "552 5.2.2 mailbox full"


def test_a_delay_notice_for_a_deferred_recipient_not_in_this_attempt():
    # Recipients of other destinations settle separately; the notice goes out at the
    # first settlement past delay_after, whichever recipient it is about.
    waiting = rcpt("b@example.com", state=DEFERRED, attempts=1, last_reply="451 4.4.1 earlier")
    msg = message(rcpt("a@example.net"), waiting)
    s = settings(delay_after=1 * H, delay_without_notify=True)
    out = run(msg, got(0, OK), now=T0 + 2 * H, settings=s)
    (report,) = out.delayed
    assert report.recipient.address == "b@example.com"
    assert report.status == "4.4.1"  # from the stored reply
    assert out.message.recipients[1] == msgspec.structs.replace(waiting, delay_notified=True)


def test_a_delay_notice_for_another_recipient_has_a_transient_status():
    # b was deferred by a transient 552 5.2.2 (classified 4.2.2) before delay_after. Its
    # notice comes from a's settlement, and takes the status from b's stored reply line.
    waiting = rcpt("b@example.com", state=DEFERRED, attempts=1, last_reply="552 5.2.2 mailbox full")
    msg = message(rcpt("a@example.net"), waiting)
    s = settings(delay_after=1 * H, delay_without_notify=True)
    (report,) = run(msg, got(0, OK), now=T0 + 2 * H, settings=s).delayed
    assert report.action == "delayed"
    assert report.status == "4.2.2"


# -- flushed -----------------------------------------------------------------------------------


def test_flush_makes_a_deferred_recipient_due_now():
    old = rcpt(
        state=DEFERRED,
        attempts=1,
        next_attempt=T0 + 6 * H,
        history=(Attempt(T0, TEMP.line(), MX, "transient", "other"),),
    )
    new = flushed(old, T0 + 60, greylist_min=5 * M)
    assert new.next_attempt == T0 + 60
    assert new == msgspec.structs.replace(old, next_attempt=T0 + 60)  # nothing else changes


def test_flush_keeps_the_greylist_window():
    grey = Attempt(T0, GREY.line(), MX, "transient", "greylisting")
    old = rcpt(state=DEFERRED, attempts=1, next_attempt=T0 + H, history=(grey,))
    assert flushed(old, T0 + 60, greylist_min=5 * M).next_attempt == T0 + 5 * M
    # Once the window has passed, now.
    assert flushed(old, T0 + 10 * M, greylist_min=5 * M).next_attempt == T0 + 10 * M


def test_flush_only_looks_at_the_last_attempt():
    grey = Attempt(T0, GREY.line(), MX, "transient", "greylisting")
    temp = Attempt(T0 + 10, TEMP.line(), MX, "transient", "other")
    old = rcpt(state=DEFERRED, attempts=2, next_attempt=T0 + H, history=(grey, temp))
    assert flushed(old, T0 + 20, greylist_min=5 * M).next_attempt == T0 + 20


def test_flush_after_a_greylisting_settlement():
    # The round trip: settle() records the kind that flushed() reads.
    deferred = run(message(), got(0, GREY), now=T0).message.recipients[0]
    assert flushed(deferred, T0 + 1, greylist_min=5 * M).next_attempt == T0 + 5 * M


def test_flush_a_deferred_recipient_without_history():
    old = rcpt(state=DEFERRED, attempts=1, next_attempt=T0 + H)
    assert flushed(old, T0, greylist_min=5 * M).next_attempt == T0


@pytest.mark.parametrize("state", [QUEUED, DELIVERED, BOUNCED, EXPIRED])
def test_flush_leaves_other_states_alone(state):
    old = rcpt(state=state, next_attempt=T0 + H)
    assert flushed(old, T0, greylist_min=5 * M) is old


# -- expire_due --------------------------------------------------------------------------------


def pending_message(**fields) -> Message:
    return message(
        rcpt("a@example.net", state=DELIVERED, attempts=1, last_reply="250 2.0.0 ok"),
        rcpt("b@example.net", state=DEFERRED, attempts=3, last_reply=TEMP.line(), remote_mta=MX),
        rcpt("c@example.net"),  # never tried
        **fields,
    )


def test_expire_due_before_the_expiry_is_nothing():
    assert expire_due(pending_message(), T0 + 5 * D - 1, settings()) is None


def test_expire_due_skips_held_messages():
    assert expire_due(pending_message(held=True), T0 + 9 * D, settings()) is None


def test_expire_due_expires_the_pending_recipients():
    msg = pending_message()
    out = expire_due(msg, T0 + 5 * D, settings())  # exactly at the expiry
    assert out is not None
    a, b, c = out.message.recipients
    assert a is msg.recipients[0]
    assert (b.state, c.state) == (EXPIRED, EXPIRED)
    assert b.next_attempt is None and b.last_reply == TEMP.line()
    assert out.finished
    by_rcpt = {r.recipient.address: r for r in out.failed}
    assert set(by_rcpt) == {"b@example.net", "c@example.net"}
    # The last real reply's status; 4.4.7 only when there was none.
    assert (by_rcpt["b@example.net"].status, by_rcpt["b@example.net"].diagnostic) == (
        "4.3.0",
        TEMP.line(),
    )
    assert (by_rcpt["c@example.net"].status, by_rcpt["c@example.net"].diagnostic) == ("4.4.7", None)
    assert [e["event"] for e in out.events] == ["expired", "expired"]


def test_an_expiry_after_network_failures_reports_the_last_of_them():
    # No server ever answered: the DSN still says why (it used to give no reason at all).
    refused = Reply("connect", 0, "4.4.1", network="refused")
    msg = message(rcpt(state=DEFERRED, attempts=4, last_reply=refused.line()))
    out = expire_due(msg, T0 + 5 * D, settings())
    assert out is not None
    (report,) = out.failed
    assert report.diagnostic == refused.line() and refused.line()
    assert report.status == "4.4.1"


def test_expire_due_honours_the_expires_header():
    assert expire_due(pending_message(expires=T0 + H), T0 + H - 1, settings()) is None
    assert expire_due(pending_message(expires=T0 + H), T0 + H, settings()) is not None


def test_expire_due_discard_and_hold():
    discarded = expire_due(pending_message(), T0 + 6 * D, settings(expire_action="discard"))
    assert discarded is not None and discarded.failed == []
    assert [r.state for r in discarded.message.recipients] == [DELIVERED, EXPIRED, EXPIRED]

    held = expire_due(pending_message(), T0 + 6 * D, settings(expire_action="hold"))
    assert held is not None and held.failed == []
    assert held.message.held
    assert [r.state for r in held.message.recipients] == [DELIVERED, DEFERRED, QUEUED]
    assert [e["event"] for e in held.events] == ["expired_held", "expired_held"]
    # Held now: the periodic check leaves it alone from here on.
    assert expire_due(held.message, T0 + 7 * D, settings(expire_action="hold")) is None


# -- bounce_now --------------------------------------------------------------------------------


def test_bounce_now_fails_every_pending_recipient():
    msg = pending_message()
    out = bounce_now(msg, T0 + H, "bounced by the operator")
    a, b, c = out.message.recipients
    assert a is msg.recipients[0]
    assert (b.state, b.next_attempt, b.last_reply) == (BOUNCED, None, TEMP.line())
    assert (c.state, c.last_reply) == (BOUNCED, "bounced by the operator")
    assert out.finished
    by_rcpt = {r.recipient.address: r for r in out.failed}
    assert by_rcpt["b@example.net"].status == "4.3.0"  # the last real reply's
    assert by_rcpt["c@example.net"].status == "5.0.0"
    assert by_rcpt["c@example.net"].diagnostic == "bounced by the operator"
    assert [e["rcpt"] for e in out.events] == ["b@example.net", "c@example.net"]
    assert {e["event"] for e in out.events} == {"bounced_by_operator"}


def test_bounce_now_respects_notify_and_the_null_sender():
    never = message(rcpt(notify="NEVER"))
    assert bounce_now(never, T0, "reason").failed == []
    null = message(rcpt(), sender="")
    out = bounce_now(null, T0, "reason")
    assert out.failed == [] and out.message.recipients[0].state == BOUNCED


# -- properties --------------------------------------------------------------------------------

REPLIES = [OK, NO_USER, REFUSED, TEMP, GREY, FULL, LOST]


@st.composite
def recipients(draw) -> Recipient:
    state = draw(st.sampled_from([QUEUED, DEFERRED, DELIVERED, BOUNCED]))
    attempts = 0 if state == QUEUED else draw(st.integers(1, 30))
    return rcpt(
        f"r{draw(st.integers(0, 10**6))}@example.net",
        notify=draw(st.sampled_from([None, "NEVER", "DELAY", "FAILURE,DELAY"])),
        state=state,
        attempts=attempts,
        last_reply=draw(st.sampled_from([None, TEMP.line(), FULL.line()])) if attempts else None,
        delay_notified=draw(st.booleans()),
    )


@st.composite
def attempts(draw):
    """A message, results for a subset of its recipients, and the time."""
    msg = message(*draw(st.lists(recipients(), min_size=1, max_size=5)))
    indexes = draw(st.sets(st.integers(0, len(msg.recipients) - 1)))
    results = [got(i, draw(st.sampled_from(REPLIES))) for i in sorted(indexes)]
    now = T0 + draw(st.floats(0, 10 * D))
    return msg, results, now


any_settings = st.builds(
    settings,
    lifetime=st.floats(1, 6 * D),
    expire_action=st.sampled_from(["bounce", "discard", "hold"]),
    delay_after=st.floats(0, 6 * D),
    delay_without_notify=st.booleans(),
)


@given(attempts(), any_settings, st.floats(1, 8), st.randoms(use_true_random=False))
def test_settle_touches_only_the_results(attempt, s, factor, rng):
    msg, results, now = attempt
    out = settle(msg, results, now, rng, s, retry_factor=factor)
    settled = {r.index for r in results}
    assert len(out.message.recipients) == len(msg.recipients)
    assert len([e for e in out.events if e["event"] == "delivery"]) == len(results)
    for i, (before, after) in enumerate(zip(msg.recipients, out.message.recipients, strict=True)):
        if i in settled:
            continue
        if after != before:
            # The one exception: a pending delay notice goes out with any settlement.
            assert now - msg.created >= s.delay_after
            assert before.state == DEFERRED and not before.delay_notified
            assert after == msgspec.structs.replace(before, delay_notified=True)


@given(attempts(), any_settings, st.floats(1, 8), st.randoms(use_true_random=False))
def test_settled_recipients_are_recorded_and_never_due_in_the_past(attempt, s, factor, rng):
    msg, results, now = attempt
    out = settle(msg, results, now, rng, s, retry_factor=factor)
    for result in results:
        before, after = msg.recipients[result.index], out.message.recipients[result.index]
        assert after.attempts == before.attempts + 1
        assert after.history[-1].time == now and after.last_attempt == now
        if result.verdict.outcome in ("transient", "ambiguous"):
            if after.next_attempt is not None:
                assert after.state == DEFERRED
                assert after.next_attempt >= now
            else:  # expired by the look-ahead
                assert after.state == EXPIRED or out.message.held
        else:
            assert after.state in FINAL_STATES and after.next_attempt is None


@given(
    st.floats(0, 10 * D),
    st.floats(0, 10 * D),
    st.floats(0, H),
    st.sampled_from(["greylisting", "other", "throttling", ""]),
)
def test_flush_is_never_before_now_nor_inside_the_window(last, now, window, kind):
    old = rcpt(
        state=DEFERRED, attempts=1, history=(Attempt(T0 + last, "4xx", MX, "transient", kind),)
    )
    due = flushed(old, T0 + now, window).next_attempt
    assert due is not None and due >= T0 + now
    if kind == "greylisting":
        assert due == max(T0 + now, T0 + last + window)
    else:
        assert due == T0 + now


# Our address on a block list, at MAIL FROM: about us, not about the recipients.
LISTED = Reply(
    "mail",
    554,
    "5.7.1",
    "Service unavailable; Client host [192.0.2.1] blocked using zen.spamhaus.org",
)


def about_us(action: str) -> SettleSettings:
    return dataclasses.replace(settings(), on_sender_block=action)


def test_a_reply_about_our_sending_defers_every_recipient_by_default():
    msg = message(rcpt("a@example.net"), rcpt("b@example.net"))
    out = run(msg, got(0, LISTED), got(1, LISTED), now=T0)
    assert [r.state for r in out.message.recipients] == [DEFERRED, DEFERRED]
    assert not out.failed and not out.suppress and not out.message.held


def test_on_sender_block_hold_holds_the_message_for_review():
    msg = message(rcpt("a@example.net"), rcpt("b@example.net"))
    out = run(msg, got(0, LISTED), got(1, LISTED), now=T0, settings=about_us("hold"))
    assert out.message.held and out.message.held_reason == "sender_block"
    assert [r.state for r in out.message.recipients] == [DEFERRED, DEFERRED]
    [held] = [e for e in out.events if e["event"] == "sender_block_held"]
    assert held["kind"] == "blocklist" and "zen.spamhaus.org" in held["reply"]
    assert not out.failed and not out.suppress


def test_on_sender_block_bounce_bounces_without_suppressing():
    msg = message(rcpt("a@example.net"))
    out = run(msg, got(0, LISTED), now=T0, settings=about_us("bounce"))
    assert out.message.recipients[0].state == BOUNCED
    assert [r.status for r in out.failed] == ["5.7.1"]
    assert not out.suppress  # the recipient did nothing wrong


def test_on_sender_block_leaves_other_replies_alone():
    msg = message(rcpt("a@example.net"), rcpt("b@example.net"))
    out = run(msg, got(0, NO_USER), got(1, TEMP), now=T0, settings=about_us("hold"))
    assert [r.state for r in out.message.recipients] == [BOUNCED, DEFERRED]
    assert not out.message.held
