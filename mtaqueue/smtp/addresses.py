r"""Envelope address syntax (RFC 5321 4.1.2, RFC 6531) and xtext (RFC 3461 4).

Pure functions: the listener uses them to refuse malformed paths with a clear
reply instead of queueing mail that no receiver would take.

A mailbox's syntax is one pattern, MAILBOX_PATTERN, that `check_mailbox` checks and the
HTTP API's OpenAPI document publishes. It is written in the syntax Python's `re` and
ECMA-262 (JSON Schema's `pattern`, with the `u` flag) read alike: classes of \xHH and
\uHHHH, non-capturing groups, `$` only at the end (the server uses fullmatch: Python's
`$` also matches before a final newline), a lookahead only a negative one (a generator
such as Hypothesis's from_regex draws `(?=X)Y` as X then Y). What it cannot say is
checked apart: lengths in octets of UTF-8 (the pattern counts characters, which is exact
for ASCII), that the text is UTF-8 at all (no lone surrogate: not every ECMA-262 engine
takes a surrogate in a pattern), and SMTPUTF8 for a non-ASCII address.
"""

from __future__ import annotations

import re

MAX_LOCAL_PART = 64
MAX_DOMAIN = 255
MAX_PATH = 256
MAX_LABEL = 63


def either(*alternatives: str) -> str:
    return "(?:" + "|".join(alternatives) + ")"


# RFC 5322 3.2.3 atext; with SMTPUTF8 (RFC 6531) any non-ASCII character too.
_NON_ASCII = r"[^\x00-\x7f]"
_ATEXT = either(r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~\-]", _NON_ASCII)
ATOM = re.compile(r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~\-]+\Z")  # RFC 5322 atom, e.g. an ORCPT addr-type
DOT_STRING = rf"{_ATEXT}+(?:\.{_ATEXT}+)*"


def quoted_string(angle: bool = True) -> str:
    """RFC 5321 Quoted-string (qtext and UTF-8, or a backslash and printable ASCII);
    angle=False: without "<" (inside "Name <...>", which the API splits at its last "<")."""
    qtext = r"\x20\x21\x23-\x5b\x5d-\x7e" if angle else r"\x20\x21\x23-\x3b\x3d-\x5b\x5d-\x7e"
    pair = r"\x20-\x7e" if angle else r"\x20-\x3b\x3d-\x7e"
    char = either(f"[{qtext}]", _NON_ASCII, rf"\\[{pair}]")
    return f'"{char}*"'


def local_part(angle: bool = True) -> str:
    return either(DOT_STRING, quoted_string(angle))


# A label of letters, digits and hyphens (and with SMTPUTF8 any non-ASCII character: a
# U-label), 1 to 63 characters, no hyphen at either end; a trailing dot is the root.
_LET_DIG = either("[A-Za-z0-9]", _NON_ASCII)
_LDH = either(r"[A-Za-z0-9\-]", _NON_ASCII)
_LABEL = rf"{_LET_DIG}(?:{_LDH}{{0,{MAX_LABEL - 2}}}{_LET_DIG})?"
_DOMAIN_NAME = rf"{_LABEL}(?:\.{_LABEL})*\.?"
# Address literals: IPv4 (no leading zeros) and IPv6 (RFC 4291 2.2, no zone: RFC 5321
# 4.1.3 has none); a General-address-literal (tag:content) is not taken.
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_IPV4 = rf"{_OCTET}(?:\.{_OCTET}){{3}}"
_H = "[0-9A-Fa-f]{1,4}"


def _ipv6() -> str:
    """Eight groups, or fewer around one "::" that stands for one zero group at least;
    the last two groups may be written as an IPv4 address."""

    def upto(piece: str, n: int) -> str:
        return f"(?:{piece}){{0,{n}}}" if n else ""

    h = _H
    forms = [f"(?:{h}:){{7}}{h}", f"(?:{h}:){{6}}{_IPV4}"]
    for left in range(8):  # the groups before the "::"
        head = (f"(?:{h}:){{{left - 1}}}{h}" if left > 1 else h * left) + "::"
        room = 7 - left  # for the groups after it
        tails = [h + upto(f":{h}", room - 1)] if room else []
        if room >= 2:  # an IPv4 address is two groups
            tails.append(upto(f"{h}:", room - 2) + _IPV4)
        forms.append(head + (either(*tails) + "?" if tails else ""))
    return either(*forms)


