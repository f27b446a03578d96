"""dsn: who gets a notice (RFC 3461) and the notice itself, read back with the email package."""

from __future__ import annotations

import email
import email.policy
import re
import string
from email.message import EmailMessage
from email.utils import parsedate_to_datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtaqueue.dsn import DsnParams, RecipientReport, build_dsn, is_8bit, notice, wants_notice
from mtaqueue.model import Message, Recipient

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z
MTA = "mta.example"
DSN_ID = "0123456789ABC000"
ORIGINAL = (
    b"Received: from app ([192.0.2.7]) by mta.example; Fri, 15 Jan 2027 08:00:00 +0000\r\n"
    b"From: App <app@sender.example>\r\n"
    b"To: r@d.example\r\n"
    b"Subject: Invoice\r\n"
    b"Message-ID: <m1@app.example>\r\n"
    b"\r\n"
    b"Hello.\r\n"
)
ORIGINAL_HEADER = ORIGINAL[: ORIGINAL.index(b"\r\n\r\n") + 2]
REPLY = "550 5.1.1 <r@d.example>: no such user"
ACTIONS = ("failed", "delayed", "delivered", "relayed", "expanded")


def make_message(*recipients: Recipient, sender: str = "app@sender.example", **fields) -> Message:
    recipients = recipients or (Recipient("r@d.example"),)
    return Message("0123456789ABB000", sender, recipients, NOW, 100, "p1", **fields)


def report(rcpt: Recipient, action: str = "failed", status: str = "5.1.1", **fields):
    fields = {"diagnostic": REPLY, "remote_mta": "mx1.d.example", "last_attempt": NOW + 60} | fields
    return RecipientReport(rcpt, action, status, **fields)


def build(message: Message, reports, original: bytes = ORIGINAL, max_return=100_000) -> bytes:
    dsn = build_dsn(message, reports, original, DsnParams(MTA, NOW + 120, max_return, DSN_ID))
    lines = dsn.split(b"\r\n")
    assert lines[-1] == b"", "ends with CRLF"
    assert all(len(line) <= 998 and b"\r" not in line and b"\n" not in line for line in lines)
    return dsn


def parse(dsn: bytes) -> EmailMessage:
    msg = email.message_from_bytes(dsn, policy=email.policy.default)
    assert msg.get_content_type() == "multipart/report"
    assert msg.get_param("report-type") == "delivery-status"
    assert not msg.defects
    return msg


def parts(msg: EmailMessage) -> list[EmailMessage]:
    return list(msg.iter_parts())


def types(msg: EmailMessage) -> list[str]:
    return [part.get_content_type() for part in parts(msg)]


def fields(msg: EmailMessage) -> tuple[dict, list[dict]]:
    """The per-message fields and the per-recipient groups of the delivery-status part."""
    status = parts(msg)[1]
    assert status.get_content_type() == "message/delivery-status"
    blocks = [dict(block.items()) for block in status.get_payload()]
    return blocks[0], blocks[1:]


def raw_bodies(dsn: bytes, msg: EmailMessage) -> list[bytes]:
    """Each part's body exactly as it is on the wire."""
    pieces = dsn.split(b"\r\n\r\n", 1)[1].split(b"--" + msg.get_boundary().encode())
    return [piece[2:-2].split(b"\r\n\r\n", 1)[1] for piece in pieces[1:-1]]


def human(msg: EmailMessage) -> str:
    """The text part, its wrapped lines joined with single spaces."""
    return " ".join(parts(msg)[0].get_content().split())


def epoch(date: str) -> float:
    return parsedate_to_datetime(date).timestamp()


# -- who gets a notice ------------------------------------------------------------


