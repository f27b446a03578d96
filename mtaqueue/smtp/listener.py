"""The submission listener: sockets, timers and limits around `ServerSession`.

It runs in the listener's process (listener_main.py); its `spool` is the daemon's, over a
socketpair (`SpoolClient`), and `on_change` tells the daemon its sessions and counts.
A plain asyncio Protocol (no StreamReader): each read goes straight into the
session, replies go straight out. Commits go to the spool as futures with a
done-callback, so accepting a message costs no task and no thread hop of its own.
A message too large to hold is written to its spool file piece by piece as the
session hands it on; while a piece is written (in a thread) we stop reading that
client once a little more has come, so the client waits for the disk, not our memory.
Mail a DKIM key signs goes to the signing service between `prepare()` and the spool
(a streamed message is signed by the spool's threads as they write it).
"""

from __future__ import annotations

import asyncio
import ipaddress
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..dkim.service import SigningService
from ..dkim.signature import PendingSignature
from ..logs import get_logger
from ..model import Message
from ..spool.errors import StorageFull
from ..submission import (
    Received,
    Refused,
    SubmissionSettings,
    accepted_fields,
    prepare,
    prepare_header,
)
from ..transaction import Stream, Submit
from .actions import CheckCredentials, Finish, StartTLS, Write
from .admission import Limits, Slots, in_networks
from .auth import Credentials
from .server_session import ServerSession
from .session_settings import SessionSettings
from .spool_client import RemoteIncoming, SpoolClient

log = get_logger("listener")

MAX_PIPELINED = 1 << 20  # input buffered while a commit is pending before we stop reading
STREAM_BACKLOG = 1 << 17  # the same while a piece of a streamed message is written


@dataclass(frozen=True, slots=True)
class ListenerSettings:
    host: str
    port: int
    mynetworks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    max_connections: int
    max_connections_per_client: int
    client_limit_exceptions: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    command_timeout: float
    stress_command_timeout: float  # instead, while the listener is under stress
    data_timeout: float
    stress_data_timeout: float  # instead, while the listener is under stress
    min_data_rate: int
    session: SessionSettings
    submission: SubmissionSettings


