"""The SMTP listener in a process of its own; the daemon's end of it.

    listener = ListenerProcess(spool, signing, on_rcpt_refused, args)
    await listener.start()           # RuntimeError(why) if it cannot listen
    listener.addresses / .accepted / .sessions / .state()   # for ready, status, metrics
    listener.reload(done)            # after the daemon's own reload succeeded; done() once
                                     # the process has read the config too
    await listener.close(grace)      # stop listening, sessions finish within grace

Postfix's smtpd is not its queue manager, and ours is not either: a session's commands,
replies and content cost several system calls and some Python each, and in the daemon's
one thread they took a quarter of what a message costs it. The listener's process
(listener_main.py) speaks SMTP to the clients and hands each message here whole
(`Commit`), or piece by piece when it is too large to hold; the spool stays the daemon's
alone — ids come from a lane of their own (ids.py), the suppression list is copied over
and kept current, the spool's storage refusal is told as it changes (Spool.on_refusal).

A listener's process that dies is started again (a second later, then up to a minute
apart while it keeps dying within a minute of its start); sessions it had open are gone,
and a message whose 250 was not sent is the client's to send again, as with any
connection lost. The suppression list and the storage refusal go to a new process before
it listens, so its first session already has them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import msgspec

from .child_process import ChildLink, abandon, start_child
from .dkim.service import SigningService
from .framing import frame
from .logs import get_logger
from .smtp import handover as h
from .spool.errors import StorageFull
from .spool.incoming import IncomingMessage
from .spool.records import Suppress, Unsuppress
from .spool.store import Spool

log = get_logger("daemon")

START_TIMEOUT = 30.0  # seconds for the process to listen
RESTART_DELAYS = (1.0, 5.0, 15.0, 60.0)  # after each death in a row
STABLE = 60.0  # seconds: a process that lived this long died "first" again


class ListenerProcess:
    def __init__(
        self,
        spool: Spool,
        signing: SigningService,
        on_rcpt_refused: Callable[[str, str, float], None],
        args: list[str],
    ) -> None:
        self.spool = spool
        self.signing = signing
        self.on_rcpt_refused = on_rcpt_refused
        self.args = args  # for listener_main: the config file and overrides, the hostname
        self.addresses: list[str] = []
        self.accepted = 0  # messages committed for the listener (a duplicate's first id too)
        self._state = h.State(0, 0, 0)
        self._link: _Link | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._closing = False
        self._deaths = 0  # in a row, each within STABLE of its start
        self._started_at = 0.0  # monotonic
        self._restarting: asyncio.Task | None = None
        self._reloads: list[Callable[[], None]] = []  # waiting for the process's Reloaded
        self._told_refusal: str | None = None
        spool.on_suppression = self._suppression_changed
        spool.on_refusal = self._refusal_changed

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None and self._link else None

    @property
    def sessions(self) -> int:
        return self._state.sessions

    def state(self) -> dict[str, int]:
        """For the metrics: sessions open, whether under stress, sessions shed so far."""
        return {
            "sessions": self._state.sessions,
            "stress": self._state.stress,
            "shed": self._state.shed,
        }

    async def start(self) -> None:
        link = _Link(self)
        process = await start_child("mtaqueue.listener_main", self.args, link)
        try:
            # Read before it listens (listener_main binds after its end is connected).
            self._told_refusal = self.spool.refusal
            link.send(h.Suppressions(list(self.spool.suppressed.values()), []))
            link.send(h.Storage(self._told_refusal))
            await asyncio.wait_for(link.ready, START_TIMEOUT)
            await asyncio.wait_for(link.bound, START_TIMEOUT)
        except BaseException:
            await abandon(process, link.transport)
            raise
        self._link, self._process = link, process
        self._started_at = time.monotonic()
        self.addresses = link.bound.result()

    def reload(self, done: Callable[[], None]) -> None:
        if self._link is None:  # restarting: the next process reads the config as it starts
            done()
            return
        self._reloads.append(done)
        self._send(h.Reload())

    async def close(self, grace: float) -> None:
        self._closing = True
        if self._restarting is not None:
            self._restarting.cancel()
        process = self._process
        if process is None:
            return
        self._send(h.Drain(float(grace)))  # a config Duration is a float of its own
        try:
            await asyncio.wait_for(process.wait(), grace + 5.0)
        except TimeoutError:
            await abandon(process, None)
        if self._link is not None:
            _discard_streams(self._link)

    # -- serving the process ------------------------------------------------------------

    def _send(self, message: h.Down) -> None:
        if self._link is not None:
            self._link.send(message)

    def _suppression_changed(self, op: Suppress | Unsuppress) -> None:
        if isinstance(op, Suppress):
            self._send(h.Suppressions([op], []))
        else:
            self._send(h.Suppressions([], [op.address]))

    def _refusal_changed(self) -> None:
        refusal = self.spool.refusal
        if refusal != self._told_refusal:
            self._told_refusal = refusal
            self._send(h.Storage(refusal))

    def received(self, link: _Link, message: h.Up) -> None:
        if isinstance(message, h.Commit):
            future = self.spool.accept(message.message, message.content, message.signatures)
            future.add_done_callback(lambda f, m=message: link.answer(m.token, f, m.message.size))
        elif isinstance(message, h.Open):
            signer = self.signing.signer.stream(message.header, message.now)
            incoming = self.spool.incoming(message.message, signer)
            link.streams[message.token] = incoming
            link.answer_write(message.token, incoming.write(message.data))
        elif isinstance(message, h.Piece):
            link.answer_write(message.token, link.streams[message.token].write(message.data))
        elif isinstance(message, h.Close):
            incoming = link.streams.pop(message.token)
            future = incoming.commit(message.data)
            future.add_done_callback(
                lambda f, t=message.token, i=incoming: link.answer(t, f, i.message.size)
            )
        elif isinstance(message, h.Discard):
            with contextlib.suppress(KeyError):
                link.streams.pop(message.token).discard()
        elif isinstance(message, h.RcptRefused):
            self.on_rcpt_refused(message.address, message.reason, message.now)
        elif isinstance(message, h.State):
            self._state = message
        elif isinstance(message, h.Reloaded):
            if self._reloads:
                self._reloads.pop(0)()
        elif not link.bound.done():
            link.bound.set_result(message.addresses)

    def lost(self, link: _Link) -> None:
        _discard_streams(link)
        if link is not self._link or self._closing:
            return
        reloads, self._reloads = self._reloads, []
        for done in reloads:
            done()
        self._state = h.State(0, 0, 0)
        self._link = None
        if time.monotonic() - self._started_at >= STABLE:
            self._deaths = 0
        log.error("listener_exited", restart_in=self._restart_later())

    def _restart_later(self) -> float:
        """Start a new process after the delay for the deaths so far; that delay."""
        delay = RESTART_DELAYS[min(self._deaths, len(RESTART_DELAYS) - 1)]
        self._deaths += 1
        self._restarting = asyncio.get_running_loop().create_task(self._restart(delay))
        return delay

    async def _restart(self, delay: float) -> None:
        await asyncio.sleep(delay)
        try:
            await self.start()
        except (OSError, RuntimeError, TimeoutError) as exc:
            log.error("listener_restart_failed", error=str(exc), retry_in=self._restart_later())
            return
        log.info("listener_restarted", listen=self.addresses)


def _discard_streams(link: _Link) -> None:
    """Forget the messages a listener was still writing (their files are removed)."""
    for incoming in link.streams.values():
        incoming.discard()
    link.streams.clear()


def _refused(token: int, exc: BaseException) -> h.Refused:
    """The storage's refusal of a message: full (452 4.3.1) or a failed write (451 4.3.0)."""
    return h.Refused(token, isinstance(exc, StorageFull), str(exc))


