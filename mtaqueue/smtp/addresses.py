"""Envelope address syntax (RFC 5321 4.1.2, RFC 6531) and xtext (RFC 3461 4).

Pure functions: the listener uses them to refuse malformed paths with a clear
reply instead of queueing mail that no receiver would take.
"""

from __future__ import annotations

import ipaddress
import re

MAX_LOCAL_PART = 64
MAX_DOMAIN = 255
MAX_PATH = 256

# atext of RFC 5322 3.2.3; with SMTPUTF8 any non-ASCII character is allowed too.
_ATEXT = r"A-Za-z0-9!#$%&'*+/=?^_`{|}~\-"
_UTF8 = "\u0080-\ud7ff\ue000-\U0010ffff"  # any non-ASCII character but lone surrogates
ATOM = re.compile(rf"[{_ATEXT}]+\Z")  # RFC 5322 atom, e.g. an ORCPT addr-type
_DOT_STRING = re.compile(rf"[{_ATEXT}]+(\.[{_ATEXT}]+)*\Z")
_DOT_STRING_UTF8 = re.compile(rf"[{_ATEXT}{_UTF8}]+(\.[{_ATEXT}{_UTF8}]+)*\Z")
_QUOTED = re.compile(r'"([\x20\x21\x23-\x5b\x5d-\x7e]|\\[\x20-\x7e])*"\Z')
_QUOTED_UTF8 = re.compile(rf'"([\x20\x21\x23-\x5b\x5d-\x7e{_UTF8}]|\\[\x20-\x7e])*"\Z')
_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\Z")
_LABEL_UTF8 = re.compile(rf"[A-Za-z0-9{_UTF8}]([A-Za-z0-9{_UTF8}\-]*)\Z")


class AddressError(ValueError):
    """The path is malformed; the message says what is wrong."""


def split_path(arg: str) -> tuple[str, str]:
    """Split `<path> params` (the argument after FROM: / TO:) into path and params.

    Returns the address without angle brackets ("" for the null path <>).
    """
    arg = arg.lstrip()
    if not arg.startswith("<"):
        raise AddressError("address must be enclosed in <>")
    end = _closing_bracket(arg)
    path, params = arg[1:end], arg[end + 1 :]
    if params and not params.startswith(" "):
        raise AddressError("expected a space after the address")
    if path.startswith("@"):  # source route (RFC 5321 4.1.1.3): accepted, ignored
        colon = path.find(":")
        if colon < 0:
            raise AddressError("malformed source route")
        path = path[colon + 1 :]
    return path, params.strip()


def _closing_bracket(arg: str) -> int:
    # A '>' inside a quoted local part does not close the path.
    quoted = escaped = False
    for i, ch in enumerate(arg):
        if escaped:
            escaped = False
        elif ch == "\\" and quoted:
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == ">" and not quoted:
            return i
    raise AddressError("missing closing '>'")


def check_mailbox(address: str, *, utf8: bool) -> None:
    """Raise AddressError unless `address` is a valid local-part@domain."""
    try:
        octets = address.encode("utf-8")
    except UnicodeEncodeError:  # the wire bytes were not UTF-8 (decoded with surrogateescape)
        raise AddressError("address is not valid UTF-8") from None
    if len(octets) > MAX_PATH:
        raise AddressError(f"address longer than {MAX_PATH} octets")
    at = address.rfind("@")
    if at <= 0:
        raise AddressError("address needs a local part and a domain")
    local, domain = address[:at], address[at + 1 :]
    if not utf8 and not address.isascii():
        raise AddressError("non-ASCII address needs SMTPUTF8")
    if len(local.encode("utf-8")) > MAX_LOCAL_PART:
        raise AddressError(f"local part longer than {MAX_LOCAL_PART} octets")
    dot, quoted = (_DOT_STRING_UTF8, _QUOTED_UTF8) if utf8 else (_DOT_STRING, _QUOTED)
    if not (dot.match(local) or quoted.match(local)):
        raise AddressError("invalid local part")
    check_domain(domain, utf8=utf8)


def check_domain(domain: str, *, utf8: bool) -> None:
    if domain.startswith("["):
        _check_address_literal(domain)
        return
    if not domain or len(domain.encode("utf-8")) > MAX_DOMAIN:
        raise AddressError("invalid domain length")
    label = _LABEL_UTF8 if utf8 else _LABEL
    for part in domain.removesuffix(".").split("."):
        if len(part) > 63 or not label.match(part):
            raise AddressError(f"invalid domain {domain!r}")


def _check_address_literal(domain: str) -> None:
    if not domain.endswith("]"):
        raise AddressError("unterminated address literal")
    inner = domain[1:-1]
    try:
        if inner[:5].lower() == "ipv6:":
            ipaddress.IPv6Address(inner[5:])
        else:
            ipaddress.IPv4Address(inner)
    except ValueError:
        raise AddressError(f"invalid address literal {domain!r}") from None


def qualified_hostname(name: str) -> bool:
    """Can other hosts know us by `name`? Not "localhost" or a name without a dot, as
    getfqdn() gives on many hosts: EHLO, Received and MAILER-DAEMON would say so."""
    name = name.lower().rstrip(".")
    return "." in name and name.split(".")[0] != "localhost" and not name.endswith(".localdomain")


def domain_of(address: str) -> str:
    return address[address.rfind("@") + 1 :].lower()


def xtext_decode(text: str) -> str:
    """Decode RFC 3461 xtext ("+XX" escapes of UTF-8 octets); raise AddressError if malformed.

    Octets that are not UTF-8 are refused, not kept as lone surrogates: such a str cannot
    be encoded (msgspec, the journal, the log) and would fail far from the client.
    """
    if "+" not in text:
        if not _xtext_chars_ok(text):
            raise AddressError("invalid xtext")
        return text
    out = bytearray()
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "+":
            hexpart = text[i + 1 : i + 3]
            if len(hexpart) != 2 or not all(c in "0123456789ABCDEF" for c in hexpart):
                raise AddressError("invalid xtext escape")
            out.append(int(hexpart, 16))
            i += 3
        else:
            if not _xtext_chars_ok(ch):
                raise AddressError("invalid xtext")
            out.append(ord(ch))
            i += 1
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError:
        raise AddressError("xtext does not decode to UTF-8") from None


def xtext_encode(text: str) -> str:
    return "".join(
        chr(b) if 0x21 <= b <= 0x7E and b not in b"+=" else f"+{b:02X}"
        for b in text.encode("utf-8")
    )


def _xtext_chars_ok(text: str) -> bool:
    return all("!" <= ch <= "~" and ch != "=" for ch in text)
