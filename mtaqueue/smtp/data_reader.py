"""One message's data, read up to the final dot (sans-IO): `DataReader`, `Refused`.

`DataReader.begin(envelope, helo, esmtp, user)` when DATA is accepted; then `read(buf)`
takes all the input in `buf` and answers with what the session does next:

- None: more input is needed;
- `Stream` or `Write`: a piece of a message too large to hold, to store; `cannot_store
  (reply)` if it could not be (the rest is then read and dropped, and `reply` given);
- at the final dot, with what followed it left in `buf`: `Submit` (a message held whole)
  or `Finish` (the end of a streamed one) to commit, or `Refused` with the reply.

A message is held whole unless its data grows past `stream_threshold`: then it is handed
on in pieces of about `STREAM_PIECE` octets as it arrives, and the reader keeps only a few
octets of it (and its header, until the header ends), so the memory it takes is bounded.
Both ways the content and the refusals are the same (see content.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..transaction import Envelope, Stream, Submit
from . import content as data_
from .actions import Finish, Write
from .content import Limits, Pieces

STREAM_PIECE = 128 << 10  # a streamed message is handed on once this much data is in


@dataclass(frozen=True, slots=True)
class Refused:
    """The message ended and is not taken: `reply` for the client; `client_error` unless
    the I/O layer could not store it."""

    reply: str
    client_error: bool = True


class DataReader:
    def __init__(self, limits: Limits, stream_threshold: int | None) -> None:
        self._limits = limits
        self._stream_threshold = stream_threshold
        # The message data being read: a 2-octet context (at first a CRLF sentinel), then
        # what has not been handed on yet.
        self._data = bytearray()
        self._data_scan = 0
        self._data_overflow = False
        self._stream_from: int | None = None  # data octets from which to try streaming
        self._pieces: Pieces | None = None  # set while the message is streamed
        self._storing = False  # the I/O layer stores the streamed message
        self._io_refusal: str | None = None  # its reply for a message it could not store
        # The transaction the message is for, to hand on with it.
        self._envelope = Envelope()
        self._helo = ""
        self._esmtp = False
        self._user: str | None = None

    @property
    def streaming(self) -> bool:
        return self._pieces is not None

    def begin(self, envelope: Envelope, helo: str, esmtp: bool, user: str | None) -> None:
        self._envelope, self._helo, self._esmtp, self._user = envelope, helo, esmtp, user
        self._data = bytearray(b"\r\n")
        self._stream_from = self._stream_threshold

    def cannot_store(self, reply: str) -> None:
        """The I/O layer cannot store the streamed message: read the rest, then answer this."""
        self._storing, self._io_refusal = False, reply

    def read(self, buf: bytearray) -> Stream | Write | Submit | Finish | Refused | None:
        """Collect message data up to <CRLF>.<CRLF> (see the module's docstring)."""
        data = self._data
        data += buf
        buf.clear()
        end = data.find(b"\r\n.\r\n", self._data_scan)
        if end < 0:
            self._data_scan = max(0, len(data) - 4)
            if self._pieces is not None:
                if len(data) - 2 >= STREAM_PIECE:
                    return self._stream_piece(data, _cut_point(data))
            elif self._data_overflow or len(data) - 4 > self._limits.max_raw:
                # Too big: keep reading to the end, but keep nothing but the tail.
                self._data_overflow = True
                del data[:-4]
                self._data_scan = 0
            elif self._stream_from is not None and len(data) - 2 >= self._stream_from:
                return self._start_stream(data)
            return None
        buf[:0] = data[end + 5 :]
        pieces, storing, io_refusal = self._pieces, self._storing, self._io_refusal
        # The content is what lies between the context and the final ".\r\n".
        if pieces is None:
            overflow = self._data_overflow or end > self._limits.max_raw
            stuffed = bytes(data[: end + 2])
            self._end_data()
            return self._finish_data(stuffed, overflow)
        last = pieces.take(bytes(data[2 : end + 2]), bytes(data[:2]), pieces.header_over)
        self._end_data()
        return _finish_stream(pieces, last, storing, io_refusal)

    def _end_data(self) -> None:
        self._data = bytearray()
        self._data_scan = 0
        self._data_overflow = False
        self._stream_from = self._pieces = self._io_refusal = None
        self._storing = False

    def _finish_data(self, stuffed: bytes, overflow: bool) -> Submit | Refused:
        """A message held whole: `stuffed` is its data after the CRLF sentinel."""
        limits = self._limits
        window = limits.window
        refusal = None
        if overflow:
            refusal = data_.TOO_BIG
        elif not data_.has_bare_newline(stuffed):  # CRLF only: the fast path
            content = stuffed.replace(b"\r\n.", b"\r\n")[2:]
            header_over = len(stuffed) - 2 > window and data_.header_end(stuffed, True, window) < 0
        elif limits.reject:
            refusal = data_.BARE
        else:
            content, header_over = _normalize(stuffed, window)
        if refusal is None:
            refusal = data_.refusal(
                limits,
                too_big=len(content) > limits.max_size,
                header_over=header_over,
                nul=limits.reject and b"\0" in content,
                long_line=data_.has_line_over(content, limits.max_line),
            )
        if refusal is not None:
            return Refused(refusal)
        return Submit(self._envelope, content, self._helo, self._esmtp, self._user)

    def _start_stream(self, data: bytearray) -> Stream | None:
        """Past the threshold: once the client's line ending and the end of the header are
        known, hand the header on and go on in pieces."""
        window = self._limits.window
        crlf = data_.uses_crlf(data, window, complete=False)
        split = -1 if crlf is None else data_.header_end(data, crlf, window)
        cut = _cut_point(data)
        header_over = crlf is not None and split < 0 and len(data) >= window + 5
        if crlf is None or (split < 0 and not header_over) or split > cut:
            # Not known yet. Look again once the data has grown by an eighth: searching
            # it again on every small read would cost time quadratic in its length.
            self._stream_from = len(data) - 2 + len(data) // 8 + 1
            return None
        pieces = self._pieces = Pieces(self._limits, crlf)
        if header_over:  # refused: the data is only counted, all of it as header
            pieces.header_over = True
            pieces.take(bytes(data[2:cut]), bytes(data[:2]), True)
            self._cut(data, cut)
            return None
        header = pieces.take(bytes(data[2:split]), bytes(data[:2]), True)
        first = pieces.take(bytes(data[split:cut]), bytes(data[split - 2 : split]), False)
        self._cut(data, cut)
        if pieces.refused:
            return None
        self._storing = True
        return Stream(self._envelope, header, first, self._helo, self._esmtp, self._user)

    def _stream_piece(self, data: bytearray, cut: int) -> Write | None:
        pieces = self._pieces
        assert pieces is not None
        content = pieces.take(bytes(data[2:cut]), bytes(data[:2]), pieces.header_over)
        self._cut(data, cut)
        return Write(content) if content and self._storing else None

    def _cut(self, data: bytearray, cut: int) -> None:
        """Drop the data before `cut` (handed on), but the two octets of context."""
        del data[: cut - 2]
        self._data_scan = max(0, len(data) - 4)


def _finish_stream(
    pieces: Pieces, last: bytes, storing: bool, io_refusal: str | None
) -> Finish | Refused:
    refusal = pieces.refusal()
    if storing:
        return Finish(last, refusal)
    if refusal is not None:
        return Refused(refusal)
    # The I/O layer could not store it; what it said, as for a Submit.
    assert io_refusal is not None
    return Refused(io_refusal, client_error=False)


def _normalize(stuffed: bytes, window: int) -> tuple[bytes, bool]:
    """bare_newline = "normalize": the content of data with bare CR or LF (see content.py),
    and whether its header is too long to end within the window."""
    crlf = data_.uses_crlf(stuffed, window, complete=True)
    assert crlf is not None
    split = data_.header_end(stuffed, crlf, window)
    if split < 0:  # all header
        return data_.header(stuffed[2:], crlf, True), len(stuffed) - 2 > window
    header = data_.header(stuffed[2:split], crlf, True)
    return header + data_.body(stuffed[split:], True), False


def _cut_point(data: bytearray) -> int:
    """Where to cut the data read so far into a piece: the final dot may still start at
    the last 2 octets kept as context (any earlier one would have been found), and a
    piece must not end just after a CR, which may be half a CRLF."""
    cut = len(data) - 2
    return cut - 1 if data[cut - 1] == 0x0D else cut