@pytest.mark.parametrize(
    ("notify", "action", "delay_without_notify", "expected"),
    [
        (None, "failed", False, True),
        (None, "delayed", False, False),
        (None, "delayed", True, True),
        (None, "delivered", True, False),
        (None, "relayed", True, False),
        (None, "expanded", True, False),
        ("FAILURE", "failed", False, True),
        ("FAILURE", "delayed", True, False),
        ("FAILURE", "delivered", False, False),
        ("SUCCESS,DELAY", "failed", False, False),
        ("SUCCESS,DELAY", "delayed", False, True),
        ("SUCCESS,DELAY", "delivered", False, True),
        ("SUCCESS,DELAY", "relayed", False, True),
        ("SUCCESS,DELAY", "expanded", False, True),
        ("DELAY,FAILURE", "failed", False, True),
        ("DELAY,FAILURE", "relayed", False, False),
        ("success,failure", "delivered", False, True),
    ],
)
def test_wants_notice_follows_notify(notify, action, delay_without_notify, expected):
    rcpt = Recipient("r@d.example", notify=notify)
    message = make_message(rcpt)
    assert (
        wants_notice(message, rcpt, action, delay_without_notify=delay_without_notify) is expected
    )


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("notify", [None, "NEVER", "FAILURE", "SUCCESS,FAILURE,DELAY"])
def test_null_sender_never_gets_a_notice(action, notify):
    rcpt = Recipient("r@d.example", notify=notify)
    message = make_message(rcpt, sender="")
    assert not wants_notice(message, rcpt, action, delay_without_notify=True)


@pytest.mark.parametrize("action", ACTIONS)
def test_notify_never_means_no_notice(action):
    rcpt = Recipient("r@d.example", notify="NEVER")
    assert not wants_notice(make_message(rcpt), rcpt, action, delay_without_notify=True)


# -- the notice's envelope ----------------------------------------------------------


def queue_notice(message: Message, reports, original: bytes = ORIGINAL):
    params = DsnParams(MTA, NOW + 120, 100_000, DSN_ID)
    return notice(message, reports, original, params, klass="p0", lifetime=86400.0)


def test_the_notice_goes_from_the_null_sender_to_the_original_sender_alone():
    rcpts = (Recipient("r@d.example"), Recipient("s@d.example", notify="FAILURE,DELAY"))
    message = make_message(*rcpts, envid="E1", ret="HDRS", tenant="shop", client="192.0.2.7")
    envelope, content = queue_notice(message, [report(r) for r in rcpts])
    assert envelope.sender == ""  # MAIL FROM:<>: never a notice about a notice
    assert envelope.recipients == (Recipient("app@sender.example"),)  # NOTIFY left out
    assert (envelope.id, envelope.klass, envelope.helo) == (DSN_ID, "p0", MTA)
    assert envelope.created == NOW + 120 and envelope.expires == NOW + 120 + 86400
    assert envelope.size == len(content) and not envelope.held
    # Nothing of the original's envelope is carried over.
    assert envelope.envid is None and envelope.ret is None and envelope.tenant is None
    assert envelope.client == "" and envelope.idempotency_key is None
    assert (envelope.body, envelope.smtputf8) == ("7BIT", False)
    assert content == build(message, [report(r) for r in rcpts])


def test_a_utf8_sender_or_8bit_content_is_flagged_in_the_envelope():
    message = make_message(sender="ü@sender.example")
    envelope, content = queue_notice(message, [report(message.recipients[0])])
    assert envelope.recipients[0].address == "ü@sender.example"
    assert envelope.smtputf8 is True and envelope.body == "8BITMIME" and is_8bit(content)
    original = ORIGINAL.replace(b"Hello.", "Grüße.".encode())
    envelope, _ = queue_notice(make_message(), [report(Recipient("r@d.example"))], original)
    assert envelope.body == "8BITMIME" and envelope.smtputf8 is False


@pytest.mark.parametrize(
    ("sender", "rcpt", "action"),
    [
        ("", Recipient("r@d.example"), "failed"),  # about a notice: never
        ("", Recipient("r@d.example", notify="SUCCESS"), "delivered"),
        ("app@sender.example", Recipient("r@d.example", notify="NEVER"), "failed"),
        ("app@sender.example", Recipient("r@d.example", notify="NEVER"), "delayed"),
        ("app@sender.example", Recipient("r@d.example", notify="FAILURE"), "relayed"),
        ("app@sender.example", Recipient("r@d.example"), "delivered"),  # not asked for
    ],
)
def test_no_notice_where_none_may_go(sender, rcpt, action):
    message = make_message(rcpt, sender=sender)
    with pytest.raises(ValueError):
        queue_notice(message, [report(rcpt, action, "5.0.0" if action == "failed" else "2.0.0")])