class _Link(ChildLink):
    def __init__(self, owner: ListenerProcess) -> None:
        super().__init__("listener")
        self.owner = owner
        self.bound: asyncio.Future = asyncio.get_running_loop().create_future()
        self.streams: dict[int, IncomingMessage] = {}  # token -> a message being written

    def answered(self, payload: bytes) -> None:
        try:
            message = h.decode_up(payload)
        except msgspec.MsgspecError as exc:  # a bug: end it, a new one starts
            log.error("listener_protocol_error", error=str(exc))
            if self.transport is not None:
                self.transport.abort()
            return
        self.owner.received(self, message)

    def lost(self) -> None:
        if not self.bound.done():
            self.bound.set_exception(ConnectionError("listener exited while starting"))
        self.owner.lost(self)

    def answer(self, token: int, future: asyncio.Future, size: int) -> None:
        exc = future.exception()
        if exc is None:
            self.owner.accepted += 1
            self.send(h.Committed(token, future.result(), size))
        else:
            self.send(_refused(token, exc))

    def answer_write(self, token: int, future: asyncio.Future) -> None:
        def done(f: asyncio.Future) -> None:
            exc = f.exception()
            self.send(h.Written(token) if exc is None else _refused(token, exc))

        future.add_done_callback(done)

    def send(self, message: h.Down) -> None:
        if self.transport is not None:
            self.transport.write(frame(h.encode(message)))
