"""The server's checks against the OpenAPI document's schemas, table by table: whatever
the schema allows the server takes, whatever it refuses the server refuses (400). The
schemas are read by jsonschema-rs (ECMA-262 patterns, as schemathesis and most clients
read them) and by Python's jsonschema alike. A whole schemathesis run against a daemon is
in test_api_schemathesis_e2e.py.
"""

from __future__ import annotations

import json
import re

import jsonschema_rs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from mtaqueue.api.errors import ApiError
from mtaqueue.api.openapi import document
from mtaqueue.api.rules import base64_text
from mtaqueue.api.server import suppression_address, suppression_fields
from mtaqueue.api.submit import build, check, check_key, decode, parse_address, refuse_now
from mtaqueue.smtp.addresses import check_mailbox
from mtaqueue.smtp.session_settings import SessionSettings
from mtaqueue.submission import Received, SubmissionSettings

CLASSES, MAX_RECIPIENTS = ("p0", "p1", "p2"), 3
DOCUMENT = document(CLASSES, MAX_RECIPIENTS)


def _allowed(schema, value):
    """The schema's verdict, ECMA-262's `$` (jsonschema-rs) and Python's (jsonschema)
    alike; Python's `$` also matches before a final newline."""
    schema = {**schema, "components": DOCUMENT["components"]}
    verdict = jsonschema_rs.validator_for(schema).is_valid(value)
    if not (isinstance(value, str) and value.endswith("\n")):
        assert Draft202012Validator(schema).is_valid(value) == verdict, value
    return verdict


# -- the Idempotency-Key: the server's check is the OpenAPI document's schema ----------

_KEYS = [
    "order-1", "a", "a b", "commande-é №1", "\U0001f600", "x\u200by", "k" * 256,
    "", " ", "\t", "k" * 257, " a", "a ", "a\tb", "a\nb", "a\x7f", "a\x85", "\u00a0",
    "a\u00a0", "\u3000a", "\ufeffa", "\u200b", "\u2028",
]  # fmt: skip


@pytest.mark.parametrize("key", _KEYS)
def test_the_server_takes_exactly_the_keys_the_openapi_schema_allows(key):
    (parameter,) = DOCUMENT["paths"]["/v1/messages"]["post"]["parameters"]
    allowed = _allowed(parameter["schema"], key)
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
        parameters = DOCUMENT["paths"]["/v1/messages"][method]["parameters"]
        [key] = [p for p in parameters if p["name"] == "idempotency_key"]
        assert not _allowed(key["schema"], "") and _allowed(key["schema"], "order-1")


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
    ("é" * 33 + "@b.example", False),  # 66 octets
    ("用" * 21 + "@b.example", True),  # 63 octets
    ("用" * 22 + "@b.example", False),
    ("\U0001f600" * 16 + "@b.example", True),  # 64 octets
    ("\U0001f600" * 17 + "@b.example", False),
    ("x" * 31 + "é@b.example", True),  # 32 characters, as wide as their widest: 64
    ("x" * 32 + "é@b.example", False),  # 34 octets, but 33 characters 2 octets wide
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


def _address_schemas():
    paths = DOCUMENT["paths"]
    [address] = paths["/v1/suppressions/{address}"]["put"]["parameters"]
    submission = DOCUMENT["components"]["schemas"]["Submission"]["properties"]
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
    """As PUT and DELETE /v1/suppressions/{address} take it."""
    try:
        suppression_address(address)
    except ApiError as exc:
        assert exc.status == 400 and exc.message.startswith("invalid address ")
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


def test_the_api_counts_characters_as_wide_as_the_widest_the_listener_counts_octets():
    # A pattern cannot count octets; it bounds characters as if each were as wide as the
    # widest of its part. 33 characters, one of them "é": 34 octets, which the listener
    # takes, but 66 by the API's count, which it does not (nor does the schema).
    bare, field = _address_schemas()
    mailbox = "x" * 32 + "é@b.example"
    check_mailbox(mailbox, utf8=True)
    assert not _allowed(bare, mailbox) and not _allowed(field, mailbox)
    assert not _server_takes_mailbox(mailbox) and not _server_takes_field(mailbox)
    assert "as wide" not in field["description"] and "beyond ASCII" in field["description"]


