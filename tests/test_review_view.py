"""The review queue as the control socket shows it (mtaqueue.control.views): what is in it,
in which order, and what an entry says. Pure: records in, plain data out."""

from __future__ import annotations

import msgspec

from mtaqueue.control.views import Filters, in_review, matches, review_json, review_order
from mtaqueue.model import (
    DEFERRED,
    DELIVERED,
    HELD_AT_EXPIRY,
    HELD_BY_OPERATOR,
    HELD_BY_REVALIDATION,
    Attempt,
    Message,
    Recipient,
    with_hold,
    without_hold,
)

T0 = 1_700_000_000.0


def message(queue_id: str, created: float = T0, *recipients: Recipient) -> Message:
    recipients = recipients or (Recipient("bob@example.org", state=DEFERRED),)
    return Message(queue_id, "app@example.com", recipients, created, 100, "p2")


def test_only_mtaqueue_s_own_holds_are_in_review():
    fresh = message("A")
    assert not in_review(fresh)
    assert in_review(with_hold(fresh, HELD_AT_EXPIRY, T0 + 60))
    assert in_review(with_hold(fresh, HELD_BY_REVALIDATION, T0 + 60))
    assert not in_review(with_hold(fresh, HELD_BY_OPERATOR, T0 + 60))
    old_record_hold = msgspec.structs.replace(fresh, held=True)  # no reason: an older version
    assert not in_review(old_record_hold)
    assert not in_review(without_hold(with_hold(fresh, HELD_AT_EXPIRY, T0 + 60)))


def test_a_hold_keeps_its_first_reason_and_a_release_forgets_it():
    expired = with_hold(message("A"), HELD_AT_EXPIRY, T0 + 60)
    assert with_hold(expired, HELD_BY_OPERATOR, T0 + 120) is expired  # still in review
    released = without_hold(expired)
    assert (released.held, released.held_reason, released.held_at) == (False, "", None)


def test_longest_waiting_in_review_first():
    late = with_hold(message("A", T0), HELD_AT_EXPIRY, T0 + 500)
    early = with_hold(message("B", T0 + 100), HELD_BY_REVALIDATION, T0 + 200)
    assert sorted([late, early], key=review_order) == [early, late]


def test_an_entry_has_the_last_reply_and_its_cause_per_recipient():
    greylisted = Recipient(
        "bob@example.org",
        state=DEFERRED,
        attempts=2,
        last_attempt=T0 + 90,
        last_reply="450 4.2.0 Greylisted",
        history=(
            Attempt(T0, "451 4.3.0 busy", "mx", "transient", "temporary"),
            Attempt(T0 + 90, "450 4.2.0 Greylisted", "mx", "transient", "greylisting"),
        ),
    )
    done = Recipient("amy@example.org", state=DELIVERED, attempts=1, last_reply="250 ok")
    msg = with_hold(message("A", T0, greylisted, done), HELD_AT_EXPIRY, T0 + 100)
    entry = review_json(msg, T0 + 400)
    assert (entry["reason"], entry["age"], entry["waiting"]) == ("expired", 400.0, 300.0)
    assert entry["recipients"] == [
        {
            "address": "bob@example.org",
            "state": "held",
            "attempts": 2,
            "last_attempt": T0 + 90,
            "last_reply": "450 4.2.0 Greylisted",
            "cause": "greylisting",
        },
        {
            "address": "amy@example.org",
            "state": "delivered",
            "attempts": 1,
            "last_attempt": None,
            "last_reply": "250 ok",
            "cause": None,
        },
    ]


def test_the_review_selector_of_bulk_commands():
    expired = with_hold(message("A"), HELD_AT_EXPIRY, T0)
    by_operator = with_hold(message("B"), HELD_BY_OPERATOR, T0)
    assert matches(expired, Filters(review=True))
    assert not matches(by_operator, Filters(review=True))
    assert matches(by_operator, Filters(review=False))
