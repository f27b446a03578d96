"""Revalidation before a late send (mtaqueue.policy.revalidate): pure, a clock passed in."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtaqueue.model import Message, Recipient
from mtaqueue.policy.revalidate import (
    CANCEL,
    HOLD,
    PASS_VALID,
    SEND,
    Answer,
    decide,
    needs_check,
    request_body,
)

T0 = 1_700_000_000.0
H = 3600.0


def message(sender: str = "app@example.com", **fields) -> Message:
    fields = {"klass": "p1", "created": T0, "size": 10} | fields
    return Message("66175AA83CCEC000", sender, (Recipient("bob@example.org"),), **fields)


def test_never_when_the_class_does_not_revalidate():
    assert not needs_check(message(), T0 + 30 * 24 * H, 0.0, None)


def test_only_once_the_message_is_older_than_revalidate_after():
    assert not needs_check(message(), T0 + H - 1, H, None)  # young: sent as it is
    assert needs_check(message(), T0 + H, H, None)
    assert needs_check(message(), T0 + 3 * H, H, None)


def test_a_go_ahead_holds_for_the_attempt_it_came_before_and_no_longer():
    now = T0 + 2 * H
    assert not needs_check(message(), now, H, passed_at=now)  # the dispatch that follows
    # Its other recipients, due a little later (jitter), and our own short waits.
    assert not needs_check(message(), now + PASS_VALID - 1, H, passed_at=now)
    assert needs_check(message(), now + PASS_VALID, H, passed_at=now)
    # A retry, at the soonest the default schedule's first step later, asks again.
    assert PASS_VALID < 5 * 60
    assert needs_check(message(), now + 5 * 60, H, passed_at=now)


def test_our_own_notices_are_never_checked():
    assert not needs_check(message(sender=""), T0 + 10 * H, H, None)


@pytest.mark.parametrize(
    ("answer", "on_error", "decision"),
    [
        (Answer(200), "send", SEND),
        (Answer(200), "hold", SEND),
        (Answer(204), "hold", SEND),
        (Answer(410), "send", CANCEL),
        (Answer(410), "hold", CANCEL),
        (Answer(404), "send", SEND),  # not Gone: a wrong URL never cancels mail
        (Answer(404), "hold", HOLD),
        (Answer(500), "hold", HOLD),
        (Answer(302), "hold", HOLD),
        (Answer(error="no answer within 5s"), "send", SEND),
        (Answer(error="no answer within 5s"), "hold", HOLD),
        (Answer(error="connection refused"), "hold", HOLD),
    ],
)
def test_what_an_answer_decides(answer, on_error, decision):
    assert decide(answer, on_error) == decision


def test_failed_is_what_on_error_decides():
    assert not Answer(200).failed and not Answer(410).failed
    assert Answer(503).failed and Answer(error="timeout").failed


def test_the_request_names_the_message_and_its_age_and_nothing_of_the_mail():
    msg = message(idempotency_key="order-42", tenant="shop")
    assert request_body(msg, T0 + 7200.5) == {
        "message_id": "66175AA83CCEC000",
        "idempotency_key": "order-42",
        "class": "p1",
        "tenant": "shop",
        "age": 7200.5,
    }


@given(
    after=st.floats(0, 10 * H),
    age=st.floats(0, 20 * H),
    since_pass=st.one_of(st.none(), st.floats(0, 20 * H)),
)
def test_a_message_is_checked_only_when_late_and_not_let_go_recently(after, age, since_pass):
    now = T0 + age
    passed_at = None if since_pass is None else now - since_pass
    checked = needs_check(message(), now, after, passed_at)
    late = after > 0 and now - T0 >= after  # as the clock rounds them
    fresh_pass = passed_at is not None and now - passed_at < PASS_VALID
    assert checked == (late and not fresh_pass)


def test_the_secret_file_is_read_when_the_settings_are_taken(tmp_path):
    # The edge (delivery/revalidation.py) takes the settings at start and at each reload:
    # an unreadable secret file is a config error then, not a failure at the first check.
    from mtaqueue import config
    from mtaqueue.delivery.revalidation import Revalidation

    url = 'revalidate.url="http://127.0.0.1:9/check"'
    missing = config.load(None, [url, f'revalidate.secret_file="{tmp_path / "none"}"'])
    with pytest.raises(config.ConfigError, match=r"revalidate\.secret_file"):
        Revalidation(missing, lambda *decided: None)
    (tmp_path / "key").write_text("from-the-file\nignored\n")
    good = config.load(None, [url, f'revalidate.secret_file="{tmp_path / "key"}"'])
    revalidation = Revalidation(good, lambda *decided: None)
    assert revalidation._secret == "from-the-file"
    with pytest.raises(config.ConfigError):
        revalidation.reconfigure(missing)
    assert revalidation._secret == "from-the-file"  # a refused reload changes nothing