@settings(max_examples=100, deadline=None)
@given(st.data(), st.sampled_from(["ascii", "utf-8"]))
def test_whatever_the_schemas_patterns_draw_the_server_takes(data, codec):
    bare, field = _address_schemas()
    alphabet = st.characters(codec=codec)
    mailbox = data.draw(st.from_regex(bare["pattern"], fullmatch=True, alphabet=alphabet))
    assert _server_takes_mailbox(mailbox), mailbox
    text = data.draw(st.from_regex(field["pattern"], fullmatch=True, alphabet=alphabet))
    assert len(text) > field["maxLength"] or _server_takes_field(text), text


# -- a submission: its shape and its other fields -------------------------------------

_SESSION = SessionSettings("mx.test", max_message_size=100_000, max_recipients=MAX_RECIPIENTS)
_SETTINGS = SubmissionSettings("mx.test", CLASSES, "p1")
_BASE = {"from": "app@b.example", "to": ["a@b.example"]}
_TEXT = {"subject": "Hi", "text": "Hello"}
_RAW = {"raw": "Subject: Hi\n\nHello\n"}
_FILE = {"filename": "a.txt", "content": "aGk="}
_SUBMISSIONS = [
    # (the fields besides from and to, valid)
    (_TEXT, True),
    ({"subject": "Hi", "html": "<p>Hello</p>"}, True),
    ({"subject": "", "text": "", "html": ""}, True),
    ({"subject": "Hi"}, False),  # no text nor html
    ({"subject": "Hi", "text": None, "html": None}, False),  # null: as if left out
    ({"text": "Hello"}, False),  # no subject
    (_RAW, True),
    ({**_RAW, "subject": None, "text": None, "attachments": []}, True),
    ({**_RAW, "subject": "Hi"}, False),
    ({**_RAW, "html": "<p>x</p>"}, False),
    ({**_RAW, "attachments": [_FILE]}, False),
    ({"raw": None, **_TEXT}, True),
    ({"raw": ""}, False),
    ({"raw": " \r\n\t\u3000"}, False),  # white space only
    ({"raw": "\u3000x"}, True),
    ({"raw": 1}, False),
    ({**_TEXT, "subject": "a\nb"}, False),
    ({**_TEXT, "subject": "a\u2028b"}, False),  # the email package folds there
    ({**_TEXT, "subject": "a\x85b"}, False),
    ({**_TEXT, "subject": "a\u00a0b\u200b\ufeffc \U0001f600"}, True),  # no control character
    ({**_TEXT, "class": "p0"}, True),
    ({**_TEXT, "class": None}, True),
    ({**_TEXT, "class": "p9"}, False),
    ({**_TEXT, "class": 0}, False),
    ({**_TEXT, "expires": 3600}, True),
    ({**_TEXT, "expires": 0.5}, True),
    ({**_TEXT, "expires": 5e-324}, True),  # more than nothing: to come
    ({**_TEXT, "expires": 10**11}, True),
    ({**_TEXT, "expires": 10**11 + 1}, False),
    ({**_TEXT, "expires": 0}, False),
    ({**_TEXT, "expires": -1}, False),
    ({**_TEXT, "expires": True}, False),
    ({**_TEXT, "expires": None}, True),
    ({**_TEXT, "expires": "2h"}, True),
    ({**_TEXT, "expires": "90"}, True),
    ({**_TEXT, "expires": "0.001ms"}, True),
    ({**_TEXT, "expires": "999999d"}, True),
    ({**_TEXT, "expires": "1000000d"}, False),  # 6 digits of days at most
    ({**_TEXT, "expires": "9999999.9999h"}, True),
    ({**_TEXT, "expires": "10000000h"}, False),
    ({**_TEXT, "expires": "999999999m"}, True),
    ({**_TEXT, "expires": "99999999999"}, True),
    ({**_TEXT, "expires": "99999999999s"}, True),
    ({**_TEXT, "expires": "100000000000s"}, False),
    ({**_TEXT, "expires": "99999999999999ms"}, True),
    ({**_TEXT, "expires": "999999999999999ms"}, False),
    ({**_TEXT, "expires": "5sm"}, False),
    ({**_TEXT, "expires": "0s"}, False),
    ({**_TEXT, "expires": "00.0"}, False),
    ({**_TEXT, "expires": "2 h"}, False),
    ({**_TEXT, "expires": " 2h"}, False),
    ({**_TEXT, "expires": "2w"}, False),
    ({**_TEXT, "expires": "1e3"}, False),
    ({**_TEXT, "expires": "2999-12-31T23:59:59Z"}, True),
    ({**_TEXT, "expires": "2999-12-31t23:59:59.123456789z"}, True),
    ({**_TEXT, "expires": "2999-12-31 23:59:59+23:59"}, True),
    ({**_TEXT, "expires": "2996-02-29T00:00:00-01:00"}, True),  # a leap year
    ({**_TEXT, "expires": "2100-02-29T00:00:00Z"}, False),  # not one
    ({**_TEXT, "expires": "2400-02-29T00:00:00Z"}, True),
    ({**_TEXT, "expires": "9998-12-31T23:59:59-23:59"}, True),
    ({**_TEXT, "expires": "9999-01-01T00:00:00Z"}, False),  # the year 10000 not far away
    ({**_TEXT, "expires": "2999-04-31T00:00:00Z"}, False),
    ({**_TEXT, "expires": "2999-12-31T24:00:00Z"}, False),
    ({**_TEXT, "expires": "2999-12-31T23:59:60Z"}, False),  # no leap second
    ({**_TEXT, "expires": "2999-12-31T23:59:59"}, False),  # no offset
    ({**_TEXT, "expires": "2999-12-31T23:59:59+24:00"}, False),
    ({**_TEXT, "expires": "29991231T235959Z"}, False),  # ISO 8601's basic form
    ({**_TEXT, "expires": "2000-01-01T00:00:00Z"}, True),  # past: a 422, not a 400
    ({**_TEXT, "headers": {"Reply-To": "x@b.example", "X-Tag": "é"}}, True),
    ({**_TEXT, "headers": {"X-Mtaqueue-Class": "p0"}}, False),
    ({**_TEXT, "headers": {"x-mtaqueue-IDEMPOTENCY-key": "k"}}, False),
    ({**_RAW, "headers": {"X-Mtaqueue-Expires": "2h"}}, False),
    ({**_TEXT, "headers": {"subject": "again"}}, False),  # the composing writes it
    ({**_RAW, "headers": {"subject": "again"}}, True),
    ({**_TEXT, "headers": {"Bad Name": "x"}}, False),
    ({**_TEXT, "headers": {"X:A": "x"}}, False),
    ({**_TEXT, "headers": {"": "x"}}, False),
    ({**_TEXT, "headers": {"X-A": "a\r\nX-B: b"}}, False),
    ({**_TEXT, "headers": {"X-A": 1}}, False),
    ({**_TEXT, "attachments": [_FILE]}, True),
    ({**_TEXT, "attachments": [{**_FILE, "content": "aGk"}]}, False),  # unpadded
    ({**_TEXT, "attachments": [{**_FILE, "content": " aG\nk= "}]}, True),
    ({**_TEXT, "attachments": [{**_FILE, "content": "AAAA="}]}, False),  # Python's b64decode
    ({**_TEXT, "attachments": [{**_FILE, "content": "a==="}]}, False),
    ({**_TEXT, "attachments": [{**_FILE, "content": ""}]}, True),
    ({**_TEXT, "attachments": [{**_FILE, "content_type": "text/plain"}]}, True),
    ({**_TEXT, "attachments": [{**_FILE, "content_type": "text/"}]}, False),
    ({**_TEXT, "attachments": [{**_FILE, "content_type": "tëxt/plain"}]}, False),
    ({**_TEXT, "attachments": [{**_FILE, "filename": "a\nb"}]}, False),
    ({**_TEXT, "attachments": [{**_FILE, "content_id": "<logo>"}]}, True),
    ({**_TEXT, "attachments": [{**_FILE, "content_id": "a\tb"}]}, False),
    ({**_TEXT, "attachments": [{"filename": "a.txt"}]}, False),
    ({**_TEXT, "attachments": [{**_FILE, "size": 2}]}, False),
    ({**_TEXT, "to": []}, False),
    ({**_TEXT, "to": ["a@b.example"] * MAX_RECIPIENTS}, True),
    ({**_TEXT, "to": ["a@b.example"] * (MAX_RECIPIENTS + 1)}, False),
    ({**_TEXT, "to": "a@b.example"}, False),
    ({**_TEXT, "from": "Shop <shop@b.example>"}, True),
    ({**_TEXT, "from": None}, False),
    ({**_TEXT, "colour": "blue"}, False),
]


