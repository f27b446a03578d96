"""MX/A/AAAA resolution and its cache (mtaqueue.routing.resolver, .dnscache), against the
test DNS server on loopback (tests/dns_server.py)."""

from __future__ import annotations

import asyncio
import random

import dns.exception
import dns.message
import dns.query
import dns.rcode
import dns.resolver
import pytest
from dns_server import DnsServer

from mtaqueue.routing.dnscache import DnsCache
from mtaqueue.routing.nexthop import NextHop
from mtaqueue.routing.resolver import MxHost, Resolver, Route, RouteFailure


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def server():
    with DnsServer() as dns_server:
        yield dns_server


def make(server: DnsServer, **options) -> Resolver:
    defaults = {
        "timeout": 2.0,
        "negative_ttl_max": 300.0,
        "max_addresses": 5,
        "address_order": "ipv4-first",
        "rng": random.Random(0),
    }
    return Resolver([("127.0.0.1", server.port)], **(defaults | options))


def route(resolver: Resolver, host: str, port: int = 25, mx: bool = True):
    return asyncio.run(resolver.route(NextHop(host, port, mx)))


def names(result: Route) -> list[str]:
    return [host.name for host in result.hosts]


def address_queries(server: DnsServer) -> list[tuple[str, str]]:
    return [q for q in server.queries if q[1] in ("A", "AAAA")]


# -- MX -------------------------------------------------------------------------------


def test_mx_hosts_by_preference(server):
    server.add("example.org", "MX", "20 mx2.example.org")
    server.add("example.org", "MX", "10 mx1.example.org")
    server.add("example.org", "MX", "30 mx3.example.org")
    for i in (1, 2, 3):
        server.add(f"mx{i}.example.org", "A", f"127.0.0.{i + 1}")
    assert route(make(server), "example.org", 2525) == Route(
        (
            MxHost("mx1.example.org", 10, ("127.0.0.2",)),
            MxHost("mx2.example.org", 20, ("127.0.0.3",)),
            MxHost("mx3.example.org", 30, ("127.0.0.4",)),
        ),
        2525,
    )


def test_equal_preferences_are_shuffled_with_the_injected_rng(server):
    server.add("example.org", "MX", "10 a.example.org")
    server.add("example.org", "MX", "10 b.example.org")
    server.add("example.org", "MX", "20 c.example.org")
    for host in ("a", "b", "c"):
        server.add(f"{host}.example.org", "A", "127.0.0.2")
    orders = set()
    for seed in range(20):
        result = route(make(server, rng=random.Random(seed)), "example.org")
        assert names(result)[2] == "c.example.org"
        assert names(result) == names(route(make(server, rng=random.Random(seed)), "example.org"))
        orders.add(tuple(names(result)[:2]))
    assert orders == {("a.example.org", "b.example.org"), ("b.example.org", "a.example.org")}


def test_no_mx_means_implicit_mx_on_the_domains_own_addresses(server):
    server.add("plain.test", "A", "127.0.0.5")
    server.add("plain.test", "AAAA", "::1")
    assert route(make(server), "plain.test") == Route(
        (MxHost("plain.test", 0, ("127.0.0.5", "::1")),), 25
    )


def test_no_mx_and_no_address_is_permanent_5_4_4(server):
    server.add("text-only.test", "TXT", '"v=spf1 -all"')
    assert route(make(server), "text-only.test") == RouteFailure(
        True, "5.4.4", "text-only.test: no MX and no A/AAAA records"
    )


def test_null_mx_fails_permanently_without_address_lookups(server):
    server.add("nullmx.test", "MX", "0 .")
    server.add("nullmx.test", "A", "127.0.0.2")
    assert route(make(server), "nullmx.test") == RouteFailure(
        True, "5.1.10", "nullmx.test: null MX (RFC 7505): domain accepts no mail"
    )
    assert address_queries(server) == []


