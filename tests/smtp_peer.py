"""Real, scriptable SMTP servers ("peers") for delivery tests.

Each `SmtpPeer` is an aiosmtpd server bound to one loopback address, running its own asyncio
loop in a background thread. Delivery tests point the daemon's test DNS at several peers on
127.0.0.x sharing one port (`peers_on_one_port`) and script how each one answers.

    with SmtpPeer("127.0.0.2") as peer:
        peer.on("rcpt", "450 4.2.0 Greylisted, try again in 300 seconds", times=1)
        peer.on("rcpt", "550 5.1.1 No such user", rcpt="gone@example.org")
        peer.drop("data_end", times=1)       # ambiguous: message read, no reply
        ...
        peer.wait_messages(1)
        assert peer.messages[0].rcpt_params("a@example.org")["NOTIFY"] == "SUCCESS,FAILURE"

Phases: "banner", "ehlo" (EHLO and HELO), "starttls", "mail", "rcpt", "data" (the 354
step), "data_end" (after the final dot), "rset". An action is a reply string ("421 ..."
also closes the connection, as real servers do; multi-line replies may be written with
"\\n"), `HANG` (stop answering), `DROP` (abort the connection), `None` (the default
behaviour) or a callable `f(Context) -> action`.

A smarthost: `auth={"user": "password"}` offers AUTH PLAIN and LOGIN (`auth_mechanisms`), only
over TLS unless `auth_require_tls=False`; `auth_required=True` answers MAIL with 530 until the
client authenticated; `require_starttls=True` answers 530 to anything but EHLO, STARTTLS,
NOOP and QUIT before STARTTLS; `implicit_tls=context` speaks TLS from the first byte (SMTPS,
port 465 style). `auth_attempts` records every AUTH, `Received.auth_user` who sent a message.

Misbehaving peers: a 2xx where it does not belong is sent and the session goes on as if it
were right (`peer.banner = "250 hi"`, `on("mail", "252 ok")`, `on("data", "250 ok")`);
`Raw(b"...")` sends bytes as they are (garbage, an over-long line, two replies at once);
`Late(seconds, "250 ok")` answers only after a delay (past the client's timeout).

Rule order for one event: rules with `times=` first, in the order they were added (each
use counts down; a rule is removed when spent), then the standing rule for that recipient,
then the standing rule for the phase. A standing rule (no `times=`) replaces the previous
standing rule with the same phase and `rcpt=`, so `on()` works as a setter; `on(p, None)`
removes it. When no rule answers, RCPT applies greylisting (if enabled) and then 250.
`rcpt=` on "data"/"data_end" matches a message that has that recipient.

Records: `messages` holds what was accepted after the final dot, plus what was read but never
answered (HANG/DROP at "data_end": `replied=False`); `rejected` holds the others (4xx/5xx,
garbage).
For load, `keep_content=False, track_attempts=False, log_limit=0` keeps only sizes/hashes.

aiosmtpd 1.4.6 notes (see shared/reference/standards_libs.md B1): MAIL and RCPT are
reimplemented so that RFC 3461 parameters are accepted, recorded exactly as sent (case
kept) and per recipient; `hostname` is always passed (no getfqdn per connection); the
server is created with `loop.create_server` so the banner, connection tracking and
shutdown are ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import email
import email.message
import email.policy
import errno
import hashlib
import itertools
import math
import re
import ssl
import subprocess
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from aiosmtpd.smtp import SMTP, AuthResult, Envelope, LoginPassword, syntax

HANG = "hang"
DROP = "drop"
PHASES = ("banner", "ehlo", "starttls", "mail", "rcpt", "data", "data_end", "rset")
_RCPT_PHASES = frozenset({"rcpt", "data", "data_end"})
_REPLY_RE = re.compile(r"^[2-5]\d\d(?:[ -]|$)")
_NOTIFY_VALUES = frozenset({"SUCCESS", "FAILURE", "DELAY"})


@dataclass(frozen=True, slots=True)
class Raw:
    """Bytes sent as they are instead of a reply (no CRLF added); the session goes on."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Late:
    """`reply`, sent only after `delay` seconds."""

    delay: float
    reply: str


Action = str | Raw | Late | None
Script = str | Raw | Late | Callable[["Context"], Action] | None


# -- records ----------------------------------------------------------------------------


def _params(options: Iterable[str]) -> dict[str, str | bool]:
    """["NOTIFY=SUCCESS", "RET=hdrs", "SMTPUTF8"] -> {"NOTIFY": "SUCCESS", "RET": "hdrs", ...}.

    Keywords are case-insensitive (uppercased here); values are kept exactly as sent.
    """
    result: dict[str, str | bool] = {}
    for option in options:
        key, eq, value = option.partition("=")
        result[key.upper()] = value if eq else True
    return result


