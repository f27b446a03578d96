"""Relaxed canonicalisation (RFC 6376 3.4.2, 3.4.4): the header fields as signed, and the
SHA-256 of the body, fed in pieces of any size as it arrives.

The content is CRLF lines with no bare CR or LF: the listener and the API normalise line
endings before anything is stored.
"""

from __future__ import annotations

import hashlib
import re

_WSP_RUN = re.compile(rb"[ \t]+")


def relaxed_field(raw: bytes) -> bytes:
    """One field ("Name: value", folded or not, no final CRLF) as "name:value\\r\\n":
    the name lower-cased, the value unfolded, each run of WSP one space, none at either
    end of the value, none around the colon."""
    name, _, value = raw.partition(b":")
    value = _compress(value.replace(b"\r\n", b"")).strip(b" ")  # no bare CR or LF
    return name.rstrip(b" \t").lower() + b":" + value + b"\r\n"


class RelaxedBody:
    """The relaxed body's SHA-256: runs of WSP are one space, WSP at a line's end goes,
    empty lines at the end of the body go, and a body that is not empty ends with one
    CRLF. Fed the body (after the blank line that ends the header) in pieces."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self._partial = b""  # the last line, until its CRLF comes
        self._empty_lines = 0  # empty lines held back: the body may end after them

    def feed(self, data: bytes) -> None:
        data = self._partial + data
        cut = data.rfind(b"\r\n") + 2  # 1: no line ends here yet
        if cut == 1:
            self._partial = data
            return
        self._partial = data[cut:]
        self._lines(_compress(data[:cut]).replace(b" \r\n", b"\r\n"))

    def digest(self) -> bytes:
        """The body hash (bh=); the body ends here."""
        last = _compress(self._partial)
        if last:  # an unterminated last line is a line (dkimpy's reading: its WSP kept)
            self._lines(last + b"\r\n")
        self._partial = b""
        return self._hash.digest()

    def _lines(self, lines: bytes) -> None:
        """Canonical CRLF lines: hash them, but hold back the empty ones at their end."""
        kept = lines.rstrip(b"\r\n")  # whole CRLFs: there is no bare CR or LF
        trailing = (len(lines) - len(kept)) // 2
        if not kept:
            self._empty_lines += trailing
            return
        self._hash.update(b"\r\n" * self._empty_lines + kept + b"\r\n")
        self._empty_lines = trailing - 1


def _compress(data: bytes) -> bytes:
    """Each run of WSP one space (most text has none to change: no regex then)."""
    return _WSP_RUN.sub(b" ", data) if b"\t" in data or b"  " in data else data