def _server_takes_submission(fields):
    """decode, check and build as POST /v1/messages does; a 422 (the moment's matter)
    counts as taken, as the schema cannot know the moment."""
    body = json.dumps({**_BASE, **fields}).encode()
    now = 1_800_000_000.0
    try:
        checked = check(decode(body), None, _SESSION, _SETTINGS, now)
        refuse_now(checked, lambda rcpt: None)
        build(checked, None, Received("0" * 16, now, "127.0.0.1", False, "HTTP"), _SESSION,
              _SETTINGS)  # fmt: skip
    except ApiError as exc:
        assert exc.status in (400, 422), exc
        return exc.status == 422
    return True


@pytest.mark.parametrize(("fields", "valid"), _SUBMISSIONS)
def test_the_server_takes_exactly_the_submissions_the_openapi_schema_allows(fields, valid):
    schema = DOCUMENT["components"]["schemas"]["Submission"]
    assert _allowed(schema, {**_BASE, **fields}) is valid
    assert _server_takes_submission(fields) is valid


@given(st.text(alphabet="A/+=z9 \n\t\u3000é-", max_size=14))
def test_the_servers_base64_check_is_the_published_pattern(content):
    # The server checks an attachment's base64 without the pattern (linear: a 25 MiB one
    # in 0.2 s, not 14): the same language.
    pattern = DOCUMENT["components"]["schemas"]["Attachment"]["properties"]["content"]["pattern"]
    assert (base64_text(content) is not None) == bool(re.fullmatch(pattern, content))


