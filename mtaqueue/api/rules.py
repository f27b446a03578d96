r"""What the API takes in a field, where JSON Schema can say it: each rule is one pattern
(and length, bound or enum) that the server checks and the OpenAPI document publishes,
so the two agree by construction. The patterns are written in the syntax Python's `re`
and ECMA-262 (with the `u` flag) read alike, as smtp/addresses.py's are; the server
matches them whole (fullmatch: Python's `$` also matches before a final newline,
ECMA-262's does not), or searches an unanchored one as JSON Schema does.

What a pattern cannot say is checked apart and stated in the field's description: that
a text is UTF-8 (JSON may escape a lone surrogate; not every ECMA-262 engine takes one in
a pattern), lengths in octets (a pattern counts characters, the same for ASCII), and
what depends on the moment (a time already past, a suppressed recipient: 422).
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from ..config import parse_duration
from ..smtp.addresses import MAX_LOCAL_PART, MAX_PATH, WS, either, mailbox_pattern
from ..submission import MAX_EXPIRY

WHITESPACE = string.whitespace  # ASCII white space, trimmed around an address: WS
CONTROL = r"\x00-\x1f\x7f-\x9f"  # C0, DEL, C1
# A text that becomes (part of) a header field: no control character, and no line or
# paragraph separator either (the email package folds at those).
TEXT_PATTERN = f"^[^{CONTROL}\\u2028\\u2029]*$"
TEXT_RULE = "no control character (C0, DEL, C1), no U+2028 or U+2029"
# What str.isspace() calls white space.
_SPACE = r"\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
NOT_BLANK_PATTERN = f"[^{_SPACE}]"  # searched: a character besides white space

# An Idempotency-Key: 1 to MAX_KEY_LENGTH characters, no control character, no space
# (nor zero-width one) at either end.
_KEY_SPACE = r"\x20\xa0\u1680\u2000-\u200b\u2028\u2029\u202f\u205f\u3000\ufeff"
KEY_PATTERN = f"^[^{CONTROL}{_KEY_SPACE}](?:[^{CONTROL}]*[^{CONTROL}{_KEY_SPACE}])?$"

# An address (the suppressions' {address}): RFC 5321 and 6531 (smtp/addresses.py), its
# octets bounded by characters counted as wide as the widest it holds, so that the pattern
# says it all (the listener counts the octets themselves: it may take a long address that
# mixes ASCII with wider characters, which the API does not).
BARE_ADDRESS_PATTERN = f"^{mailbox_pattern(widths=True)}$"
ADDRESS_RULE = (
    f"RFC 5321 and RFC 6531; a local part of at most {MAX_LOCAL_PART} and an address of at"
    f" most {MAX_PATH} characters, or 32 and 128 if one is beyond ASCII, 21 and 85 if one is"
    " beyond U+07FF, 16 and 64 if one is beyond U+FFFF (so never more octets of UTF-8 than"
    " RFC 5321 allows: 64 and 256)"
)
# "addr" or "Name <addr>" (from, to[]): white space around either, and around the addr
# inside the brackets, is dropped. The name is what comes before the last "<", quotes
# around it dropped: a text, white space at its ends aside.
MAX_ADDRESS_FIELD = 998  # characters: a line of RFC 5322 (and a bound on the pattern's work)
_NAME_CHAR = f"[^{CONTROL}\\u2028\\u2029]"
_NAME = f"[^{CONTROL}\\u2028\\u2029 ](?:{_NAME_CHAR}*[^{CONTROL}\\u2028\\u2029 ])?"
_IN_BRACKETS = mailbox_pattern(False, f"{WS}*>{WS}*$", widths=True)
_NAME_ADDR = rf"(?:{_NAME}{WS}*)?<{WS}*{_IN_BRACKETS}{WS}*>"
_BARE = mailbox_pattern(after=f"{WS}*$", widths=True)
ADDRESS_PATTERN = rf"^{WS}*{either(_BARE, _NAME_ADDR)}{WS}*$"

# Attachments: a MIME type (RFC 6838 names) or "" (guessed from the file name); base64
# content (RFC 4648 4, padded), white space anywhere in it.
MIME_TYPE_PATTERN = r"^(?:[A-Za-z0-9!#$&^_.+\-]+/[A-Za-z0-9!#$&^_.+\-]+)?$"
_B64, _W = "[A-Za-z0-9+/]", f"[{_SPACE}]*"
BASE64_PATTERN = (
    f"^{_W}(?:(?:{_B64}{_W}){{4}})*(?:(?:{_B64}{_W}){{2}}={_W}={_W}|(?:{_B64}{_W}){{3}}={_W})?$"
)
_BASE64_CHARS = re.compile("[A-Za-z0-9+/]*={0,2}")


def base64_text(content: str) -> str | None:
    """`content` without its white space if it is what BASE64_PATTERN allows, else None.
    The same language, checked without the pattern: Python's engine takes 14 s over the
    groups of a 25 MiB attachment, this 0.2 s."""
    text = "".join(content.split())  # str.isspace(): _SPACE
    return text if len(text) % 4 == 0 and _BASE64_CHARS.fullmatch(text) else None


# Header fields: an RFC 5322 field name, not one of ours (X-Mtaqueue-*: the request's own
# fields say those), nor, for a composed message, one the composing writes.
FIELD_NAME_PATTERN = r"^[!-9;-~]+$"
OURS = ("X-Mtaqueue-Class", "X-Mtaqueue-Expires", "X-Mtaqueue-Idempotency-Key")
COMPOSED = ("From", "To", "Subject", "MIME-Version", "Content-Type", "Content-Transfer-Encoding")


def caseless(names: Sequence[str]) -> str:
    """A pattern of `names`, in any case (no flag: JSON Schema has none)."""
    spelled = ("".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else c for c in n) for n in names)
    return f"^{either(*spelled)}$"


# Expiry ("expires") and a suppression's "for": seconds as a number, or a duration ("90",
# "15m", "4h", "7d", "250ms"); not zero, and at most about 3,000 years (10^11 seconds; a
# duration of at most 6 digits of days, 7 of hours, 9 of minutes, 11 of seconds or 14 of
# milliseconds before the point): a time past the year 9999 is none Python's datetime can
# write, in a DSN's Will-Retry-Until say. Or, for "expires", an RFC 3339 time with its
# offset: a valid date of the years 0001 to 9998 (leap years counted), no leap second. The
# time must be to come: 422 if it is past (a moment's matter, as a suppressed recipient is).
MAX_SECONDS = MAX_EXPIRY
_UNIT_DIGITS = {"ms": 14, "s?": 11, "m": 9, "h": 7, "d": 6}
DURATION_PATTERN = (
    "^(?![0.]*(?:ms|s|m|h|d)?$)"
    + either(*(rf"[0-9]{{1,{digits}}}(?:\.[0-9]+)?{unit}" for unit, digits in _UNIT_DIGITS.items()))
    + "$"
)
_LEAP = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = either(
    "(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])",
    "(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)",
    "02-(?:0[1-9]|1[0-9]|2[0-8])",
)
_DATE = either(f"(?!0000|9999)[0-9]{{4}}-{_MONTH_DAY}", f"{_LEAP}-02-29")
_CLOCK = "(?:[01][0-9]|2[0-3]):[0-5][0-9]"
TIME_PATTERN = rf"^{_DATE}[Tt ]{_CLOCK}:[0-5][0-9](?:\.[0-9]+)?(?:[Zz]|[+\-]{_CLOCK})$"
_DURATION, _TIME = re.compile(DURATION_PATTERN), re.compile(TIME_PATTERN)
SECONDS_SCHEMA = {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_SECONDS}
DURATION_SCHEMA = {"type": "string", "pattern": DURATION_PATTERN}


def seconds(value: object) -> float | None:
    """The seconds of a number or a duration as SECONDS_SCHEMA or DURATION_PATTERN
    allow; None if it is neither."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value) if 0 < value <= MAX_SECONDS else None
    if isinstance(value, str) and _DURATION.fullmatch(value):
        return parse_duration(value)
    return None


