"""Message data as DATA receives it, made into the content we store (pure; no I/O).

The data is dot-stuffed and its lines end in CRLF or, from careless or hostile
clients, in a bare CR or LF. The stored content has CRLF line endings and no
stuffing dots. The same functions serve a message held whole and one read in
pieces (streamed): a piece never ends just after a CR (so never inside a CRLF), and
the two data octets before it are all the context it needs.

Header and body differ. In the body a bare CR or LF ends a line, as the client meant
it. In the header only an LF-only client ends lines with a bare LF; for any other a
bare CR or LF is inside a header line and becomes a space, as in Postfix, so
"Subject: hi<CR>X-Mtaqueue-Class: p0" cannot inject a header. An LF-only client is
one whose data has no CRLF (but the one before the final dot) within its first
`window` octets, and the header must end within the same window: both are known
before a streamed message is stored, whatever follows.

Positions below are offsets in `data`, the message data after a 2-octet CRLF
sentinel (which lets the first line look like any other).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

BARE_NEWLINE = re.compile(rb"\r(?!\n)|(?<!\r)\n")
_HEADER_END_LF = re.compile(rb"\n\r?\n")  # an empty line, lines ending in LF or CRLF

# Why a message is refused, in the order that decides between several reasons.
TOO_BIG = "552 5.3.4 Error: message too big for system"
BARE = "550 5.6.0 Error: bare <CR> or <LF> in message content (RFC 5321 2.3.8)"
NUL = "550 5.6.0 Error: NUL character in message content (RFC 5322 2.3)"


def header_too_big(window: int) -> str:
    return f"552 5.6.0 Error: message header over {window} octets (no empty line ends it)"


def line_too_long(limit: int) -> str:
    return f"550 5.6.0 Error: message has a line over {limit} characters"


def has_bare_newline(raw: bytes) -> bool:
    return not raw.count(b"\n") == raw.count(b"\r\n") == raw.count(b"\r")


def uses_crlf(data: bytes | bytearray, window: int, complete: bool) -> bool | None:
    """Does the client end lines with CRLF (else: bare LF)? None: not known yet.

    `complete`: `data` ends with the CRLF before the final dot; otherwise the final dot
    is known not to be in it."""
    if complete:
        return data.find(b"\r\n", 2, 2 + min(len(data) - 4, window)) >= 0
    at = data.find(b"\r\n", 2, 2 + window)
    if at >= 0:
        # Not the CRLF before the final dot (the dot would have been found): it counts.
        return True if at + 5 <= len(data) else None
    # None in the window (all here): whatever comes, the CRLF that counts is not there.
    return False if len(data) >= window + 2 else None


def header_end(data: bytes | bytearray, crlf: bool, window: int) -> int:
    """Where the empty line that ends the header starts, if it is within the first
    `window` octets of message data; else -1."""
    if crlf:
        at = data.find(b"\r\n\r\n", 0, window + 2)
        return at if at < 0 else at + 2
    match = _HEADER_END_LF.search(data, 1, window + 2)
    return -1 if match is None else match.start() + 1


def unstuff(text: bytes, line_start: bool) -> bytes:
    """Remove the dot that starts each line of CRLF-only `text` (RFC 5321 4.5.2)."""
    if line_start and text[:1] == b".":
        text = text[1:]
    return text.replace(b"\r\n.", b"\r\n")


def body(raw: bytes, line_start: bool) -> bytes:
    """Body data: each bare CR or LF ends a line (becomes CRLF), then dots are unstuffed."""
    if has_bare_newline(raw):
        raw = BARE_NEWLINE.sub(b"\r\n", raw)
    return unstuff(raw, line_start)


def header(raw: bytes, crlf: bool, line_start: bool) -> bytes:
    """Header data: CRLF lines (LF lines for an LF-only client), any other CR or LF a space."""
    if crlf:
        raw = BARE_NEWLINE.sub(b" ", raw)
    else:
        raw = raw.replace(b"\r\n", b"\n").replace(b"\r", b" ").replace(b"\n", b"\r\n")
    return unstuff(raw, line_start)


def has_line_over(content: bytes, limit: int, start: int = 0, end: int | None = None) -> bool:
    """Does a line of CRLF-terminated content[start:end] have more than `limit` octets
    before its CRLF?"""
    end = len(content) if end is None else end
    # Each step skips to the last line end within reach: a few steps for any message.
    while end - start > limit + 2:
        newline = content.rfind(b"\n", start, start + limit + 2)
        if newline < 0:
            return True
        start = newline + 1
    return False


def line_tail(content: bytes, limit: int, tail: int) -> int:
    """The length of the unfinished last line once `content` (CRLF lines, never ending
    in a CR) follows an unfinished line of `tail` octets; -1 if a line is over `limit`."""
    first = content.find(b"\n")
    if first < 0:
        tail += len(content)
    else:
        last = content.rfind(b"\n")
        # The first line ends in this piece, its CR just before the LF.
        if tail + first - 1 > limit or has_line_over(content, limit, first + 1, last + 1):
            return -1
        tail = len(content) - last - 1
    return tail if tail <= limit else -1


@dataclass(frozen=True, slots=True)
class Limits:
    max_size: int  # octets of content
    max_line: int  # octets of a line, without its CRLF
    window: int  # see the module docstring: the header must end within it
    reject: bool  # bare_newline = "reject": refuse bare CR/LF and NUL

    @property
    def max_raw(self) -> int:
        # Dot-stuffing adds at most a third (".\r\n" -> "..\r\n"): data over this is
        # too big whatever it holds, and need not even be looked at.
        return self.max_size * 4 // 3 + 8


def refusal(
    limits: Limits,
    *,
    overflow: bool = False,
    bare: bool = False,
    too_big: bool = False,
    header_over: bool = False,
    nul: bool = False,
    long_line: bool = False,
) -> str | None:
    """The reply for what was found wrong with a message (None: nothing), one order for
    a message held whole and one read in pieces."""
    if overflow:
        return TOO_BIG
    if bare:
        return BARE
    if too_big:
        return TOO_BIG
    if header_over:
        return header_too_big(limits.window)
    if nul:
        return NUL
    if long_line:
        return line_too_long(limits.max_line)
    return None


def whole(raw: bytes, limits: Limits) -> tuple[bytes, str | None]:
    """A message given whole and not dot-stuffed (the HTTP API's raw message): its content,
    with lines that end in LF or CRLF made CRLF lines (in the header a lone CR becomes a
    space, as from an LF-only client), and the reply refusing it, or None."""
    data = b"\n" + raw  # a sentinel line end, so that an empty first line ends the header
    end = _HEADER_END_LF.search(data, 0, limits.window + 2)
    split = len(data) if end is None else end.start() + 1
    head = data[1:split].replace(b"\r\n", b"\n").replace(b"\r", b" ").replace(b"\n", b"\r\n")
    rest = data[split:]
    content = head + (BARE_NEWLINE.sub(b"\r\n", rest) if has_bare_newline(rest) else rest)
    if not content.endswith(b"\r\n"):
        content += b"\r\n"  # SMTP can only send whole lines
    return content, refusal(
        limits,
        too_big=len(content) > limits.max_size,
        header_over=end is None and len(raw) > limits.window,
        nul=limits.reject and b"\0" in content,
        long_line=has_line_over(content, limits.max_line),
    )


class Pieces:
    """A message read in consecutive pieces: their content, and the checks a message
    held whole gets, with the same outcome (`refusal()`).

    Once the outcome is a refusal, pieces yield nothing (there is nothing to store) but
    are still counted, as far as a reason that comes first in the order may still arise.
    """

    def __init__(self, limits: Limits, crlf: bool) -> None:
        self.limits = limits
        self.crlf = crlf
        self.raw = 0  # octets of data taken
        self.size = 0  # octets of content made
        self.line = 0  # octets of the unfinished last line
        self.overflow = self.bare = self.too_big = False
        self.header_over = self.nul = self.long_line = False

    @property
    def refused(self) -> bool:
        return (
            self.overflow
            or self.bare
            or self.too_big
            or self.header_over
            or self.nul
            or self.long_line
        )

    def refusal(self) -> str | None:
        return refusal(
            self.limits,
            overflow=self.overflow,
            bare=self.bare,
            too_big=self.too_big,
            header_over=self.header_over,
            nul=self.nul,
            long_line=self.long_line,
        )

    def take(self, raw: bytes, before: bytes, in_header: bool) -> bytes:
        """The content of the next piece of data, `raw`, which follows the two data octets
        `before`; b"" once the message is refused."""
        limits = self.limits
        self.raw += len(raw)
        self.overflow = self.overflow or self.raw > limits.max_raw
        if limits.reject and not self.bare:
            self.bare = has_bare_newline(raw)
        if self.overflow or self.bare or self.too_big:
            return b""  # only these can still change the answer: no content is made
        if limits.reject:
            content = unstuff(raw, before[1:] == b"\n")  # it has no bare CR or LF
        elif in_header:
            start = before == b"\r\n" if self.crlf else before[1:] == b"\n"
            content = header(raw, self.crlf, start)
        else:
            content = body(raw, before[1:] == b"\n")  # a piece never starts after a CR
        self.size += len(content)
        self.too_big = self.size > limits.max_size
        if limits.reject and not self.nul:
            self.nul = b"\0" in content
        if not self.refused:
            self.line = line_tail(content, limits.max_line, self.line)
            self.long_line = self.line < 0
        return b"" if self.refused else content
