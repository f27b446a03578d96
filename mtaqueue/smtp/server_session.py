"""One SMTP server conversation, sans-IO (in the manner of h11).

`ServerSession` takes the bytes a client sent and produces the bytes to answer,
plus at most one `Action` at a time that needs I/O (commit the message, check a
password, start TLS). While an action is pending, further pipelined input waits
in the buffer; the I/O layer calls `resume()` with the outcome.

A message is held whole and committed with one `Submit`, unless its data grows
past `stream_threshold`: then it is handed on in pieces as it arrives (`Stream`,
`Write`..., `Finish`), and the session keeps only a few octets of it (and its
header, until the header ends), so the memory a session takes is bounded.

We write this instead of using aiosmtpd's server: the listener is the product's
hot path (see bench/RESULTS.md), and RFC 3461 parameters, per-recipient DSN
options, case-exact ENVID, bare-newline policy and limits all needed overriding
anyway. aiosmtpd still serves as the test and benchmark peers.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..model import Recipient
from ..transaction import Envelope, Stream, Submit
from . import content as data_
from .addresses import ATOM, AddressError, check_mailbox, split_path, xtext_decode
from .content import Limits, Pieces

MAX_COMMAND_LINE = 2048  # RFC 5321 allows 512, plus room for DSN parameters
MAX_ERRORS = 20  # replies with an error before we hang up on a confused client
STREAM_PIECE = 128 << 10  # a streamed message is handed on once this much data is in
_NOTIFY_VALUES = frozenset({"SUCCESS", "FAILURE", "DELAY"})
_T = TypeVar("_T")
_OVERLONG = "\x00overlong"  # _take_line's marker for a line that was too long


@dataclass(frozen=True, slots=True)
class SessionSettings:
    hostname: str
    max_message_size: int
    max_recipients: int
    bare_newline: str = "normalize"  # or "reject"
    max_line_length: int = 1 << 20  # listen.max_line_length, octets without the CRLF
    stream_threshold: int | None = None  # spool.stream_threshold; None: hold every message
    # The header must end within this many octets of data; an LF-only client is known by
    # its first this many (see content.py).
    max_header_size: int = 1 << 20
    tls_available: bool = False
    auth_available: bool = False
    auth_required: bool = False


def content_limits(settings: SessionSettings) -> Limits:
    """What a message's content may be: the listener's limits, the HTTP API's too."""
    return Limits(
        settings.max_message_size,
        settings.max_line_length,
        settings.max_header_size,
        settings.bare_newline == "reject",
    )


