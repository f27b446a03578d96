"""The listener process's spool: the daemon's, over the socketpair (`handover`).

    client = SpoolClient(on_drain, on_reload) # an asyncio Protocol on the pair
    client.ids.next(now) / client.refusal     # ids of the listener's lane; storage refusal
    client.accept(message, content, sigs)     # a future of the queue id, as Spool.accept
    client.incoming(message, header, now)     # a RemoteIncoming: write(*pieces), commit(last),
                                              # discard(), .message — as IncomingMessage
    client.suppression(address, now)          # the active entry of the daemon's list, or None
    client.rcpt_refused(address, reason, now) / .state(...) / .reloaded()   # told to the daemon

Answers fail with the exceptions the daemon's spool raised (StorageFull, StorageError), so the
listener answers its client as it would in the daemon. If the daemon goes away, every
pending answer fails with StorageError and `client.lost` is done: the process ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

from ..dkim.signature import PendingSignature
from ..framing import frame, split_frames
from ..ids import LISTENER_LANE, IdGenerator
from ..logs import get_logger
from ..model import Message
from ..spool.errors import StorageError, StorageFull
from ..spool.records import Suppress, suppressions
from . import handover as h

log = get_logger("listener")


class SpoolClient(asyncio.Protocol):
    def __init__(self, on_drain: Callable[[float], None], on_reload: Callable[[], None]) -> None:
        self.ids = IdGenerator(LISTENER_LANE)
        self.refusal: str | None = None  # the daemon's spool's, as it last said
        self.suppressed = suppressions()  # lower-cased address -> entry, as the daemon's
        self.lost = asyncio.get_running_loop().create_future()  # done when the daemon is gone
        self._on_drain = on_drain
        self._on_reload = on_reload
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._pending: dict[int, tuple[asyncio.Future, RemoteIncoming | None]] = {}
        self._token = 0

    # -- the listener's calls ---------------------------------------------------------

    def accept(
        self, message: Message, content: bytes, signatures: list[PendingSignature] | None = None
    ) -> asyncio.Future:
        token, future = self._request()
        self._send(h.Commit(token, message, content, signatures or []))
        return future

    def incoming(self, message: Message, header: bytes, now: float) -> RemoteIncoming:
        return RemoteIncoming(self, message, header, now)

    def suppression(self, address: str, now: float) -> Suppress | None:
        entry = self.suppressed.get(address.lower())
        return entry if entry is not None and entry.until > now else None

    def rcpt_refused(self, address: str, reason: str, now: float) -> None:
        self._send(h.RcptRefused(address, reason, now))

    def state(self, sessions: int, stress: int, shed: int) -> None:
        self._send(h.State(sessions, stress, shed))

    def bound(self, addresses: list[str]) -> None:
        self._send(h.Bound(addresses))

    def reloaded(self) -> None:
        self._send(h.Reloaded())

    # -- the wire ---------------------------------------------------------------------

    def _request(
        self, incoming: RemoteIncoming | None = None, token: int = 0
    ) -> tuple[int, asyncio.Future]:
        """A future for the answer to a request; a streamed message's requests share its
        token (one at a time: each piece is sent once the last is written)."""
        if not token:
            self._token += 1
            token = self._token
        future = asyncio.get_running_loop().create_future()
        if self._transport is None:
            future.set_exception(StorageError("the daemon is gone"))
        else:
            self._pending[token] = (future, incoming)
        return token, future

    def _send(self, message: msgspec.Struct) -> None:
        if self._transport is not None:
            self._transport.write(frame(h.encode(message)))

    def connection_made(self, transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        for payload in split_frames(self._buffer):
            self._received(h.decode_down(payload))

    def _received(self, message: h.Down) -> None:
        if isinstance(message, h.Committed | h.Written | h.Refused):
            future, incoming = self._pending.pop(message.token)
            if isinstance(message, h.Refused):
                error = StorageFull if message.full else StorageError
                future.set_exception(error(message.error))
            elif isinstance(message, h.Committed):
                if incoming is not None:
                    incoming.message = msgspec.structs.replace(incoming.message, size=message.size)
                future.set_result(message.queue_id)
            else:
                future.set_result(None)
        elif isinstance(message, h.Storage):
            self.refusal = message.refusal
        elif isinstance(message, h.Suppressions):
            for entry in message.entries:
                self.suppressed[entry.address] = entry
            for address in message.removed:
                self.suppressed.pop(address, None)
        elif isinstance(message, h.Reload):
            self._on_reload()
        else:
            self._on_drain(message.grace)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            if not future.done():
                future.set_exception(StorageError("the daemon is gone"))
        if not self.lost.done():
            self.lost.set_result(None)


class RemoteIncoming:
    """A message the daemon writes to its spool file as its content arrives here."""

    def __init__(self, client: SpoolClient, message: Message, header: bytes, now: float) -> None:
        self.message = message  # its size is set when it is committed
        self._client = client
        self._header: tuple[bytes, float] | None = (header, now)
        self._token = 0

    def write(self, *parts: bytes) -> asyncio.Future:
        """Append content (the first write begins with the header)."""
        data = b"".join(parts)
        if self._header is None:
            _, future = self._client._request(self, self._token)
            self._client._send(h.Piece(self._token, data))
            return future
        header, now = self._header
        self._header = None
        self._token, future = self._client._request(self)
        self._client._send(h.Open(self._token, self.message, header, now, data))
        return future

    def commit(self, last: bytes) -> asyncio.Future:
        """Append the last content and make the message durable: its queue id."""
        _, future = self._client._request(self, self._token)
        self._client._send(h.Close(self._token, last))
        return future

    def discard(self) -> None:
        if self._header is None:  # the daemon has it open
            self._client._pending.pop(self._token, None)
            self._client._send(h.Discard(self._token))