@dataclass(slots=True)
class Received:
    """One message that reached the final dot on this peer."""

    mail_from: str  # "" for the null reverse-path <>
    rcpt_tos: list[str]  # accepted recipients, in order
    mail_options: list[str]  # MAIL parameters exactly as sent
    rcpt_options: list[list[str]]  # RCPT parameters exactly as sent, one list per rcpt_tos
    content: bytes | None  # dot-unstuffed DATA; None when the peer runs with keep_content=False
    size: int
    sha256: str
    client_ip: str  # the connecting client's address
    peer: str  # the address of the peer that received it
    time: float  # epoch seconds, when the final dot was read
    replied: bool  # False: dropped or hung after the final dot (the ambiguous case)
    reply: str | None  # the reply sent after the final dot
    helo: str = ""
    tls: bool = False
    connection: int = 0  # connection number on this peer (1-based)
    txn: int = 0  # transaction number within that connection (1-based)
    auth_user: str | None = None  # who had authenticated, if anyone

    @property
    def mail_params(self) -> dict[str, str | bool]:
        return _params(self.mail_options)

    def rcpt_params(self, address: str) -> dict[str, str | bool]:
        """The RCPT parameters sent with `address` (case-insensitive match)."""
        wanted = address.lower()
        for rcpt, options in zip(self.rcpt_tos, self.rcpt_options, strict=True):
            if rcpt.lower() == wanted:
                return _params(options)
        raise KeyError(address)

    @property
    def message(self) -> email.message.Message:
        if self.content is None:
            raise ValueError("peer runs with keep_content=False")
        return email.message_from_bytes(self.content, policy=email.policy.default)


class AuthAttempt(NamedTuple):
    user: str
    mechanism: str
    ok: bool
    tls: bool  # whether the session was encrypted when the credentials came
    client_ip: str


class LogEntry(NamedTuple):
    time: float  # epoch seconds
    phase: str  # a PHASES name, or "quit", "close"
    reply: str  # what was sent; HANG / DROP when nothing was
    client_ip: str
    connection: int
    arg: str = ""  # the recipient for "rcpt", the sender for "mail"


@dataclass(slots=True)
class Context:
    """What a callable script sees."""

    phase: str
    client_ip: str
    connection: int
    attempt: int  # how many times this same event has happened (see SmtpPeer docs)
    time: float
    helo: str = ""
    mail_from: str | None = None
    rcpt: str | None = None  # the recipient being added (phase "rcpt")
    rcpt_tos: list[str] = field(default_factory=list)  # accepted so far
    mail_options: list[str] = field(default_factory=list)
    rcpt_options: list[str] = field(default_factory=list)  # of `rcpt`
    content: bytes | None = None  # phase "data_end"


@dataclass(slots=True)
class _Rule:
    action: Script
    times: int | None
    rcpt: str | None  # lowercased


# -- TLS helpers --------------------------------------------------------------------------