@dataclass(frozen=True, slots=True)
class Write:
    """More content of the message begun with `Stream`; resume() as for it."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Finish:
    """The end of the message begun with `Stream`: its last content, then commit it, or
    drop what was stored if `refusal` says why it is refused. resume() with the reply."""

    data: bytes
    refusal: str | None


@dataclass(frozen=True, slots=True)
class CheckCredentials:
    """Verify a password; resume() with the user name, or None if it is wrong."""

    user: str
    password: str


@dataclass(frozen=True, slots=True)
class StartTLS:
    """Upgrade the connection; resume() once the handshake is done (or None if it failed)."""


Action = Submit | Stream | Write | Finish | CheckCredentials | StartTLS

# Session states.
_COMMAND, _DATA, _AUTH_PLAIN, _AUTH_USER, _AUTH_PASS, _WAIT, _CLOSED = range(7)


class ServerSession:
    def __init__(
        self,
        settings: SessionSettings,
        *,
        may_relay: bool,
        storage_refusal: Callable[[], str | None] | None = None,
        rcpt_check: Callable[[str], str | None] | None = None,
    ) -> None:
        self.settings = settings
        self.may_relay = may_relay  # client address is in listen.mynetworks
        self._storage_refusal = storage_refusal or (lambda: None)  # a reply, or None
        self._rcpt_check = rcpt_check or (lambda address: None)  # a refusal reply, or None
        self.tls = False
        self.user: str | None = None
        self.helo = ""
        self.esmtp = False
        self.envelope: Envelope | None = None
        self.closed = False
        # Command lines and messages read so far: the listener's deadline restarts when
        # this moves, so a client must finish each one in time, not merely send a byte.
        self.completed = 0
        self._state = _COMMAND
        self._buf = bytearray()
        self._out: list[str] = []
        self._errors = 0
        self._discarding = False  # skipping the rest of an overlong command line
        self._limits = content_limits(settings)
        # The message data being read: a 2-octet context (at first a CRLF sentinel), then
        # what has not been handed on yet.
        self._data = bytearray()
        self._data_scan = 0
        self._data_overflow = False
        self._stream_from: int | None = None  # data octets from which to try streaming
        self._pieces: Pieces | None = None  # set while the message is streamed
        self._storing = False  # the I/O layer stores the streamed message
        self._io_refusal: str | None = None  # its reply for a message it could not store
        self._auth_user = ""
        self._pending: Action | None = None

    # -- I/O facing API -------------------------------------------------

    def greeting(self) -> bytes:
        return f"220 {self.settings.hostname} ESMTP mtaqueue\r\n".encode()

    def receive(self, data: bytes) -> Action | None:
        """Feed bytes from the client; returns an action to perform, if any."""
        if self._state == _CLOSED:
            return None
        self._buf += data
        if self._state == _WAIT:  # pipelined input waits for the pending action
            return None
        return self._advance()

    def resume(self, outcome) -> Action | None:
        """Report the outcome of the pending action and continue with buffered input."""
        action, self._pending = self._pending, None
        if isinstance(action, Stream | Write):
            self._state = _DATA
            if outcome is not None:  # it cannot be stored: read the rest, then answer this
                self._storing, self._io_refusal = False, outcome
            return self._advance()
        self._state = _COMMAND
        if isinstance(action, Submit):
            self._reply(outcome)
            self.envelope = None
        elif isinstance(action, Finish):
            (self._reply if action.refusal is None else self._error)(outcome)
            self.envelope = None
        elif isinstance(action, CheckCredentials):
            if outcome:
                self.user = outcome
                self._reply("235 2.7.0 Authentication successful")
            else:
                self._error("535 5.7.8 Authentication credentials invalid")
        elif isinstance(action, StartTLS):
            if not outcome:
                self._close()
                return None
            # RFC 3207 4.2: forget everything learned before the handshake.
            self.tls = True
            self.helo, self.esmtp, self.envelope, self.user = "", False, None, None
        return self._advance()

    def take_output(self) -> bytes:
        out = self._out
        if not out:
            return b""
        self._out = []
        return ("\r\n".join(out) + "\r\n").encode("utf-8", "surrogateescape")

    def timeout(self) -> None:
        self._reply(f"421 4.4.2 {self.settings.hostname} Error: timeout exceeded")
        self._close()

    def shutting_down(self) -> None:
        self._reply(f"421 4.3.2 {self.settings.hostname} Service shutting down, try again later")
        self._close()

    @property
    def busy(self) -> bool:
        """In the middle of a message (DATA or its commit): not to be cut off lightly."""
        return self._state == _DATA or self._state == _WAIT

    @property
    def in_data(self) -> bool:
        """Reading message data (a streamed message's pending piece included)."""
        return self._state == _DATA or isinstance(self._pending, Stream | Write)

    @property
    def streaming(self) -> bool:
        return self._pieces is not None

    @property
    def buffered(self) -> int:
        return len(self._buf)

    # -- input processing -----------------------------------------------

    def _advance(self) -> Action | None:
        while self._state not in (_WAIT, _CLOSED):
            if self._state == _DATA:
                if not self._take_data():
                    break
                self.completed += 1
                continue
            line = self._take_line()
            if line is None:
                return None
            self.completed += 1
            if line is _OVERLONG:
                self._error("500 5.5.2 Error: command line too long")
            elif self._state == _COMMAND:
                self._command(line)
            else:
                self._auth_line(line)
        if self._state == _WAIT:
            return self._pending
        return None

    def _take_line(self) -> str | None:
        buf = self._buf
        end = buf.find(b"\n")
        if end < 0:
            if len(buf) > MAX_COMMAND_LINE:
                self._discarding = True
                buf.clear()
            return None
        raw = bytes(buf[:end])
        del buf[: end + 1]
        if self._discarding or end >= MAX_COMMAND_LINE:
            self._discarding = False
            return _OVERLONG
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        return raw.decode("utf-8", "surrogateescape")

    def _take_data(self) -> bool:
        """Collect message data up to <CRLF>.<CRLF>; False when more input is needed (or
        a piece of a streamed message waits to be stored)."""
        data = self._data
        data += self._buf
        self._buf.clear()
        end = data.find(b"\r\n.\r\n", self._data_scan)
        if end < 0:
            self._data_scan = max(0, len(data) - 4)
            if self._pieces is not None:
                if len(data) - 2 >= STREAM_PIECE:
                    self._stream_piece(data, _cut_point(data))
            elif self._data_overflow or len(data) - 4 > self._limits.max_raw:
                # Too big: keep reading to the end, but keep nothing but the tail.
                self._data_overflow = True
                del data[:-4]
                self._data_scan = 0
            elif self._stream_from is not None and len(data) - 2 >= self._stream_from:
                self._start_stream(data)
            return False
        self._buf[:0] = data[end + 5 :]
        self._state = _COMMAND
        pieces, storing, io_refusal = self._pieces, self._storing, self._io_refusal
        # The content is what lies between the context and the final ".\r\n".
        if pieces is None:
            overflow = self._data_overflow or end > self._limits.max_raw
            stuffed = bytes(data[: end + 2])
            self._end_data()
            self._finish_data(stuffed, overflow)
        else:
            last = pieces.take(bytes(data[2 : end + 2]), bytes(data[:2]), pieces.header_over)
            self._end_data()
            self._finish_stream(pieces, last, storing, io_refusal)
        return True

    def _end_data(self) -> None:
        self._data = bytearray()
        self._data_scan = 0
        self._data_overflow = False
        self._stream_from = self._pieces = self._io_refusal = None
        self._storing = False

    def _finish_data(self, stuffed: bytes, overflow: bool) -> None:
        """A message held whole: `stuffed` is its data after the CRLF sentinel."""
        envelope = self.envelope
        assert envelope is not None
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
            self.envelope = None
            self._error(refusal)
            return
        self._wait(Submit(envelope, content, self.helo, self.esmtp, self.user))

    def _start_stream(self, data: bytearray) -> None:
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
            return
        pieces = self._pieces = Pieces(self._limits, crlf)
        if header_over:  # refused: the data is only counted, all of it as header
            pieces.header_over = True
            pieces.take(bytes(data[2:cut]), bytes(data[:2]), True)
            self._cut(data, cut)
            return
        header = pieces.take(bytes(data[2:split]), bytes(data[:2]), True)
        first = pieces.take(bytes(data[split:cut]), bytes(data[split - 2 : split]), False)
        self._cut(data, cut)
        if not pieces.refused:
            assert self.envelope is not None
            self._storing = True
            self._wait(Stream(self.envelope, header, first, self.helo, self.esmtp, self.user))

    def _stream_piece(self, data: bytearray, cut: int) -> None:
        pieces = self._pieces
        assert pieces is not None
        content = pieces.take(bytes(data[2:cut]), bytes(data[:2]), pieces.header_over)
        self._cut(data, cut)
        if content and self._storing:
            self._wait(Write(content))

    def _cut(self, data: bytearray, cut: int) -> None:
        """Drop the data before `cut` (handed on), but the two octets of context."""
        del data[: cut - 2]
        self._data_scan = max(0, len(data) - 4)

    def _finish_stream(
        self, pieces: Pieces, last: bytes, storing: bool, io_refusal: str | None
    ) -> None:
        refusal = pieces.refusal()
        if storing:
            self._wait(Finish(last, refusal))
            return
        self.envelope = None
        if refusal is not None:
            self._error(refusal)
        else:  # the I/O layer could not store it; what it said, as for a Submit
            assert io_refusal is not None
            self._reply(io_refusal)

    # -- commands ---------------------------------------------------------

    def _command(self, line: str) -> None:
        verb, _, arg = line.partition(" ")
        handler = _COMMANDS.get(verb.upper())
        if handler is None:
            self._error("502 5.5.1 Error: command not recognized")
            return
        handler(self, arg.strip())

    def _ehlo(self, arg: str) -> None:
        self._helo(arg, esmtp=True)

    def _helo(self, arg: str, esmtp: bool = False) -> None:
        if not arg or not arg.isprintable():
            self._error(f"501 5.5.4 Syntax: {'EHLO' if esmtp else 'HELO'} hostname")
            return
        self.helo, self.esmtp, self.envelope = arg, esmtp, None
        s = self.settings
        if not esmtp:
            self._reply(f"250 {s.hostname}")
            return
        lines = [s.hostname, "PIPELINING", f"SIZE {s.max_message_size}", "8BITMIME", "SMTPUTF8"]
        lines += ["DSN", "ENHANCEDSTATUSCODES"]
        if s.tls_available and not self.tls:
            lines.append("STARTTLS")
        if s.auth_available and self.tls:
            lines.append("AUTH PLAIN LOGIN")
        self._reply("\r\n".join(f"250-{x}" for x in lines[:-1]) + f"\r\n250 {lines[-1]}")

    def _mail(self, arg: str) -> None:
        if not self.helo:
            self._error("503 5.5.1 Error: send HELO/EHLO first")
            return
        if self.envelope is not None:
            self._error("503 5.5.1 Error: nested MAIL command")
            return
        if self.settings.auth_required and self.user is None:
            self._error("530 5.7.0 Authentication required")
            return
        envelope = self._path(
            arg, "FROM:", "MAIL FROM:<address>", "501 5.1.7 Bad sender", self._mail_path
        )
        if envelope is None:
            return
        refusal = self._storage_refusal()  # disk low (452 4.3.1), writer restarting (451 4.3.0)
        if refusal:
            self._error(refusal)
            return
        self.envelope = envelope
        self._reply("250 2.1.0 Ok")

    def _path(
        self, arg: str, keyword: str, syntax: str, bad: str, parse: Callable[[str, str], _T]
    ) -> _T | None:
        """MAIL's or RCPT's path and parameters, as `parse` takes them; None once refused."""
        rest = _strip_keyword(arg, keyword)
        if rest is None:
            self._error(f"501 5.5.4 Syntax: {syntax}")
            return None
        try:
            return parse(*split_path(rest))
        except AddressError as exc:
            self._error(f"{bad} address syntax: {exc}")
        except _ParamError as exc:
            self._error(str(exc))
        return None

    def _mail_path(self, sender: str, params: str) -> Envelope:
        envelope = Envelope(sender=sender)
        self._mail_params(envelope, params)
        if sender:
            check_mailbox(sender, utf8=envelope.smtputf8)
        return envelope

    def _mail_params(self, envelope: Envelope, params: str) -> None:
        if params and not self.esmtp:
            raise _ParamError("555 5.5.4 Error: parameters need EHLO")
        for key, value in _params(params):
            if key == "SIZE":
                if not (value.isascii() and value.isdigit()):  # not "²", which int() refuses
                    raise _ParamError("501 5.5.4 Error: bad SIZE value")
                if int(value) > self.settings.max_message_size:
                    raise _ParamError("552 5.3.4 Error: message size exceeds fixed limit")
            elif key == "BODY":
                body = value.upper()
                if body not in ("7BIT", "8BITMIME"):
                    raise _ParamError("501 5.5.4 Error: BODY must be 7BIT or 8BITMIME")
                envelope.body = body
            elif key == "SMTPUTF8":
                if value:
                    raise _ParamError("501 5.5.4 Error: SMTPUTF8 takes no value")
                envelope.smtputf8 = True
            elif key == "RET":
                if value.upper() not in ("FULL", "HDRS"):
                    raise _ParamError("501 5.5.4 Error: RET must be FULL or HDRS")
                envelope.ret = value.upper()
            elif key == "ENVID":
                if not value:
                    raise _ParamError("501 5.5.4 Error: ENVID needs a value")
                try:
                    envid = xtext_decode(value)
                except AddressError as exc:
                    raise _ParamError(f"501 5.5.4 Error: ENVID is not valid xtext: {exc}") from None
                if len(envid) > 100:
                    raise _ParamError("501 5.5.4 Error: ENVID longer than 100 characters")
                envelope.envid = envid  # RFC 3461 4.4: kept exactly, case included
            elif key == "AUTH":
                pass  # RFC 4954 5: we may ignore it
            else:
                raise _ParamError(f"555 5.5.4 Error: unsupported MAIL parameter {key}")

    def _rcpt(self, arg: str) -> None:
        envelope = self.envelope
        if envelope is None:
            self._error("503 5.5.1 Error: need MAIL command")
            return
        recipient = self._path(
            arg,
            "TO:",
            "RCPT TO:<address>",
            "501 5.1.3 Bad recipient",
            lambda address, params: self._rcpt_path(envelope, address, params),
        )
        if recipient is None:
            return
        address = recipient.address
        if not (self.may_relay or self.user is not None):
            self._error(f"554 5.7.1 <{address}>: Relay access denied")
            return
        if len(envelope.recipients) >= self.settings.max_recipients:
            self._error("452 4.5.3 Error: too many recipients")
            return
        refusal = self._rcpt_check(address)
        if refusal is not None:
            self._error(refusal)
            return
        envelope.recipients.append(recipient)
        self._reply("250 2.1.5 Ok")

    def _rcpt_path(self, envelope: Envelope, address: str, params: str) -> Recipient:
        check_mailbox(address, utf8=envelope.smtputf8)
        notify, orcpt = self._rcpt_params(params)
        return Recipient(address, orcpt=orcpt, notify=notify)

    def _rcpt_params(self, params: str) -> tuple[str | None, str | None]:
        if params and not self.esmtp:
            raise _ParamError("555 5.5.4 Error: parameters need EHLO")
        notify = orcpt = None
        for key, value in _params(params):
            if key == "NOTIFY":
                words = value.upper().split(",")
                if words != ["NEVER"] and not (words and set(words) <= _NOTIFY_VALUES):
                    raise _ParamError(
                        "501 5.5.4 Error: NOTIFY must be NEVER or SUCCESS,FAILURE,DELAY"
                    )
                notify = ",".join(words)
            elif key == "ORCPT":
                addr_type, semi, xtext = value.partition(";")
                if not semi or not ATOM.match(addr_type) or not xtext:
                    raise _ParamError("501 5.5.4 Error: ORCPT must be addr-type;address")
                try:
                    orcpt = f"{addr_type};{xtext_decode(xtext)}"
                except AddressError as exc:
                    raise _ParamError(f"501 5.5.4 Error: ORCPT is not valid xtext: {exc}") from None
                if len(value) > 500:
                    raise _ParamError("501 5.5.4 Error: ORCPT longer than 500 characters")
            else:
                raise _ParamError(f"555 5.5.4 Error: unsupported RCPT parameter {key}")
        return notify, orcpt

    def _data_cmd(self, arg: str) -> None:
        if self.envelope is None:
            self._error("503 5.5.1 Error: need MAIL command")
            return
        if not self.envelope.recipients:
            self._error("554 5.5.1 Error: no valid recipients")
            return
        if arg:
            self._error("501 5.5.4 Syntax: DATA")
            return
        self._reply("354 End data with <CR><LF>.<CR><LF>")
        self._state = _DATA
        self._data = bytearray(b"\r\n")
        self._stream_from = self.settings.stream_threshold

    def _rset(self, arg: str) -> None:
        self.envelope = None
        self._reply("250 2.0.0 Ok")

    def _noop(self, arg: str) -> None:
        self._reply("250 2.0.0 Ok")

    def _vrfy(self, arg: str) -> None:
        self._reply("252 2.0.0 Cannot VRFY user, but will accept message and attempt delivery")

    def _help(self, arg: str) -> None:
        self._reply("214 2.0.0 See RFC 5321")

    def _quit(self, arg: str) -> None:
        self._reply("221 2.0.0 Bye")
        self._close()

    def _starttls(self, arg: str) -> None:
        if not self.settings.tls_available:
            self._error("502 5.5.1 Error: STARTTLS not available")
        elif self.tls:
            self._error("503 5.5.1 Error: TLS already active")
        elif arg:
            self._error("501 5.5.4 Syntax: STARTTLS")
        else:
            self._reply("220 2.0.0 Ready to start TLS")
            # Anything pipelined after STARTTLS was sent in clear text: drop it
            # (the CVE-2011-0411 command injection).
            self._buf.clear()
            self._wait(StartTLS())

    def _auth(self, arg: str) -> None:
        if not self.settings.auth_available:
            self._error("502 5.5.1 Error: authentication not enabled")
            return
        if not self.esmtp:
            self._error("503 5.5.1 Error: send EHLO first")
            return
        if not self.tls:
            self._error("538 5.7.11 Encryption required for requested authentication mechanism")
            return
        if self.user is not None:
            self._error("503 5.5.1 Error: already authenticated")
            return
        if self.envelope is not None:
            self._error("503 5.5.1 Error: AUTH not allowed during a mail transaction")
            return
        mechanism, _, initial = arg.partition(" ")
        mechanism = mechanism.upper()
        if mechanism == "PLAIN":
            if initial:
                self._auth_plain(initial)
            else:
                self._state = _AUTH_PLAIN
                self._reply("334 ")
        elif mechanism == "LOGIN":
            if initial:
                self._auth_line_user(initial)
            else:
                self._state = _AUTH_USER
                self._reply("334 VXNlcm5hbWU6")  # "Username:"
        else:
            self._error("504 5.5.4 Error: unsupported authentication mechanism")

    def _auth_line(self, line: str) -> None:
        state, self._state = self._state, _COMMAND
        if line.strip() == "*":
            self._error("501 5.7.0 Error: authentication cancelled")
        elif state == _AUTH_PLAIN:
            self._auth_plain(line)
        elif state == _AUTH_USER:
            self._auth_line_user(line)
        else:
            password = _b64(line)
            if password is None:
                self._error("501 5.5.2 Error: invalid base64 data")
            else:
                self._wait(CheckCredentials(self._auth_user, password))

    def _auth_line_user(self, line: str) -> None:
        user = _b64(line)
        if user is None:
            self._error("501 5.5.2 Error: invalid base64 data")
            return
        self._auth_user = user
        self._state = _AUTH_PASS
        self._reply("334 UGFzc3dvcmQ6")  # "Password:"

    def _auth_plain(self, line: str) -> None:
        decoded = _b64(line)
        parts = decoded.split("\0") if decoded is not None else []
        if len(parts) != 3 or not parts[1]:
            self._error("501 5.5.2 Error: invalid PLAIN credentials")
            return
        self._wait(CheckCredentials(parts[1], parts[2]))

    # -- helpers -------------------------------------------------------------

    def _wait(self, action: Action) -> None:
        self._pending = action
        self._state = _WAIT

    def _reply(self, text: str) -> None:
        self._out.append(text)

    def _error(self, text: str) -> None:
        self._out.append(text)
        self._errors += 1
        if self._errors >= MAX_ERRORS:
            self._out.append(f"421 4.7.0 {self.settings.hostname} Error: too many errors")
            self._close()

    def _close(self) -> None:
        self._state = _CLOSED
        self.closed = True
        self._buf.clear()


class _ParamError(Exception):
    """A MAIL/RCPT parameter is refused; the message is the full reply."""


def _strip_keyword(arg: str, keyword: str) -> str | None:
    if arg[: len(keyword)].upper() != keyword:
        return None
    return arg[len(keyword) :]


def _params(text: str):
    for word in text.split():
        key, _, value = word.partition("=")
        yield key.upper(), value


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


def _b64(text: str) -> str | None:
    try:
        return base64.b64decode(text.strip(), validate=True).decode("utf-8")
    except ValueError:  # not base64 (binascii.Error), not ASCII, or not UTF-8
        return None


_COMMANDS = {
    "EHLO": ServerSession._ehlo,
    "HELO": ServerSession._helo,
    "MAIL": ServerSession._mail,
    "RCPT": ServerSession._rcpt,
    "DATA": ServerSession._data_cmd,
    "RSET": ServerSession._rset,
    "NOOP": ServerSession._noop,
    "VRFY": ServerSession._vrfy,
    "HELP": ServerSession._help,
    "QUIT": ServerSession._quit,
    "STARTTLS": ServerSession._starttls,
    "AUTH": ServerSession._auth,
}
