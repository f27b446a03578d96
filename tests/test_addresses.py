"""Envelope address syntax and RFC 3461 xtext (mtaqueue.smtp.addresses)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtaqueue.smtp.addresses import (
    MAX_LOCAL_PART,
    MAX_PATH,
    AddressError,
    check_domain,
    check_mailbox,
    domain_of,
    qualified_hostname,
    split_path,
    xtext_decode,
    xtext_encode,
)

# -- split_path ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        ("<a@b.example>", ("a@b.example", "")),
        ("<>", ("", "")),
        ("  <a@b.example>", ("a@b.example", "")),  # "MAIL FROM: <a@b>" is common
        ("<a@b.example> SIZE=10 BODY=8BITMIME", ("a@b.example", "SIZE=10 BODY=8BITMIME")),
        ("<a@b.example>   SIZE=10  ", ("a@b.example", "SIZE=10")),
        ("<@relay.example:a@b.example>", ("a@b.example", "")),
        ("<@r1.example,@r2.example:a@b.example> NOTIFY=NEVER", ("a@b.example", "NOTIFY=NEVER")),
        ('<"a>b"@c.example>', ('"a>b"@c.example', "")),  # '>' inside quotes
        ('<"a\\">"@c.example> X=1', ('"a\\">"@c.example', "X=1")),  # escaped quote
        ("<a@[127.0.0.1]>", ("a@[127.0.0.1]", "")),
    ],
)
def test_split_path(arg, expected):
    assert split_path(arg) == expected


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("a@b.example", "enclosed in <>"),
        ("", "enclosed in <>"),
        ("<a@b.example", "missing closing"),
        ('<"a>b@c.example>', "missing closing"),  # the quote never closes
        ("<a@b.example>SIZE=10", "space after the address"),
        ("<@relay.example a@b.example>", "source route"),
    ],
)
def test_split_path_refuses(arg, message):
    with pytest.raises(AddressError, match=message):
        split_path(arg)


def test_address_error_is_a_value_error():
    assert issubclass(AddressError, ValueError)


# -- check_mailbox ------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    [
        "a@b.example",
        "first.last+tag@sub.b.example",
        "!#$%&'*+/=?^_`{|}~-@b.example",
        '"john doe"@b.example',
        '"a@b"@c.example',
        '"quote\\"inside"@b.example',
        '""@b.example',
        "a@[127.0.0.1]",
        "a@[IPv6:::1]",
        "a@[ipv6:2001:db8::1]",
        "a@localhost",
        "a@xn--bcher-kva.example",
        "a@b-c.example",
        "x" * MAX_LOCAL_PART + "@b.example",
        "a@" + "d" * 63 + ".example",
        "a@1.2.example",
    ],
)
def test_valid_mailboxes(address):
    check_mailbox(address, utf8=False)
    check_mailbox(address, utf8=True)


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("", "local part and a domain"),
        ("a.example", "local part and a domain"),
        ("@b.example", "local part and a domain"),
        ("a@", "domain"),
        ("x" * (MAX_LOCAL_PART + 1) + "@b.example", "local part longer"),
        (".a@b.example", "invalid local part"),
        ("a.@b.example", "invalid local part"),
        ("a..b@b.example", "invalid local part"),
        ("a b@b.example", "invalid local part"),
        ('"unclosed@b.example', "invalid local part"),
        ('"bad"quote"@b.example', "invalid local part"),
        ("a@-b.example", "invalid domain"),
        ("a@b-.example", "invalid domain"),
        ("a@b..example", "invalid domain"),
        ("a@b_c.example", "invalid domain"),
        ("a@.", "invalid domain"),
        ("a@" + "d" * 64 + ".example", "invalid domain"),
        ("a@[127.0.0.1", "unterminated address literal"),
        ("a@[999.0.0.1]", "invalid address literal"),
        ("a@[IPv6:::g]", "invalid address literal"),
        ("a@[::1]", "invalid address literal"),  # IPv6 needs the tag
        ("a@[tag:content]", "invalid address literal"),
    ],
)
def test_invalid_mailboxes(address, message):
    with pytest.raises(AddressError, match=message):
        check_mailbox(address, utf8=False)


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("a@[IPv6:fe80::1%eth0]", "invalid address literal"),  # RFC 5321 has no zone
        ("a@[IPv6:::1%0]", "invalid address literal"),
        ("a@bü-.example", "invalid domain"),  # a U-label ends in no hyphen either
        ("a@-ü.example", "invalid domain"),
        ("a@" + "ü" * 64 + ".example", "invalid domain"),  # 64 characters
    ],
)
def test_invalid_smtputf8_mailboxes(address, message):
    with pytest.raises(AddressError, match=message):
        check_mailbox(address, utf8=True)


def test_path_length_limit():
    # A 53-octet local part and a 202-octet domain are fine alone; together they
    # make exactly the longest path, one more octet is too long.
    domain = ".".join(["d" * 49] * 4) + ".ex"  # 202 octets
    address = "x" * 53 + "@" + domain
    assert len(address) == MAX_PATH
    check_mailbox(address, utf8=False)
    with pytest.raises(AddressError, match=f"longer than {MAX_PATH}"):
        check_mailbox("x" + address, utf8=False)


def test_domain_length_limit():
    check_domain(".".join(["d" * 63] * 4), utf8=False)  # 255 octets
    with pytest.raises(AddressError, match="length"):
        check_domain(".".join(["d" * 63] * 4) + "d", utf8=False)
    with pytest.raises(AddressError, match="length"):
        check_domain("", utf8=False)


@pytest.mark.parametrize("address", ["jörg@b.example", "a@exämple.example", "用户@例子.广告"])
def test_non_ascii_needs_smtputf8(address):
    with pytest.raises(AddressError, match="SMTPUTF8"):
        check_mailbox(address, utf8=False)
    check_mailbox(address, utf8=True)


@pytest.mark.parametrize("utf8", [False, True])
def test_control_characters_never_allowed_in_local_part(utf8):
    # DEL (0x7f) is not atext, SMTPUTF8 or not (RFC 6531 only adds non-ASCII).
    for local in ("a\x7fb", "a\x00b", "a\x1fb"):
        with pytest.raises(AddressError):
            check_mailbox(local + "@b.example", utf8=utf8)


def test_non_ascii_local_part_length_counts_octets():
    local = "é" * 32  # 32 characters, 64 octets
    check_mailbox(local + "@b.example", utf8=True)
    with pytest.raises(AddressError, match="local part longer"):
        check_mailbox(local + "é@b.example", utf8=True)


def test_domain_of_lowercases_the_domain_only_part():
    assert domain_of("Mixed.Case@Sub.Example.COM") == "sub.example.com"
    assert domain_of('"a@b"@C.example') == "c.example"


# -- xtext (RFC 3461 section 4) ---------------------------------------------


@pytest.mark.parametrize(
    ("encoded", "decoded"),
    [
        ("", ""),
        ("plain", "plain"),
        ("a+2Bb", "a+b"),
        ("a+3Db", "a=b"),
        ("+20", " "),
        ("Mixed+2BCase", "Mixed+Case"),  # case outside escapes is kept
        ("+2B+2B", "++"),
        ("+41BC", "ABC"),
    ],
)
def test_xtext_decode(encoded, decoded):
    assert xtext_decode(encoded) == decoded


@pytest.mark.parametrize(
    "bad",
    [
        "a+2bb",  # hex digits must be upper case
        "a+2",  # truncated escape
        "a+",
        "+G0",
        "a=b",  # '=' must be escaped
        "a b",  # space must be escaped
        "tab\there",
        "é",
        "a+2B=",
        "+FF",  # escapes must spell UTF-8: no lone surrogates for the spool to choke on
        "x+F9+EF",
        "+C3",  # truncated sequence
        "+ED+A0+80",  # an encoded surrogate
        "+C0+AF",  # overlong
    ],
)
def test_xtext_decode_refuses(bad):
    with pytest.raises(AddressError):
        xtext_decode(bad)


def test_xtext_encode_examples():
    assert xtext_encode("a+b=c d") == "a+2Bb+3Dc+20d"
    assert xtext_encode("rfc822;user@example.com") == "rfc822;user@example.com"
    assert xtext_encode("\x00\x7f") == "+00+7F"


_XTEXT_CHARS = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in "+=")


@given(st.text(alphabet=st.characters(max_codepoint=0xFF)))
def test_xtext_round_trip_latin1(text):
    encoded = xtext_encode(text)
    assert all(c in _XTEXT_CHARS or c == "+" or c in "0123456789ABCDEF" for c in encoded)
    assert all("!" <= c <= "~" and c != "=" for c in encoded)
    assert xtext_decode(encoded) == text


@given(st.text())
def test_xtext_round_trip_any_text(text):
    # Whatever xtext_encode accepts it must encode so that xtext_decode gives it back
    # (or refuse it): an escape is exactly two hex digits, one octet.
    try:
        encoded = xtext_encode(text)
    except ValueError:
        return
    assert xtext_decode(encoded) == text


@given(st.lists(st.one_of(st.sampled_from(list(_XTEXT_CHARS)), st.integers(0, 255))))
def test_xtext_decode_then_encode_is_canonical(parts):
    # Any xtext whose escapes spell UTF-8 decodes to a str that encodes (the journal
    # needs that), and re-encoding it decodes to the same; any other is refused.
    encoded = "".join(p if isinstance(p, str) else f"+{p:02X}" for p in parts)
    octets = bytes(ord(p) if isinstance(p, str) else p for p in parts)
    try:
        octets.decode("utf-8")
    except UnicodeDecodeError:
        with pytest.raises(AddressError):
            xtext_decode(encoded)
        return
    decoded = xtext_decode(encoded)
    decoded.encode("utf-8")
    assert xtext_decode(xtext_encode(decoded)) == decoded


@pytest.mark.parametrize(
    ("name", "qualified"),
    [
        ("mx.example.com", True),
        ("mx.test", True),
        ("MX.Example.COM.", True),
        ("localhost", False),
        ("LOCALHOST", False),
        ("localhost.localdomain", False),
        ("mailhost", False),  # what getfqdn() gives when the host has no domain
        ("box.localdomain", False),
        ("localhost.", False),
    ],
)
def test_qualified_hostname(name, qualified):
    assert qualified_hostname(name) is qualified
