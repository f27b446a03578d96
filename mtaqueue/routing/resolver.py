"""The addresses to try for a next hop: MX lookup (RFC 5321 5.1, RFC 7505), A/AAAA, caching.

A DNS error is never taken for "no MX": SERVFAIL, REFUSED and timeouts defer the mail (4.4.3)
and never fall back to the domain's own A/AAAA records; only NXDOMAIN and null MX bounce.
Each lookup (MX, A, AAAA) is cached with its TTL, negative answers briefly, and failures for a
few seconds; concurrent lookups of one name share one query.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterable
from itertools import chain, zip_longest

import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.resolver
import msgspec

from mtaqueue.routing.dnscache import DnsCache, Entry, Key
from mtaqueue.routing.nexthop import NextHop, is_ip_address, literal_address
from mtaqueue.routing.sts import Applied

NXDOMAIN = "NXDOMAIN"
NODATA = "NODATA"
_NULL_MX = "."


class MxHost(msgspec.Struct, frozen=True):
    name: str
    preference: int
    addresses: tuple[str, ...]


class Route(msgspec.Struct, frozen=True):
    hosts: tuple[MxHost, ...]  # in the order to try; addresses already ordered and capped
    port: int
    sts: Applied | None = None  # the recipient domain's MTA-STS policy (delivery/mta_sts.py)
    tls_domain: str = ""  # the recipient domain, if these are its own MX hosts (TLS-RPT)
    own_mx: bool = False  # the recipient domain's own MX hosts, not a hop the operator named


class RouteFailure(msgspec.Struct, frozen=True):
    permanent: bool
    status: str  # enhanced status code: 5.1.10, 5.1.2, 5.4.4 or 4.4.3
    text: str
    network: str = "dns"  # "tls": no MX host the recipient domain's MTA-STS policy lists


class Resolver:
    def __init__(
        self,
        nameservers: list[tuple[str, int]],
        *,
        timeout: float,
        negative_ttl_max: float,
        max_addresses: int,
        address_order: str,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if nameservers:
            self._dns = dns.asyncresolver.Resolver(configure=False)
            self._dns.nameservers = [dns.nameserver.Do53Nameserver(ip, p) for ip, p in nameservers]
        else:
            self._dns = dns.asyncresolver.Resolver()  # /etc/resolv.conf
        # The whole query, retries and servers included; each try keeps dnspython's timeout.
        self._dns.lifetime = timeout
        self.cache = DnsCache(negative_ttl_max=negative_ttl_max)
        self._max_addresses = max(max_addresses, 2)  # RFC 5321 5.1: try at least two
        self._address_order = address_order
        self._rng = rng or random.Random()
        self._clock = clock  # for cache expiry only
        self._in_flight: dict[Key, asyncio.Task[Entry]] = {}

    async def route(self, hop: NextHop) -> Route | RouteFailure:
        address = literal_address(hop.host)
        if address is not None:
            return Route((MxHost(hop.host, 0, (address,)),), hop.port)
        try:
            dns.name.from_text(hop.host)
        except dns.exception.DNSException as e:
            return RouteFailure(True, "5.1.2", f"{hop.host}: not a valid domain name ({e})")
        if hop.mx:
            return await self._route_mx(hop)
        hosts, failures = await self._resolve_hosts([(hop.host, 0)])
        if hosts:
            return Route(hosts, hop.port)
        # The operator named this host: missing is more likely a typo or a DNS outage on our
        # side than a reason to bounce everything routed through it.
        why = failures[0] if failures else f"{hop.host}: no A/AAAA records"
        text = f"next hop {why}; deferred, not bounced: check the relayhost or route naming it"
        return RouteFailure(False, "4.4.3", text)

    async def _route_mx(self, hop: NextHop) -> Route | RouteFailure:
        domain = hop.host
        mx = await self._lookup(domain, "MX")
        if mx.kind == "failure":
            return RouteFailure(False, "4.4.3", f"{domain}: MX lookup failed: {mx.value}")
        implicit = mx.kind == "negative"
        if implicit and mx.value == NXDOMAIN:
            return RouteFailure(True, "5.1.2", f"{domain}: domain does not exist (NXDOMAIN)")
        # No MX records: the domain itself is the implicit MX, preference 0.
        records: tuple[tuple[int, str], ...] = ((0, domain),) if implicit else mx.value
        if any(name == _NULL_MX for _, name in records):
            broken = " (broken: null MX mixed with other MX records)" if len(records) > 1 else ""
            text = f"{domain}: null MX (RFC 7505): domain accepts no mail{broken}"
            return RouteFailure(True, "5.1.10", text)
        # Lowest preference first; a random tie-break shuffles equal preferences. Sorted first
        # so that the rng alone decides, whatever order the server sent the records in.
        ordered = sorted(sorted(records), key=lambda r: (r[0], self._rng.random()))
        names: dict[str, int] = {}
        for preference, name in ordered:
            # An MX names a host; "[192.0.2.1]" or a bare address there is a broken record.
            if not name.startswith("[") and not is_ip_address(name):
                names.setdefault(name, preference)
        hosts, failures = await self._resolve_hosts(list(names.items()))
        if hosts:
            return Route(hosts, hop.port)
        if failures:
            text = f"{domain}: no MX host address, lookup failed: {failures[0]}"
            return RouteFailure(False, "4.4.3", text)
        what = "no MX and no A/AAAA records" if implicit else "no MX host has an address"
        return RouteFailure(True, "5.4.4", f"{domain}: {what}")

    async def _resolve_hosts(
        self, hosts: list[tuple[str, int]]
    ) -> tuple[tuple[MxHost, ...], list[str]]:
        """The hosts with their capped addresses (hosts without any left out), and the
        temporary failures met on the way."""
        results = await asyncio.gather(*(self._addresses(name) for name, _ in hosts))
        failures = [failure for _, failure in results if failure]
        # Budget: first the first address of each host in order, so that a backup MX keeps a
        # chance when the primary has many addresses; then the rest, host by host.
        budget = self._max_addresses
        take = [0] * len(hosts)
        for i, (addresses, _) in enumerate(results):
            if addresses and budget:
                take[i], budget = 1, budget - 1
        for i, (addresses, _) in enumerate(results):
            more = min(len(addresses) - take[i], budget)
            take[i], budget = take[i] + more, budget - more
        capped = tuple(
            MxHost(name, preference, addresses[:n])
            for (name, preference), (addresses, _), n in zip(hosts, results, take, strict=True)
            if n
        )
        return capped, failures

    async def _addresses(self, name: str) -> tuple[tuple[str, ...], str | None]:
        """The host's addresses in the configured order, and a temporary failure, if any."""
        a, aaaa = await asyncio.gather(self._lookup(name, "A"), self._lookup(name, "AAAA"))
        v4 = a.value if a.kind == "positive" else ()
        v6 = aaaa.value if aaaa.kind == "positive" else ()
        failure = next((f"{name}: {e.value}" for e in (a, aaaa) if e.kind == "failure"), None)
        return self._order(v4, v6), failure

    async def txt(self, name: str) -> tuple[str, ...] | None:
        """The name's TXT records, each one's strings joined; None: the lookup failed
        (a temporary failure), () for NXDOMAIN or no records. Cached as the others."""
        entry = await self._lookup(name, "TXT")
        if entry.kind == "failure":
            return None
        return entry.value if entry.kind == "positive" else ()

    async def addresses(self, name: str) -> tuple[str, ...]:
        """The host's addresses in the configured order (empty when it has none or the
        lookups failed): for the MTA-STS policy host (delivery/mta_sts.py)."""
        addresses, _ = await self._addresses(name)
        return addresses

    def _order(self, v4: tuple[str, ...], v6: tuple[str, ...]) -> tuple[str, ...]:
        if self._address_order == "ipv4-first":
            return v4 + v6
        if self._address_order == "ipv6-first":
            return v6 + v4
        # as-resolved: each family in DNS order, the families alternating IPv6 first as in
        # RFC 8305 4, so that the address cap leaves both in the list.
        return tuple(a for a in chain.from_iterable(zip_longest(v6, v4)) if a is not None)

    async def _lookup(self, name: str, rdtype: str) -> Entry:
        key = (name.lower().removesuffix("."), rdtype)
        entry = self.cache.get(key, self._clock())
        if entry is not None:
            return entry
        query = self._in_flight.get(key)
        if query is None:
            query = self._in_flight[key] = asyncio.create_task(self._query(key))
            query.add_done_callback(lambda _: self._in_flight.pop(key, None))
        # Shielded: a cancelled delivery must not cancel the lookup others wait for.
        return await asyncio.shield(query)

    async def _query(self, key: Key) -> Entry:
        name, rdtype = key
        try:
            answer = await self._dns.resolve(
                dns.name.from_text(name), rdtype, raise_on_no_answer=False, search=False
            )
        except dns.resolver.NXDOMAIN as e:
            ttl = e.response(e.qnames()[0]).resolve_chaining().minimum_ttl
            return self.cache.put_negative(key, NXDOMAIN, ttl, self._clock())
        except dns.exception.Timeout:
            return self.cache.put_temporary_failure(key, "DNS timeout", self._clock())
        except dns.resolver.NoNameservers as e:
            reason = f"no nameserver answered ({_errors(e.kwargs['errors'])})"
            return self.cache.put_temporary_failure(key, reason, self._clock())
        except dns.exception.DNSException as e:
            return self.cache.put_temporary_failure(key, f"DNS error: {e}", self._clock())
        # The minimum TTL over the CNAME chain and the answer (or the SOA for NODATA).
        ttl = answer.chaining_result.minimum_ttl
        if answer.rrset is None:
            return self.cache.put_negative(key, NODATA, ttl, self._clock())
        if rdtype == "MX":
            value: tuple = tuple(
                (rd.preference, rd.exchange.to_text(omit_final_dot=True).lower())
                for rd in answer.rrset
            )
        elif rdtype == "TXT":
            value = tuple(b"".join(rd.strings).decode("utf-8", "replace") for rd in answer.rrset)
        else:
            value = tuple(rd.address for rd in answer.rrset)
        return self.cache.put_positive(key, value, ttl, self._clock())


def _errors(errors: Iterable[tuple]) -> str:
    """dnspython's per-server errors (an rcode's name or an exception), distinct, in order."""
    return ", ".join(dict.fromkeys(str(error) for _, _, _, error, _ in errors)) or "no servers"