def test_wants_notice_refuses_an_unknown_action():
    rcpt = Recipient("r@d.example")
    with pytest.raises(ValueError, match="unknown DSN action"):
        wants_notice(make_message(rcpt), rcpt, "bounced")


# -- a failure notice ---------------------------------------------------------------


def test_failure_notice_structure_and_fields():
    rcpt = Recipient("r@d.example")
    dsn = build(make_message(rcpt), [report(rcpt)])
    msg = parse(dsn)

    assert msg["From"] == f"Mail Delivery System <MAILER-DAEMON@{MTA}>"
    assert msg["To"].addresses[0].addr_spec == "app@sender.example"
    assert msg["Subject"] == "Undelivered Mail Returned to Sender"
    assert epoch(msg["Date"]) == NOW + 120
    assert msg["Date"].endswith("+0000")
    assert msg["Message-ID"] == f"<{DSN_ID}@{MTA}>"
    assert msg["In-Reply-To"] == msg["References"] == "<m1@app.example>"
    assert msg["Auto-Submitted"] == "auto-replied"
    assert msg["MIME-Version"] == "1.0"
    assert types(msg) == ["text/plain", "message/delivery-status", "message/rfc822"]

    per_message, (per_rcpt,) = fields(msg)
    assert per_message == {
        "Reporting-MTA": f"dns; {MTA}",
        "Arrival-Date": per_message["Arrival-Date"],
    }
    assert epoch(per_message["Arrival-Date"]) == NOW
    assert per_rcpt == {
        "Final-Recipient": "rfc822; r@d.example",
        "Action": "failed",
        "Status": "5.1.1",
        "Remote-MTA": "dns; mx1.d.example",
        "Diagnostic-Code": f"smtp; {REPLY}",
        "Last-Attempt-Date": per_rcpt["Last-Attempt-Date"],
    }
    assert epoch(per_rcpt["Last-Attempt-Date"]) == NOW + 60

    returned = parts(msg)[2].get_payload()[0]
    assert returned["Subject"] == "Invoice"
    assert raw_bodies(dsn, msg)[2] == ORIGINAL
    text = human(msg)
    assert "<r@d.example>: could not be delivered (5.1.1)" in text
    assert f"Reply from mx1.d.example: {REPLY}" in text
    assert "The original message is attached." in text
    assert not is_8bit(dsn)
    assert msg["Content-Transfer-Encoding"] == "7bit"


def test_the_diagnostic_is_the_last_real_reply_even_after_expiry():
    rcpt = Recipient("r@d.example")
    reply = "451 4.7.1 Greylisted, please try again later"
    msg = parse(build(make_message(rcpt), [report(rcpt, status="4.7.1", diagnostic=reply)]))
    assert fields(msg)[1][0]["Diagnostic-Code"] == f"smtp; {reply}"
    assert fields(msg)[1][0]["Status"] == "4.7.1"
    assert reply in human(msg)


def test_no_diagnostic_no_remote_mta_no_attempt_means_no_fields():
    rcpt = Recipient("r@d.example")
    bare = report(rcpt, status="4.4.7", diagnostic=None, remote_mta=None, last_attempt=None)
    msg = parse(build(make_message(rcpt), [bare]))
    assert fields(msg)[1] == [
        {"Final-Recipient": "rfc822; r@d.example", "Action": "failed", "Status": "4.4.7"}
    ]


def test_multi_line_reply_folds_one_reply_line_per_line():
    rcpt = Recipient("r@d.example")
    reply = "550-5.1.1 mailbox unavailable\n550 5.1.1 user has moved"
    dsn = build(make_message(rcpt), [report(rcpt, diagnostic=reply)])
    assert b"Diagnostic-Code: smtp; 550-5.1.1 mailbox unavailable\r\n 550 5.1.1 user" in dsn
    value = fields(parse(dsn))[1][0]["Diagnostic-Code"]
    assert value == "smtp; 550-5.1.1 mailbox unavailable 550 5.1.1 user has moved"