def test_null_mx_mixed_with_other_mx_is_still_null_and_called_broken(server):
    server.add("mixed.test", "MX", "0 .")
    server.add("mixed.test", "MX", "10 mx1.example.org")
    server.add("mx1.example.org", "A", "127.0.0.2")
    result = route(make(server), "mixed.test")
    assert (result.permanent, result.status) == (True, "5.1.10")
    assert "broken" in result.text


def test_nxdomain_is_permanent_5_1_2(server):
    assert route(make(server), "nowhere.test") == RouteFailure(
        True, "5.1.2", "nowhere.test: domain does not exist (NXDOMAIN)"
    )
    assert address_queries(server) == []


@pytest.mark.parametrize(("fail", "rcode"), [("servfail", "SERVFAIL"), ("refuse", "REFUSED")])
def test_mx_servfail_or_refused_is_temporary_and_never_falls_back_to_a(server, fail, rcode):
    getattr(server, fail)("broken.test")
    result = route(make(server), "broken.test")
    assert result == RouteFailure(
        False, "4.4.3", f"broken.test: MX lookup failed: no nameserver answered ({rcode})"
    )
    assert server.queries == [("broken.test", "MX")]


def test_mx_timeout_is_temporary_and_never_falls_back_to_a(server):
    server.drop("slow.test")
    result = route(make(server, timeout=0.5), "slow.test")
    assert result == RouteFailure(False, "4.4.3", "slow.test: MX lookup failed: DNS timeout")
    assert server.queries == [("slow.test", "MX")]


def test_cname_to_a_domain_with_mx_is_followed(server):
    server.add("alias.test", "CNAME", "example.org")
    server.add("example.org", "MX", "10 mx1.example.org")
    server.add("mx1.example.org", "CNAME", "host.example.org")
    server.add("host.example.org", "A", "127.0.0.2")
    assert route(make(server), "alias.test") == Route(
        (MxHost("mx1.example.org", 10, ("127.0.0.2",)),), 25
    )


def test_cname_to_a_domain_without_mx_uses_the_implicit_mx(server):
    server.add("alias.test", "CNAME", "plain.test")
    server.add("plain.test", "A", "127.0.0.5")
    assert route(make(server), "alias.test") == Route(
        (MxHost("alias.test", 0, ("127.0.0.5",)),), 25
    )


def test_cname_to_a_missing_name_is_nxdomain(server):
    server.add("dangling.test", "CNAME", "gone.test")
    result = route(make(server), "dangling.test")
    assert (result.permanent, result.status) == (True, "5.1.2")


# -- MX hosts' addresses ----------------------------------------------------------------


def test_mx_host_with_temporary_failure_is_skipped_when_another_works(server):
    server.add("example.org", "MX", "10 broken.example.org")
    server.add("example.org", "MX", "20 mx2.example.org")
    server.servfail("broken.example.org")
    server.add("mx2.example.org", "A", "127.0.0.3")
    assert route(make(server), "example.org") == Route(
        (MxHost("mx2.example.org", 20, ("127.0.0.3",)),), 25
    )


def test_no_mx_host_address_with_a_temporary_failure_is_temporary(server):
    server.add("example.org", "MX", "10 broken.example.org")
    server.add("example.org", "MX", "20 gone.example.org")  # NXDOMAIN
    server.servfail("broken.example.org")
    result = route(make(server), "example.org")
    assert (result.permanent, result.status) == (False, "4.4.3")
    assert "broken.example.org" in result.text


def test_no_mx_host_address_is_permanent_5_4_4(server):
    server.add("example.org", "MX", "10 gone.example.org")
    server.add("example.org", "MX", "20 text-only.example.org")
    server.add("text-only.example.org", "TXT", '"x"')
    assert route(make(server), "example.org") == RouteFailure(
        True, "5.4.4", "example.org: no MX host has an address"
    )


def test_mx_host_that_is_an_ip_literal_is_skipped(server):
    server.add("example.org", "MX", "5 [127.0.0.9]")
    server.add("example.org", "MX", "6 127.0.0.9")
    server.add("example.org", "MX", "10 mx1.example.org")
    server.add("mx1.example.org", "A", "127.0.0.2")
    assert names(route(make(server), "example.org")) == ["mx1.example.org"]


