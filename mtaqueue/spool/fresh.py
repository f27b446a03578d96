"""The content of messages just accepted, kept for their delivery.

    fresh = FreshContent(max_bytes)
    fresh.keep(queue_id, content)   after the accept is durable
    fresh.get(queue_id) -> bytes | None
    fresh.drop(queue_id)            the message left the queue
    len(fresh), fresh.bytes

A relay delivers most mail seconds after it took it, while the content it received is
still in hand: kept here, the delivery needs no open, read and checksum of the file it
was written to. Only content stored exactly as given is kept (not one the writer signed),
oldest first out past `max_bytes`; anything not here is read from its file, as always.
"""

from __future__ import annotations

MAX_BYTES = 4 * 1024 * 1024  # the minutes of a busy relay's newest mail, at ~2 KiB each


class FreshContent:
    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._content: dict[str, bytes] = {}  # by queue id, oldest first

    def __len__(self) -> int:
        return len(self._content)

    def keep(self, queue_id: str, content: bytes) -> None:
        if len(content) > self.max_bytes // 8:  # a large one would push out many
            return
        self.drop(queue_id)
        self._content[queue_id] = content
        self.bytes += len(content)
        while self.bytes > self.max_bytes:
            self.drop(next(iter(self._content)))

    def get(self, queue_id: str) -> bytes | None:
        return self._content.get(queue_id)

    def drop(self, queue_id: str) -> None:
        content = self._content.pop(queue_id, None)
        if content is not None:
            self.bytes -= len(content)
