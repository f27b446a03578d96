"""The HTTP API's pure parts: the tokens file, composing a message, a raw message's
content, the Idempotency-Key's and the addresses' checks against their schemas, how a
message's end is told (the daemon-level behaviour is in test_api_e2e.py and
test_api_edges_e2e.py)."""

from __future__ import annotations

import email
import email.policy

import jsonschema_rs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from mtaqueue.api.compose import Part, address, compose
from mtaqueue.api.errors import ApiError
from mtaqueue.api.openapi import document
from mtaqueue.api.submit import check_key, parse_address
from mtaqueue.api.tokens import Caller, load_tokens
from mtaqueue.control.suppression import checked_address
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
        address("Jörg", "app@example.com"),
        [address("", "a@example.org"), address("B", '"b c"@example.org')],
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
    content = compose(address("", "jörg@exämple.de"), [address("", "a@b.org")], "Grüße",
                      None, "<p>x</p>", [], utf8=True)  # fmt: skip
    assert b"From: j\xc3\xb6rg@ex\xc3\xa4mple.de\r\n" in content
    assert b"Content-Type: text/html" in content


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


# -- the Idempotency-Key: the server's check is the OpenAPI document's schema ----------

_KEYS = [
    "order-1", "a", "a b", "commande-é №1", "\U0001f600", "x\u200by", "k" * 256,
    "", " ", "\t", "k" * 257, " a", "a ", "a\tb", "a\nb", "a\x7f", "a\x85", "\u00a0",
    "a\u00a0", "\u3000a", "\ufeffa", "\u200b", "\u2028",
]  # fmt: skip


@pytest.mark.parametrize("key", _KEYS)
def test_the_server_takes_exactly_the_keys_the_openapi_schema_allows(key):
    (parameter,) = document()["paths"]["/v1/messages"]["post"]["parameters"]
    allowed = Draft202012Validator(parameter["schema"]).is_valid(key)
    try:
        check_key(key)
    except ApiError as exc:
        assert exc.status == 400 and exc.message.startswith("Idempotency-Key: ")
        assert not allowed, key
    else:
        assert allowed, key


def test_a_cancel_by_key_states_that_the_key_may_not_be_empty():
    # The server answers an empty idempotency_key "required" (400): the schema says so.
    for method in ("get", "delete"):
        parameters = document()["paths"]["/v1/messages"][method]["parameters"]
        [key] = [p for p in parameters if p["name"] == "idempotency_key"]
        assert not Draft202012Validator(key["schema"]).is_valid("")
        assert Draft202012Validator(key["schema"]).is_valid("order-1")


# -- addresses: the server's check is the OpenAPI document's schema -----------------

_D63, _D64 = "d" * 63, "d" * 64
_LONG_PATH = "x" * 53 + "@" + ".".join(["d" * 49] * 4) + ".ex"  # 256 characters
_MAILBOXES = [
    # (address, valid): as a bare address, and as the addr of "Name <addr>"
    ("a@b.example", True),
    ("first.last+tag@sub.b.example", True),
    ("!#$%&'*+/=?^_`{|}~-@b.example", True),
    ('"john doe"@b.example', True),
    ('"a@b"@c.example', True),
    ('"a>b"@c.example', True),
    ('"quote\\"inside"@b.example', True),
    ('""@b.example', True),
    ('"tab\there"@b.example', False),
    ('"unclosed@b.example', False),
    ('"bad"quote"@b.example', False),
    ("a@[127.0.0.1]", True),
    ("a@[1.2.3.04]", False),  # no leading zeros
    ("a@[256.0.0.1]", False),
    ("a@[IPv6:2001:db8::1]", True),
    ("a@[ipv6:::ffff:192.0.2.1]", True),
    ("a@[IPv6:1:2:3:4:5:6:7:8]", True),
    ("a@[IPv6:1:2:3:4:5:6:7:8:9]", False),
    ("a@[IPv6:1::2::3]", False),
    ("a@[IPv6:fe80::1%eth0]", False),  # a zone is no part of an address literal
    ("a@[::1]", False),  # the tag is needed
    ("a@[127.0.0.1", False),
    ("a@[tag:content]", False),
    ("jörg@exämple.example", True),
    ("用户@例子.广告", True),
    ("\u3000a@b.example", True),  # any non-ASCII character is atext (RFC 6531)
    ("é" * 32 + "@b.example", True),  # 64 octets
    ("x" * 64 + "@b.example", True),
    ("x" * 65 + "@b.example", False),
    ("a@" + _D63 + ".example", True),
    ("a@" + _D64 + ".example", False),
    ("a@ü" + "d" * 62 + ".example", True),  # 63 characters (its A-label is longer)
    ("a@b.example.", True),  # the root
    ("a@b..example", False),
    ("a@.", False),
    ("a@-b.example", False),
    ("a@b-.example", False),
    ("a@bü-.example", False),  # a U-label neither: RFC 5891 4.2.3.1
    ("a@b_c.example", False),
    (_LONG_PATH, True),
    ("x" + _LONG_PATH, False),
    ("", False),
    ("a", False),
    ("@b.example", False),
    ("a@", False),
    ("a b@b.example", False),
    (".a@b.example", False),
    ("a..b@b.example", False),
    ("a\x7f@b.example", False),
    ("a@b.example\x00", False),
]
_FIELDS = [
    # (the text of from or to[i], valid): "addr" or "Name <addr>"
    ("  a@b.example\t\n", True),
    ("Name <a@b.example>", True),
    ("<a@b.example>", True),
    ("Name<a@b.example>", True),
    ("\tName\t< a@b.example\t>\r\n", True),
    ('"Doe, John" <a@b.example>', True),
    ('"" <a@b.example>', True),
    ("Jörg Müller <jörg@b.example>", True),
    ("a\u00a0b\u200bc <a@b.example>", True),  # not a control character
    ("a<b <c@b.example>", True),  # the addr is after the last "<"
    ('Name <"a>b"@c.example>', True),
    ('"a<b"@c.example', True),  # bare: no ">" at the end
    ('Name <"a<b"@c.example>', False),  # split at the last "<": b"@c.example
    ("Na\tme <a@b.example>", False),
    ('"\tName" <a@b.example>', False),  # a tab in the name (inside the quotes)
    ("Na\x85me <a@b.example>", False),  # C1
    ("Name\x00 <a@b.example>", False),
    ("Name <a@b.example", False),
    ("Name a@b.example>", False),
    ("Name <>", False),
    ("<>", False),
    ("Name <a@b.example> x", False),
    ("a@b.example <c@d.example>", True),  # a name may look like an address
    ("N" * 984 + " <a@b.example>", True),  # 998 characters
    ("N" * 985 + " <a@b.example>", False),
    (" ", False),
]


