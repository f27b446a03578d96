"""The delivery edge: one SMTP client connection to one MX address (aiosmtplib).

It speaks the protocol and reports what happened as `Reply` records (phase,
code, enhanced code, text, or the network event); it decides nothing — the
policy classifies, the delivery layer acts.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import ssl
from dataclasses import dataclass

import aiosmtplib

from ..config import TimeoutsConfig
from ..model import Message, Recipient
from ..policy.replies import Reply
from .addresses import xtext_encode

_DOT_LINE = re.compile(rb"^\.", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class ClientSettings:
    helo_name: str
    timeouts: TimeoutsConfig
    tls: str  # "opportunistic", "required" or "off"


class ConnectFailed(Exception):
    """No usable SMTP session with this address; `reply` says why."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(reply.line())
        self.reply = reply


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
        self.transactions = 0
        self.banner = ""

    @property
    def dsn(self) -> bool:
        return self.client.supports_extension("dsn")

    @property
    def usable(self) -> bool:
        return self.client.is_connected

    @classmethod
    async def open(
        cls, host: str, ip: str, port: int, settings: ClientSettings, *, use_tls: bool = True
    ) -> SmtpConnection:
        """Connect, read the greeting, EHLO (and STARTTLS); raises ConnectFailed."""
        t = settings.timeouts
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
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
        client = aiosmtplib.SMTP(local_hostname=settings.helo_name, start_tls=False)
        conn = cls(client, host, ip, tls=False)
        try:
            greeting = await _step(
                "banner", client.connect(sock=sock, timeout=t.banner, start_tls=False)
            )
            conn.banner = greeting.message
            await conn._hello(t.ehlo)
            if settings.tls != "off" and use_tls and client.supports_extension("starttls"):
                await conn._start_tls(t)
        except ConnectFailed:
            conn.abort()
            raise
        if settings.tls == "required" and not conn.tls:
            conn.abort()
            raise ConnectFailed(
                Reply("starttls", 0, "4.7.10", f"{host} does not offer TLS", network="tls")
            )
        return conn

    async def _start_tls(self, t: TimeoutsConfig) -> None:
        """STARTTLS and the EHLO over TLS; any failure in between is a "starttls" failure.

        (With TLS 1.3 a server that rejects the handshake may only say so at our next
        read, the EHLO: the caller's clear-text fallback must see it as a TLS problem.)
        """
        try:
            await _step(
                "starttls",
                self.client.starttls(
                    tls_context=_TLS, server_hostname=self.host, timeout=t.starttls
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
            await _step("ehlo", self.client.ehlo(timeout=timeout))
        except ConnectFailed as failed:
            if not 500 <= failed.reply.code < 600:
                raise
            await _step("ehlo", self.client.helo(timeout=timeout))  # an old server

    async def send(
        self, message: Message, recipients: list[Recipient], content: bytes, t: TimeoutsConfig
    ) -> list[Reply]:
        """One transaction; returns the decisive reply for each recipient, in order.

        A failure that ends the connection raises ConnectFailed only before MAIL;
        from MAIL on, it is reported as every pending recipient's reply.
        """
        self.transactions += 1
        client = self.client
        if message.smtputf8 and not client.supports_extension("smtputf8"):
            reply = Reply("mail", 553, "5.6.7", f"{self.host} does not support SMTPUTF8")
            return [reply] * len(recipients)
        dsn = self.dsn
        options = [f"SIZE={len(content)}"]
        if message.body == "8BITMIME" and client.supports_extension("8bitmime"):
            options.append("BODY=8BITMIME")
        if message.smtputf8:
            options.append("SMTPUTF8")
        if dsn and message.ret:
            options.append(f"RET={message.ret}")
        if dsn and message.envid:
            options.append(f"ENVID={xtext_encode(message.envid)}")
        replies: list[Reply | None] = [None] * len(recipients)
        try:
            await _step("mail", client.mail(message.sender, options=options, timeout=t.mail))
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
                await _step("rcpt", client.rcpt(rcpt.address, options=rcpt_options, timeout=t.rcpt))
                accepted.append(i)
            except ConnectFailed as failed:
                replies[i] = failed.reply
                if not client.is_connected:
                    return [r or failed.reply for r in replies]
        if not accepted:
            await self._reset()
            return [r for r in replies if r is not None]
        final = await self._data(content, t)
        return [r or final for r in replies]

    async def _data(self, content: bytes, t: TimeoutsConfig) -> Reply:
        """DATA with its own timeouts for the 354 and for the final reply.

        aiosmtplib's data() uses one timeout for both and cannot tell which step
        failed; the step matters (a lost reply after the final dot is ambiguous).
        """
        protocol = self.client.protocol
        assert protocol is not None
        try:
            start = await _step("data", self.client.execute_command(b"DATA", timeout=t.data_start))
        except ConnectFailed as failed:
            return failed.reply
        if start.code != 354:
            return Reply.parse("data", start.code, start.message)
        body = _DOT_LINE.sub(b"..", content)
        if not body.endswith(b"\r\n"):
            body += b"\r\n"
        try:
            # The same sequence as aiosmtplib's execute_data_command, after the 354.
            async with protocol._command_lock:  # type: ignore[union-attr]
                protocol._response_pending = True
                protocol.write(body + b".\r\n")
                final = await protocol.read_response(timeout=t.data_done)
        except aiosmtplib.SMTPTimeoutError:
            return _network("data_end", "timeout", "no reply after the end of data")
        except (aiosmtplib.SMTPServerDisconnected, ConnectionError):
            return _network("data_end", "lost", "connection lost after the end of data")
        return Reply.parse("data_end", final.code, final.message)

    async def _reset(self) -> None:
        if self.client.is_connected:
            try:
                await self.client.rset(timeout=30)
            except (aiosmtplib.SMTPException, OSError):
                self.abort()

    async def quit(self) -> None:
        with contextlib.suppress(aiosmtplib.SMTPException, OSError):
            if self.client.is_connected:
                await self.client.quit(timeout=10)
        self.abort()

    def abort(self) -> None:
        with contextlib.suppress(OSError, RuntimeError):
            self.client.close()


async def _step(phase: str, call):
    """Await an aiosmtplib call; turn its exceptions into a ConnectFailed(Reply)."""
    try:
        return await call
    except aiosmtplib.SMTPTimeoutError:
        text = f"timed out waiting for the {phase} reply"
        raise ConnectFailed(_network(phase, "timeout", text)) from None
    except aiosmtplib.SMTPServerDisconnected:
        raise ConnectFailed(_network(phase, "lost", f"connection lost during {phase}")) from None
    except aiosmtplib.SMTPResponseException as exc:
        raise ConnectFailed(Reply.parse(phase, exc.code, exc.message)) from None
    except ssl.SSLError as exc:
        raise ConnectFailed(_network(phase, "tls", f"TLS failed: {exc}")) from None
    except (aiosmtplib.SMTPException, OSError) as exc:
        raise ConnectFailed(_network(phase, "lost", f"{phase}: {exc}")) from None


def _network(phase: str, event: str, text: str) -> Reply:
    return Reply(phase, 0, "", text, network=event)
