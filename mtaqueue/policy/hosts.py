"""Per-host suspend timers: an MX host that fails is left alone for a while.

    HostSuspensions(base, maximum)
    .failed(host, now, reply, source) -> until      .succeeded(host, source)
    .suspended / .until / .reason (host, now, source); .available / .next_release (hosts)
    .held(host, now) -> bool            suspended for any source
    .lift(host, now) -> bool            an operator's flush or unsuspend, for every source
    .suspensions(now) -> [Suspension]   every one in force (mtaqueue-ctl hosts)
    .snapshot(now, source) -> {host: until}
    .prune(now)                         forget the hosts released over `maximum` ago
    len(suspensions)                    hosts remembered

A host that fails (connect, greeting, EHLO, TLS) is suspended for `base`, doubling with
each consecutive failure up to `maximum`; a success resets it. The caller skips suspended
hosts and tries the next MX; when a destination has none left it waits for
`next_release` (an internal wait: not a failed attempt, see backoff).

Failures reported while a host is already suspended come from connections that were in
flight when it broke: one outage, counted once, so five parallel timeouts do not make a
one-minute suspension into sixteen.

A host is remembered after its release so that failing again right away keeps doubling;
one released for longer than `maximum` without failing starts over. Such entries are
dropped as they are read, at `prune` (the upkeep's sweep), and at most `limit` hosts are
remembered (the longest quiet go first).

An operator's flush or `unsuspend` lifts a suspension (`lift`) but keeps the streak: the
caller lets one probe connection through (the destination's breaker, half-open), and a
host still dead is suspended again, for longer, after that one connect (Postfix's
`postqueue -f` re-enables dead destinations the same way, qmgr_enable_all).

A host is a name and a port (`host_key`): two servers behind one address on different
ports are two hosts, and one failing does not suspend the other.

Providers judge per client IP, so a suspension is per (source, host): `source` is the
pool address the connection left from ("" the default source). A host that refuses one
of our addresses (a greeting that names the client, a per-IP connection limit or
firewall) is still tried from the others. It is down for every source (`EVERY`) when
`quorum` sources have it suspended at once for failures where it said nothing (refused,
timed out, unreachable, closed before a reply): the sources yet to try it skip it too.
A host that answered (a 554 greeting, a reply out of step) is up: what it said concerns
the source that heard it, never the others. A success from any source ends the host's
suspension for every source, and that source's own. (KumoMTA keys its connection
failures by egress path, source x site; Postfix by transport, a source address being a
transport's smtp_bind_address.)
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from .replies import Reply

# Keeps 2**n finite on a very long streak; 64 doublings outgrow any sane maximum.
_MAX_DOUBLINGS = 64
EVERY = "*"  # the source of a suspension for every source: the host is down
QUORUM = 2  # sources the host said nothing to, suspended at once, that make it down
# Failures without a word from the host: it may be down (or drop one address).
_SILENT = frozenset({"refused", "timeout", "unreachable", "lost"})


def host_key(name: str, port: int) -> str:
    """The host's name as it is shown, with its port unless 25: "mx1.example.org",
    "relay.example.org:2525", "[::1]:2525"."""
    if port == 25:
        return name
    return f"[{name}]:{port}" if ":" in name else f"{name}:{port}"


def silent(reply: Reply | None) -> bool:
    """Whether the host said nothing at all (no reply known: none either)."""
    return reply is None or (reply.code == 0 and reply.network in _SILENT)


class Suspension(msgspec.Struct, frozen=True):
    """One suspension in force, as `mtaqueue-ctl hosts` shows it."""

    host: str  # host_key: "mx1.example.org", "relay.example.org:2525"
    source: str  # the pool address it is suspended for; "" the default, EVERY all
    until: float
    failures: int  # consecutive: the suspension doubles with each
    reason: Reply | None  # the failure that started the outage


class _Entry(msgspec.Struct, frozen=True):
    failures: int  # consecutive
    until: float
    reason: Reply | None  # the failure that started the outage


class HostSuspensions:
    def __init__(
        self, base: float, maximum: float, *, limit: int = 100_000, quorum: int = QUORUM
    ) -> None:
        self.base = base
        self.maximum = maximum
        self.limit = limit
        self.quorum = quorum
        # host -> source (or EVERY) -> its entry; hosts ordered by last failure
        self._hosts: dict[str, dict[str, _Entry]] = {}

    def __len__(self) -> int:
        """Hosts remembered: suspended, or released but still on a failure streak."""
        return len(self._hosts)

    def failed(self, host: str, now: float, reply: Reply | None = None, source: str = "") -> float:
        """Suspend `host` for `source` after a failure at `now` (`reply` says what it was),
        and for every source if that makes `quorum` it said nothing to; returns when it is
        released for `source`."""
        entries = self._hosts.pop(host, None)
        if entries is None:
            if len(self._hosts) >= self.limit:
                self._make_room(now)
            entries = {}
        self._hosts[host] = entries  # the last to fail goes last
        down = entries.get(EVERY)
        if down is not None and now < down.until:  # in flight when it went down: that outage
            return down.until
        until = self._fail(entries, source, now, reply)
        mute = [s for s, e in entries.items() if s != EVERY and now < e.until and silent(e.reason)]
        if silent(reply) and len(mute) >= self.quorum:
            until = max(until, self._fail(entries, EVERY, now, reply))
        return until

    def succeeded(self, host: str, source: str = "") -> None:
        """`source` reached `host`: it is up, for every source; others' own stay."""
        entries = self._hosts.get(host)
        if entries is not None:
            entries.pop(source, None)
            entries.pop(EVERY, None)
            if not entries:
                del self._hosts[host]

    def until(self, host: str, now: float, source: str = "") -> float | None:
        """When `host` is released for `source`; None if it is not suspended for it."""
        entries = self._hosts.get(host)
        if entries is None:
            return None
        latest = max((e.until for s, e in entries.items() if s in (source, EVERY)), default=0.0)
        self._forget_host(host, entries, now)
        return latest if now < latest else None

    def suspended(self, host: str, now: float, source: str = "") -> bool:
        return self.until(host, now, source) is not None

    def reason(self, host: str, source: str = "") -> Reply | None:
        """The failure that suspended `host` for `source`, if it is remembered."""
        entries = self._hosts.get(host, {})
        mine = [e for s, e in entries.items() if s in (source, EVERY)]
        return max(mine, key=lambda e: e.until).reason if mine else None

    def available(self, hosts: Iterable[str], now: float, source: str = "") -> list[str]:
        """The hosts that are not suspended for `source`, in the given order."""
        return [host for host in hosts if not self.suspended(host, now, source)]

    def next_release(self, hosts: Iterable[str], now: float, source: str = "") -> float | None:
        """When every one of `hosts` is suspended for `source`: the earliest release."""
        releases = []
        for host in hosts:
            until = self.until(host, now, source)
            if until is None:
                return None
            releases.append(until)
        return min(releases, default=None)

    def held(self, host: str, now: float) -> bool:
        """Whether `host` is suspended for any source at `now`."""
        return any(now < entry.until for entry in self._hosts.get(host, {}).values())

    def lift(self, host: str, now: float) -> bool:
        """An operator lifts `host`'s suspension for every source (flush, unsuspend): it
        is released now, its streak kept, so that failing again at once suspends it for
        longer. Whether it was suspended for any source."""
        entries = self._hosts.get(host, {})
        held = [source for source, entry in entries.items() if now < entry.until]
        for source in held:
            entries[source] = msgspec.structs.replace(entries[source], until=now)
        return bool(held)

    def suspensions(self, now: float) -> list[Suspension]:
        """Every suspension in force, the latest release last (`mtaqueue-ctl hosts`)."""
        self._forget(now)
        found = [
            Suspension(host, source, entry.until, entry.failures, entry.reason)
            for host, entries in self._hosts.items()
            for source, entry in entries.items()
            if now < entry.until
        ]
        return sorted(found, key=lambda s: (s.until, s.host, s.source))

    def snapshot(self, now: float, source: str = "") -> dict[str, float]:
        """Hosts suspended for `source` and until when, for the control socket."""
        self._forget(now)
        found = ((host, self.until(host, now, source)) for host in list(self._hosts))
        return {host: until for host, until in found if until is not None}

    def prune(self, now: float) -> None:
        self._forget(now)

    def _fail(
        self, entries: dict[str, _Entry], source: str, now: float, reply: Reply | None
    ) -> float:
        entry = entries.get(source)
        if entry is not None and now < entry.until:  # the same outage, seen by another connection
            return entry.until
        failures = 1 if entry is None or self._stale(entry.until, now) else entry.failures + 1
        until = now + min(self.maximum, self.base * 2.0 ** min(failures - 1, _MAX_DOUBLINGS))
        entries[source] = _Entry(failures, until, reply)
        return until

    def _stale(self, until: float, now: float) -> bool:
        return now >= until + self.maximum

    def _forget_host(self, host: str, entries: dict[str, _Entry], now: float) -> None:
        for source in [s for s, e in entries.items() if self._stale(e.until, now)]:
            del entries[source]
        if not entries:
            del self._hosts[host]

    def _forget(self, now: float) -> None:
        for host, entries in list(self._hosts.items()):
            self._forget_host(host, entries, now)

    def _make_room(self, now: float) -> None:
        self._forget(now)
        # Still full: drop the hosts quiet the longest, a tenth at a time so that the scan
        # above runs once per many failures, not on every one.
        excess = len(self._hosts) - self.limit + 1
        if excess > 0:
            for host in list(self._hosts)[: max(excess, self.limit // 10)]:
                del self._hosts[host]