def test_a_diagnostic_that_is_not_an_smtp_reply_is_not_labelled_smtp():
    rcpt = Recipient("r@d.example")
    diagnostic = "connect to mx1.d.example[192.0.2.1]:25: Connection refused"
    msg = parse(build(make_message(rcpt), [report(rcpt, status="4.4.1", diagnostic=diagnostic)]))
    assert fields(msg)[1][0]["Diagnostic-Code"] == f"X-mtaqueue; {diagnostic}"


def test_remote_mta_address_is_a_domain_literal():
    rcpt = Recipient("r@d.example")
    reports = [report(rcpt, remote_mta="192.0.2.1"), report(rcpt, remote_mta="2001:db8::25")]
    groups = fields(parse(build(make_message(rcpt), reports)))[1]
    assert [g["Remote-MTA"] for g in groups] == ["dns; [192.0.2.1]", "dns; [IPv6:2001:db8::25]"]


def test_no_message_id_in_the_original_means_no_in_reply_to():
    rcpt = Recipient("r@d.example")
    original = ORIGINAL.replace(b"Message-ID: <m1@app.example>\r\n", b"")
    msg = parse(build(make_message(rcpt), [report(rcpt)], original))
    assert msg["In-Reply-To"] is None and msg["References"] is None


# -- ENVID and ORCPT ----------------------------------------------------------------


def test_original_envelope_id_only_with_envid_case_kept_and_decoded():
    rcpt = Recipient("r@d.example")
    without = fields(parse(build(make_message(rcpt), [report(rcpt)])))[0]
    assert "Original-Envelope-Id" not in without
    # RFC 3461 6.3 (a): the field carries the ENVID decoded from xtext, not re-encoded.
    message = make_message(rcpt, envid="QQ314159+Order=42")
    dsn = build(message, [report(rcpt)])
    assert dsn.index(b"Original-Envelope-Id:") < dsn.index(b"Reporting-MTA:")
    assert fields(parse(dsn))[0]["Original-Envelope-Id"] == "QQ314159+Order=42"


def test_an_envid_with_unprintable_characters_stays_7bit():
    rcpt = Recipient("r@d.example")
    dsn = build(make_message(rcpt, envid="a\x01b\u00e9"), [report(rcpt)])
    assert fields(parse(dsn))[0]["Original-Envelope-Id"] == "a+01b+C3+A9"


def test_original_recipient_only_with_orcpt():
    with_orcpt = Recipient("bob@d.example", orcpt="rfc822;Bob@Example.COM")
    without = Recipient("carol@d.example")
    message = make_message(with_orcpt, without)
    groups = fields(parse(build(message, [report(with_orcpt), report(without)])))[1]
    assert groups[0]["Original-Recipient"] == "rfc822;Bob@Example.COM"
    assert groups[0]["Final-Recipient"] == "rfc822; bob@d.example"
    assert "Original-Recipient" not in groups[1]
    assert groups[1]["Final-Recipient"] == "rfc822; carol@d.example"


# -- what is returned ---------------------------------------------------------------


def test_ret_hdrs_returns_the_header_only():
    rcpt = Recipient("r@d.example")
    dsn = build(make_message(rcpt, ret="HDRS"), [report(rcpt)])
    msg = parse(dsn)
    assert types(msg) == ["text/plain", "message/delivery-status", "text/rfc822-headers"]
    assert raw_bodies(dsn, msg)[2] == ORIGINAL_HEADER
    assert "Hello." not in parts(msg)[2].get_content()


def test_ret_full_or_absent_returns_the_full_message():
    rcpt = Recipient("r@d.example")
    for ret in ("FULL", None):
        dsn = build(make_message(rcpt, ret=ret), [report(rcpt)])
        assert raw_bodies(dsn, parse(dsn))[2] == ORIGINAL


