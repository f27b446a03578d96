"""submission.prepare: from a received transaction to a queue record and its content."""

from __future__ import annotations

import base64
from email.utils import parsedate_to_datetime

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtaqueue.model import Recipient
from mtaqueue.smtp.actions import CheckCredentials
from mtaqueue.smtp.server_session import ServerSession
from mtaqueue.smtp.session_settings import SessionSettings
from mtaqueue.submission import MAX_KEY_LENGTH, Received, Refused, SubmissionSettings, prepare
from mtaqueue.transaction import Envelope, Submit

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z
QID = "0123456789ABC000"
SETTINGS = SubmissionSettings(hostname="mx.test", classes=("p0", "p1", "p2"), default_class="p1")
RECEIVED = Received(queue_id=QID, now=NOW, client="192.0.2.7", tls=False)
HEADER_TAIL = b"Message-ID: <m1@app.example>\r\nDate: Fri, 15 Jan 2027 08:00:00 +0000\r\n"


def submit(
    content: bytes,
    recipients=("r@d.example",),
    *,
    sender: str = "app@sender.example",
    user: str | None = None,
    helo: str = "client.example",
    esmtp: bool = True,
    **envelope,
) -> Submit:
    rcpts = [r if isinstance(r, Recipient) else Recipient(r) for r in recipients]
    envelope_ = Envelope(sender=sender, recipients=rcpts, **envelope)
    return Submit(envelope_, content, helo, esmtp, user)


def run(content: bytes, received: Received = RECEIVED, **kwargs):
    return prepare(submit(content, **kwargs), received, SETTINGS)


def refused(content: bytes, **kwargs) -> str:
    with pytest.raises(Refused) as info:
        run(content, **kwargs)
    return str(info.value)


def split_added(content: bytes, original_rest: bytes) -> list[bytes]:
    """Check that `content` is added header fields + `original_rest`; return the fields."""
    assert content.endswith(original_rest)
    added = content[: len(content) - len(original_rest)]
    assert added.endswith(b"\r\n")
    fields: list[bytes] = []
    for line in added[:-2].split(b"\r\n"):
        if line[:1] in (b" ", b"\t"):
            fields[-1] += b"\r\n" + line
        else:
            fields.append(line)
    return fields


# -- the record -------------------------------------------------------------------


def test_record_fields():
    content = b"Subject: hi\r\n" + HEADER_TAIL + b"\r\nbody\r\n"
    recipients = (
        Recipient("a@d.example", orcpt="rfc822;A@d.example", notify="SUCCESS,FAILURE"),
        Recipient("b@d.example", notify="NEVER"),
    )
    message, stored = prepare(
        submit(
            content,
            recipients,
            user="tenant1",
            helo="app-host",
            envid="Env-ID-1",
            ret="HDRS",
            body="8BITMIME",
            smtputf8=True,
        ),
        RECEIVED,
        SETTINGS,
    )
    assert message.id == QID
    assert message.sender == "app@sender.example"
    assert message.recipients == recipients
    assert message.created == NOW
    assert message.size == len(stored)
    assert message.klass == "p1"  # the default class
    assert message.expires is None
    assert message.idempotency_key is None
    assert message.envid == "Env-ID-1"
    assert message.ret == "HDRS"
    assert message.body == "8BITMIME"
    assert message.smtputf8
    assert message.tenant == "tenant1"
    assert message.client == "192.0.2.7"
    assert message.helo == "app-host"
    assert not message.held


def test_null_sender_is_kept():
    message, _ = run(b"\r\nbody\r\n", sender="")
    assert message.sender == ""


# -- X-Mtaqueue-* headers ------------------------------------------------------------


def test_submission_headers_are_read_and_removed():
    before = b"From: App <app@sender.example>\r\nTo: r@d.example\r\n"
    middle = b"Subject: a folded\r\n subject line\r\n"
    after = HEADER_TAIL + b"X-Other: keep me\r\n"
    body = b"\r\nBody line 1\r\nX-Mtaqueue-Class: p2\r\n\r\nlast\r\n"
    content = (
        before
        + b"X-Mtaqueue-Class: p0\r\n"
        + middle
        + b"X-Mtaqueue-Expires: 2h\r\n"
        + b"X-Mtaqueue-Idempotency-Key: reset-42\r\n"
        + after
        + body
    )
    message, stored = run(content)
    assert message.klass == "p0"
    assert message.expires == NOW + 7200
    assert message.idempotency_key == "reset-42"
    # Everything else, header and body, byte for byte, in order.
    fields = split_added(stored, before + middle + after + body)
    assert len(fields) == 1  # only Received: the message had Message-ID and Date
    assert fields[0].startswith(b"Received: ")
    assert stored.lower().count(b"x-mtaqueue") == 1  # the one in the body stays
    assert message.size == len(stored)


