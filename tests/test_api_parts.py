"""The HTTP API's pure parts: the tokens file, composing a message, a raw message's
content, how a message's end is told (the server's checks against the OpenAPI document's
schemas are in test_api_schema.py; the daemon-level behaviour in test_api_e2e.py and
test_api_edges_e2e.py)."""

from __future__ import annotations

import email
import email.policy

import pytest

from mtaqueue.api.compose import Part, compose
from mtaqueue.api.tokens import Caller, load_tokens
from mtaqueue.model import Recipient
from mtaqueue.smtp.content import TOO_BIG, Limits, whole
from mtaqueue.spool.finished import Ended, Finished, end_state, recipients_state

OPERATOR, SHOP = "operator-0123456789abcdef", "shop-0123456789abcdef"


def test_tokens_file_lines_comments_and_tenants(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"# comment\n\n{OPERATOR}\n  {SHOP} Shop Two  \n")
    path.chmod(0o600)
    tokens, warnings = load_tokens(str(path))
    assert len(tokens) == 2 and warnings == []
    assert tokens.caller(OPERATOR) == Caller(None)
    assert tokens.caller(SHOP) == Caller("Shop Two")
    assert tokens.caller(SHOP[:-1]) is None and tokens.caller("") is None
    assert Caller(None).sees("anyone") and not Caller("a").sees("b") and Caller("a").sees("a")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("short\n", "line 1: a token needs at least 16 characters"),
        (f"# ok\n{OPERATOR}\n{OPERATOR} shop\n", "the same token is on two lines"),
        ("tok\x7fen-0123456789abc\n", "line 1: a token is printable ASCII"),
    ],
)
def test_a_bad_tokens_file_is_refused_naming_the_line(tmp_path, text, error):
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        load_tokens(str(path))


def test_a_tokens_file_others_can_read_is_warned_about_and_none_is_no_tokens(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"{OPERATOR}\n")
    path.chmod(0o644)
    assert "chmod 600" in load_tokens(str(path))[1][0]
    tokens, warnings = load_tokens("")
    assert len(tokens) == 0 and warnings == [] and tokens.caller(OPERATOR) is None


def test_compose_text_html_and_attachments_7bit_clean():
    content = compose(
        ("Jörg", "app@example.com"),
        [("", "a@example.org"), ("B", '"b c"@example.org')],
        "Grüße",
        "héllo\n",
        "<p>héllo <img src='cid:logo'></p>\n",
        [Part("a.pdf", b"%PDF"), Part("logo.png", b"\x89PNG", content_id="<logo>")],
        utf8=False,
    )
    assert content.isascii() and b"\r\n" in content and b"\n" not in content.replace(b"\r\n", b"")
    msg = email.message_from_bytes(content, policy=email.policy.default)
    assert msg["From"] == "Jörg <app@example.com>" and msg["Subject"] == "Grüße"
    assert msg["To"] == 'a@example.org, B <"b c"@example.org>'
    assert msg.get_content_type() == "multipart/mixed"
    alternative, pdf, logo = msg.iter_parts()
    assert [p.get_content_type() for p in alternative.iter_parts()] == ["text/plain", "text/html"]
    assert pdf.get_content_type() == "application/pdf" and pdf.get_content() == b"%PDF"
    assert logo["Content-ID"] == "<logo>" and logo.get_content_disposition() == "inline"
    assert content.count(b"MIME-Version") == 1  # the message's, not each part's


def test_compose_for_smtputf8_keeps_utf8_headers():
    content = compose(("", "jörg@exämple.de"), [("", "a@b.org")], "Grüße",
                      None, "<p>x</p>", [], utf8=True)  # fmt: skip
    assert b"From: j\xc3\xb6rg@ex\xc3\xa4mple.de\r\n" in content
    assert b"Content-Type: text/html" in content


@pytest.mark.parametrize("utf8", [False, True])
def test_compose_writes_from_and_to_as_checked_even_where_the_email_package_misreads(utf8):
    # Mailboxes RFC 5321 allows that the email package writes bare or reads as white space
    # (".b"@y as .b@y, then a TypeError in a list); names quoted, encoded, folded.
    odd = ['".b"@y.example', '"a..b"@y.example', '""@y.example', '"\\\\"@y.example']
    if utf8:
        odd.append("a\u3000.b@y.example")
    names = ["", 'Doe, J. "Jr"', "=?utf-8?q?x?=", "Jörg", "N" * 200]
    to = [(names[i % len(names)], mailbox) for i, mailbox in enumerate(odd)]
    content = compose(("Shop", "shop@b.example"), to, "s", "t", None, [], utf8)
    header = content[: content.index(b"\r\n\r\n")].decode("utf-8")
    assert header.startswith("From: Shop <shop@b.example>\r\nTo: ")
    for _, mailbox in to:
        assert mailbox in header  # as checked, quotes and all
    assert max(len(line) for line in header.split("\r\n")) < 100
    policy = email.policy.SMTPUTF8 if utf8 else email.policy.SMTP
    parsed = email.message_from_bytes(content, policy=policy)["To"].addresses
    assert [a.display_name for a in parsed][1:4] == ['Doe, J. "Jr"', "=?utf-8?q?x?=", "Jörg"]


LIMITS = Limits(max_size=1000, max_line=100, window=200, reject=False)


@pytest.mark.parametrize(
    ("raw", "content"),
    [
        (b"Subject: a\nX: b\rc\n\nbody\rline\n.dot",
         b"Subject: a\r\nX: b c\r\n\r\nbody\r\nline\r\n.dot\r\n"),
        (b"Subject: a\r\n\r\nbody\r\n", b"Subject: a\r\n\r\nbody\r\n"),
        (b"\nno header\n", b"\r\nno header\r\n"),
        (b"Subject: only a header", b"Subject: only a header\r\n"),
    ],
)  # fmt: skip
def test_a_raw_message_gets_crlf_lines_and_no_header_line_break_from_a_lone_cr(raw, content):
    assert whole(raw, LIMITS) == (content, None)


def test_a_raw_message_gets_the_listeners_limits():
    assert whole(b"S: x\n\n" + b"y\n" * 400, LIMITS)[1] == TOO_BIG
    assert "line over 100" in whole(b"S: x\n\n" + b"y" * 101, LIMITS)[1]
    assert "header over 200" in whole(b"S: " + b"x" * 250, LIMITS)[1]
    assert whole(b"S: x\n\n\0", LIMITS)[1] is None
    assert "NUL" in whole(b"S: x\n\n\0", Limits(1000, 100, 200, reject=True))[1]


# -- how a message left the queue ----------------------------------------------------


def test_the_end_state_of_a_message_and_the_bounded_memory_of_ends():
    delivered = Recipient("a@x.org", state="delivered")
    bounced = Recipient("b@x.org", state="bounced")
    assert end_state("done", [delivered, delivered]) == "delivered"
    assert end_state("done", [delivered, bounced]) == "finished"
    assert end_state("cancelled", [Recipient("a@x.org")]) == "cancelled"
    assert end_state("cancelled by revalidation", []) == "cancelled"
    assert end_state("deleted by operator", [delivered]) == "deleted"
    assert end_state("message file missing", []) == "deleted"
    assert recipients_state([delivered, Recipient("c@x.org")]) == "finished"
    finished = Finished(limit=2)
    for queue_id in ("A", "B", "C"):
        finished.add(queue_id, "cancelled", "shop")
    assert finished.get("A") is None and len(finished) == 2  # the oldest is forgotten
    assert finished.get("C") == Ended("cancelled", "shop") and finished.get("C").tenant == "shop"