def test_duplicate_mx_host_is_tried_once_at_its_best_preference(server):
    server.add("example.org", "MX", "20 mx1.example.org")
    server.add("example.org", "MX", "10 mx1.example.org")
    server.add("mx1.example.org", "A", "127.0.0.2")
    assert route(make(server), "example.org").hosts == (
        MxHost("mx1.example.org", 10, ("127.0.0.2",)),
    )


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        ("ipv4-first", ("127.0.0.2", "127.0.0.3", "127.0.0.4", "::1", "::ffff:127.0.0.2")),
        ("ipv6-first", ("::1", "::ffff:127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.4")),
        ("as-resolved", ("::1", "127.0.0.2", "::ffff:127.0.0.2", "127.0.0.3", "127.0.0.4")),
    ],
)
def test_address_order(server, order, expected):
    for address in ("127.0.0.2", "127.0.0.3", "127.0.0.4"):
        server.add("multi.test", "A", address)
    for address in ("::1", "::ffff:127.0.0.2"):
        server.add("multi.test", "AAAA", address)
    result = route(make(server, address_order=order), "multi.test")
    assert result.hosts[0].addresses == expected


def add_hosts(server: DnsServer, counts: list[int]) -> None:
    for i, count in enumerate(counts, 1):
        server.add("example.org", "MX", f"{i * 10} mx{i}.example.org")
        for j in range(count):
            server.add(f"mx{i}.example.org", "A", f"127.0.{i}.{j + 1}")


def test_address_cap_keeps_the_first_address_of_each_host_first(server):
    add_hosts(server, [4, 2, 1])
    result = route(make(server, max_addresses=4), "example.org")
    assert [host.addresses for host in result.hosts] == [
        ("127.0.1.1", "127.0.1.2"),
        ("127.0.2.1",),
        ("127.0.3.1",),
    ]


def test_address_cap_fills_up_host_by_host(server):
    add_hosts(server, [3, 3])
    result = route(make(server, max_addresses=5), "example.org")
    assert [host.addresses for host in result.hosts] == [
        ("127.0.1.1", "127.0.1.2", "127.0.1.3"),
        ("127.0.2.1", "127.0.2.2"),
    ]


def test_address_cap_drops_hosts_beyond_it(server):
    add_hosts(server, [1, 1, 1])
    assert names(route(make(server, max_addresses=2), "example.org")) == [
        "mx1.example.org",
        "mx2.example.org",
    ]


@pytest.mark.parametrize(("counts", "expected"), [([3], 2), ([3, 3], 2)])
def test_at_least_two_addresses_are_tried(server, counts, expected):
    add_hosts(server, counts)
    result = route(make(server, max_addresses=1), "example.org")
    assert sum(len(host.addresses) for host in result.hosts) == expected


# -- next hops without MX lookup ------------------------------------------------------


def test_bracketed_host_next_hop_uses_its_addresses_without_mx_lookup(server):
    server.add("relay.test", "MX", "10 elsewhere.test")
    server.add("relay.test", "A", "127.0.0.7")
    server.add("relay.test", "AAAA", "::1")
    assert route(make(server), "relay.test", 2525, mx=False) == Route(
        (MxHost("relay.test", 0, ("127.0.0.7", "::1")),), 2525
    )
    assert ("relay.test", "MX") not in server.queries


def test_bracketed_host_next_hop_not_found_is_temporary(server):
    result = route(make(server), "missing-relay.test", 2525, mx=False)
    assert (result.permanent, result.status) == (False, "4.4.3")
    assert "relayhost" in result.text


def test_bracketed_host_next_hop_dns_failure_is_temporary(server):
    server.servfail("relay.test")
    result = route(make(server), "relay.test", 2525, mx=False)
    assert (result.permanent, result.status) == (False, "4.4.3")
    assert "SERVFAIL" in result.text