@pytest.mark.parametrize(
    "name", [b"x-mtaqueue-class", b"X-MTAQUEUE-CLASS", b"X-MtaQueue-Class", b"X-Mtaqueue-Class "]
)
def test_header_names_are_case_insensitive(name):
    message, stored = run(name + b": p2\r\n" + HEADER_TAIL + b"\r\nx\r\n")
    assert message.klass == "p2"
    assert b"x-mtaqueue" not in stored.lower()


def test_folded_submission_headers():
    content = (
        b"X-Mtaqueue-Class:\r\n p0\r\n"
        b"X-Mtaqueue-Expires:\r\n\t2030-01-01T00:00:00Z\r\n"
        b"Subject: s\r\n" + HEADER_TAIL + b"\r\nbody\r\n"
    )
    message, stored = run(content)
    assert message.klass == "p0"
    assert message.expires == 1_893_456_000
    assert b"x-mtaqueue" not in stored.lower()
    assert b"\r\n p0" not in stored and b"2030" not in stored  # continuation lines went too
    split_added(stored, b"Subject: s\r\n" + HEADER_TAIL + b"\r\nbody\r\n")


def test_folded_idempotency_key_is_unfolded():
    # RFC 5322 2.2.3: unfolding removes the CRLF before the whitespace.
    content = b"X-Mtaqueue-Idempotency-Key: order-1234\r\n part-2\r\n\r\nbody\r\n"
    message, stored = run(content)
    assert message.idempotency_key == "order-1234 part-2"
    assert b"order-1234" not in stored and b"part-2" not in stored


def test_similar_header_names_are_not_ours():
    content = b"X-Mtaqueue-Classic: p0\r\nX-Mtaqueue: p0\r\n" + HEADER_TAIL + b"\r\nx\r\n"
    message, stored = run(content)
    assert message.klass == "p1"
    assert stored.endswith(content)


def test_headers_in_the_body_are_not_read():
    content = HEADER_TAIL + b"\r\nX-Mtaqueue-Class: nonsense\r\nX-Mtaqueue-Expires: bad\r\n"
    message, stored = run(content)
    assert message.klass == "p1"
    assert message.expires is None
    assert stored.endswith(content)


def test_empty_class_header_means_the_default():
    message, _ = run(b"X-Mtaqueue-Class:   \r\n\r\nx\r\n")
    assert message.klass == "p1"


def test_unknown_class_is_refused():
    reply = refused(b"X-Mtaqueue-Class: urgent\r\n\r\nx\r\n")
    assert reply.startswith("554 5.6.0 ")
    assert "'urgent'" in reply
    assert "p0, p1, p2" in reply


def test_class_names_are_case_sensitive():
    assert "'P0'" in refused(b"X-Mtaqueue-Class: P0\r\n\r\nx\r\n")


def test_default_class_applies_without_header():
    settings = SubmissionSettings("mx.test", ("p0", "p1", "p2"), "p2")
    message, _ = prepare(submit(b"Subject: x\r\n\r\nx\r\n"), RECEIVED, settings)
    assert message.klass == "p2"


def test_last_submission_header_wins():
    message, stored = run(b"X-Mtaqueue-Class: p0\r\nX-Mtaqueue-Class: p2\r\n\r\nx\r\n")
    assert message.klass == "p2"
    assert b"x-mtaqueue" not in stored.lower()


def test_header_without_colon_does_not_crash():
    content = b"X-Mtaqueue-Class\r\nSubject: s\r\n\r\nbody\r\n"
    try:
        _, stored = run(content)
    except Refused as exc:
        assert str(exc).startswith("5")
    else:
        assert stored.endswith(b"Subject: s\r\n\r\nbody\r\n")