def rfc3339(value: str) -> float | None:
    """Epoch seconds of an RFC 3339 time as TIME_PATTERN allows; None if it is not one."""
    if not _TIME.fullmatch(value):
        return None
    return datetime.fromisoformat(value.upper()).timestamp()  # 3.11 reads no "t" or "z"


def expires_schema() -> dict[str, Any]:
    return {
        "anyOf": [SECONDS_SCHEMA, DURATION_SCHEMA, {"type": "string", "pattern": TIME_PATTERN}],
        "description": "give up after this: an RFC 3339 time to come (a past one is a 422),"
        ' a duration ("2h", "7d") or seconds from now',
    }


def submission_schemas(classes: Sequence[str] | None, max_recipients: int | None) -> dict:
    """The Attachment and Submission schemas; `classes` and `max_recipients` as the
    daemon's configuration has them (None: left open)."""
    text = {"type": "string", "pattern": TEXT_PATTERN, "description": TEXT_RULE}
    nullable = {"type": ["string", "null"]}
    address = {
        "type": "string",
        "maxLength": MAX_ADDRESS_FIELD,
        "pattern": ADDRESS_PATTERN,
        "description": f'"addr" or "Name <addr>" (the name: {TEXT_RULE}); {ADDRESS_RULE}',
    }
    to = {"type": "array", "items": address, "minItems": 1}
    if max_recipients is not None:
        to["maxItems"] = max_recipients
    return {
        "Attachment": {
            "type": "object",
            "required": ["filename", "content"],
            "properties": {
                "filename": text,
                "content": {
                    "type": "string",
                    "contentEncoding": "base64",
                    "pattern": BASE64_PATTERN,
                    "description": "base64, padded; white space anywhere in it",
                },
                "content_type": {
                    "type": "string",
                    "pattern": MIME_TYPE_PATTERN,
                    "description": 'type/subtype; "" = guessed from the file name',
                },
                "content_id": {
                    **text,
                    "description": f"set: an inline part, shown where the HTML says cid:...;"
                    f" {TEXT_RULE}",
                },
            },
            "additionalProperties": False,
        },
        "Submission": {
            "type": "object",
            "required": ["from", "to"],
            "properties": {
                "from": {
                    **address,
                    "description": f"the envelope sender: {address['description']}",
                },
                "to": to,
                "raw": {
                    **nullable,
                    "pattern": NOT_BLANK_PATTERN,
                    "description": "a whole RFC 5322 message (lines may end in LF), not blank;"
                    " instead of subject/text/html/attachments. X-Mtaqueue-* header fields in"
                    " it are honoured and removed, as over SMTP.",
                },
                "subject": {**text, "type": ["string", "null"]},
                "text": nullable,
                "html": nullable,
                "attachments": {
                    "type": "array",
                    "items": {"$ref": "#/components/schemas/Attachment"},
                },
                "class": ({"enum": [*classes, None]} if classes is not None else nullable)
                | {"description": "delivery class (p0, p1, p2, ...)"},
                "expires": {
                    **expires_schema(),
                    "anyOf": [*expires_schema()["anyOf"], {"type": "null"}],
                },
                "headers": {
                    "type": "object",
                    "propertyNames": {
                        "pattern": FIELD_NAME_PATTERN,
                        "not": {"pattern": caseless(OURS)},
                    },
                    "additionalProperties": text,
                    "description": "more header fields (Reply-To, List-Unsubscribe, ...), not"
                    f" {', '.join(OURS)} (the request's own fields say those)",
                },
            },
            "additionalProperties": False,
            "oneOf": [
                {
                    "required": ["raw"],
                    "properties": {
                        "raw": {"type": "string"},
                        **{name: {"type": "null"} for name in ("subject", "text", "html")},
                        "attachments": {"maxItems": 0},
                    },
                },
                {
                    "required": ["subject"],
                    "properties": {
                        "raw": {"type": "null"},
                        "subject": {"type": "string"},
                        "headers": {"propertyNames": {"not": {"pattern": caseless(COMPOSED)}}},
                    },
                    "anyOf": [
                        {"required": [name], "properties": {name: {"type": "string"}}}
                        for name in ("text", "html")
                    ],
                },
            ],
            "description": "Either raw, or subject with text and/or html (and attachments);"
            " null is as if left out. 422 for what depends on the moment: a suppressed"
            " recipient, an expires time already past.",
        },
    }
