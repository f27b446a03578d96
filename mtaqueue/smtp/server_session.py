"""One SMTP server conversation, sans-IO (in the manner of h11): `ServerSession`.

`ServerSession` takes the bytes a client sent (`receive`) and produces the bytes to
answer (`take_output`), plus at most one `Action` at a time that needs I/O (commit the
message, check a password, start TLS; see actions.py). While an action is pending,
further pipelined input waits in the buffer; the I/O layer calls `resume()` with the
outcome.

The session is the command state machine: it reads command lines and answers EHLO,
MAIL, RCPT, DATA, STARTTLS, AUTH and the rest. It hands MAIL's and RCPT's arguments to
arguments.py, the message data after DATA to `DataReader` (held whole and committed
with one `Submit`, or past `stream_threshold` handed on in pieces: `Stream`, `Write`...,
`Finish`), and AUTH's exchange to `SaslExchange`.

We write this instead of using aiosmtpd's server: the listener is the product's
hot path (see bench/RESULTS.md), and RFC 3461 parameters, per-recipient DSN
options, case-exact ENVID, bare-newline policy and limits all needed overriding
anyway. aiosmtpd still serves as the test and benchmark peers.
"""

from __future__ import annotations

from collections.abc import Callable

from ..transaction import Envelope, Stream, Submit
from .actions import Action, CheckCredentials, Finish, StartTLS, Write
from .arguments import ArgumentError, mail_from, rcpt_to
from .data_reader import DataReader, Refused
from .sasl import SaslExchange
from .session_settings import SessionSettings, content_limits

MAX_COMMAND_LINE = 2048  # RFC 5321 allows 512, plus room for DSN parameters
MAX_ERRORS = 20  # replies with an error before we hang up on a confused client
_OVERLONG = "\x00overlong"  # _take_line's marker for a line that was too long

# Session states.
_COMMAND, _DATA, _AUTH, _WAIT, _CLOSED = range(5)


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
        self._reader = DataReader(content_limits(settings), settings.stream_threshold)
        self._sasl = SaslExchange()
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
                self._reader.cannot_store(outcome)
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
        return self._reader.streaming

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
                self._state = _COMMAND
                self._auth_step(self._sasl.answer(line))
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
        read = self._reader.read(self._buf)
        if read is None:
            return False
        if isinstance(read, Stream | Write):  # a piece to store; the data goes on
            self._wait(read)
            return False
        self._state = _COMMAND  # past the final dot
        if isinstance(read, Refused):
            self.envelope = None
            (self._error if read.client_error else self._reply)(read.reply)
        else:
            self._wait(read)
        return True

    # -- commands ---------------------------------------------------------

    def _command(self, line: str) -> None:
        verb, _, arg = line.partition(" ")
        verb = verb.upper()
        handler = _COMMANDS.get(verb)
        if handler is not None:
            handler(self, arg.strip())
        elif verb in _ANSWERS:
            self._reply(_ANSWERS[verb])
        else:
            self._error("502 5.5.1 Error: command not recognized")

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
        try:
            envelope = mail_from(arg, esmtp=self.esmtp, max_size=self.settings.max_message_size)
        except ArgumentError as exc:
            self._error(str(exc))
            return
        refusal = self._storage_refusal()  # disk low (452 4.3.1), writer restarting (451 4.3.0)
        if refusal:
            self._error(refusal)
            return
        self.envelope = envelope
        self._reply("250 2.1.0 Ok")

    def _rcpt(self, arg: str) -> None:
        envelope = self.envelope
        if envelope is None:
            self._error("503 5.5.1 Error: need MAIL command")
            return
        try:
            recipient = rcpt_to(arg, esmtp=self.esmtp, smtputf8=envelope.smtputf8)
        except ArgumentError as exc:
            self._error(str(exc))
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
        self._reader.begin(self.envelope, self.helo, self.esmtp, self.user)

    def _rset(self, arg: str) -> None:
        self.envelope = None
        self._reply("250 2.0.0 Ok")

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
        self._auth_step(self._sasl.start(arg))

    def _auth_step(self, step: CheckCredentials | str) -> None:
        """What the AUTH exchange answered: a challenge, a refusal or credentials to check."""
        if isinstance(step, CheckCredentials):
            self._wait(step)
        elif self._sasl.waiting:
            self._state = _AUTH
            self._reply(step)
        else:
            self._error(step)

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


_COMMANDS = {
    "EHLO": ServerSession._ehlo,
    "HELO": ServerSession._helo,
    "MAIL": ServerSession._mail,
    "RCPT": ServerSession._rcpt,
    "DATA": ServerSession._data_cmd,
    "RSET": ServerSession._rset,
    "QUIT": ServerSession._quit,
    "STARTTLS": ServerSession._starttls,
    "AUTH": ServerSession._auth,
}
# Commands that only answer, whatever their argument.
_ANSWERS = {
    "NOOP": "250 2.0.0 Ok",
    "VRFY": "252 2.0.0 Cannot VRFY user, but will accept message and attempt delivery",
    "HELP": "214 2.0.0 See RFC 5321",
}