# -- expiry ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2h", NOW + 7200),
        ("90s", NOW + 90),
        ("15m", NOW + 900),
        ("1d", NOW + 86400),
        ("1.5h", NOW + 5400),
        ("3600", NOW + 3600),
        ("500ms", NOW + 0.5),
        ("2030-01-01T00:00:00Z", 1_893_456_000),
        ("2030-01-01T01:00:00+01:00", 1_893_456_000),
        ("2029-12-31T19:00:00-05:00", 1_893_456_000),
        ("2030-01-01T00:00:00.250Z", 1_893_456_000.25),
        (" 2h ", NOW + 7200),
    ],
)
def test_expires(value, expected):
    message, _ = run(b"X-Mtaqueue-Expires: " + value.encode() + b"\r\n\r\nx\r\n")
    assert message.expires == pytest.approx(expected)


def test_expires_naive_time_is_refused():
    reply = refused(b"X-Mtaqueue-Expires: 2030-01-01T00:00:00\r\n\r\nx\r\n")
    assert reply.startswith("554 5.6.0")
    assert "time zone" in reply


@pytest.mark.parametrize("value", [b"2020-01-01T00:00:00Z", b"0s", b"0"])
def test_expires_in_the_past_is_refused(value):
    reply = refused(b"X-Mtaqueue-Expires: " + value + b"\r\n\r\nx\r\n")
    assert reply == "554 5.6.0 X-Mtaqueue-Expires is already past"


@pytest.mark.parametrize("value", [b"tomorrow", b"2h30", b"-5m", b"1e5", b"", b"5 weeks"])
def test_expires_garbage_is_refused(value):
    reply = refused(b"X-Mtaqueue-Expires: " + value + b"\r\n\r\nx\r\n")
    assert reply.startswith("554 5.6.0 X-Mtaqueue-Expires")


@pytest.mark.parametrize("value", [b"999999999d", b"9999-12-31T23:59:59Z", b"100000000001s"])
def test_expires_too_far_ahead_is_refused(value):
    # Past the year 9999 no datetime writes it (a DSN's Will-Retry-Until): refused here.
    reply = refused(b"X-Mtaqueue-Expires: " + value + b"\r\n\r\nx\r\n")
    assert reply.startswith("554 5.6.0 X-Mtaqueue-Expires is too far ahead"), reply


# -- idempotency key ---------------------------------------------------------------


def test_idempotency_key_limits():
    key = "k" * MAX_KEY_LENGTH
    message, _ = run(f"X-Mtaqueue-Idempotency-Key: {key}\r\n\r\nx\r\n".encode())
    assert message.idempotency_key == key
    reply = refused(f"X-Mtaqueue-Idempotency-Key: {key}k\r\n\r\nx\r\n".encode())
    assert reply.startswith("554 5.6.0")
    assert "Idempotency-Key" in reply


def test_empty_idempotency_key_is_none():
    message, stored = run(b"X-Mtaqueue-Idempotency-Key:\r\n\r\nx\r\n")
    assert message.idempotency_key is None
    assert b"x-mtaqueue" not in stored.lower()


# -- added trace and identification headers ----------------------------------------


def test_received_comes_first_and_names_the_queue_id_and_single_recipient():
    content = b"Subject: s\r\n" + HEADER_TAIL + b"\r\nbody\r\n"
    _, stored = run(content, recipients=("only@d.example",))
    (received,) = split_added(stored, content)
    assert received.startswith(b"Received: from client.example ([192.0.2.7])\r\n\tby mx.test")
    assert b" id " + QID.encode() in received
    assert b"for <only@d.example>;" in received
    assert b"with ESMTP " in received
    date = received.rsplit(b";", 1)[1].strip().decode()
    assert parsedate_to_datetime(date).timestamp() == NOW


def test_received_has_no_for_with_several_recipients():
    content = b"Subject: s\r\n" + HEADER_TAIL + b"\r\nbody\r\n"
    _, stored = run(content, recipients=("a@d.example", "b@d.example"))
    (received,) = split_added(stored, content)
    assert b"for <" not in received
    assert b"a@d.example" not in received and b"b@d.example" not in received


@pytest.mark.parametrize(
    ("tls", "user", "smtputf8", "proto"),
    [
        (False, None, False, b"ESMTP"),
        (True, None, False, b"ESMTPS"),
        (True, "u", False, b"ESMTPSA"),
        (False, "u", False, b"ESMTPA"),
        (True, "u", True, b"UTF8SMTPSA"),
        (False, None, True, b"UTF8SMTP"),
    ],
)
def test_received_protocol(tls, user, smtputf8, proto):
    received = Received(QID, NOW, "192.0.2.7", tls)
    _, stored = run(b"\r\nx\r\n", received=received, user=user, smtputf8=smtputf8)
    assert b" with " + proto + b" id " in stored.split(b"\r\n\r\n")[0]


