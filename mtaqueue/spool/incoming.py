"""A new message written to its spool file as its content arrives (data too large to hold).

    incoming = spool.incoming(message, signer)   # an IncomingMessage
    await incoming.write(piece); ...             # StorageFull / StorageError
    queue_id = await incoming.commit(last)       # or incoming.discard()

The disk work runs in the daemon's threads (the spool's `incoming()` gives them), so
that the event loop never waits for the disk; the writer then only syncs and renames
the file (writer.Place). A `ContentSigner` sees the content as it is written.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Protocol

import msgspec

from ..model import Message
from .durable import is_disk_full
from .errors import StorageError, StorageFull
from .message_file import MessageFileWriter


class ContentSigner(Protocol):
    """Sees a streamed message's content as it is written (in the spool's threads), then
    gives the fields that go before it (a DKIM signature: `dkim.signer.StreamSigning`)."""

    def feed(self, data: bytes) -> None: ...

    def fields(self) -> bytes: ...


class IncomingMessage:
    """A new message written to its spool file as its content arrives.

    `write()` the content piece by piece, each once the last is written (the futures
    say so), then `commit()` or `discard()` it. The disk work runs in the spool's
    threads; a file that is not committed is removed (a crash leaves a temp file, which
    the start-up sweep removes)."""

    def __init__(
        self,
        message: Message,
        signer: ContentSigner | None,
        *,
        path: Path,
        io: Executor,
        place: Callable[[Message], asyncio.Future],
    ) -> None:
        self.message = message  # its record; its size is set by commit()
        self._file = MessageFileWriter(path)  # its temp file
        self._signer = signer
        self._io = io  # the spool's threads
        self._place = place  # makes the written file durable: the queue id, as Spool.accept

    def write(self, *parts: bytes) -> asyncio.Future:
        """Append content; the future fails with StorageFull or StorageError."""
        return self._in_thread(self._write, *parts)

    def commit(self, last: bytes) -> asyncio.Future:
        """Append the last content, then make the message durable as `Spool.accept()`
        does (with the same answers: the queue id, or a duplicate's first id)."""
        result = asyncio.get_running_loop().create_future()

        def finish() -> None:
            self._write(last)
            head = b"" if self._signer is None else self._signer.fields()
            size = len(head) + self._file.length
            self.message = msgspec.structs.replace(self.message, size=size)
            self._file.finish(self.message, head)

        def finished(future: asyncio.Future) -> None:
            if future.exception() is not None:
                self.discard()
                result.set_exception(future.exception())
            else:
                self._place(self.message).add_done_callback(placed)

        def placed(future: asyncio.Future) -> None:
            exc = future.exception()
            if exc is not None or future.result() != self.message.id:
                self.discard()  # not stored, or a duplicate of one that is
            if exc is not None:
                result.set_exception(exc)
            else:
                result.set_result(future.result())

        self._in_thread(finish).add_done_callback(finished)
        return result

    def _write(self, *parts: bytes) -> None:
        if self._signer is not None:
            for part in parts:
                self._signer.feed(part)
        self._file.write(*parts)

    def discard(self) -> None:
        """Forget it: its file is removed (in the background)."""
        with contextlib.suppress(RuntimeError):  # closed: the next start removes the file
            self._io.submit(self._file.discard)

    def _in_thread(self, call: Callable[..., None], *args: bytes) -> asyncio.Future:
        def run() -> None:
            try:
                call(*args)
            except OSError as exc:
                raise (StorageFull if is_disk_full(exc) else StorageError)(str(exc)) from None

        return asyncio.get_running_loop().run_in_executor(self._io, run)
