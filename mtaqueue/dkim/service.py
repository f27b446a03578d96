"""Signing on the acceptance path, off the event loop.

`SigningService.sign()` takes a prepared message (steering fields gone, Received added)
and gives back the record and content to store: signed if a key signs it. A message
with an RSA key (~0.26 ms a signature), or large, is signed by the signer process
(`worker`): sent as it comes (one write for what a loop iteration asks) and answered in
order. A small one with Ed25519 keys only (~0.06 ms in all) costs less than the trip there
and back: signed in the event loop. So is everything while that process is not running
(starting, after a crash, after a reload that changed the keys): slower, never unsigned,
never refused for it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

import msgspec

from ..child_process import ChildLink, abandon, start_child
from ..framing import frame
from ..logs import get_logger
from ..model import Message
from .signer import Signer
from .worker import Answer, Tables

log = get_logger("dkim")

START_TIMEOUT = 10.0
# Larger content (an API message held whole) goes to the signer whatever its keys: even
# hashing it would hold up the event loop.
INLINE_MAX = 64 << 10
BACKOFF_FIRST, BACKOFF_MAX = 1.0, 60.0
STABLE = 30.0  # a signer that lived this long is restarted at once when it dies
# Signer processes. On two cores one is best: a second one (or a thread pool, or the event
# loop signing too when the signer is behind) took CPU from the daemon and its writer and
# accepted 25% less (bench/RESULTS.md); more cores may want more.
PROCESSES = 1

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Answer)


class SigningError(Exception):
    """The message could not be signed (a bug): it is refused with a 451."""


@dataclass(slots=True)
class _Pending:
    message: Message
    content: bytes
    future: asyncio.Future


class SigningService:
    def __init__(self, signer: Signer, tables: Tables, processes: int = PROCESSES) -> None:
        self.signer = signer  # also signs streamed messages (listener) and inline
        self._tables = tables
        self._processes = processes
        self._links: list[_SignerLink] = []  # the signer processes that are ready
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    def start(self) -> None:
        """Start the signer processes in the background, if there are keys at all; mail is
        signed inline meanwhile."""
        if self._tables and all(task.done() for task in self._tasks):
            tasks = [self._keep_running() for _ in range(self._processes)]
            self._tasks = [asyncio.ensure_future(task) for task in tasks]

    def reconfigure(self, signer: Signer, tables: Tables) -> None:
        """New keys (SIGHUP): inline at once, in new signer processes as soon as they run."""
        self.signer = signer
        if tables != self._tables:
            self._tables = tables
            for link in self._links:
                link.expected = True
                if link.transport is not None:
                    link.transport.close()  # its work is done inline; a new one starts
            self.start()

    async def close(self) -> None:
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for link in list(self._links):
            self._lost(link)  # what it still had is signed inline now
            await abandon(link.process, link.transport)

    def sign(self, message: Message, content: bytes) -> asyncio.Future | None:
        """A future of (record, content) to store, or None if no key signs the message.
        The future fails with SigningError only for a bug."""
        keys = self.signer.keys_for_content(content)
        if not keys:
            return None
        pending = _Pending(message, content, asyncio.get_running_loop().create_future())
        link = min(self._links, key=_backlog, default=None)
        rsa = any(key.algorithm == "rsa-sha256" for key in keys)
        costly = rsa or len(content) > INLINE_MAX
        if link is None or link.transport is None or not costly:
            self._inline(pending)
        else:
            link.send(pending)
        return pending.future

    def sign_now(self, message: Message, content: bytes) -> tuple[Message, bytes]:
        """Signed here and now, in the event loop: for the daemon's own rare mail (DSNs).
        A bug is logged and leaves it unsigned: a notice must not be lost for it."""
        try:
            signed = self.signer.sign(content, message.created)
        except Exception as exc:
            log.error("dkim_signing_failed", id=message.id, error=f"signing failed: {exc!r}")
            return message, content
        return (message, content) if signed is None else _stored(message, *signed)

    # -- the work ----------------------------------------------------------------------

    def _inline(self, pending: _Pending) -> None:
        try:
            signed = self.signer.sign(pending.content, pending.message.created)
        except Exception as exc:
            self._failed(pending, f"signing failed: {exc!r}")
            return
        if signed is None:  # the keys changed since sign() was called: unsigned now
            self._resolve(pending, b"", pending.content)
        else:
            self._resolve(pending, *signed)

    def _resolve(self, pending: _Pending, fields: bytes, content: bytes) -> None:
        if not pending.future.done():
            pending.future.set_result(_stored(pending.message, fields, content))

    def _failed(self, pending: _Pending, error: str) -> None:
        log.error("dkim_signing_failed", id=pending.message.id, error=error)
        if not pending.future.done():
            pending.future.set_exception(SigningError(error))

    def _answered(self, pending: _Pending, payload: bytes) -> None:
        try:
            fields, converted, error = _decoder.decode(payload)
        except msgspec.DecodeError:  # cannot happen; if it does, no mail pays for it
            log.error("dkim_signer_answer_unreadable", id=pending.message.id)
            self._inline(pending)
            return
        if error:
            self._failed(pending, error)
        elif not fields:  # the signer had other keys (a reload): sign with ours
            self._inline(pending)
        else:
            self._resolve(pending, fields, converted or pending.content)

    # -- the processes -----------------------------------------------------------------

    def _lost(self, link: _SignerLink) -> None:
        if link not in self._links:
            return
        self._links.remove(link)
        pending, link.sent = link.sent, deque()
        link.outgoing.clear()
        for item in pending:
            self._inline(item)
        if not link.expected and not self._closed:
            log.error("dkim_signer_lost", pid=link.process.pid, signed_inline=len(pending))
        if not link.gone.done():  # cancelled with _keep_running, by close()
            link.gone.set_result(None)

    async def _keep_running(self) -> None:
        """One signer process, started again whenever it ends while there are keys."""
        backoff = 0.0
        while not self._closed and self._tables:
            await asyncio.sleep(backoff)
            backoff = min(max(2 * backoff, BACKOFF_FIRST), BACKOFF_MAX)  # if it fails
            link = _SignerLink(self)
            try:
                link.process = await start_child("mtaqueue.dkim.worker", [], link)
            except OSError as exc:
                log.error("dkim_signer_start_failed", error=str(exc))
                continue
            try:
                assert link.transport is not None
                link.transport.write(frame(_encoder.encode(self._tables)))
                await asyncio.wait_for(link.ready, START_TIMEOUT)
            except (TimeoutError, ConnectionError, RuntimeError) as exc:
                log.error("dkim_signer_start_failed", error=str(exc))
                await abandon(link.process, link.transport)
                continue
            except asyncio.CancelledError:  # close() while it starts: do not leave it
                await abandon(link.process, link.transport)
                raise
            started = time.monotonic()
            self._links.append(link)
            log.info("dkim_signer_ready", pid=link.process.pid)
            await link.gone
            await link.process.wait()
            if link.expected or time.monotonic() - started >= STABLE:
                backoff = 0.0


def _backlog(link: _SignerLink) -> int:
    return len(link.sent)


def _stored(message: Message, fields: bytes, content: bytes) -> tuple[Message, bytes]:
    """The record and content to store: the signature fields first."""
    stored = fields + content
    return msgspec.structs.replace(message, size=len(stored)), stored


class _SignerLink(ChildLink):
    """The daemon's end of the socketpair to one signer process."""

    def __init__(self, service: SigningService) -> None:
        super().__init__("signer")
        self.service = service
        self.process: asyncio.subprocess.Process
        self.gone: asyncio.Future = asyncio.get_running_loop().create_future()
        self.expected = False  # closed by us (a reload), not a crash
        self.sent: deque[_Pending] = deque()  # asked of it, in order
        self.outgoing: list[bytes] = []  # frames of `sent` still to write

    def send(self, pending: _Pending) -> None:
        self.sent.append(pending)
        self.outgoing.append(frame(_encoder.encode((pending.content, pending.message.created))))
        if len(self.outgoing) == 1:  # one write for what this loop iteration asks
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        work = b"".join(self.outgoing)
        self.outgoing.clear()
        if work and self.transport is not None:
            self.transport.write(work)

    def answered(self, payload: bytes) -> None:
        if self.sent:
            self.service._answered(self.sent.popleft(), payload)

    def lost(self) -> None:
        self.service._lost(self)
        if not self.gone.done():
            self.gone.set_result(None)
