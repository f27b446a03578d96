"""Which state changes make which events (pure)."""

from __future__ import annotations

import itertools

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from mtaqueue.events import derive
from mtaqueue.model import (
    BOUNCED,
    DEFERRED,
    DELIVERED,
    EXPIRED,
    QUEUED,
    Attempt,
    Message,
    Recipient,
)

T = 1_800_000_000.0
ACTIONS = {"p1": "notify"}


def message(*rcpts: Recipient, **kw) -> Message:
    rcpts = rcpts or (Recipient("bob@example.org"),)
    return Message("M1", "app@sender.test", rcpts, T, 100, "p1", **kw)


def attempt(r: Recipient, reply: str, outcome: str, kind: str, state: str, t: float) -> Recipient:
    return msgspec.structs.replace(
        r,
        state=state,
        attempts=r.attempts + 1,
        last_reply=reply,
        last_attempt=t,
        remote_mta="mx.example.org",
        next_attempt=t + 300 if state == DEFERRED else None,
        history=(*r.history, Attempt(t, reply, "mx.example.org", outcome, kind)),
    )


def types(events) -> list[tuple[str, str | None]]:
    return [(e.type, e.recipient) for e in events]


def test_acceptance_is_one_accepted_event_per_recipient() -> None:
    m = message(Recipient("a@x.org"), Recipient("b@x.org"), idempotency_key="k1", tenant="shop")
    evs = derive.accepted(m, T)
    assert types(evs) == [("accepted", "a@x.org"), ("accepted", "b@x.org")]
    assert all(e.idempotency_key == "k1" and e.tenant == "shop" for e in evs)


def test_deferred_once_per_kind_not_once_per_retry() -> None:
    r0 = Recipient("bob@example.org")
    grey = "451 4.7.1 Greylisted, try later"
    r1 = attempt(r0, grey, "transient", "greylisting", DEFERRED, T + 1)
    r2 = attempt(r1, grey, "transient", "greylisting", DEFERRED, T + 301)
    r3 = attempt(r2, "421 4.7.28 rate limited", "transient", "throttling", DEFERRED, T + 900)
    steps = [message(r) for r in (r0, r1, r2, r3)]
    told = [derive.changed(a, b, T, ACTIONS) for a, b in itertools.pairwise(steps)]
    assert [types(e) for e in told] == [
        [("deferred", "bob@example.org")],
        [],
        [("deferred", "bob@example.org")],
    ]
    first, _, second = (e[0] if e else None for e in told)
    assert (first.kind, first.code, first.enhanced) == ("greylisting", 451, "4.7.1")
    assert (second.kind, second.attempt) == ("throttling", 3)
    assert first.next_attempt == T + 301


def test_final_states_tell_delivered_bounced_expired_with_the_reply() -> None:
    r0 = Recipient("a@x.org")
    ok = attempt(r0, "250 2.0.0 Ok: queued", "delivered", "ok", DELIVERED, T + 1)
    bad = attempt(r0, "550 5.1.1 <a@x.org>: no such user", "permanent", "mailbox", BOUNCED, T + 1)
    late = msgspec.structs.replace(
        attempt(r0, "421 4.7.0 try later", "transient", "throttling", DEFERRED, T + 1),
        state=EXPIRED,
        next_attempt=None,
    )
    (d,) = derive.changed(message(r0), message(ok), T, ACTIONS)
    (b,) = derive.changed(message(r0), message(bad), T, ACTIONS)
    (x,) = derive.removed(message(r0), message(late), "done", T, ACTIONS)
    assert (d.type, d.code, d.text, d.remote_host) == (
        "delivered",
        250,
        "Ok: queued",
        "mx.example.org",
    )
    assert (b.type, b.cause, b.enhanced) == ("bounced", "mailbox", "5.1.1")
    # Expired while throttled is not a bad mailbox: the kind and the class's action say so.
    assert (x.type, x.kind, x.code, x.action) == ("expired", "throttling", 421, "notify")


def test_an_operator_bounce_has_cause_operator() -> None:
    r0 = Recipient("a@x.org")
    r1 = msgspec.structs.replace(
        r0, state=BOUNCED, last_reply="550 5.0.0 returned by the administrator"
    )
    (b,) = derive.changed(message(r0), message(r1), T, ACTIONS)
    assert b.cause == "operator"


def test_a_cancel_tells_only_the_recipients_not_final_yet() -> None:
    done = attempt(Recipient("a@x.org"), "250 ok", "delivered", "ok", DELIVERED, T)
    m = message(done, Recipient("b@x.org"))
    evs = derive.removed(m, None, "cancelled", T, ACTIONS)
    assert types(evs) == [("cancelled", "b@x.org")] and evs[0].reason == "cancelled"
    assert derive.removed(m, None, "done", T, ACTIONS) == []


def test_held_and_delayed() -> None:
    r0 = attempt(Recipient("a@x.org"), "451 4.3.0 later", "transient", "other", DEFERRED, T)
    held = derive.changed(message(r0), message(r0, held=True), T, ACTIONS)
    assert types(held) == [("held", "a@x.org")]
    late = msgspec.structs.replace(r0, delay_notified=True)
    assert types(derive.changed(message(r0), message(late), T, ACTIONS)) == [("delayed", "a@x.org")]


outcomes = st.sampled_from(
    [
        ("451 4.7.1 greylisted", "transient", "greylisting", DEFERRED),
        ("421 4.7.28 slow down", "transient", "throttling", DEFERRED),
        ("250 2.0.0 ok", "delivered", "ok", DELIVERED),
        ("550 5.1.1 no such user", "permanent", "mailbox", BOUNCED),
    ]
)


@given(st.lists(outcomes, min_size=1, max_size=12))
def test_any_run_of_attempts_tells_at_most_one_final_event(run) -> None:
    r = Recipient("a@x.org")
    steps = [message(r)]
    for i, (reply, outcome, kind, state) in enumerate(run):
        if r.state in (DELIVERED, BOUNCED):
            break
        r = attempt(r, reply, outcome, kind, state, T + i)
        steps.append(message(r))
    told = [e for a, b in itertools.pairwise(steps) for e in derive.changed(a, b, T, ACTIONS)]
    finals = [e for e in told if e.type in ("delivered", "bounced")]
    assert len(finals) == (1 if r.state in (DELIVERED, BOUNCED) else 0)
    deferrals = [e.kind for e in told if e.type == "deferred"]
    # Never the same kind twice in a row: one event per change of reason.
    assert all(a != b for a, b in itertools.pairwise(deferrals))
    assert r.state != QUEUED


def test_an_expiry_that_holds_for_review_is_an_expired_event_with_action_hold() -> None:
    r0 = attempt(
        Recipient("a@x.org"), "421 4.7.0 try later", "transient", "throttling", DEFERRED, T
    )
    held = message(r0, held=True, held_reason="expired", held_at=T + 1)
    evs = derive.changed(message(r0), held, T, ACTIONS)
    assert [(e.type, e.action, e.reason) for e in evs] == [
        ("expired", "hold", None),
        ("held", None, "expired"),
    ]
    assert evs[0].kind == "throttling" and evs[0].code == 421
