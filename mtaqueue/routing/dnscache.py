"""A TTL cache for DNS answers, positive and negative, with `now` passed in.

Temporary failures are cached too, briefly, so that a burst of deliveries to a domain whose
nameservers answer SERVFAIL makes one query rather than one per message. At most
`max_entries` answers are kept (the least used go first), and expired ones are swept out
once a minute as new answers come in.

    cache = DnsCache(negative_ttl_max=...)
    cache.get(key, now) / put_positive / put_negative / put_temporary_failure(key, ..., now)
    cache.forget(name); cache.prune(now); len(cache); cache.hits, cache.misses
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Literal

import msgspec

PRUNE_EVERY = 60.0  # seconds between sweeps for expired answers (at a lookup)

Key = tuple[str, str]  # (lower-case name without the final dot, record type)
Kind = Literal["positive", "negative", "failure"]


class Entry(msgspec.Struct, frozen=True):
    kind: Kind
    value: Any
    expires: float


class DnsCache:
    def __init__(
        self,
        *,
        negative_ttl_max: float,
        min_ttl: float = 5.0,
        max_ttl: float = 86400.0,
        failure_ttl: float = 10.0,
        max_entries: int = 10_000,
    ) -> None:
        self.negative_ttl_max = negative_ttl_max
        self.min_ttl = min_ttl
        self.max_ttl = max_ttl
        self.failure_ttl = failure_ttl
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[Key, Entry] = OrderedDict()
        self._prune_at = 0.0  # `now` of the next prune of expired answers

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Key, now: float) -> Entry | None:
        entry = self._entries.get(key)
        if entry is None or entry.expires <= now:
            if entry is not None:
                del self._entries[key]
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def forget(self, name: str) -> None:
        """Drop every cached answer for a name (mtaqueue-ctl requeue: look it up again)."""
        name = name.lower().rstrip(".")
        for key in [k for k in self._entries if k[0] == name]:
            del self._entries[key]

    def put_positive(self, key: Key, value: Any, ttl: float, now: float) -> Entry:
        # The floor keeps a zero-TTL record from costing a query per message.
        ttl = min(max(ttl, self.min_ttl), self.max_ttl)
        return self._put(key, Entry("positive", value, now + ttl), now)

    def put_negative(self, key: Key, value: Any, ttl: float, now: float) -> Entry:
        # The cap wins over the floor: a "no such domain" must not outlive a quick DNS fix.
        ttl = min(max(ttl, self.min_ttl), self.negative_ttl_max)
        return self._put(key, Entry("negative", value, now + ttl), now)

    def put_temporary_failure(self, key: Key, value: Any, now: float) -> Entry:
        return self._put(key, Entry("failure", value, now + self.failure_ttl), now)

    def prune(self, now: float) -> int:
        """Drop the answers that have expired; how many went."""
        expired = [key for key, entry in self._entries.items() if entry.expires <= now]
        for key in expired:
            del self._entries[key]
        return len(expired)

    def _put(self, key: Key, entry: Entry, now: float) -> Entry:
        if now >= self._prune_at:  # expired answers go, not only the least used
            self._prune_at = now + PRUNE_EVERY
            self.prune(now)
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return entry
