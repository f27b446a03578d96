"""Signing on the acceptance path: the daemon makes each signature but its value, the
spool writer makes the value as it writes the message's file.

`SigningService.sign()` takes a prepared message (steering fields gone, Received added)
and gives back what to store: the signature fields (a placeholder where each value goes:
its length is the key's, so the record's size is final), the content they sign, and the
signatures still to make. Canonicalising and hashing a small message costs ~40 µs here.
The value, an RSA-2048 signature, costs ~0.26 ms of CPU: the spool writer makes it on its
I/O threads while it writes the file (OpenSSL signs without the GIL), in parallel with the
other files of the group commit and with the daemon. A signer process of its own was
slower on two cores: one more trip a message, and its serial burst of signatures after
each group commit stood between the sessions and the disk (bench/RESULTS.md).

The writer knows a key by its id (SigningKey.key_id): the spool sends it the PEM of each
key the first time a batch needs it (`pems`, to which a reload adds the new keys and from
which none is taken: a message made with an old key may still be on its way).
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import msgspec

from ..logs import get_logger
from ..model import Message
from .signature import PendingSignature, fill
from .signer import Signer

log = get_logger("dkim")

# Larger content (an API message held whole) is prepared in a thread: even hashing it
# would hold up the event loop.
INLINE_MAX = 64 << 10


class SigningError(Exception):
    """The message could not be signed (a bug): it is refused with a 451."""


class Signed(NamedTuple):
    message: Message  # its size that of the content as stored
    content: bytes  # as stored: the signature fields first
    pending: list[PendingSignature]  # the values the spool writer makes (offsets in content)


class SigningService:
    def __init__(self, signer: Signer) -> None:
        self.signer = signer  # also signs streamed messages (listener) and DSNs
        self.pems: dict[str, bytes] = {}  # key id -> PEM, for the spool writer
        self._remember(signer)

    def reconfigure(self, signer: Signer) -> None:
        """New keys (SIGHUP): for the mail prepared from now on."""
        self.signer = signer
        self._remember(signer)

    def sign(self, message: Message, content: bytes) -> asyncio.Future | None:
        """A future of the `Signed` message, or None if no key signs it. The future fails
        with SigningError only for a bug."""
        if not self.signer.keys_for_content(content):
            return None
        if len(content) > INLINE_MAX:
            return asyncio.ensure_future(asyncio.to_thread(self._prepare, message, content))
        future = asyncio.get_running_loop().create_future()
        try:
            future.set_result(self._prepare(message, content))
        except SigningError as exc:
            future.set_exception(exc)
        return future

    def fill(self, signed: Signed) -> bytes:
        """The content with its signatures made, for a message the spool's threads write
        rather than its writer (past spool.stream_threshold). Blocking: in a thread."""
        try:
            return fill(signed.content, signed.pending, self.signer.private)
        except (KeyError, ValueError) as exc:  # a reload took the key: a 451, then again
            log.error("dkim_signing_failed", id=signed.message.id, error=repr(exc))
            raise SigningError(f"signing failed: {exc!r}") from None

    def sign_now(self, message: Message, content: bytes) -> tuple[Message, bytes]:
        """Signed here and now, in the event loop: for the daemon's own rare mail (DSNs).
        A bug is logged and leaves it unsigned: a notice must not be lost for it."""
        try:
            signed = self.signer.sign(content, message.created)
        except Exception as exc:
            log.error("dkim_signing_failed", id=message.id, error=f"signing failed: {exc!r}")
            return message, content
        return (message, content) if signed is None else _stored(message, *signed)

    def _prepare(self, message: Message, content: bytes) -> Signed:
        try:
            presigned = self.signer.prepare(content, message.created)
        except Exception as exc:
            log.error("dkim_signing_failed", id=message.id, error=f"signing failed: {exc!r}")
            raise SigningError(f"signing failed: {exc!r}") from None
        if presigned is None:  # the keys changed since sign() asked: unsigned now
            return Signed(message, content, [])
        stored, content = _stored(message, presigned.fields, presigned.content)
        return Signed(stored, content, presigned.pending)

    def _remember(self, signer: Signer) -> None:
        self.pems.update({key_id: key.pem for key_id, key in signer.by_id.items()})


def _stored(message: Message, fields: bytes, content: bytes) -> tuple[Message, bytes]:
    """The record and content to store: the signature fields first."""
    stored = fields + content
    return msgspec.structs.replace(message, size=len(stored)), stored
