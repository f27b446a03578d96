"""Source pools by class and by tenant: the local addresses a message's connections leave
from. A class's pool wins, then its tenant's; neither: the default source (the system
picks the address, delivery.helo_name is said).

Providers limit and judge per client IP, so a pooled source is part of the destination it
sends to (delivery/destination.py `destination_key`): pacing, breaker and what was learned
are per (source, destination), and host suspensions per (source, host) (policy/hosts.py).
Which source of a pool takes a message is policy/egress.py's choice. Pure.
"""

from __future__ import annotations

import ipaddress

import msgspec

from .. import config


class Source(msgspec.Struct, frozen=True):
    address: str  # normalised ("::1", "127.0.0.11")
    helo: str = ""  # "" = delivery.helo_name
    warmup: tuple[int, ...] = ()  # daily messages per destination, a step a day (policy/warmup.py)

    @property
    def family(self) -> int:
        return family_of(self.address)


class Pool(msgspec.Struct, frozen=True):
    name: str
    sources: tuple[Source, ...]
    blocklist_hold: float
    warmup_spread: float  # mail waiting for the next day's allowance: back within this


def family_of(address: str) -> int:
    """4 or 6."""
    return 6 if ":" in address else 4


def _source(entry: str | config.SourceConfig) -> Source:
    if isinstance(entry, str):
        return Source(str(ipaddress.ip_address(entry)))
    return Source(str(ipaddress.ip_address(entry.address)), entry.helo, tuple(entry.warmup))


class Pools:
    def __init__(self, cfg: config.Config) -> None:
        """The pools the config names (checked by config.load)."""
        self.pools = {
            name: Pool(
                name,
                tuple(_source(s) for s in table.sources),
                table.blocklist_hold,
                table.warmup_spread,
            )
            for name, table in cfg.pools.items()
        }
        self._classes = {n: c.pool for n, c in cfg.classes.items() if c.pool}
        self._tenants = {n: t.pool for n, t in cfg.tenants.items() if t.pool}

    def for_message(self, klass: str, tenant: str | None) -> Pool | None:
        name = self._classes.get(klass)
        if name is None and tenant is not None:
            name = self._tenants.get(tenant)
        return self.pools.get(name) if name is not None else None
