"""Which source a message leaves from, and what destinations said about our sources (sans-IO).

- A pool's source for a destination is the least loaded of those usable there (mail
  waiting plus connections at that (source, destination)), ties taken in turn: a batch
  spreads over the pool, and a source that a destination paces harder gets less of it.
- A source that drew a blocklist reply ("listed at Spamhaus", "blocked using ...") from a
  destination is out for that destination until its hold ends; the pool's other sources
  carry on, and other destinations still get it.
- A source warming up (policy/warmup.py) is not chosen for a destination once its mail
  there (sent today plus queued or on its way) reaches the day's allowance.
- A destination that refuses IPv6 senders (Gmail's "550-5.7.1 ... IPv6 ... PTR") gets IPv4
  from then on, for IPV4_HOLD after the last such refusal.

Destinations are named by their key without a source ("base"). All this state survives
restarts (`encode`/`decode`, saved by delivery/upkeep.py every 30 s); `encode` drops the
expired entries and the ramps unused for a month (policy/warmup.py `Warmups.prune`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterable

import msgspec

from ..routing.pools import Source
from .warmup import Ramp, Warmups

IPV4_HOLD = 30 * 86400.0  # a PTR/SPF fix on our side is rare: ask again after a month


class _Saved(msgspec.Struct):
    excluded: dict[str, float] = {}  # "base@address" -> until
    ipv4_only: dict[str, float] = {}  # base -> until
    warmup: dict[str, Ramp] = {}  # "base@address" -> its ramp (warm stays so while used)
    version: int = 1


class EgressState:
    def __init__(self) -> None:
        self._excluded: dict[tuple[str, str], float] = {}
        self._ipv4_only: dict[str, float] = {}
        self._turn = itertools.count()
        self.warmup = Warmups()

    # -- sources ---------------------------------------------------------------------------

    def choose(
        self,
        sources: Iterable[Source],
        base: str,
        families: Collection[int],
        load: Callable[[Source], int],
        now: float,
        placed: Callable[[Source], int] | None = None,
    ) -> Source | None:
        """The source for mail to `base`, whose addresses are of `families`; None: no
        source of the pool may send there now (see `usable_after`, `warming`). `placed`:
        the messages queued or on their way at a source, for its warm-up (else `load`)."""
        open_ = [s for s in sources if s.family in families and not self.excluded(base, s, now)]
        usable, loads = [], []
        for source in open_:
            room = self.warmup.left(base, source, now)
            if room is None or (placed or load)(source) < room:
                usable.append(source)
                loads.append(load(source))
        if not usable:
            return None
        least = [s for s, n in zip(usable, loads, strict=True) if n == min(loads)]
        return least[next(self._turn) % len(least)]

    def excluded(self, base: str, source: Source, now: float) -> bool:
        until = self._excluded.get((base, source.address))
        return until is not None and until > now

    def exclude(self, base: str, source: Source, now: float, hold: float) -> bool:
        """Take `source` out for `base` for `hold` seconds; whether it was in (replies of
        one episode, already in flight, do not extend the hold)."""
        if self.excluded(base, source, now):
            return False
        self._excluded[(base, source.address)] = now + hold
        return True

    def usable_after(
        self, sources: Iterable[Source], base: str, families: Collection[int], now: float
    ) -> float | None:
        """When the first source of `families` excluded for `base` comes back; None if
        none of those families is excluded (no source of theirs in the pool)."""
        ends = [
            self._excluded[(base, s.address)]
            for s in sources
            if s.family in families and self.excluded(base, s, now)
        ]
        return min(ends) if ends else None

    def warming(
        self, sources: Iterable[Source], base: str, families: Collection[int], now: float
    ) -> bool:
        """After `choose` found none: whether a source of `families` is not excluded for
        `base`, so that only its warm-up allowance for the day keeps it."""
        return any(s.family in families and not self.excluded(base, s, now) for s in sources)

    # -- address families ------------------------------------------------------------------

    def families(self, base: str, addresses: Iterable[str], now: float) -> set[int]:
        """The families of `addresses` that may be used for `base`."""
        families = {6 if ":" in a else 4 for a in addresses}
        if self.ipv4_only(base, now) and 4 in families:
            families.discard(6)
        return families

    def ipv4_only(self, base: str, now: float) -> bool:
        return self._ipv4_only.get(base, 0.0) > now

    def refuse_ipv6(self, base: str, now: float) -> bool:
        """`base` refused us over IPv6: IPv4 from now on; whether that is news."""
        fresh = not self.ipv4_only(base, now)
        self._ipv4_only[base] = now + IPV4_HOLD
        return fresh

    # -- views and persistence -------------------------------------------------------------

    def snapshot(self, base: str, source: Source | None, now: float) -> dict:
        """What `mtaqueue-ctl domains` shows of a (source, destination)."""
        until = self._excluded.get((base, source.address), 0.0) if source is not None else 0.0
        return {
            "source_excluded_until": until if until > now else None,
            "ipv4_only": self.ipv4_only(base, now),
        } | self.warmup.snapshot(base, source, now)

    def encode(self, now: float) -> bytes:
        self._excluded = {k: t for k, t in self._excluded.items() if t > now}
        self._ipv4_only = {k: t for k, t in self._ipv4_only.items() if t > now}
        self.warmup.prune(now)
        excluded = {f"{base}@{address}": t for (base, address), t in self._excluded.items()}
        ramps = {f"{base}@{address}": r for (base, address), r in self.warmup.ramps.items()}
        saved = _Saved(dict(sorted(excluded.items())), self._ipv4_only, dict(sorted(ramps.items())))
        return msgspec.json.encode(saved)

    def sizes(self) -> dict[str, int]:
        return {
            "egress_exclusions": len(self._excluded),
            "ipv4_only": len(self._ipv4_only),
            "warmup_ramps": len(self.warmup.ramps),
        }

    def restore(self, data: bytes) -> None:
        """Raises msgspec.DecodeError (a ValueError) for a damaged file."""
        saved = msgspec.json.decode(data, type=_Saved)
        for key, until in saved.excluded.items():
            base, _, address = key.rpartition("@")
            self._excluded[(base, address)] = until
        self._ipv4_only.update(saved.ipv4_only)
        for key, ramp in saved.warmup.items():
            base, _, address = key.rpartition("@")
            self.warmup.ramps[(base, address)] = ramp
