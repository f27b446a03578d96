"""The content of messages just accepted, kept for their delivery.

    fresh = FreshContent(max_bytes)
    fresh.keep(queue_id, content)   after the accept is durable
    fresh.pin(queue_id, content)    its file waits (spool/filing.py): kept until...
    fresh.unpin(queue_id)           ... the writer has written it
    fresh.get(queue_id) -> bytes | None, fresh.waits(queue_id) -> bool
    fresh.drop(queue_id)            the message left the queue
    len(fresh), fresh.bytes, fresh.pinned_bytes

A relay delivers most mail seconds after it took it, while the content it received is
still in hand: kept here, the delivery needs no open, read and checksum of the file it
was written to. Only content stored exactly as given is kept (not one the writer signed),
oldest first out past `max_bytes`; anything not here is read from its file, as always.
A message whose file waits has only the journal's copy on disk: its content is pinned
here, whatever `max_bytes` says, until its file is written (the writer bounds that).
"""

from __future__ import annotations

MAX_BYTES = 4 * 1024 * 1024  # the minutes of a busy relay's newest mail, at ~2 KiB each


class FreshContent:
    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._content: dict[str, bytes] = {}  # by queue id, oldest first
        self._pinned: dict[str, bytes] = {}  # by queue id: the files that wait
        self.pinned_bytes = 0

    def __len__(self) -> int:
        """Messages whose content is held (one both kept and pinned counts once)."""
        return len(self._content) + sum(q not in self._content for q in self._pinned)

    def pin(self, queue_id: str, content: bytes) -> None:
        if queue_id not in self._pinned:
            self._pinned[queue_id] = content
            self.pinned_bytes += len(content)

    def unpin(self, queue_id: str) -> None:
        content = self._pinned.pop(queue_id, None)
        if content is not None:
            self.pinned_bytes -= len(content)

    def waits(self, queue_id: str) -> bool:
        """The message's file is not written yet."""
        return queue_id in self._pinned

    def keep(self, queue_id: str, content: bytes) -> None:
        if len(content) > self.max_bytes // 8:  # a large one would push out many
            return
        self._forget(queue_id)
        self._content[queue_id] = content
        self.bytes += len(content)
        while self.bytes > self.max_bytes:
            self._forget(next(iter(self._content)))  # (a pin stays)

    def get(self, queue_id: str) -> bytes | None:
        content = self._content.get(queue_id)
        return content if content is not None else self._pinned.get(queue_id)

    def drop(self, queue_id: str) -> None:
        self.unpin(queue_id)
        self._forget(queue_id)

    def _forget(self, queue_id: str) -> None:
        content = self._content.pop(queue_id, None)
        if content is not None:
            self.bytes -= len(content)
