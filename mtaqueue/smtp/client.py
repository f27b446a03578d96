"""The delivery edge: one SMTP client connection to one MX address (aiosmtplib).

It speaks the protocol and reports what happened as `Reply` records (phase,
code, enhanced code, text, or the network event); it decides nothing — the
policy classifies, the delivery layer acts.

A connection to a smarthost (`Smarthost`) may require TLS: implicit (SMTPS, from the first
byte) or STARTTLS with no clear-text fallback, the certificate and name verified; then
client AUTH, PLAIN or LOGIN as the server offers them. AUTH is never sent without TLS.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import ssl
from dataclasses import dataclass, field

import aiosmtplib
from aiosmtplib import SMTPResponseException

from ..config import TimeoutsConfig
from ..conversion import Refused, prepare
from ..logs import get_logger
from ..model import Message, Recipient
from ..policy.replies import COMPLETES, Reply
from ..routing.relays import IMPLICIT, STARTTLS
from .addresses import xtext_encode

# Content up to this size is checked for the hop on the event loop (tens of microseconds);
# larger content in a thread (25 MiB: ~0.1 s to check, ~0.7 s to re-encode).
CONVERT_INLINE = 256 * 1024

log = get_logger("delivery")

_DOT_LINE = re.compile(rb"^\.", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class ClientSettings:
    helo_name: str
    timeouts: TimeoutsConfig
    tls: str  # "opportunistic", "required" or "off"
    source: str = ""  # the local address to bind (a pool's source); "" = the system's choice


@dataclass(frozen=True, slots=True)
class Smarthost:
    """What a connection to a smarthost adds (routing/relays.py, delivery/smarthosts.py)."""

    tls: str  # IMPLICIT, STARTTLS or "" (as ClientSettings.tls, unverified)
    context: ssl.SSLContext | None = field(default=None, compare=False)  # verifies, with tls
    user: str = ""  # "" = no AUTH
    password: str = field(default="", repr=False)
    ca_file: str = ""  # what `context` trusts ("" = the system's CA store)


class ConnectFailed(Exception):
    """No usable SMTP session with this address; `reply` says why. `local`: our address
    on the connection, once it was made (TLS-RPT's sending-mta-ip), else ""."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(reply.line())
        self.reply = reply
        self.local = ""


def _tls_context() -> ssl.SSLContext:
    # Opportunistic TLS to MX hosts: encrypt, do not authenticate (RFC 7435); MTA-STS or
    # DANE would be what makes a certificate check meaningful. So no CA store either
    # (loading it costs ~50 ms of every start).
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


_TLS = _tls_context()


class SmtpConnection:
    """An open session with one server; carries one or more transactions."""

    def __init__(self, client: aiosmtplib.SMTP, host: str, ip: str, tls: bool) -> None:
        self.client = client
        self.host = host  # the MX name, for logs and DSNs' Remote-MTA
        self.ip = ip
        self.tls = tls
        self.verified = False  # TLS with the certificate checked for `host` (MTA-STS)
        self.transactions = 0
        self.refusals = 0  # 4xx replies since it last delivered (the sender counts them)
        self.banner = ""

    @property
    def dsn(self) -> bool:
        return self.client.supports_extension("dsn")

    @property
    def usable(self) -> bool:
        return self.client.is_connected

    @classmethod
    async def open(
        cls,
        host: str,
        ip: str,
        port: int,
        settings: ClientSettings,
        *,
        use_tls: bool = True,
        smarthost: Smarthost | None = None,
    ) -> SmtpConnection:
        """Connect, read the greeting, EHLO (and STARTTLS, and AUTH at a smarthost);
        raises ConnectFailed. `use_tls` False: no STARTTLS (the opportunistic fallback)."""
        t = settings.timeouts
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        if settings.source:
            try:
                sock.bind((settings.source, 0))
            except OSError as exc:  # ours (an address this host does not have): not the host's
                sock.close()
                text = f"cannot bind source {settings.source}: {exc}"
                raise ConnectFailed(_network("connect", "local", text)) from None
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (ip, port)), t.connect)
        except TimeoutError:
            sock.close()
            raise ConnectFailed(_network("connect", "timeout", f"no answer from {ip}")) from None
        except ConnectionRefusedError:
            sock.close()
            raise ConnectFailed(_network("connect", "refused", f"{ip} refused")) from None
        except OSError as exc:
            sock.close()
            raise ConnectFailed(_network("connect", "unreachable", f"{ip}: {exc}")) from None
        try:
            local = sock.getsockname()[0]
        except OSError:  # already reset
            local = ""
        relay_tls = smarthost.tls if smarthost is not None else ""
        implicit = relay_tls == IMPLICIT
        # A smarthost's required TLS is verified; opportunistic TLS to an MX is not (_TLS).
        context = smarthost.context if relay_tls and smarthost is not None else None
        client = aiosmtplib.SMTP(
            hostname=host if implicit else None,  # the name its certificate must carry
            local_hostname=settings.helo_name,
            use_tls=implicit,
            tls_context=context if implicit else None,
            start_tls=False,
        )
        conn = cls(client, host, ip, tls=implicit)
        required = relay_tls != "" or settings.tls == "required"
        try:
            greeting = await _step(
                conn, "banner", client.connect(sock=sock, timeout=t.banner, start_tls=False)
            )
            conn.banner = greeting.message
            await conn._hello(t.ehlo)
            wanted = relay_tls == STARTTLS or (not relay_tls and settings.tls != "off")
            if wanted and use_tls and client.supports_extension("starttls"):
                await conn._start_tls(t, context or _TLS)
            if required and not conn.tls:
                why = "; AUTH is not sent in clear text" if smarthost and smarthost.user else ""
                text = f"{host} does not offer TLS{why}"
                raise ConnectFailed(Reply("starttls", 0, "4.7.10", text, network="tls"))
            if smarthost is not None and smarthost.user:
                await conn._authenticate(smarthost, t.ehlo)
        except ConnectFailed as failed:
            conn.abort()
            failed.local = local
            raise
        return conn

    async def _authenticate(self, smarthost: Smarthost, timeout: float) -> None:
        """AUTH PLAIN, else LOGIN, as the server's EHLO offers (RFC 4954); only over TLS.
        AUTH waits as long as EHLO does (it has no timeout of its own)."""
        client = self.client
        if not self.tls:  # relays.tls_mode requires TLS with a user: a second lock
            text = "AUTH not sent: the session is not encrypted"
            raise ConnectFailed(Reply("auth", 0, "", text, network="tls"))
        offered = client.server_auth_methods  # lower-case, from the EHLO after TLS
        user, password = smarthost.user, smarthost.password
        if "plain" in offered:
            call = client.auth_plain(user, password, timeout=timeout)
        elif "login" in offered:
            call = client.auth_login(user, password, timeout=timeout)
        else:
            what = f"only {' '.join(offered).upper()}" if offered else "no AUTH"
            text = f"{self.host} offers {what}: AUTH PLAIN or LOGIN is needed for {user}"
            raise ConnectFailed(Reply("auth", 0, "", text, network="auth"))
        await _step(self, "auth", call)

    async def _start_tls(self, t: TimeoutsConfig, context: ssl.SSLContext) -> None:
        """STARTTLS and the EHLO over TLS; any failure in between is a "starttls" failure.

        (With TLS 1.3 a server that rejects the handshake may only say so at our next
        read, the EHLO: the caller's clear-text fallback must see it as a TLS problem.)
        """
        try:
            await _step(
                self,
                "starttls",
                self.client.starttls(
                    tls_context=context, server_hostname=self.host, timeout=t.starttls
                ),
            )
            self.tls = True
            await self._hello(t.ehlo)
        except ConnectFailed as failed:
            reply = failed.reply
            raise ConnectFailed(
                Reply(
                    "starttls",
                    reply.code,
                    reply.enhanced,
                    f"TLS session failed: {reply.text}",
                    network="tls" if reply.network else "",
                )
            ) from None

    async def _hello(self, timeout: float) -> None:
        try:
            await _step(self, "ehlo", self.client.ehlo(timeout=timeout))
        except ConnectFailed as failed:
            if not 500 <= failed.reply.code < 600:
                raise
            await _step(self, "ehlo", self.client.helo(timeout=timeout))  # an old server

    async def send(
        self, message: Message, recipients: list[Recipient], content: bytes, t: TimeoutsConfig
    ) -> list[Reply]:
        """One transaction; returns the decisive reply for each recipient, in order.

        Every failure is a reply: a refusal, a network event, a protocol error, or a local
        error (ours) for anything else before the final dot. A session left in doubt is
        closed (`usable` turns false) so that no later reply can be taken for another's.
        """
        self.transactions += 1
        try:
            return await self._send(message, recipients, content, t)
        except Exception as exc:  # a bug of ours before the final dot: nothing was delivered
            self.abort()
            reply = _network("mail", "local", f"local error: {type(exc).__name__}: {exc}")
            return [reply] * len(recipients)

    async def _send(
        self, message: Message, recipients: list[Recipient], content: bytes, t: TimeoutsConfig
    ) -> list[Reply]:
        client = self.client
        if message.smtputf8 and not client.supports_extension("smtputf8"):
            reply = Reply("mail", 553, "5.6.7", f"{self.host} does not support SMTPUTF8")
            return [reply] * len(recipients)
        # RFC 6531 makes 8BITMIME part of SMTPUTF8; Postfix also takes one for the other.
        eightbitmime = client.supports_extension("8bitmime")
        eight_bit_hop = eightbitmime or client.supports_extension("smtputf8")
        if len(content) < CONVERT_INLINE:
            prepared = prepare(content, eightbitmime=eight_bit_hop)
        else:  # scanning (or re-encoding) megabytes would stall every other session
            prepared = await asyncio.to_thread(prepare, content, eightbitmime=eight_bit_hop)
        if isinstance(prepared, Refused):
            reply = Reply("mail", 554, prepared.status, f"{prepared.reason} ({self.host})")
            return [reply] * len(recipients)
        dsn = self.dsn
        options = [f"SIZE={len(prepared.content)}"]
        if prepared.eight_bit and eightbitmime:
            options.append("BODY=8BITMIME")
        if message.smtputf8:
            options.append("SMTPUTF8")
        if dsn and message.ret:
            options.append(f"RET={message.ret}")
        if dsn and message.envid:
            options.append(f"ENVID={xtext_encode(message.envid)}")
        # Addresses in UTF-8 only with SMTPUTF8 (RFC 6531 3.2); else they are ASCII.
        encoding = "utf-8" if message.smtputf8 else "ascii"
        replies: list[Reply | None] = [None] * len(recipients)
        try:
            await self._command("mail", "MAIL FROM", message.sender, options, encoding, t.mail)
        except ConnectFailed as failed:
            await self._reset()
            return [failed.reply] * len(recipients)
        accepted = []
        for i, rcpt in enumerate(recipients):
            rcpt_options = []
            if dsn and rcpt.notify:
                rcpt_options.append(f"NOTIFY={rcpt.notify}")
            if dsn and rcpt.orcpt:
                kind, _, address = rcpt.orcpt.partition(";")
                rcpt_options.append(f"ORCPT={kind};{xtext_encode(address)}")
            try:
                await self._command("rcpt", "RCPT TO", rcpt.address, rcpt_options, encoding, t.rcpt)
                accepted.append(i)
            except ConnectFailed as failed:
                replies[i] = failed.reply
                if not client.is_connected:
                    return [r or failed.reply for r in replies]
        if not accepted:
            await self._reset()
            return [r for r in replies if r is not None]
        final = await self._data(prepared.content, t)
        return [r or final for r in replies]

    async def _command(
        self,
        phase: str,
        verb: str,
        address: str,
        options: list[str],
        encoding: str,
        timeout: float,
    ) -> None:
        """MAIL FROM:<address> or RCPT TO:<address>, with its parameters."""
        try:
            words = [f"{verb}:<{address}>".encode(encoding), *(o.encode("ascii") for o in options)]
        except UnicodeEncodeError as exc:  # nothing sent: the session is as it was
            raise ConnectFailed(_network(phase, "local", f"local error: {exc}")) from None
        await _step(self, phase, self.client.execute_command(b" ".join(words), timeout=timeout))

    async def _data(self, content: bytes, t: TimeoutsConfig) -> Reply:
        """DATA with its own timeouts for the 354 and for the final reply.

        aiosmtplib's data() uses one timeout for both and cannot tell which step
        failed; the step matters: from the final dot on, any failure is ambiguous (the
        server may have the message), and only a 2xx is a delivery.
        """
        try:
            await _step(self, "data", self.client.execute_command(b"DATA", timeout=t.data_start))
        except ConnectFailed as failed:
            await self._reset()  # a refused DATA leaves the transaction open
            return failed.reply
        body = _DOT_LINE.sub(b"..", content)
        if not body.endswith(b"\r\n"):
            body += b"\r\n"
        protocol = self.client.protocol
        if protocol is None:
            return _network("data", "lost", "connection lost before the content was sent")
        # As aiosmtplib's execute_data_command does after the 354 (the connection is this
        # worker's alone: no command lock).
        protocol._response_pending = True
        try:
            protocol.write(body + b".\r\n")
        except Exception as exc:
            self.abort()
            return _network("data", "lost", f"the content could not be sent: {exc}")
        try:
            final = await protocol.read_response(timeout=t.data_done)
        except aiosmtplib.SMTPTimeoutError:
            reply = _network("data_end", "timeout", "no reply after the end of data")
        except (aiosmtplib.SMTPServerDisconnected, ConnectionError):
            reply = _network("data_end", "lost", "connection lost after the end of data")
        except aiosmtplib.SMTPResponseException as exc:  # garbage, or a reply too long
            reply = _reply("data_end", exc.code, exc.message)
        except Exception as exc:
            reply = _network("data_end", "local", f"local error after the end of data: {exc}")
        else:
            reply = _reply("data_end", final.code, final.message)
            if final.code // 100 in (2, 4, 5) and final.code != 421 and self._in_step():
                return reply
        self.abort()  # the session is over (421), or a later reply could be this one's
        return reply

    def _in_step(self) -> bool:
        """No more than the one reply came: a server that sends two (or a late one) would
        have every later reply taken for the one before."""
        protocol = self.client.protocol
        return protocol is not None and not protocol._buffer

    async def _reset(self) -> None:
        if not self.client.is_connected:
            return
        try:
            await self.client.rset(timeout=30)
        except Exception as exc:  # "421 too many errors" and the like: the session is over
            reply = f"{exc.code} {exc.message}" if isinstance(exc, SMTPResponseException) else exc
            log.warning("rset_failed", host=self.host, ip=self.ip, reply=str(reply))
            self.abort()

    async def quit(self) -> None:
        with contextlib.suppress(Exception):  # a courtesy: whatever happens, it is closed
            if self.client.is_connected:
                await self.client.quit(timeout=10)
        self.abort()

    def abort(self) -> None:
        with contextlib.suppress(OSError, RuntimeError):
            self.client.close()