def test_received_strips_parentheses_from_helo():
    _, stored = run(b"\r\nx\r\n", helo="evil) (by trusted")
    assert stored.startswith(b"Received: from evil by trusted ([192.0.2.7])")


def test_message_id_and_date_added_when_missing():
    content = b"Subject: s\r\n\r\nbody\r\n"
    _, stored = run(content)
    fields = split_added(stored, content)
    assert [f.split(b":", 1)[0] for f in fields] == [b"Received", b"Message-ID", b"Date"]
    assert fields[1] == b"Message-ID: <" + QID.encode() + b"@mx.test>"
    date = fields[2].split(b":", 1)[1].strip().decode()
    assert parsedate_to_datetime(date).timestamp() == NOW


@pytest.mark.parametrize(
    ("present", "added"),
    [
        (b"Message-Id: <x@y>\r\n", [b"Received", b"Date"]),
        (b"DATE: Fri, 15 Jan 2027 08:00:00 +0000\r\n", [b"Received", b"Message-ID"]),
        (b"message-id:<x@y>\r\ndate: Fri, 15 Jan 2027 08:00:00 +0000\r\n", [b"Received"]),
    ],
)
def test_message_id_and_date_kept_when_present(present, added):
    content = b"Subject: s\r\n" + present + b"\r\nbody\r\n"
    _, stored = run(content)
    fields = split_added(stored, content)
    assert [f.split(b":", 1)[0] for f in fields] == added


def test_message_id_in_body_does_not_count():
    content = b"Subject: s\r\n\r\nMessage-ID: <x@y>\r\nDate: today\r\n"
    _, stored = run(content)
    fields = split_added(stored, content)
    assert [f.split(b":", 1)[0] for f in fields] == [b"Received", b"Message-ID", b"Date"]


# -- recipients ---------------------------------------------------------------------


def test_duplicate_recipients_are_removed_keeping_order():
    recipients = (
        Recipient("b@d.example", notify="NEVER"),
        Recipient("a@d.example"),
        Recipient("b@d.example", notify="SUCCESS"),
        Recipient("c@d.example"),
        Recipient("a@d.example"),
    )
    message, _ = run(b"\r\nx\r\n", recipients=recipients)
    assert [r.address for r in message.recipients] == ["b@d.example", "a@d.example", "c@d.example"]
    assert message.recipients[0].notify == "NEVER"  # the first occurrence wins


# -- odd shapes of content -------------------------------------------------------------


def test_message_without_header_body_separator():
    content = b"Subject: no body\r\nX-Mtaqueue-Class: p0\r\nFrom: a@b.example\r\n"
    message, stored = run(content)
    assert message.klass == "p0"
    fields = split_added(stored, b"Subject: no body\r\nFrom: a@b.example\r\n")
    assert [f.split(b":", 1)[0] for f in fields] == [b"Received", b"Message-ID", b"Date"]
    assert b"\r\n\r\n" not in stored  # still no body


def test_message_starting_with_empty_line_has_no_header():
    content = b"\r\nX-Mtaqueue-Class: p0\r\nJust body\r\n"
    message, stored = run(content)
    assert message.klass == "p1"  # that line is body text
    fields = split_added(stored, content)
    assert [f.split(b":", 1)[0] for f in fields] == [b"Received", b"Message-ID", b"Date"]


def test_empty_message():
    message, stored = run(b"")
    fields = split_added(stored, b"")
    assert [f.split(b":", 1)[0] for f in fields] == [b"Received", b"Message-ID", b"Date"]
    assert message.size == len(stored)


def test_body_bytes_are_untouched():
    body = b"\r\n\xff\xfe binary-ish\r\n.\r\n..\r\n\r\n\r\n  indented\r\n"
    content = b"Subject: s\r\n" + HEADER_TAIL + body
    _, stored = run(content)
    assert stored.endswith(content)


