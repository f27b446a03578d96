"""Warm-up ramps as the operator sees and moves them (mtaqueue-ctl warmup, domains).

    Ramps(driver, placement, outcomes, registry, upkeep)
    .show(address) -> [dict]                 each ramp of the warming sources (of one)
    .move(address, name, to_first) -> [dict] (async) back to the first step, or finished
    .unrouted(live) -> [dict]                ramps with no live destination, for `domains`

Raises ValueError, with a text that names it, for an address that is no warming source
or a destination where it has no ramp. A move is saved to egress.json before the answer.
"""

from __future__ import annotations

import asyncio
import ipaddress

from ..logs import get_logger
from ..policy import warmup
from ..routing.pools import Source
from ..scheduler.actions import Action
from ..scheduler.core import OPERATOR
from .destination import sourced
from .driver import Driver
from .outcomes import Outcomes
from .placement import Placement
from .registry import Registry, named
from .upkeep import Upkeep

log = get_logger("delivery")


class Ramps:
    def __init__(
        self,
        driver: Driver,
        placement: Placement,
        outcomes: Outcomes,
        registry: Registry,
        upkeep: Upkeep,
    ) -> None:
        self.driver = driver
        self.placement = placement
        self.outcomes = outcomes
        self.registry = registry
        self.upkeep = upkeep
        self.egress = placement.egress

    def show(self, address: str | None = None) -> list[dict]:
        now = self.driver.now()
        return [
            self._entry(base, source, now)
            for source in self._warming(address)
            for base in self.egress.warmup.bases(source.address)
        ]

    async def move(
        self, address: str, name: str | None, to_first: bool, started: bool
    ) -> list[dict]:
        """Put `address`'s ramp at the destination `name` (its key, or a domain it serves;
        None: every destination it has a ramp at) back on the first step (`to_first`:
        mail queued there over that step's allowance goes to the pool's others or waits)
        or past the last (mail waiting there for the next day's allowance goes now)."""
        if not started:  # the ramps were never loaded: saving would lose them
            raise ValueError("delivery is off (delivery.enabled = false): no ramp to move")
        (source,) = self._warming(address)
        now = self.driver.now()
        entries = []
        actions: list[Action] = []
        for base in self._bases(source, name):
            ramp = self.egress.warmup.move(base, source, now, to_first)
            self.placement.log_ramps()  # a day end it came across first
            (log.warning if to_first else log.info)(
                "warmup_restarted" if to_first else "warmup_finished",
                base=base,
                source=source.address,
                step=ramp.step + 1,
                allowance=warmup.allowance(ramp, source.warmup),
                sent=ramp.sent,
            )
            entries.append(self._entry(base, source, now))
            if to_first:
                actions += self.placement.replace_queued(sourced(base, source), now)
            else:
                for message_id in self.placement.warm.release(base, now):
                    actions += self.outcomes.schedule(message_id, now, now, OPERATOR)
        self.driver.perform(actions)
        await asyncio.to_thread(self.upkeep.save_egress, self.egress.encode(now))
        return entries

    def unrouted(self, live: list[dict]) -> list[dict]:
        """The warm-up of (source, destination)s with no live destination (after a
        restart, say): a ramp's state matters while its mail waits for the next day."""
        names = {d["destination"] for d in live}
        sources = self._sources()
        now = self.driver.now()
        entries = []
        for base, address in list(self.egress.warmup.ramps):
            source = sources.get(address)
            if source is None or sourced(base, source) in names:
                continue
            entries.append(
                {"destination": sourced(base, source), "routed": False, "source": address}
                | {"domains": [], "queued": {}, "deferred": {}, "active": 0, "last_replies": []}
                | self.egress.warmup.snapshot(base, source, now)
            )
        return entries

    def _sources(self) -> dict[str, Source]:
        return {s.address: s for p in self.placement.pools.pools.values() for s in p.sources}

    def _warming(self, address: str | None) -> list[Source]:
        sources = [s for s in self._sources().values() if s.warmup]
        if address is None:
            return sorted(sources, key=lambda s: s.address)
        normal = str(ipaddress.ip_address(address))  # a ValueError that names it
        found = [s for s in sources if s.address == normal]
        if not found:
            raise ValueError(f"{normal} is no source of a pool with a warmup schedule")
        return found

    def _bases(self, source: Source, name: str | None) -> list[str]:
        known = self.egress.warmup.bases(source.address)
        if name is None:
            found = known
        else:
            name = name.lower().removesuffix(f"@{source.address}")
            destinations = self.registry.destinations
            live = (destinations.get(sourced(base, source)) for base in known)
            found = [
                base
                for base, d in zip(known, live, strict=True)
                if base == name or (d is not None and named(d, name))
            ]
        if not found:
            where = "anywhere" if name is None else f"at {name}"
            raise ValueError(f"source {source.address} has no ramp {where} (see warmup show)")
        return found

    def _entry(self, base: str, source: Source, now: float) -> dict:
        """A ramp as `mtaqueue-ctl warmup` shows it."""
        shown = self.egress.warmup.snapshot(base, source, now)["warmup"]
        return {"source": source.address, "destination": base, **shown}