def _allowed(schema, value):
    """The schema's verdict, ECMA-262's `$` (jsonschema-rs, as schemathesis reads it) and
    Python's (jsonschema) alike; Python's `$` also matches before a final newline."""
    verdict = jsonschema_rs.validator_for(schema).is_valid(value)
    if not value.endswith("\n"):
        assert Draft202012Validator(schema).is_valid(value) == verdict, value
    return verdict


def _address_schemas():
    paths = document()["paths"]
    [address] = paths["/v1/suppressions/{address}"]["put"]["parameters"]
    submission = document()["components"]["schemas"]["Submission"]["properties"]
    to, sender = submission["to"]["items"], submission["from"]
    assert to["pattern"] == sender["pattern"] and to["maxLength"] == sender["maxLength"]
    return address["schema"], sender


def _server_takes_field(text):
    try:
        parse_address("to[0]", text)
    except ApiError as exc:
        assert exc.status == 400 and exc.message.startswith("to[0]: ")
        return False
    return True


def _server_takes_mailbox(address):
    try:
        checked_address(address)
    except ValueError as exc:
        assert str(exc).startswith("invalid address ")
        return False
    return True


@pytest.mark.parametrize(("mailbox", "valid"), _MAILBOXES)
def test_the_server_takes_exactly_the_addresses_the_openapi_schema_allows(mailbox, valid):
    bare, field = _address_schemas()
    assert _server_takes_mailbox(mailbox) is valid
    assert _allowed(bare, mailbox) is valid
    for text in (mailbox, f"Name <{mailbox}>", f'"Doe, J." < {mailbox} >'):
        assert _server_takes_field(text) is valid, text
        assert _allowed(field, text) is valid, text


@pytest.mark.parametrize(("text", "valid"), _FIELDS)
def test_the_server_takes_exactly_the_from_and_to_the_openapi_schema_allows(text, valid):
    _, field = _address_schemas()
    assert _server_takes_field(text) is valid
    assert _allowed(field, text) is valid


def test_a_bare_address_has_no_white_space_around_it():
    bare, _ = _address_schemas()
    for mailbox in (" a@b.example", "a@b.example ", "a@b.example\n"):
        assert not _server_takes_mailbox(mailbox) and not _allowed(bare, mailbox)


def test_octets_are_what_the_schema_cannot_count():
    # 33 two-octet characters: within the pattern's 64 characters, over RFC 5321's 64
    # octets. The schema states the octets in the description; the server counts them.
    bare, field = _address_schemas()
    mailbox = "é" * 33 + "@b.example"
    assert _allowed(bare, mailbox) and _allowed(field, mailbox)
    assert not _server_takes_mailbox(mailbox) and not _server_takes_field(mailbox)
    assert "octets" in field["description"]


_ASCII = st.characters(codec="ascii")


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_whatever_the_schemas_patterns_draw_the_server_takes(data):
    # ASCII: a character is an octet, so the patterns say it all.
    bare, field = _address_schemas()
    mailbox = data.draw(st.from_regex(bare["pattern"], fullmatch=True, alphabet=_ASCII))
    assert _server_takes_mailbox(mailbox), mailbox
    text = data.draw(st.from_regex(field["pattern"], fullmatch=True, alphabet=_ASCII))
    assert len(text) > field["maxLength"] or _server_takes_field(text), text


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