def test_tenant_header_names_the_tenant_and_is_removed():
    settings = SubmissionSettings("mx.test", ("p0", "p1", "p2"), "p1", tenant_header=b"x-tenant")
    content = b"X-Tenant: shop-7\r\nSubject: s\r\n\r\nbody\r\n"
    message, stored = prepare(submit(content), RECEIVED, settings)
    assert message.tenant == "shop-7"
    assert b"X-Tenant" not in stored and stored.endswith(b"Subject: s\r\n\r\nbody\r\n")
    # An authenticated user is the tenant, whatever the header says.
    message, _ = prepare(submit(content, user="alice"), RECEIVED, settings)
    assert message.tenant == "alice"
    # Without the setting the header is ordinary content.
    message, stored = prepare(submit(content), RECEIVED, SETTINGS)
    assert message.tenant is None and b"X-Tenant: shop-7" in stored


@pytest.mark.parametrize(
    "name", [b"X-Mtaqueue-Idempotency-Key", b"X-Mtaqueue-Class", b"X-Mtaqueue-Expires", b"X-Tenant"]
)
def test_submission_header_that_is_not_utf8_is_refused(name):
    # Decoding with "replace" made the keys b"\xff" and b"\xfe" one key: the second
    # message got 250 as a "duplicate" of the first and was never queued.
    with_tenant = SubmissionSettings("mx.test", ("p1",), "p1", tenant_header=b"x-tenant")
    content = name + b": k\xff\r\nSubject: s\r\n\r\nbody\r\n"
    with pytest.raises(Refused) as info:
        prepare(submit(content), RECEIVED, with_tenant)
    assert str(info.value) == f"554 5.6.0 {name.decode()} is not valid UTF-8"


# -- whatever a client sends, the record encodes -------------------------------------

_NOISE = st.binary(max_size=8).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
_ESCAPES = st.lists(st.integers(0, 255), min_size=1, max_size=3).map(
    lambda octets: b"".join(b"+%02X" % o for o in octets)
)
_WORDS = st.sampled_from([b"a", b"@", b"x.test", b";", b"rfc822", b"utf-8", "é".encode(), b"\\"])
_FIELD = st.lists(st.one_of(_NOISE, _ESCAPES, _WORDS), max_size=5).map(b"".join)
_B64 = st.lists(st.one_of(_NOISE, _WORDS), max_size=3).map(
    lambda parts: base64.b64encode(b"\0" + b"".join(parts) + b"\0pw")
)


@settings(max_examples=300, deadline=None)
@given(
    helo=_FIELD,
    user=_B64,
    sender=_FIELD,
    envid=_FIELD,
    orcpt=st.tuples(_FIELD, _FIELD),
    rcpt=_FIELD,
    header=_FIELD,
    utf8=st.booleans(),
)
def test_nothing_a_client_sends_makes_a_record_that_cannot_be_encoded(
    helo, user, sender, envid, orcpt, rcpt, header, utf8
):
    # A str that msgspec cannot encode (a lone surrogate from undecodable bytes) once
    # wedged the spool writer: every field of the record must encode.
    utf8_param = b" SMTPUTF8" if utf8 else b""
    wire = (
        b"EHLO " + helo + b"\r\nAUTH PLAIN " + user + b"\r\n"
        b"MAIL FROM:<" + sender + b">" + utf8_param + b"\r\n"
        b"RCPT TO:<b@x.test>\r\nDATA\r\nX-Tenant: " + header + b"\r\n\r\nbody\r\n.\r\n"
        b"MAIL FROM:<a@sender.test> ENVID=" + envid + utf8_param + b"\r\n"
        b"RCPT TO:<b@x.test> ORCPT=" + orcpt[0] + b";" + orcpt[1] + b"\r\n"
        b"RCPT TO:<" + rcpt + b"@x.test>\r\n"
        b"DATA\r\nX-Mtaqueue-Idempotency-Key: " + header + b"\r\n\r\nbody\r\n.\r\n"
    )
    session = ServerSession(
        SessionSettings("mx.test", 100_000, 100, tls_available=True, auth_available=True),
        may_relay=True,
    )
    session.receive(b"EHLO c\r\nSTARTTLS\r\n")
    session.resume(True)
    with_tenant = SubmissionSettings("mx.test", ("p1",), "p1", tenant_header=b"x-tenant")
    action = session.receive(wire)
    while action is not None:
        if isinstance(action, CheckCredentials):
            action = session.resume(action.user)  # any user the client names is "right"
            continue
        assert isinstance(action, Submit)
        try:
            message, _ = prepare(action, RECEIVED, with_tenant)
        except Refused:
            pass
        else:
            msgspec.msgpack.encode(message)
            msgspec.json.encode(message)
        action = session.resume("250 2.0.0 Ok: queued as X")
    session.take_output()
