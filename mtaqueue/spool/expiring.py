"""A map whose entries end at a time of their own, forgotten a slice of time at a time.

    entries = Expiring(time_of)          # time_of(value) -> when the entry ends (epoch s)
    entries[key] = value; del entries[key]; get, pop, update, len, iteration
    entries.forget_before(t) -> int      # drop the entries whose time is before t
    prune_period(window) -> float        # how often the spool's two processes forget

The spool keeps two such maps for as long as they live, whatever became of the mail they
came from: idempotency keys (key_index.py) and suppressions. Each entry is also filed under
the slice of time (SLICE seconds) its time falls in, so forgetting touches only the slices
before `t` (whole) and the one that holds it, never the whole map, whatever order a replay
brought the entries in. An entry set again is filed again under its new slice; its old
slice's reference is skipped when that slice is forgotten.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")

SLICE = 600.0  # seconds of entry times filed together
PRUNE_EVERY = 60.0  # seconds: at most this late is an expired entry forgotten


def prune_period(window: float) -> float:
    """Seconds between prunes: a minute, or half the dedupe window if that is shorter
    (a key then outlives its window by at most half of it)."""
    return min(PRUNE_EVERY, max(1.0, window / 2))


class Expiring(MutableMapping[K, V]):
    def __init__(self, time_of: Callable[[V], float]) -> None:
        self._time_of = time_of
        self._entries: dict[K, V] = {}
        self._slices: dict[int, list[K]] = {}  # slice number -> keys whose time is in it

    def __getitem__(self, key: K) -> V:
        return self._entries[key]

    def get(self, key: K, default=None):  # type: ignore[override]
        return self._entries.get(key, default)  # the hot path: no Mapping detour

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __setitem__(self, key: K, value: V) -> None:
        self._entries[key] = value
        self._slices.setdefault(int(self._time_of(value) // SLICE), []).append(key)

    def __delitem__(self, key: K) -> None:
        del self._entries[key]  # its slice's reference is skipped when forgotten

    def forget_before(self, t: float) -> int:
        """Drop the entries whose time is before t; how many went."""
        gone = 0
        entries, time_of = self._entries, self._time_of
        for number in [n for n in self._slices if n * SLICE < t]:
            kept = []
            for key in self._slices.pop(number):
                value = entries.get(key)
                if value is None:
                    continue
                at = time_of(value)
                if at < t:
                    del entries[key]
                    gone += 1
                elif at // SLICE == number:  # not due yet (else it is filed again later)
                    kept.append(key)
            if kept:
                self._slices[number] = kept
        return gone