def test_content_over_max_return_returns_the_header_only():
    rcpt = Recipient("r@d.example")
    dsn = build(make_message(rcpt), [report(rcpt)], max_return=len(ORIGINAL) - 1)
    msg = parse(dsn)
    assert types(msg)[2] == "text/rfc822-headers"
    assert raw_bodies(dsn, msg)[2] == ORIGINAL_HEADER
    assert f"is {len(ORIGINAL)} bytes" in human(msg)
    at_limit = build(make_message(rcpt), [report(rcpt)], max_return=len(ORIGINAL))
    assert types(parse(at_limit))[2] == "message/rfc822"


def test_content_8bitmime_cannot_carry_returns_the_header_only():
    rcpt = Recipient("r@d.example")
    original = ORIGINAL + b"x" * 1200 + b"\r\n"
    msg = parse(build(make_message(rcpt), [report(rcpt)], original))
    assert types(msg)[2] == "text/rfc822-headers"
    assert "only its header is attached" in human(msg)


def test_8bit_content_is_returned_marked_8bit():
    rcpt = Recipient("r@d.example")
    original = ORIGINAL.replace(b"Hello.", "Grüße.".encode())
    dsn = build(make_message(rcpt, body="8BITMIME"), [report(rcpt)], original)
    msg = parse(dsn)
    assert types(msg)[2] == "message/rfc822"
    assert parts(msg)[2]["Content-Transfer-Encoding"] == "8bit"
    assert raw_bodies(dsn, msg)[2] == original
    assert is_8bit(dsn)
    assert msg["Content-Transfer-Encoding"] == "8bit"
    assert parts(msg)[1]["Content-Transfer-Encoding"] == "7bit"


def test_a_lost_original_is_not_attached():
    rcpt = Recipient("r@d.example")
    msg = parse(build(make_message(rcpt), [report(rcpt)], b""))
    assert types(msg) == ["text/plain", "message/delivery-status"]
    assert "cannot be attached" in human(msg)


# -- delay and success notices --------------------------------------------------------


def test_delay_notice():
    rcpt = Recipient("r@d.example", notify="DELAY")
    until = NOW + 5 * 86400
    reply = "421 4.7.0 Try again later"
    delayed = report(rcpt, "delayed", "4.7.0", diagnostic=reply, will_retry_until=until)
    dsn = build(make_message(rcpt, ret="FULL"), [delayed])
    msg = parse(dsn)
    assert msg["Subject"] == "Delayed Mail (still being retried)"
    # Delay and success notices return the header only (RFC 3461 6.2), whatever RET says.
    assert types(msg)[2] == "text/rfc822-headers"
    group = fields(msg)[1][0]
    assert group["Action"] == "delayed"
    assert group["Diagnostic-Code"] == f"smtp; {reply}"
    assert epoch(group["Will-Retry-Until"]) == until
    text = human(msg)
    assert "still" in text and reply in text
    assert "We will keep trying until Wed, 20 Jan 2027 08:00:00 +0000." in text


def test_will_retry_until_only_for_delayed():
    rcpt = Recipient("r@d.example")
    msg = parse(build(make_message(rcpt), [report(rcpt, will_retry_until=NOW + 86400)]))
    assert "Will-Retry-Until" not in fields(msg)[1][0]
    assert "keep trying" not in human(msg)


@pytest.mark.parametrize(
    ("action", "subject"),
    [
        ("delivered", "Successful Mail Delivery Report"),
        ("relayed", "Relayed Mail Delivery Report"),
        ("expanded", "Successful Mail Delivery Report"),
    ],
)
def test_success_notices(action, subject):
    rcpt = Recipient("r@d.example", notify="SUCCESS")
    done = report(rcpt, action, "2.0.0", diagnostic="250 2.0.0 Ok: queued as 4XYZ")
    msg = parse(build(make_message(rcpt), [done]))
    assert msg["Subject"] == subject
    assert types(msg)[2] == "text/rfc822-headers"
    assert fields(msg)[1][0]["Action"] == action
    assert fields(msg)[1][0]["Status"] == "2.0.0"