_ADDRESS_LITERAL = rf"\[{either(_IPV4, '[Ii][Pp][Vv]6:' + _ipv6())}\]"
DOMAIN = either(_DOMAIN_NAME, _ADDRESS_LITERAL)


# ASCII white space (Python's string.whitespace): what may surround a mailbox where a
# text holds one (the HTTP API's "Name <addr>"); never the last character of one.
WS = r"[\t-\r ]"


# The octets of UTF-8 that a pattern cannot count: it can bound the characters as if each
# were as wide as the widest the text holds. A character beyond the first range is 2
# octets wide or more, beyond the second 3, beyond the third 4.
_NARROW = {2: r"\x00-\x7f", 3: r"\x00-\u07ff", 4: r"\x00-\uffff"}


def mailbox_pattern(angle: bool = True, after: str = "$", widths: bool = False) -> str:
    """local-part@domain followed by `after` (to the end of the text: "$", or white space,
    ">" ... then "$"; no "@" in it); angle=False: no "<" in it. Its lengths are negative
    lookaheads: at most MAX_PATH characters, a local part of at most MAX_LOCAL_PART (the
    domain is then within MAX_DOMAIN); with `widths`, so many octets wide, each character
    counted as wide as the widest of the part (a bound of its own for a text that is not
    ASCII; without, the octets are checked apart). The lookaheads scan no further than a
    mailbox can reach, and not from white space, which no mailbox starts with: a text that
    is no mailbox costs linear time, not quadratic."""
    reach = r"[\s\S]" if angle else "[^<]"
    local_end, path_end = f"@{'[^@]' if angle else '[^@<]'}*$", f"[^\\t-\\r ]{after}"
    bounds = [
        rf"(?!{reach}{{{MAX_PATH},}}{path_end})",
        rf"(?!{reach}{{{MAX_LOCAL_PART + 1},}}{local_end})",
    ]
    for width, narrow in _NARROW.items() if widths else ():
        before = narrow if angle else narrow.replace(r"\x00-", r"\x00-\x3b\x3d-")  # not <
        wide = f"[{before}]*[^{narrow}]"  # a character wider than `narrow` comes
        path, local = MAX_PATH // width, MAX_LOCAL_PART // width + 1
        bounds += [
            rf"(?!(?={reach}{{{path},}}{path_end}){wide})",
            rf"(?!(?={reach}{{{local},}}{local_end}){wide}{reach}*{local_end})",
        ]
    return rf"(?!{WS}){''.join(bounds)}{local_part(angle)}@{DOMAIN}"


MAILBOX_PATTERN = f"^{mailbox_pattern()}$"
_MAILBOX = re.compile(MAILBOX_PATTERN)
_LOCAL = re.compile(local_part())
_DNS_NAME = re.compile(_DOMAIN_NAME)
_LITERAL = re.compile(_ADDRESS_LITERAL)


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
    """Raise AddressError unless `address` is a valid local-part@domain: MAILBOX_PATTERN,
    and what it cannot say (UTF-8, octets, SMTPUTF8)."""
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
    if not _MAILBOX.fullmatch(address):
        if not _LOCAL.fullmatch(local):
            raise AddressError("invalid local part")
        check_domain(domain, utf8=utf8)
        raise AddressError("invalid address")  # not reached: the pattern is local@domain


def check_domain(domain: str, *, utf8: bool) -> None:
    """Raise AddressError unless `domain` is a domain name or an address literal."""
    if domain.startswith("["):
        if not domain.endswith("]"):
            raise AddressError("unterminated address literal")
        if not _LITERAL.fullmatch(domain):
            raise AddressError(f"invalid address literal {domain!r}")
        return
    if not domain or len(domain.encode("utf-8", "surrogatepass")) > MAX_DOMAIN:
        raise AddressError("invalid domain length")
    if not utf8 and not domain.isascii():
        raise AddressError("non-ASCII domain needs SMTPUTF8")
    if not _DNS_NAME.fullmatch(domain):
        raise AddressError(f"invalid domain {domain!r}")


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