class Listener:
    def __init__(
        self,
        settings: ListenerSettings,
        spool: SpoolClient,
        signing: SigningService,
        *,
        tls: ssl.SSLContext | None = None,
        credentials: Credentials | None = None,
        rcpt_check: Callable[[str], str | None] | None = None,
        on_change: Callable[[], None] = lambda: None,  # sessions, stress or sheds changed
    ) -> None:
        self.settings = settings
        self.rcpt_check = rcpt_check
        self.on_change = on_change
        self.spool = spool
        self.signing = signing
        self.tls = tls
        self.credentials = credentials
        self.slots = Slots(_limits(settings))
        self.draining = False
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: SubmissionProtocol(self),
            self.settings.host,
            self.settings.port,
            reuse_address=True,
            backlog=1024,
        )
        self._sweeper = asyncio.create_task(self._sweep_deadlines())

    def reconfigure(self, settings: ListenerSettings) -> None:
        """New limits for new sessions (the address is fixed until restart)."""
        self.settings = settings
        self.slots.configure(_limits(settings))

    def state(self) -> dict[str, int]:
        """For the metrics: sessions open, whether under stress, sessions shed so far."""
        slots = self.slots
        return {
            "sessions": len(slots.sessions),
            "stress": int(slots.stress.active),
            "shed": slots.shed_count,
        }

    @property
    def connections(self) -> set[SubmissionProtocol]:
        return self.slots.sessions  # type: ignore[return-value]  # only ours go in

    @property
    def addresses(self) -> list[str]:
        assert self._server is not None
        return [f"{s.getsockname()[0]}:{s.getsockname()[1]}" for s in self._server.sockets]

    def may_relay(self, client: str) -> bool:
        return in_networks(client, self.settings.mynetworks)

    async def close(self, grace: float) -> None:
        """Stop accepting; let sessions in the middle of a message finish, up to `grace`."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.drain()
        deadline = time.monotonic() + grace
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.abort()
        if self._sweeper is not None:
            self._sweeper.cancel()

    async def _sweep_deadlines(self) -> None:
        # One periodic pass instead of a timer per connection: cheaper per read.
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for conn in list(self.connections):
                conn.check_deadline(now)
            self.slots.check(now)
            self.on_change()


def _limits(settings: ListenerSettings) -> Limits:
    return Limits(
        settings.max_connections,
        settings.max_connections_per_client,
        settings.client_limit_exceptions,
        settings.session.hostname,
        settings.stress_command_timeout,
        settings.stress_data_timeout,
    )


class SubmissionProtocol(asyncio.Protocol):
    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.transport: asyncio.Transport | None = None
        self.session: ServerSession | None = None
        self.client = ""
        # When the command line (or the DATA transfer) in progress must be done by.
        self.deadline = time.monotonic() + listener.settings.command_timeout
        self.progress = time.monotonic()  # the last completed command, or DATA bytes
        self._waiting = False
        self._waited_from = 0.0  # monotonic: when the pending action began
        self._incoming: RemoteIncoming | None = None  # the streamed message being written
        self._write_paused = False  # our replies pile up: the client does not read them
        self._reading = True
        self._starting_tls = False
        self._tls_task: asyncio.Future | None = None
        self._tls = False

    # -- asyncio callbacks ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        self.client = peer[0] if peer else ""
        listener = self.listener
        settings = listener.settings
        now = time.monotonic()
        refusal = listener.slots.admit(self, now)
        listener.on_change()
        if refusal is not None:
            self._refuse(refusal)
            return
        self._restart_deadline(now)  # shorter under stress
        self.session = ServerSession(
            settings.session,
            may_relay=listener.may_relay(self.client),
            storage_refusal=lambda: listener.spool.refusal,
            rcpt_check=listener.rcpt_check,
        )
        transport.write(self.session.greeting())

    def connection_lost(self, exc: Exception | None) -> None:
        if self._incoming is not None:  # gone in the middle of a streamed message
            self._incoming.discard()
            self._incoming = None
        self.listener.slots.release(self, time.monotonic())
        self.listener.on_change()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        session = self.session
        if session is None or self._starting_tls:
            return  # clear text sent before the TLS handshake is never executed
        now = time.monotonic()
        in_data, completed = session.in_data, session.completed
        try:
            action = session.receive(data)
            if session.completed != completed:
                self._restart_deadline(now)
            elif in_data:
                self.progress = now
                # Postfix's smtpd_min_data_rate: each read earns len/min_data_rate seconds,
                # never more than data_timeout ahead. A stalled or trickling client runs
                # out; one that keeps the rate can send a message of any allowed size.
                settings = self.listener.settings
                earned = self.deadline + len(data) / settings.min_data_rate
                timeout = self.listener.slots.data_timeout(settings.data_timeout)
                self.deadline = min(earned, now + timeout)
            self._continue(action)
        except Exception:  # a bug must cost one session a clear reply, not hang it
            log.exception("session_failed", client=self.client)
            if self.transport is not None:
                self.transport.write(b"421 4.3.0 Internal error, try again later\r\n")
                self.transport.close()
            return
        self._update_reading()

    def eof_received(self) -> bool | None:
        return False  # close our side too

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._update_reading()

    # -- driving the session -------------------------------------------------------

    def _continue(self, action) -> None:
        session = self.session
        transport = self.transport
        if session is None or transport is None:
            return
        out = session.take_output()
        if out:
            transport.write(out)
        if action is not None:
            self._waiting = True
            self._waited_from = time.monotonic()
            if isinstance(action, Submit):
                self._submit(action)
            elif isinstance(action, Stream):
                self._stream(action)
            elif isinstance(action, Write):
                assert self._incoming is not None
                self._stored(self._incoming.write(action.data))
            elif isinstance(action, Finish):
                self._finish(action)
            elif isinstance(action, CheckCredentials):
                self._check_credentials(action)
            elif isinstance(action, StartTLS):
                self._starting_tls = True
                self._tls_task = asyncio.ensure_future(self._start_tls())
        elif session.closed:
            transport.close()
        elif self.listener.draining and not session.busy:
            session.shutting_down()
            self._continue(None)

    def _resume(self, outcome) -> None:
        self._waiting = False
        if self.session is None or self.transport is None:
            return
        # The client waited for us, not we for it: that time is not its own.
        now = time.monotonic()
        if self.session.in_data:  # a piece of a streamed message was written
            self.deadline += now - self._waited_from
        else:
            self._restart_deadline(now)
        self._update_reading()
        self._continue(self.session.resume(outcome))

    def _submit(self, submit: Submit) -> None:
        spool = self.listener.spool
        now = time.time()
        received = Received(spool.ids.next(now), now, self.client, self._tls)
        try:
            message, content = prepare(submit, received, self.listener.settings.submission)
        except Refused as exc:
            log.info("refused", client=self.client, sender=submit.envelope.sender, reply=str(exc))
            self._resume(str(exc))
            return
        signing = self.listener.signing.sign(message, content)
        if signing is None:
            self._accept(message, content)
        else:
            signing.add_done_callback(self._signed)

    def _signed(self, future: asyncio.Future) -> None:
        if future.exception() is not None:  # a bug, logged by the signing service
            self._resume("451 4.3.0 Temporary signing failure, try again later")
        else:
            self._accept(*future.result())

    def _accept(
        self, message: Message, content: bytes, pending: list[PendingSignature] | None = None
    ) -> None:
        future = self.listener.spool.accept(message, content, pending or [])
        future.add_done_callback(lambda f: self._committed(f, message))

    def _stream(self, stream: Stream) -> None:
        """A message too large to hold begins: write its file as it comes."""
        spool = self.listener.spool
        now = time.time()
        received = Received(spool.ids.next(now), now, self.client, self._tls)
        try:
            message, header = prepare_header(
                stream, stream.header, 0, received, self.listener.settings.submission
            )
        except Refused as exc:
            log.info("refused", client=self.client, sender=stream.envelope.sender, reply=str(exc))
            self._resume(str(exc))  # the session reads the rest and answers this
            return
        # Signed (by the daemon) as its content is written: the header goes before the body.
        self._incoming = spool.incoming(message, header, now)
        self._stored(self._incoming.write(header, stream.data))

    def _stored(self, future: asyncio.Future) -> None:
        def done(f: asyncio.Future) -> None:
            exc = f.exception()
            if exc is None:
                self._resume(None)
                return
            if self._incoming is not None:
                self._incoming.discard()
                self._incoming = None
            self._resume(self._storage_refusal(exc))

        future.add_done_callback(done)

    def _finish(self, finish: Finish) -> None:
        incoming, self._incoming = self._incoming, None  # the spool's from now on
        assert incoming is not None
        if finish.refusal is not None:
            incoming.discard()
            self._resume(finish.refusal)
            return
        future = incoming.commit(finish.data)
        future.add_done_callback(lambda f: self._committed(f, incoming.message))

    def _committed(self, future: asyncio.Future, message: Message) -> None:
        exc = future.exception()
        if exc is None:
            queue_id = future.result()
            if queue_id == message.id:
                log.info("accepted", **accepted_fields(message, self.client))
            else:
                log.info(
                    "duplicate_submission",
                    id=queue_id,
                    idempotency_key=message.idempotency_key,
                    client=self.client,
                )
            reply = f"250 2.0.0 Ok: queued as {queue_id}"
        else:
            reply = self._storage_refusal(exc)
        self._resume(reply)

    def _storage_refusal(self, exc: BaseException) -> str:
        if isinstance(exc, StorageFull):
            log.error("spool_full", error=str(exc), client=self.client)
            return "452 4.3.1 Insufficient system storage"
        log.error("spool_write_failed", error=str(exc), client=self.client)
        return "451 4.3.0 Temporary storage failure, try again later"

    def _check_credentials(self, action: CheckCredentials) -> None:
        credentials = self.listener.credentials
        if credentials is None:
            self._resume(None)
            return
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(None, credentials.check, action.user, action.password)

        def done(f: asyncio.Future) -> None:
            user = f.result() if f.exception() is None else None
            if user is None:
                log.warning("auth_failed", user=action.user, client=self.client)
            self._resume(user)

        future.add_done_callback(done)

    async def _start_tls(self) -> None:
        loop = asyncio.get_running_loop()
        transport = self.transport
        context = self.listener.tls
        try:
            assert transport is not None and context is not None
            self.transport = await loop.start_tls(transport, self, context, server_side=True)
        except (OSError, ssl.SSLError, ConnectionError, AssertionError) as exc:
            log.info("tls_failed", client=self.client, error=str(exc))
            self._waiting = False
            if transport is not None:
                transport.abort()
            return
        self._tls = True
        self._starting_tls = False
        self._resume(True)

    # -- limits ----------------------------------------------------------------------

    def _restart_deadline(self, now: float) -> None:
        self.progress = now  # a command done, our reply on its way: the clock starts over
        listener = self.listener
        if self.in_data:
            self.deadline = now + listener.slots.data_timeout(listener.settings.data_timeout)
        else:
            self.deadline = now + listener.slots.command_timeout(listener.settings.command_timeout)

    # -- what the listener's slots ask (admission.Session) ---------------------------------

    @property
    def in_data(self) -> bool:
        return self.session is not None and self.session.in_data

    def quiet(self, now: float) -> float:
        """Seconds without progress: a slowloris trickling a line makes none."""
        return now - self.progress

    def give_way(self, reply: str) -> None:
        """Closed so that a newcomer gets a slot (under stress)."""
        if self.transport is not None:
            self.transport.write(reply.encode() + b"\r\n")
            self.transport.close()

    def _update_reading(self) -> None:
        """Read only while the client reads our replies and a pending commit has room:
        a client pipelining commands without reading must not grow our buffers."""
        session, transport = self.session, self.transport
        if session is None or transport is None:
            return
        limit = STREAM_BACKLOG if session.streaming else MAX_PIPELINED
        backlog = self._waiting and session.buffered > limit
        reading = not (self._write_paused or backlog)
        if reading != self._reading:
            self._reading = reading
            (transport.resume_reading if reading else transport.pause_reading)()

    def check_deadline(self, now: float) -> None:
        session = self.session
        if not self.in_data:  # under stress, a session from before it gets the short one too
            timeout = self.listener.slots.command_timeout(self.listener.settings.command_timeout)
            self.deadline = min(self.deadline, self.progress + timeout)
        if session is None or self._waiting or now <= self.deadline:
            return
        if session.closed or self._write_paused:
            self.abort()  # it reads nothing we write: a 421 would only wait in a buffer
            return
        log.info("session_timeout", client=self.client, in_data=session.in_data)
        session.timeout()
        self._continue(None)

    def drain(self) -> None:
        """Daemon is stopping: end idle sessions now, busy ones after their message."""
        if self.session is not None and not self.session.busy and not self._waiting:
            self.session.shutting_down()
            self._continue(None)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def _refuse(self, reply: str) -> None:
        assert self.transport is not None
        self.transport.write(reply.encode() + b"\r\n")
        self.transport.close()