# -- several recipients, boundary, line lengths ------------------------------------


def test_several_recipients_in_one_notice_in_order():
    rcpts = [Recipient(f"u{i}@d{i}.example") for i in range(3)]
    message = make_message(*rcpts, Recipient("not-reported@d.example"))
    reports = [
        report(rcpts[0], diagnostic="550 5.1.1 unknown user"),
        report(rcpts[1], status="5.7.1", diagnostic="554 5.7.1 rejected by policy"),
        report(rcpts[2], status="4.4.7", diagnostic="451 4.3.0 temporary failure"),
    ]
    msg = parse(build(message, reports))
    groups = fields(msg)[1]
    assert [g["Final-Recipient"] for g in groups] == [f"rfc822; {r.address}" for r in rcpts]
    assert [g["Status"] for g in groups] == ["5.1.1", "5.7.1", "4.4.7"]
    assert [g["Diagnostic-Code"] for g in groups] == [f"smtp; {r.diagnostic}" for r in reports]
    text = human(msg)
    assert all(r.diagnostic in text for r in reports)
    assert "not-reported" not in text
    assert "not-reported" not in str(parts(msg)[1])


def test_mixed_failed_and_delayed_reports():
    failed, delayed = Recipient("a@d.example"), Recipient("b@e.example")
    reports = [report(failed), report(delayed, "delayed", "4.4.1", will_retry_until=NOW + 9999)]
    msg = parse(build(make_message(failed, delayed), reports))
    assert msg["Subject"] == "Undelivered Mail Returned to Sender"
    assert [g["Action"] for g in fields(msg)[1]] == ["failed", "delayed"]
    assert "Will-Retry-Until" in fields(msg)[1][1]


def test_boundary_never_occurs_in_the_content():
    rcpt = Recipient("r@d.example")
    first = parse(build(make_message(rcpt), [report(rcpt)])).get_boundary()
    # The original holds the boundary we would pick, and the next few candidates.
    lines = [f"--{first}", f"--{first}--", first.replace("_0", "_1"), first.replace("_0", "_2")]
    original = ORIGINAL + "\r\n".join(lines).encode() + b"\r\n"
    dsn = build(make_message(rcpt), [report(rcpt)], original)
    msg = parse(dsn)
    boundary = msg.get_boundary()
    assert boundary != first
    assert boundary.encode() not in original
    assert types(msg) == ["text/plain", "message/delivery-status", "message/rfc822"]
    assert raw_bodies(dsn, msg)[2] == original


def test_a_very_long_diagnostic_is_folded_under_998_octets():
    rcpt = Recipient("r@d.example")
    reply = "550 5.7.1 " + " ".join(["blocked"] * 400) + " " + "x" * 3000
    dsn = build(make_message(rcpt), [report(rcpt, status="5.7.1", diagnostic=reply)])
    msg = parse(dsn)  # build() checked every line <= 998 octets
    value = fields(msg)[1][0]["Diagnostic-Code"]
    assert value.startswith("smtp; 550 5.7.1 blocked blocked")
    # Folding keeps the text; only the 3000-octet word had to be cut.
    assert value.replace(" ", "") == ("smtp;" + reply).replace(" ", "")
    status = raw_bodies(dsn, msg)[1].split(b"\r\n")
    assert all(len(line) <= 78 for line in status if b"xxx" not in line)
    assert all(len(line) <= 78 for line in raw_bodies(dsn, msg)[0].split(b"\r\n"))


# -- internationalised mail (RFC 6531/6533) ---------------------------------------


