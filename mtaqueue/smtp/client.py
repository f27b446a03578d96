"""The delivery edge: one SMTP client connection to one MX address.

    await SmtpConnection.open(host, ip, port, settings, use_tls=, smarthost=) -> it
        connect, greeting, EHLO (STARTTLS, AUTH); raises ConnectFailed(reply)
    await .send(message, recipients, content, t) -> [Reply]   one transaction
    .pipeline                    the session's transactions (smtp/pipeline.py)
    .usable  .dsn  .host  .ip  .tls  .verified  .banner
    .handshake                   [(kind, seconds)]: the connect, banner and EHLO, timed
    await .quit() / .abort()

It speaks the protocol and reports what happened as `Reply` records (phase,
code, enhanced code, text, or the network event); it decides nothing — the
policy classifies, the delivery layer acts.

The handshake is aiosmtplib's: it does TLS (STARTTLS, implicit TLS, their errors) and
AUTH well. The transactions are ours (smtp/pipeline.py, on a ReplyStream that takes the
transport over): aiosmtplib keeps one reply at a time and cannot pipeline.

A connection to a smarthost (`Smarthost`) may require TLS: implicit (SMTPS, from the first
byte) or STARTTLS with no clear-text fallback, the certificate and name verified; then
client AUTH, PLAIN or LOGIN as the server offers them. AUTH is never sent without TLS.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiosmtplib

from ..config import TimeoutsConfig
from ..model import Message, Recipient
from ..policy.replies import COMPLETES, Reply
from ..routing.relays import IMPLICIT, STARTTLS
from .pipeline import Ahead, Pending, Pipeline, network, smtp_reply
from .reply_stream import ReplyStream


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


# What the delivery side gives for the transaction to write behind a Pending one's dot.
Follow = Callable[[Pending], Awaitable[Ahead | None]]


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
        self.handshake: list[tuple[str, float]] = []  # replies timed (policy/latency.py)
        self.pipeline: Pipeline | None = None  # the transactions, once the handshake is over

    @property
    def dsn(self) -> bool:
        return self.pipeline is not None and self.pipeline.dsn

    @property
    def usable(self) -> bool:
        return self.pipeline is not None and self.pipeline.usable

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
                raise ConnectFailed(network("connect", "local", text)) from None
        started = time.monotonic()
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (ip, port)), t.connect)
        except TimeoutError:
            sock.close()
            raise ConnectFailed(network("connect", "timeout", f"no answer from {ip}")) from None
        except ConnectionRefusedError:
            sock.close()
            raise ConnectFailed(network("connect", "refused", f"{ip} refused")) from None
        except OSError as exc:
            sock.close()
            raise ConnectFailed(network("connect", "unreachable", f"{ip}: {exc}")) from None
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
        timed = conn.handshake
        try:
            timed.append(("connect", time.monotonic() - started))
            started = time.monotonic()
            greeting = await _step(
                conn, "banner", client.connect(sock=sock, timeout=t.banner, start_tls=False)
            )
            conn.banner = greeting.message
            if not implicit:  # (else its time is TLS's as much as the server's)
                timed.append(("banner", time.monotonic() - started))
            started = time.monotonic()
            await conn._hello(t.ehlo)
            timed.append(("ehlo", time.monotonic() - started))
            wanted = relay_tls == STARTTLS or (not relay_tls and settings.tls != "off")
            if wanted and use_tls and client.supports_extension("starttls"):
                await conn._start_tls(t, context or _TLS)
            if required and not conn.tls:
                why = "; AUTH is not sent in clear text" if smarthost and smarthost.user else ""
                text = f"{host} does not offer TLS{why}"
                raise ConnectFailed(Reply("starttls", 0, "4.7.10", text, network="tls"))
            if smarthost is not None and smarthost.user:
                await conn._authenticate(smarthost, t.ehlo)
            conn._take_over()
        except ConnectFailed as failed:
            conn.abort()
            failed.local = local
            raise
        return conn

    def _take_over(self) -> None:
        """The handshake is over: the transactions read their replies from a ReplyStream
        (aiosmtplib's protocol keeps one reply at a time: pipelined ones would be lost)."""
        client = self.client
        transport = client.protocol.transport if client.protocol is not None else None
        if transport is None or transport.is_closing():
            raise ConnectFailed(network("ehlo", "lost", "connection lost after EHLO"))
        extensions = frozenset(client.esmtp_extensions)
        stream = ReplyStream.take_over(transport)
        self.pipeline = Pipeline(stream, extensions, self.host, self.ip)

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
        self,
        message: Message,
        recipients: list[Recipient],
        content: bytes,
        t: TimeoutsConfig,
        follow: Follow | None = None,
    ) -> list[Reply]:
        """One transaction (smtp/pipeline.py); returns the decisive reply for each
        recipient, in order. `follow`, asked when the content is next on a pipelining
        session: the transaction to write behind its final dot (then `pipeline.ahead`
        says whether it went out with its replies, for the next `send` of that message).

        Every failure is a reply: a refusal, a network event, a protocol error, or a local
        error (ours) for anything else before the final dot. A session left in doubt is
        closed (`usable` turns false) so that no later reply can be taken for another's.
        """
        self.transactions += 1
        pipeline = self.pipeline
        assert pipeline is not None
        try:
            begun = await pipeline.begin(message, recipients, content, t)
            if isinstance(begun, list):
                return begun
            then = await follow(begun) if follow is not None and pipeline.pipelining else None
            return await pipeline.finish(begun, t, then)
        except Exception as exc:  # a bug of ours before the final dot: nothing was delivered
            self.abort()
            reply = network("mail", "local", f"local error: {type(exc).__name__}: {exc}")
            return [reply] * len(recipients)

    def _in_step(self) -> bool:
        """During the handshake (aiosmtplib's protocol): no more than the one reply came. A
        server that sends two (or a late one) would have every later reply taken for the
        one before."""
        protocol = self.client.protocol
        return protocol is not None and not protocol._buffer

    async def quit(self) -> None:
        if self.pipeline is not None:
            await self.pipeline.quit()
        self.abort()

    def abort(self) -> None:
        with contextlib.suppress(OSError, RuntimeError):
            if self.pipeline is not None:
                self.pipeline.close()
            else:
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
        reply = network(phase, "timeout", f"timed out waiting for the {phase} reply")
    except aiosmtplib.SMTPServerDisconnected:
        reply = network(phase, "lost", f"connection lost during {phase}")
    except aiosmtplib.SMTPResponseException as exc:  # aiosmtplib checked the code
        reply = smtp_reply(phase, exc.code, exc.message)
    except ssl.SSLError as exc:
        reply = network(phase, "tls", f"TLS failed: {exc}")
    except (aiosmtplib.SMTPException, OSError) as exc:
        if isinstance(exc.__cause__, ssl.SSLError):  # implicit TLS: the handshake at connect
            reply = network(phase, "tls", f"TLS failed: {exc.__cause__}")
        else:
            reply = network(phase, "lost", f"{phase}: {exc}")
    except Exception as exc:  # ours: an address that does not encode, a bug
        reply = network(phase, "local", f"local error: {type(exc).__name__}: {exc}")
    else:
        if response.code in COMPLETES[phase] and conn._in_step():
            return response
        if response.code in COMPLETES[phase]:
            reply = network(phase, "protocol", f"more than one reply to {phase}")
        else:
            reply = smtp_reply(phase, response.code, response.message)
    if not 400 <= reply.code < 600:
        conn.abort()
    raise ConnectFailed(reply)