def test_an_expiry_already_past_is_a_422():
    fields = {**_TEXT, "expires": "2000-01-01T00:00:00Z"}
    body = json.dumps({**_BASE, **fields}).encode()
    with pytest.raises(ApiError) as refused:
        refuse_now(check(decode(body), None, _SESSION, _SETTINGS, 1.8e9), lambda rcpt: None)
    assert refused.value.status == 422 and "already past" in refused.value.message


def test_what_the_email_package_cannot_read_in_a_structured_field_is_a_400():
    # The schema cannot say which texts the email package's parser of a Reply-To (or a
    # Message-ID, ...) reads: its IndexError is a 400 naming the field, not a 500.
    fields = {**_TEXT, "headers": {"Reply-To": "<"}}
    assert _allowed(DOCUMENT["components"]["schemas"]["Submission"], {**_BASE, **fields})
    body = json.dumps({**_BASE, **fields}).encode()
    checked = check(decode(body), None, _SESSION, _SETTINGS, 0.0)
    with pytest.raises(ApiError) as refused:
        build(checked, None, Received("0" * 16, 0.0, "", False, "HTTP"), _SESSION, _SETTINGS)
    assert refused.value.status == 400 and refused.value.message.startswith("headers.Reply-To:")


def test_the_document_left_open_names_no_class_and_no_recipient_limit():
    open_ = document()["components"]["schemas"]["Submission"]["properties"]
    assert "maxItems" not in open_["to"] and "enum" not in open_["class"]
    assert DOCUMENT["components"]["schemas"]["Submission"]["properties"]["to"]["maxItems"] == 3


# -- a suppression's body -------------------------------------------------------------

_SUPPRESSION_BODIES = [
    ({}, True),
    ({"reason": "unsubscribed", "for": "365d"}, True),
    ({"reason": None, "for": None}, True),
    ({"reason": ""}, True),
    ({"for": 86400}, True),
    ({"for": 0}, False),
    ({"for": -1}, False),
    ({"for": ""}, False),
    ({"for": "soon"}, False),
    ({"for": "1e5"}, False),
    ({"for": {}}, False),
    ({"for": True}, False),
    ({"reason": 0}, False),
    ({"reason": {}}, False),
    ({"until": 1}, False),
]


@pytest.mark.parametrize(("body", "valid"), _SUPPRESSION_BODIES)
def test_the_server_takes_exactly_the_suppression_bodies_the_openapi_schema_allows(body, valid):
    schema = DOCUMENT["components"]["schemas"]["SuppressionRequest"]
    assert _allowed(schema, body) is valid
    try:
        reason, ttl = suppression_fields(body, 30.0)
    except ApiError as exc:
        assert exc.status == 400 and not valid
    else:
        assert valid and reason and ttl > 0