def test_utf8_recipient_is_reported_as_utf8_address_type():
    rcpt = Recipient("jürgen@dö.example", orcpt="utf-8;jürgen@dö.example")
    original = "From: app@sender.example\r\nSubject: Grüße\r\n\r\nHallo.\r\n".encode()
    message = make_message(rcpt, smtputf8=True, body="8BITMIME")
    dsn = build(message, [report(rcpt)], original)
    msg = parse(dsn)
    group = fields(msg)[1][0]
    assert group["Final-Recipient"] == "utf-8; j\\x{FC}rgen@d\\x{F6}.example"
    assert group["Original-Recipient"] == "utf-8;j\\x{FC}rgen@d\\x{F6}.example"
    assert raw_bodies(dsn, msg)[1].isascii()  # message/delivery-status stays 7-bit
    assert "<jürgen@dö.example>: could not be delivered" in human(msg)
    # A UTF-8 header (RFC 6532) goes back as message/global (RFC 6533 4.2).
    assert types(msg)[2] == "message/global"
    assert raw_bodies(dsn, msg)[2] == original


def test_utf8_header_only_is_returned_as_message_global_headers():
    rcpt = Recipient("jürgen@dö.example")
    original = "Subject: Grüße\r\n\r\nHallo.\r\n".encode()
    msg = parse(build(make_message(rcpt, smtputf8=True, ret="HDRS"), [report(rcpt)], original))
    assert types(msg)[2] == "message/global-headers"


def test_utf8_sender_is_addressed_as_is():
    rcpt = Recipient("r@d.example")
    dsn = build(make_message(rcpt, sender="zoë@sender.example", smtputf8=True), [report(rcpt)])
    parse(dsn)
    # The email package leaves a UTF-8 header undecoded, so look at the bytes.
    assert "\r\nTo: <zoë@sender.example>\r\n".encode() in dsn


# -- refusals --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sender", "reports", "error"),
    [
        ("", [report(Recipient("r@d.example"))], "null sender"),
        ("app@sender.example", [], "at least one"),
        ("app@sender.example", [report(Recipient("r@d.example"), "bounced")], "unknown"),
        ("app@sender.example", [report(Recipient("r@d.example"), status="550")], "status"),
    ],
)
def test_build_dsn_refuses(sender, reports, error):
    with pytest.raises(ValueError, match=error):
        build(make_message(sender=sender), reports)


# -- round trip ------------------------------------------------------------------------

_ATEXT = string.ascii_letters + string.digits + "!#$%&'*+/=?^_`{|}~-"
_LOCAL = st.text(
    st.sampled_from(_ATEXT) | st.characters(categories=["L"], min_codepoint=0xA0),
    min_size=1,
    max_size=40,
)
_DOMAIN = st.from_regex(r"[a-z0-9]{1,20}(\.[a-z0-9]{1,20}){0,3}", fullmatch=True)
# Not "=?": the email package would decode an RFC 2047 encoded-word in the field.
_WORD = st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=30
).filter(lambda word: "=?" not in word)
_REPLY_LINE = st.builds(
    lambda code, enhanced, words: f"{code} {enhanced} {' '.join(words)}".strip(),
    st.sampled_from(["421", "450", "451", "452", "550", "551", "552", "553", "554"]),
    st.from_regex(r"[45]\.[0-9]{1,3}\.[0-9]{1,3}", fullmatch=True),
    st.lists(_WORD, max_size=60),
)


def _unescape(address: str) -> str:
    return re.sub(r"\\x\{([0-9A-F]+)\}", lambda m: chr(int(m[1], 16)), address)


@given(local=_LOCAL, domain=_DOMAIN, reply_lines=st.lists(_REPLY_LINE, min_size=1, max_size=3))
def test_reply_and_address_round_trip(local, domain, reply_lines):
    address = f"{local}@{domain}"
    rcpt = Recipient(address)
    reply = "\n".join(reply_lines)
    message = make_message(rcpt, smtputf8=not address.isascii())
    msg = parse(build(message, [report(rcpt, diagnostic=reply)]))
    group = fields(msg)[1][0]
    assert group["Diagnostic-Code"] == "smtp; " + " ".join(reply_lines)
    addr_type, _, final = group["Final-Recipient"].partition("; ")
    if address.isascii():
        assert (addr_type, final) == ("rfc822", address)
    else:
        assert addr_type == "utf-8"
        assert final.isascii() and _unescape(final) == address
    assert f"<{address}>" in human(msg)