@pytest.mark.parametrize("address", ["127.0.0.2", "::1"])
def test_ip_literal_next_hop_needs_no_dns(server, address):
    assert route(make(server), address, 2525, mx=False) == Route(
        (MxHost(address, 0, (address,)),), 2525
    )
    assert server.queries == []


def test_invalid_domain_name_is_permanent_5_1_2(server):
    result = route(make(server), "x" * 64 + ".test")
    assert (result.permanent, result.status) == (True, "5.1.2")
    assert server.queries == []


# -- caching ------------------------------------------------------------------------


def example_org(server: DnsServer, ttl: int = 300) -> None:
    server.add("example.org", "MX", "10 mx1.example.org", ttl=ttl)
    server.add("mx1.example.org", "A", "127.0.0.2", ttl=ttl)


def test_cache_hit_does_not_touch_the_network(server):
    example_org(server)
    resolver = make(server)
    first = route(resolver, "example.org")
    queries = list(server.queries)
    server.stop()
    assert route(resolver, "example.org") == first
    assert server.queries == queries
    assert resolver.cache.hits == 3  # MX, A, AAAA (the NODATA answer is cached too)


def test_concurrent_routes_share_one_query(server):
    example_org(server)
    resolver = make(server)

    async def many():
        return await asyncio.gather(
            *(resolver.route(NextHop("example.org", 25, True)) for _ in range(10))
        )

    asyncio.run(many())
    assert server.queries.count(("example.org", "MX")) == 1


def assert_kept_for(server, clock: Clock, resolver, name: str, seconds: float) -> None:
    """`name`'s MX answer is asked for once, kept until just before `seconds` have
    passed and asked for again just after."""
    route(resolver, name)
    clock.now += seconds - 1
    route(resolver, name)
    assert server.queries.count((name, "MX")) == 1
    clock.now += 2
    route(resolver, name)
    assert server.queries.count((name, "MX")) == 2


def test_positive_answer_expires_with_its_ttl(server):
    example_org(server, ttl=300)
    clock = Clock()
    assert_kept_for(server, clock, make(server, clock=clock), "example.org", 300)


def test_negative_answer_ttl_is_capped_by_negative_ttl_max(server):
    server.soa_ttl = 3600
    clock = Clock()
    resolver = make(server, clock=clock, negative_ttl_max=60.0)
    assert_kept_for(server, clock, resolver, "nowhere.test", 60)


def test_negative_answer_ttl_comes_from_the_soa(server):
    server.soa_ttl = 30
    server.add("plain.test", "A", "127.0.0.5", ttl=3600)
    clock = Clock()
    resolver = make(server, clock=clock, negative_ttl_max=300.0)
    assert_kept_for(server, clock, resolver, "plain.test", 30)  # MX is NODATA
    assert server.queries.count(("plain.test", "A")) == 1


def test_temporary_failure_is_cached_briefly(server):
    server.servfail("example.org")
    clock = Clock()
    resolver = make(server, clock=clock)
    assert route(resolver, "example.org").status == "4.4.3"
    assert route(resolver, "example.org").status == "4.4.3"
    assert server.queries == [("example.org", "MX")]
    server.remove("example.org")
    example_org(server)
    clock.now += resolver.cache.failure_ttl + 1
    assert names(route(resolver, "example.org")) == ["mx1.example.org"]


# -- nameservers ----------------------------------------------------------------------


def test_system_resolver_is_not_used_when_nameservers_are_given(server, monkeypatch):
    def read_resolv_conf(*args):
        raise AssertionError("read the system resolver configuration")

    monkeypatch.setattr(dns.resolver.BaseResolver, "read_resolv_conf", read_resolv_conf)
    example_org(server)
    assert names(route(make(server), "example.org")) == ["mx1.example.org"]
    with pytest.raises(AssertionError):
        Resolver(
            [], timeout=1.0, negative_ttl_max=60.0, max_addresses=5, address_order="as-resolved"
        )