def self_signed_cert(directory: str | Path, hostname: str = "peer.test") -> tuple[Path, Path]:
    """Make (cert.pem, key.pem) for `hostname` in `directory` with the openssl CLI."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / f"{hostname}.crt", directory / f"{hostname}.key"
    if not (cert.exists() and key.exists()):
        args = ["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
        args += ["-nodes", "-days", "2"]
        names = ["-subj", f"/CN={hostname}", "-addext", f"subjectAltName=DNS:{hostname}"]
        subprocess.run(
            ["openssl", *args, *names, "-keyout", str(key), "-out", str(cert)],
            check=True,
            capture_output=True,
        )
    return cert, key


def self_signed_context(directory: str | Path, hostname: str = "peer.test") -> ssl.SSLContext:
    """A server-side TLS context with a fresh self-signed certificate for `hostname`."""
    cert, key = self_signed_cert(directory, hostname)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context


# -- the protocol (one instance per connection) -------------------------------------------


def _wire(reply: str) -> str:
    """Normalise a reply: "\\n"-separated lines become one CRLF-joined multi-line reply."""
    if "\n" not in reply:
        return reply
    lines = [line.rstrip("\r") for line in reply.strip("\r\n").split("\n")]
    out = [f"{line[:3]}-{line[4:]}" for line in lines[:-1]]
    out.append(f"{lines[-1][:3]} {lines[-1][4:]}")
    return "\r\n".join(out)


def _check_action(action: object) -> None:
    if action is None or action in (HANG, DROP) or callable(action) or isinstance(action, Raw):
        return
    reply = action.reply if isinstance(action, Late) else action
    if not isinstance(reply, str) or not all(
        _REPLY_RE.match(line) for line in reply.strip("\r\n").split("\n")
    ):
        raise ValueError(f"not an SMTP reply, HANG, DROP, Raw, Late, None or callable: {action!r}")


def _normalised(action: Script) -> Script:
    if isinstance(action, str):
        return _wire(action)
    if isinstance(action, Late):
        return Late(action.delay, _wire(action.reply))
    return action


def _text(action: Action) -> str:
    """What an action sends, as text (for logs and records)."""
    if isinstance(action, Late):
        return action.reply
    if isinstance(action, Raw):
        return action.data.decode("ascii", "replace")
    return action or ""


class _PeerSMTP(SMTP):
    # Commands carrying ORCPT/ENVID can be long; StreamReader still caps lines at 1001.
    command_size_limit = 1000
    command_size_limits = defaultdict(lambda: 1000)  # class-level and cleared per connection

    def __init__(self, peer: SmtpPeer, **kwargs: Any) -> None:
        super().__init__(_Handler(peer), **kwargs)
        self._peer = peer
        self._conn = 0
        self._client_ip = ""
        self._override_next_push: str | None = None
        self._txn = 0
        self._reset_txn()

    def _reset_txn(self) -> None:
        self._mail_from: str | None = None
        self._mail_options: list[str] = []
        self._rcpt_options: list[list[str]] = []

    def _set_post_data_state(self) -> None:  # called by RSET, HELO/EHLO, after DATA, connect
        super()._set_post_data_state()
        self._reset_txn()

    # -- connection life --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        first = self._original_transport is None  # else: the TLS layer after STARTTLS
        if first:
            peername = transport.get_extra_info("peername")
            self._client_ip = peername[0] if peername else ""
            self._conn = self._peer._connection_opened(self)
        super().connection_made(transport)
        if first and self._handler_coroutine is not None:
            self._handler_coroutine.add_done_callback(self._session_done)

    def _session_done(self, task: asyncio.Task[None]) -> None:
        # Retrieve the outcome so asyncio never reports it; a client that resets the
        # connection is normal, anything else is a peer bug worth failing a test for.
        if not task.cancelled():
            error = task.exception()
            if error is not None and not isinstance(error, ConnectionError):
                self._peer.errors.append(f"{type(error).__name__}: {error}")

    def connection_lost(self, error: Exception | None) -> None:
        try:
            super().connection_lost(error)
        finally:
            self._peer._connection_closed(self)

    async def _forever(self) -> None:
        # Cancelled by connection_lost (client gives up, peer stops, or aiosmtpd's timeout).
        await self.loop.create_future()

    async def _act(self, phase: str, reply: Action, arg: str = "") -> None:
        """Log and send `reply`; HANG and DROP never return (the session is cancelled)."""
        self._peer._log(phase, _text(reply), self, arg)
        if reply == HANG:
            await self._forever()
        if reply == DROP:
            assert self.transport is not None
            self.transport.abort()
            await self._forever()
        await self.push(reply)

    async def push(self, status: str | bytes | Raw | Late) -> None:
        if self._override_next_push is not None:
            status, self._override_next_push = self._override_next_push, None
        if isinstance(status, Late):
            await asyncio.sleep(status.delay)
            status = status.reply
        if isinstance(status, Raw):
            self._writer.write(status.data)
            await self._writer.drain()
            return
        await super().push(status)
        if (
            isinstance(status, str)
            and status.startswith("421")
            and self.transport is not None
            and not self.transport.is_closing()
        ):
            self.transport.close()  # a 421 ends the session, as real servers do

    def _context(self, phase: str, **kw: Any) -> Context:
        return Context(
            phase=phase,
            client_ip=self._client_ip,
            connection=self._conn,
            attempt=0,
            time=time.time(),
            helo=(self.session.host_name or "") if self.session else "",
            mail_from=self._mail_from,
            rcpt_tos=list(self.envelope.rcpt_tos) if self.envelope else [],
            mail_options=list(self._mail_options),
            **kw,
        )

    # -- banner --

    async def _handle_client(self) -> None:
        peer = self._peer
        attempt = peer._attempt(("banner", self._client_ip))
        reply = peer._decide("banner", None, (), lambda: self._context("banner"), attempt)
        if reply is None:
            reply = peer.banner
        if _text(reply).startswith("2"):  # 220, or a 2xx out of step: the session goes on
            self._peer._log("banner", _text(reply), self)
            self._override_next_push = reply  # aiosmtpd's own greeting push
            await super()._handle_client()
            return
        try:
            await self._act("banner", reply)  # 421 / 554 / HANG / DROP
        finally:  # also when cancelled: the client went away during a hang
            if self.transport is not None and not self.transport.is_closing():
                self.transport.close()

    # -- HELO / EHLO / STARTTLS --

    def _ehlo_lines(self) -> list[str]:
        peer = self._peer
        keywords = []
        if self.data_size_limit:
            keywords.append(f"SIZE {self.data_size_limit}")
        if peer.eightbitmime:
            keywords.append("8BITMIME")
        if peer.pipelining:
            keywords.append("PIPELINING")
        if self.enable_SMTPUTF8:
            keywords.append("SMTPUTF8")
        if peer.dsn:
            keywords.append("DSN")
        keywords.append("ENHANCEDSTATUSCODES")
        if self.tls_context and not self._tls_protocol:
            keywords.append("STARTTLS")
        offer = self.encrypted or not self._auth_require_tls
        if peer.auth is not None and self._auth_methods and offer:
            keywords.append("AUTH " + " ".join(sorted(self._auth_methods)))
        lines = [self.hostname, *keywords]
        return [f"250-{line}" for line in lines[:-1]] + [f"250 {lines[-1]}"]

    async def _greet(self, verb: str, hostname: str | None) -> None:
        if not hostname:
            await self._act("ehlo", f"501 5.5.4 Syntax: {verb} hostname")
            return
        self._set_rset_state()
        peer = self._peer
        attempt = peer._attempt(("ehlo", self._client_ip))
        reply = peer._decide("ehlo", None, (), lambda: self._context("ehlo"), attempt)
        if reply is None:
            reply = "\r\n".join(self._ehlo_lines()) if verb == "EHLO" else f"250 {self.hostname}"
        if _text(reply).startswith("2"):
            self.session.host_name = hostname
            self.session.extended_smtp = verb == "EHLO"
        await self._act("ehlo", reply, hostname)

    @syntax("HELO hostname")
    async def smtp_HELO(self, hostname: str) -> None:
        await self._greet("HELO", hostname)

    @syntax("EHLO hostname")
    async def smtp_EHLO(self, hostname: str) -> None:
        await self._greet("EHLO", hostname)

    @syntax("STARTTLS", when="tls_context")
    async def smtp_STARTTLS(self, arg: str) -> None:
        peer = self._peer
        if self._tls_protocol is not None:
            await self._act("starttls", "503 5.5.1 Error: TLS already active")
            return
        if self.tls_context and not arg:
            attempt = peer._attempt(("starttls", self._client_ip))
            reply = peer._decide("starttls", None, (), lambda: self._context("starttls"), attempt)
            if reply is not None and not _text(reply).startswith("220"):
                await self._act("starttls", reply)
                return
            peer._log("starttls", _text(reply) or "220 Ready to start TLS", self)
            self._override_next_push = reply
        await super().smtp_STARTTLS(arg)

    async def smtp_RSET(self, arg: str) -> None:
        peer = self._peer
        attempt = peer._attempt(("rset", self._client_ip))
        reply = peer._decide("rset", None, (), lambda: self._context("rset"), attempt)
        reply = reply or "250 2.0.0 Ok"
        peer._log("rset", _text(reply), self)
        self._override_next_push = reply if not arg else None
        await super().smtp_RSET(arg)  # (push() closes after a 421)

    async def smtp_QUIT(self, arg: str) -> None:
        self._peer._log("quit", "221 2.0.0 Bye", self)
        self._override_next_push = "221 2.0.0 Bye" if not arg else None
        await super().smtp_QUIT(arg)

    # -- MAIL / RCPT (RFC 3461 aware; parameters kept exactly as sent) --

    async def _syntax_error(self, phase: str, message: str, arg: str = "") -> None:
        await self._act(phase, message, arg)

    @property
    def encrypted(self) -> bool:
        return self._tls_protocol is not None or self._peer.implicit_tls is not None

    def _auth_user(self) -> str | None:
        data = getattr(self.session, "auth_data", None) if self.session else None
        if not (self.session and self.session.authenticated and data is not None):
            return None
        return data.login.decode()

    def _authenticate(self, mechanism: str, auth_data: object) -> AuthResult:
        peer = self._peer
        assert peer.auth is not None and isinstance(auth_data, LoginPassword)
        user, password = auth_data.login.decode(), auth_data.password.decode()
        ok = peer.auth.get(user) == password
        peer.auth_attempts.append(AuthAttempt(user, mechanism, ok, self.encrypted, self._client_ip))
        self._peer._log("auth", "235" if ok else "535", self, user)
        return AuthResult(success=ok, handled=False, auth_data=auth_data if ok else None)

    @syntax("MAIL FROM: <address>", extended=" [SP <mail-parameters>]")
    async def smtp_MAIL(self, arg: str | None) -> None:
        if await self.check_helo_needed():
            return
        if await self.check_auth_needed("MAIL"):  # auth_required: 530 5.7.0
            self._peer._log("mail", "530 5.7.0 Authentication required", self)
            return
        usage = "501 5.5.4 Syntax: MAIL FROM:<address>"
        rest = self._strip_command_keyword("FROM:", arg) if arg else None
        if rest is None:
            return await self._syntax_error("mail", usage)
        address, params = self._getaddr(rest)
        if address is None:
            return await self._syntax_error("mail", "553 5.1.3 Error: malformed address")
        if not address:
            return await self._syntax_error("mail", usage)
        if address == "<>":
            address = ""
        if self._mail_from is not None:
            return await self._syntax_error("mail", "503 5.5.1 Error: nested MAIL command")
        options = (params or "").split()
        if options and not self.session.extended_smtp:
            return await self._syntax_error("mail", usage, address)
        error = self._check_mail_options(options)
        if error:
            return await self._syntax_error("mail", error, address)

        peer = self._peer
        attempt = peer._attempt(("mail", self._client_ip, address))
        reply = peer._decide(
            "mail",
            None,
            (),
            lambda: self._context("mail", mail_from=address, mail_options=options),
            attempt,
        )
        if reply is None:
            reply = "250 2.1.0 Ok"
        if _text(reply).startswith("2"):
            self._mail_from = address
            self._mail_options = options
            self.envelope.mail_from = address or "<>"
            self.envelope.mail_options = options
            self._txn += 1
            peer.transactions += 1
        await self._act("mail", reply, address)

    def _check_mail_options(self, options: list[str]) -> str | None:
        seen = set()
        for option in options:
            key, eq, value = option.partition("=")
            key = key.upper()
            if not key.isalnum() or (eq and not value) or key in seen:
                return "501 5.5.4 Bad MAIL parameter syntax"
            seen.add(key)
            if key == "BODY":
                if value.upper() not in ("7BIT", "8BITMIME"):
                    return "501 5.5.4 BODY can only be one of 7BIT, 8BITMIME"
                if value.upper() == "8BITMIME" and not self._peer.eightbitmime:
                    return f"555 5.5.4 Unsupported option: {option}"
            elif key == "SIZE":
                if not value.isdigit():
                    return "501 5.5.4 Bad SIZE parameter syntax"
                if self.data_size_limit and int(value) > self.data_size_limit:
                    return "552 5.3.4 Message size exceeds fixed limit"
            elif key == "SMTPUTF8" and self.enable_SMTPUTF8:
                if eq:
                    return "501 5.5.4 SMTPUTF8 takes no arguments"
            elif key == "RET" and self._peer.dsn:
                if value.upper() not in ("FULL", "HDRS"):
                    return "501 5.5.4 Bad RET parameter syntax"
            elif key == "ENVID" and self._peer.dsn:
                if not value:
                    return "501 5.5.4 Bad ENVID parameter syntax"
            else:
                return f"555 5.5.4 Unsupported option: {option}"
        return None

    def _check_rcpt_options(self, options: list[str]) -> str | None:
        seen = set()
        for option in options:
            key, eq, value = option.partition("=")
            key = key.upper()
            if not key.isalnum() or (eq and not value) or key in seen:
                return "501 5.5.4 Bad RCPT parameter syntax"
            seen.add(key)
            if key == "NOTIFY" and self._peer.dsn:
                words = value.upper().split(",")
                if words != ["NEVER"] and not (
                    words and set(words) <= _NOTIFY_VALUES and len(set(words)) == len(words)
                ):
                    return "501 5.5.4 Bad NOTIFY parameter syntax"
            elif key == "ORCPT" and self._peer.dsn:
                addr_type, semi, addr = value.partition(";")
                if not (addr_type and semi and addr):
                    return "501 5.5.4 Bad ORCPT parameter syntax"
            else:
                return f"555 5.5.4 Unsupported option: {option}"
        return None

    @syntax("RCPT TO: <address>", extended=" [SP <mail-parameters>]")
    async def smtp_RCPT(self, arg: str | None) -> None:
        if await self.check_helo_needed():
            return
        if self._mail_from is None:
            return await self._syntax_error("rcpt", "503 5.5.1 Error: need MAIL command")
        usage = "501 5.5.4 Syntax: RCPT TO:<address>"
        rest = self._strip_command_keyword("TO:", arg) if arg else None
        if rest is None:
            return await self._syntax_error("rcpt", usage)
        address, params = self._getaddr(rest)
        if address is None:
            return await self._syntax_error("rcpt", "553 5.1.3 Error: malformed address")
        if not address or address == "<>":
            return await self._syntax_error("rcpt", usage)
        options = (params or "").split()
        if options and not self.session.extended_smtp:
            return await self._syntax_error("rcpt", usage, address)
        error = self._check_rcpt_options(options)
        if error:
            return await self._syntax_error("rcpt", error, address)

        peer = self._peer
        lowered = address.lower()
        attempt = peer._attempt(("rcpt", self._client_ip, self._mail_from, lowered))
        reply = peer._decide(
            "rcpt",
            lowered,
            (),
            lambda: self._context("rcpt", rcpt=address, rcpt_options=options),
            attempt,
        )
        if reply is None:
            reply = peer._greylisted(self._client_ip, self._mail_from, lowered)
        if reply is None:
            reply = "250 2.1.5 Ok"
        if _text(reply).startswith("2"):
            self.envelope.rcpt_tos.append(address)
            self.envelope.rcpt_options.extend(options)
            self._rcpt_options.append(options)
        await self._act("rcpt", reply, address)

    # -- DATA --

    @syntax("DATA")
    async def smtp_DATA(self, arg: str) -> None:
        if await self.check_helo_needed():
            return
        if not self.envelope.rcpt_tos:
            return await self._syntax_error("data", "503 5.5.1 Error: need RCPT command")
        if arg:
            return await self._syntax_error("data", "501 5.5.4 Syntax: DATA")
        peer = self._peer
        rcpts = [r.lower() for r in self.envelope.rcpt_tos]
        attempt = peer._attempt(("data", self._client_ip, self._mail_from, *rcpts))
        reply = peer._decide("data", None, rcpts, lambda: self._context("data"), attempt)
        if reply is None:
            reply = "354 End data with <CR><LF>.<CR><LF>"
        if not _text(reply).startswith("354"):
            await self._act("data", reply)
            return
        peer._log("data", _text(reply), self)
        self._override_next_push = reply
        await super().smtp_DATA(arg)  # reads the body, calls _data_end through _Handler

    async def _data_end(self, envelope: Envelope) -> Action:
        peer = self._peer
        content = envelope.original_content or b""
        rcpts = [r.lower() for r in envelope.rcpt_tos]
        mail_from = self._mail_from or ""
        attempt = peer._attempt(("data_end", self._client_ip, mail_from, *rcpts))
        reply = peer._decide(
            "data_end", None, rcpts, lambda: self._context("data_end", content=content), attempt
        )
        if reply is None:
            reply = f"250 2.0.0 Ok: queued as {peer._next_queue_id()}"
        replied = reply not in (HANG, DROP)
        record = Received(
            mail_from=mail_from,
            rcpt_tos=list(envelope.rcpt_tos),
            mail_options=self._mail_options,
            rcpt_options=self._rcpt_options,
            content=content if peer.keep_content else None,
            size=len(content),
            sha256=hashlib.sha256(content).hexdigest(),
            client_ip=self._client_ip,
            peer=peer.host,
            time=time.time(),
            replied=replied,
            reply=_text(reply) if replied else None,
            helo=self.session.host_name or "",
            tls=self.encrypted,
            connection=self._conn,
            txn=self._txn,
            auth_user=self._auth_user(),
        )
        accepted = not replied or _text(reply).startswith("2")
        (peer.messages if accepted else peer.rejected).append(record)
        if replied:
            peer._log("data_end", _text(reply), self)
            return reply  # aiosmtpd pushes it (and push() closes after a 421)
        await self._act("data_end", reply)  # hangs or drops; never returns
        raise AssertionError("unreachable")


def _authenticator(server: _PeerSMTP, session, envelope, mechanism: str, data) -> AuthResult:
    return server._authenticate(mechanism, data)


class _Handler:
    """Tiny aiosmtpd handler (aiosmtpd runs dir() on it for every connection)."""

    def __init__(self, peer: SmtpPeer) -> None:
        self.peer = peer

    async def handle_exception(self, error: Exception) -> str:
        self.peer.errors.append(f"{type(error).__name__}: {error}")
        return f"451 4.3.0 Peer error: {type(error).__name__}"

    async def handle_DATA(self, server: _PeerSMTP, session: Any, envelope: Envelope) -> str:
        return await server._data_end(envelope)


# -- the peer -----------------------------------------------------------------------------


class SmtpPeer:
    """A scriptable SMTP server on `host:port` with its own loop in a background thread.

    `attempt` in a Context counts the same event: for "rcpt" the (client ip, sender,
    recipient) triplet; "mail": (client ip, sender); "data"/"data_end": (client ip, sender,
    recipients); "banner"/"ehlo"/"starttls": client ip. 0 when track_attempts=False.
    """

    HANG = HANG
    DROP = DROP

    def __init__(
        self,
        host: str = "127.0.0.2",
        port: int = 0,
        *,
        hostname: str = "peer.test",
        dsn: bool = True,
        smtputf8: bool = True,
        eightbitmime: bool = True,
        starttls: ssl.SSLContext | None = None,
        implicit_tls: ssl.SSLContext | None = None,
        require_starttls: bool = False,
        auth: dict[str, str] | None = None,
        auth_mechanisms: tuple[str, ...] = ("LOGIN", "PLAIN"),
        auth_required: bool = False,
        auth_require_tls: bool = True,
        pipelining: bool = False,
        data_size_limit: int = 33554432,
        timeout: float = 300.0,
        keep_content: bool = True,
        track_attempts: bool = True,
        log_limit: int | None = 10_000,
    ) -> None:
        self.host = host
        self.port = port
        self.hostname = hostname
        self.dsn = dsn
        self.smtputf8 = smtputf8
        self.eightbitmime = eightbitmime
        self.starttls = starttls
        self.implicit_tls = implicit_tls
        self.require_starttls = require_starttls
        self.auth = auth
        self.auth_mechanisms = auth_mechanisms
        self.auth_required = auth_required
        self.auth_require_tls = auth_require_tls
        self.auth_attempts: list[AuthAttempt] = []
        self.pipelining = pipelining
        self.data_size_limit = data_size_limit
        self.timeout = timeout
        self.keep_content = keep_content
        self.track_attempts = track_attempts
        self._banner: Action = f"220 {hostname} ESMTP"

        self.messages: list[Received] = []  # accepted, or read but never answered
        self.rejected: list[Received] = []  # answered 4xx/5xx after the final dot
        self.log: deque[LogEntry] = deque(maxlen=log_limit)
        self.connections = 0  # accepted TCP connections, total
        self.active = 0  # open right now
        self.max_active = 0  # peak of `active`
        self.transactions = 0  # MAIL commands answered 2xx
        self.errors: list[str] = []  # unexpected exceptions in the peer (should stay empty)

        self._log_enabled = log_limit != 0
        self._lock = threading.Lock()
        self._limited: dict[str, list[_Rule]] = {p: [] for p in PHASES}
        self._standing: dict[str, dict[str | None, Script]] = {p: {} for p in PHASES}
        self._attempts: Counter[tuple] = Counter()
        self._greylist_window = 0.0
        self._greylist_seen: dict[tuple[str, str, str], float] = {}
        self._queue_ids = itertools.count(1)
        self._protocols: set[_PeerSMTP] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None

    @property
    def banner(self) -> Action:
        """The greeting, e.g. "421 4.7.0 Too busy" (a 4xx/5xx greeting or garbage closes the
        session; a 2xx, even out of step, goes on)."""
        return self._banner

    @banner.setter
    def banner(self, reply: Action) -> None:
        if reply in (HANG, DROP):
            raise ValueError("use hang('banner') / drop('banner')")
        _check_action(reply)
        self._banner = _normalised(reply)

    def __repr__(self) -> str:
        return f"<SmtpPeer {self.host}:{self.port} messages={len(self.messages)}>"

    # -- life --

    def start(self) -> SmtpPeer:
        if self._thread is not None:
            raise RuntimeError("already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._run, name=f"smtp-peer-{self.host}", daemon=True
        )
        self._thread.start()
        try:
            self._call(self._listen())
        except BaseException:
            self._finish_thread()
            raise
        return self

    def stop(self) -> None:
        """Close the listener and every connection, then stop the loop and join the thread."""
        if self._thread is None:
            return
        with contextlib.suppress(Exception):
            self._call(self._close_all(), timeout=10)
        self._finish_thread()

    def __enter__(self) -> SmtpPeer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def refuse_connections(self) -> None:
        """Stop listening: new connections are refused (existing ones continue)."""
        self._call(self._unlisten())

    def resume(self) -> None:
        """Listen again on the same address and port."""
        self._call(self._listen())

    # -- scripting (thread-safe; takes effect for the next event) --

    def on(
        self,
        phase: str,
        reply: Script,
        *,
        times: int | None = None,
        rcpt: str | None = None,
    ) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; one of {PHASES}")
        if rcpt is not None and phase not in _RCPT_PHASES:
            raise ValueError(f"rcpt= only applies to {sorted(_RCPT_PHASES)}")
        if times is not None and times < 1:
            raise ValueError("times must be >= 1")
        _check_action(reply)
        reply = _normalised(reply)
        key = rcpt.lower() if rcpt is not None else None
        with self._lock:
            if times is not None:
                if reply is not None:
                    self._limited[phase].append(_Rule(reply, times, key))
            elif reply is None:
                self._standing[phase].pop(key, None)
            else:
                self._standing[phase][key] = reply

    def hang(self, phase: str, *, times: int | None = None, rcpt: str | None = None) -> None:
        """Stop answering at `phase`; the connection stays open until the client gives up."""
        self.on(phase, HANG, times=times, rcpt=rcpt)

    def drop(self, phase: str, *, times: int | None = None, rcpt: str | None = None) -> None:
        """Abort the connection at `phase` instead of replying."""
        self.on(phase, DROP, times=times, rcpt=rcpt)

    def greylist(self, window: float | None) -> None:
        """Greylist at RCPT: a new (client ip, sender, rcpt) triplet gets 450 4.2.0 until
        `window` seconds after it was first seen. 0/None turns it off (and forgets)."""
        with self._lock:
            self._greylist_window = float(window or 0)
            self._greylist_seen = {}

    def clear(self, phase: str | None = None) -> None:
        """Forget scripted rules (all phases, or one)."""
        with self._lock:
            for p in [phase] if phase else PHASES:
                self._limited[p].clear()
                self._standing[p].clear()

    # -- assertions helpers --

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self!r}: condition not met in {timeout} s")
            time.sleep(0.01)

    def wait_messages(self, count: int = 1, timeout: float = 10.0) -> list[Received]:
        """Block until at least `count` messages were received; returns them."""
        self.wait_for(lambda: len(self.messages) >= count, timeout)
        return self.messages

    def replies(self, phase: str) -> list[str]:
        """Replies sent at `phase`, oldest first (from the bounded log)."""
        return [entry.reply for entry in list(self.log) if entry.phase == phase]

    # -- internals: loop thread --

    def _run(self) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        loop.set_exception_handler(
            lambda _loop, context: self.errors.append(str(context.get("message", context)))
        )
        try:
            loop.run_forever()
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()

    def _finish_thread(self) -> None:
        assert self._loop is not None and self._thread is not None
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._thread = None
        self._loop = None

    def _call(self, coro: Any, timeout: float = 10.0) -> Any:
        if self._loop is None:
            coro.close()
            raise RuntimeError(f"{self!r} is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _listen(self) -> None:
        if self._server is not None:
            return
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._protocol, self.host, self.port, reuse_address=True, ssl=self.implicit_tls
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def _unlisten(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()

    async def _close_all(self) -> None:
        await self._unlisten()
        protocols = list(self._protocols)
        for protocol in protocols:
            if protocol.transport is not None:
                protocol.transport.abort()
        deadline = time.monotonic() + 5
        while self._protocols and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        tasks = [p._handler_coroutine for p in protocols if p._handler_coroutine is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=5)

    def _protocol(self) -> _PeerSMTP:
        return _PeerSMTP(
            self,
            hostname=self.hostname,
            ident="ESMTP",
            data_size_limit=self.data_size_limit,
            enable_SMTPUTF8=self.smtputf8,
            tls_context=self.starttls,
            timeout=self.timeout,
            loop=self._loop,
            require_starttls=self.require_starttls,
            auth_required=self.auth_required,
            # Implicit TLS: encrypted from the first byte, which aiosmtpd does not know.
            auth_require_tls=self.auth_require_tls and self.implicit_tls is None,
            auth_exclude_mechanism=[m for m in ("LOGIN", "PLAIN") if m not in self.auth_mechanisms],
            authenticator=_authenticator if self.auth is not None else None,
        )

    # -- internals: called from the loop thread --

    def _connection_opened(self, protocol: _PeerSMTP) -> int:
        self._protocols.add(protocol)
        self.connections += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        return self.connections

    def _connection_closed(self, protocol: _PeerSMTP) -> None:
        if protocol in self._protocols:
            self._protocols.discard(protocol)
            self.active -= 1
            self._log("close", "", protocol)

    def _log(self, phase: str, reply: str, protocol: _PeerSMTP, arg: str = "") -> None:
        if self._log_enabled:
            self.log.append(
                LogEntry(time.time(), phase, reply, protocol._client_ip, protocol._conn, arg)
            )

    def _attempt(self, key: tuple) -> int:
        if not self.track_attempts:
            return 0
        self._attempts[key] += 1
        return self._attempts[key]

    def _next_queue_id(self) -> str:
        return f"{self.host}-{next(self._queue_ids)}"

    def _decide(
        self,
        phase: str,
        rcpt: str | None,
        rcpts: Iterable[str],
        context: Callable[[], Context],
        attempt: int,
    ) -> Action:
        limited, standing = self._limited[phase], self._standing[phase]
        if not limited and not standing:
            return None
        chosen: Script = None
        with self._lock:
            for rule in limited:
                if rule.rcpt is None or rule.rcpt == rcpt or rule.rcpt in rcpts:
                    chosen = rule.action
                    rule.times -= 1
                    if rule.times <= 0:
                        limited.remove(rule)
                    break
            else:
                if rcpt is not None and rcpt in standing:
                    chosen = standing[rcpt]
                else:
                    for key in rcpts:
                        if key in standing:
                            chosen = standing[key]
                            break
                    else:
                        chosen = standing.get(None)
        if callable(chosen):
            ctx = context()
            ctx.attempt = attempt
            chosen = chosen(ctx)
            if callable(chosen):
                raise TypeError(f"a script returned a callable: {chosen!r}")
            _check_action(chosen)
            chosen = _normalised(chosen)
        return chosen

    def _greylisted(self, client_ip: str, sender: str, rcpt: str) -> str | None:
        window = self._greylist_window
        if not window:
            return None
        now = time.monotonic()
        with self._lock:
            first = self._greylist_seen.setdefault((client_ip, sender, rcpt), now)
        remaining = first + window - now
        if remaining <= 0:
            return None
        return f"450 4.2.0 Greylisted, try again in {max(1, math.ceil(remaining))} seconds"


def peers_on_one_port(
    hosts: list[str], per_host: Mapping[str, dict[str, Any]] | None = None, **kw: Any
) -> list[SmtpPeer]:
    """Start one peer per host, all on the same port (the first picks an ephemeral port);
    `kw` go to every peer, `per_host[host]` to that one's (over `kw`).

    Retries with another port when one of the other addresses already has it in use.
    """
    if "port" in kw:
        raise TypeError("peers_on_one_port chooses the port")
    options = {host: {**kw, **(per_host or {}).get(host, {})} for host in hosts}
    last_error: OSError | None = None
    for _ in range(20):
        first = SmtpPeer(hosts[0], 0, **options[hosts[0]]).start()
        peers = [first]
        try:
            for host in hosts[1:]:
                peers.append(SmtpPeer(host, first.port, **options[host]).start())
        except OSError as error:
            for peer in peers:
                peer.stop()
            if error.errno != errno.EADDRINUSE:
                raise
            last_error = error
            continue
        return peers
    raise RuntimeError(f"no common free port for {hosts}") from last_error
