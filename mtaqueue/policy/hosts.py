"""Per-host suspend timers: an MX host that fails is left alone for a while.

A host that fails (connect, greeting, EHLO, TLS) is suspended for `base`, doubling with
each consecutive failure up to `maximum`; a success resets it. The caller skips suspended
hosts and tries the next MX; when a destination has none left it waits for
`next_release` (an internal wait: not a failed attempt, see backoff).

Failures reported while a host is already suspended come from connections that were in
flight when it broke: one outage, counted once, so five parallel timeouts do not make a
one-minute suspension into sixteen.

A host is remembered after its release so that failing again right away keeps doubling;
one released for longer than `maximum` without failing starts over. Such entries are
dropped lazily, and at most `limit` hosts are remembered (the longest quiet go first).

A host is a name and a port (`host_key`): two servers behind one address on different
ports are two hosts, and one failing does not suspend the other.
"""

from __future__ import annotations

from collections.abc import Iterable

from .replies import Reply

# Keeps 2**n finite on a very long streak; 64 doublings outgrow any sane maximum.
_MAX_DOUBLINGS = 64


def host_key(name: str, port: int) -> str:
    """The host's name as it is shown, with its port unless 25: "mx1.example.org",
    "relay.example.org:2525", "[::1]:2525"."""
    if port == 25:
        return name
    return f"[{name}]:{port}" if ":" in name else f"{name}:{port}"


class HostSuspensions:
    def __init__(self, base: float, maximum: float, *, limit: int = 100_000) -> None:
        self.base = base
        self.maximum = maximum
        self.limit = limit
        # host -> (consecutive failures, suspended until, why); ordered by last failure
        self._hosts: dict[str, tuple[int, float, Reply | None]] = {}

    def __len__(self) -> int:
        """Hosts remembered: suspended, or released but still on a failure streak."""
        return len(self._hosts)

    def failed(self, host: str, now: float, reply: Reply | None = None) -> float:
        """Suspend `host` after a failure at `now` (`reply` says what it was); returns when
        it is released."""
        entry = self._hosts.pop(host, None)
        if entry is not None and now < entry[1]:  # the same outage, seen by another connection
            self._hosts[host] = entry
            return entry[1]
        failures = 1 if entry is None or self._stale(entry[1], now) else entry[0] + 1
        until = now + min(self.maximum, self.base * 2.0 ** min(failures - 1, _MAX_DOUBLINGS))
        if len(self._hosts) >= self.limit:
            self._make_room(now)
        self._hosts[host] = (failures, until, reply)
        return until

    def succeeded(self, host: str) -> None:
        self._hosts.pop(host, None)

    def suspended(self, host: str, now: float) -> bool:
        entry = self._hosts.get(host)
        if entry is None:
            return False
        if self._stale(entry[1], now):
            del self._hosts[host]
        return now < entry[1]

    def reason(self, host: str) -> Reply | None:
        """The failure that suspended `host`, if it is remembered."""
        entry = self._hosts.get(host)
        return entry[2] if entry is not None else None

    def available(self, hosts: Iterable[str], now: float) -> list[str]:
        """The hosts that are not suspended, in the given order."""
        return [host for host in hosts if not self.suspended(host, now)]

    def next_release(self, hosts: Iterable[str], now: float) -> float | None:
        """When every one of `hosts` is suspended: the earliest release. Else None."""
        releases = []
        for host in hosts:
            if not self.suspended(host, now):
                return None
            releases.append(self._hosts[host][1])
        return min(releases, default=None)

    def snapshot(self, now: float) -> dict[str, float]:
        """Suspended hosts and until when, for the control socket and metrics."""
        self._forget(now)
        return {host: until for host, (_, until, _) in self._hosts.items() if now < until}

    def _stale(self, until: float, now: float) -> bool:
        return now >= until + self.maximum

    def _forget(self, now: float) -> None:
        for host in [h for h, (_, until, _) in self._hosts.items() if self._stale(until, now)]:
            del self._hosts[host]

    def _make_room(self, now: float) -> None:
        self._forget(now)
        # Still full: drop the hosts quiet the longest, a tenth at a time so that the scan
        # above runs once per many failures, not on every one.
        excess = len(self._hosts) - self.limit + 1
        if excess > 0:
            for host in list(self._hosts)[: max(excess, self.limit // 10)]:
                del self._hosts[host]