def test_each_nameserver_has_its_own_port(server):
    example_org(server)
    with DnsServer() as refusing:
        refusing.refuse("example.org")
        refusing.refuse("mx1.example.org")
        resolver = Resolver(
            [("127.0.0.1", refusing.port), ("127.0.0.1", server.port)],
            timeout=2.0,
            negative_ttl_max=60.0,
            max_addresses=5,
            address_order="ipv4-first",
        )
        assert names(route(resolver, "example.org")) == ["mx1.example.org"]
        assert ("example.org", "MX") in refusing.queries
        assert ("example.org", "MX") in server.queries


# -- the test server ------------------------------------------------------------------


def test_server_answers_over_udp_and_tcp_case_insensitively(server):
    server.add("Example.ORG", "MX", "10 mx1.example.org", ttl=123)
    query = dns.message.make_query("EXAMPLE.org", "MX")
    for send in (dns.query.udp, dns.query.tcp):
        response = send(query, "127.0.0.1", timeout=2.0, port=server.port)
        [rrset] = response.answer
        assert (rrset.ttl, rrset[0].to_text().lower()) == (123, "10 mx1.example.org.")
    assert server.queries == [("example.org", "MX")] * 2


def test_server_drop_answers_neither_udp_nor_tcp(server):
    server.drop("slow.test")
    query = dns.message.make_query("slow.test", "A")
    for send in (dns.query.udp, dns.query.tcp):
        with pytest.raises(dns.exception.Timeout):
            send(query, "127.0.0.1", timeout=0.2, port=server.port)


def test_server_negative_answers_carry_the_soa_ttl(server):
    server.soa_ttl = 42
    server.add("known.test", "A", "127.0.0.2")
    for name, rcode in (("known.test", dns.rcode.NOERROR), ("unknown.test", dns.rcode.NXDOMAIN)):
        response = dns.query.udp(dns.message.make_query(name, "MX"), "127.0.0.1", 2.0, server.port)
        assert response.rcode() == rcode
        assert response.answer == []
        assert response.resolve_chaining().minimum_ttl == 42


# -- the cache on its own -------------------------------------------------------------


def test_cache_clamps_positive_ttls():
    cache = DnsCache(negative_ttl_max=60.0, min_ttl=5.0, max_ttl=100.0)
    assert cache.put_positive(("a", "A"), ("127.0.0.2",), 0, now=0.0).expires == 5.0
    assert cache.put_positive(("b", "A"), ("127.0.0.2",), 10**6, now=0.0).expires == 100.0


def test_cache_caps_negative_ttls_even_below_the_floor():
    assert DnsCache(negative_ttl_max=60.0).put_negative(("a", "MX"), "x", 3600, 0.0).expires == 60
    assert DnsCache(negative_ttl_max=0.0).put_negative(("a", "MX"), "x", 3600, 0.0).expires == 0


def test_cache_expiry_and_counters():
    cache = DnsCache(negative_ttl_max=60.0)
    cache.put_temporary_failure(("a", "MX"), "SERVFAIL", now=0.0)
    assert cache.get(("a", "MX"), now=cache.failure_ttl - 0.1).kind == "failure"
    assert cache.get(("a", "MX"), now=cache.failure_ttl) is None
    assert cache.get(("b", "MX"), now=0.0) is None
    assert (cache.hits, cache.misses, len(cache)) == (1, 2, 0)


def test_cache_evicts_the_least_recently_used():
    cache = DnsCache(negative_ttl_max=60.0, max_entries=2)
    cache.put_positive(("a", "A"), (), 300, now=0.0)
    cache.put_positive(("b", "A"), (), 300, now=0.0)
    cache.get(("a", "A"), now=1.0)
    cache.put_positive(("c", "A"), (), 300, now=1.0)
    assert cache.get(("b", "A"), now=1.0) is None
    assert cache.get(("a", "A"), now=1.0) is not None
    assert len(cache) == 2