async def _step(conn: SmtpConnection, phase: str, call):
    """Await one aiosmtplib step and check its reply against the codes that complete it.

    Any failure raises ConnectFailed(Reply): a 4xx/5xx refusal leaves the session as it
    is; anything else (a timeout, a lost connection, a reply out of step, garbage, more
    than one reply, a local error) leaves it in doubt, so it is closed.
    """
    try:
        response = await call
    except aiosmtplib.SMTPTimeoutError:
        reply = _network(phase, "timeout", f"timed out waiting for the {phase} reply")
    except aiosmtplib.SMTPServerDisconnected:
        reply = _network(phase, "lost", f"connection lost during {phase}")
    except aiosmtplib.SMTPResponseException as exc:  # aiosmtplib checked the code
        reply = _reply(phase, exc.code, exc.message)
    except ssl.SSLError as exc:
        reply = _network(phase, "tls", f"TLS failed: {exc}")
    except (aiosmtplib.SMTPException, OSError) as exc:
        if isinstance(exc.__cause__, ssl.SSLError):  # implicit TLS: the handshake at connect
            reply = _network(phase, "tls", f"TLS failed: {exc.__cause__}")
        else:
            reply = _network(phase, "lost", f"{phase}: {exc}")
    except Exception as exc:  # ours: an address that does not encode, a bug
        reply = _network(phase, "local", f"local error: {type(exc).__name__}: {exc}")
    else:
        if response.code in COMPLETES[phase] and conn._in_step():
            return response
        if response.code in COMPLETES[phase]:
            reply = _network(phase, "protocol", f"more than one reply to {phase}")
        else:
            reply = _reply(phase, response.code, response.message)
    if not 400 <= reply.code < 600:
        conn.abort()
    raise ConnectFailed(reply)


def _reply(phase: str, code: int, message: str) -> Reply:
    """A server's reply; one without a valid code is no SMTP reply at all."""
    if 100 <= code < 600:
        return Reply.parse(phase, code, message)
    return _network(phase, "protocol", f"protocol error: {message}"[:500])


def _network(phase: str, event: str, text: str) -> Reply:
    return Reply(phase, 0, "", text, network=event)
