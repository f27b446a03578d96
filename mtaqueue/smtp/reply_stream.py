"""An SMTP client session's transport once the handshake is over: writes, and replies in order.

    ReplyStream.take_over(transport) -> ReplyStream   it receives what arrives from now on
    .write(data)                      queue bytes (a pipelined group is one write)
    await .reply(timeout) -> (code, text)   the next reply; raises StreamError
    .buffered -> bool                 bytes or replies have arrived that nobody asked for
    .written  .flushed  .arrived      when the last write went (all of it handed to the
                                      kernel?) and when the last reply read had arrived
    .open -> bool / .close()

aiosmtplib connects, greets, says EHLO, STARTTLS and AUTH for us (TLS and its errors are
what it does well); but its protocol keeps one reply at a time and drops bytes that arrive
while no command is pending, so a server's answers to a pipelined group (RFC 2920), which
arrive together, would be lost. This protocol takes the transport over after the handshake
and keeps every complete reply in a queue, so each command's reply is read in turn.

The parser is strict: a line is "ddd" followed by " " (the last line), "-" (more follow)
or the end of the line; every line of a reply has the same code. Anything else is a
protocol error, as is a line over MAX_LINE octets or a reply over MAX_REPLY.
"""

from __future__ import annotations

import asyncio
import collections
import time

MAX_LINE = 8192
MAX_REPLY = 4 * MAX_LINE


class StreamError(Exception):
    """No reply: `event` is "timeout", "lost" or "protocol"; the text says what happened."""

    def __init__(self, event: str, text: str) -> None:
        super().__init__(text)
        self.event = event


class ReplyStream(asyncio.Protocol):
    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._lines: list[tuple[int, bytes]] = []  # of the reply being read
        self._size = 0
        self._replies: collections.deque[tuple[int, str, float]] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._ended: StreamError | None = None
        # Monotonic seconds, for timing replies (policy/latency.py).
        self.written = 0.0
        self.flushed = True  # the last write went to the kernel whole (not queued here)
        self.arrived = 0.0

    @classmethod
    def take_over(cls, transport: asyncio.Transport) -> ReplyStream:
        stream = cls()
        stream._transport = transport
        transport.set_protocol(stream)
        return stream

    # -- asyncio.Protocol ----------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._ended is not None:
            return
        self._buffer += data
        try:
            self._parse(time.monotonic())
        except StreamError as exc:
            self._end(exc)
            self.close()
        self._wake()

    def eof_received(self) -> bool:
        self._end(StreamError("lost", "the server closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        why = f": {exc}" if exc is not None else ""
        self._end(StreamError("lost", f"connection lost{why}"))
        self._transport = None

    # -- for the client ------------------------------------------------------------------

    @property
    def open(self) -> bool:
        return (
            self._transport is not None and not self._transport.is_closing() and self._ended is None
        )

    @property
    def buffered(self) -> bool:
        """Bytes that nobody asked for came: a reply, part of one, or garbage."""
        garbage = self._ended is not None and self._ended.event == "protocol"
        return bool(self._buffer or self._replies) or garbage

    def write(self, data: bytes) -> None:
        if not self.open:
            raise StreamError("lost", "connection lost before the command was sent")
        assert self._transport is not None
        self.written = time.monotonic()  # (before: a reply may come before write returns)
        self._transport.write(data)
        self.flushed = not self._transport.get_write_buffer_size()

    async def reply(self, timeout: float) -> tuple[int, str]:
        """The next reply; the replies that came before an end are read first."""
        if not self._replies and self._ended is None:
            # A timer of our own, not asyncio.wait_for (a task's worth of futures and
            # callbacks per reply, four replies a message).
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(timeout, _expire, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        if self._replies:
            code, text, self.arrived = self._replies.popleft()
            return code, text
        assert self._ended is not None
        raise self._ended

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # -- parsing -------------------------------------------------------------------------

    def _parse(self, at: float) -> None:
        while True:
            end = self._buffer.find(b"\n")
            if end < 0:
                if len(self._buffer) > MAX_LINE:
                    raise StreamError("protocol", f"a reply line over {MAX_LINE} octets")
                return
            line = bytes(self._buffer[: end + 1])
            del self._buffer[: end + 1]
            if len(line) > MAX_LINE:
                raise StreamError("protocol", f"a reply line over {MAX_LINE} octets")
            text = line.rstrip(b"\r\n")
            head, sep = text[:3], text[3:4]
            if len(head) != 3 or not head.isdigit() or sep not in (b"", b" ", b"-"):
                shown = text[:80].decode("utf-8", "replace")
                raise StreamError("protocol", f"protocol error: not an SMTP reply: {shown!r}")
            code = int(head)
            if self._lines and self._lines[0][0] != code:
                raise StreamError("protocol", "protocol error: a reply's lines differ in code")
            self._size += len(line)
            if self._size > MAX_REPLY:
                raise StreamError("protocol", f"a reply over {MAX_REPLY} octets")
            self._lines.append((code, text[4:].strip(b" \t")))
            if sep != b"-":
                message = b"\n".join(part for _, part in self._lines)
                text = message.decode("utf-8", "surrogateescape")
                self._replies.append((code, text, at))
                self._lines, self._size = [], 0

    def _end(self, error: StreamError) -> None:
        if self._ended is None:
            self._ended = error
            self._wake()

    def _wake(self) -> None:
        ready = self._replies or self._ended is not None
        if self._waiter is not None and not self._waiter.done() and ready:
            self._waiter.set_result(None)


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(StreamError("timeout", "no reply in time"))
