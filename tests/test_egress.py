"""policy/egress.py: which source of a pool, which sources are out, IPv4 for IPv6 refusers."""

from __future__ import annotations

import pytest

from mtaqueue import config
from mtaqueue.policy.egress import IPV4_HOLD, EgressState
from mtaqueue.routing.pools import Pools, Source

A, B, V6 = Source("192.0.2.11"), Source("192.0.2.12", "b.example"), Source("2001:db8::11")
POOL = (A, B, V6)
MX = "mx.example.org"


def test_the_least_loaded_source_goes_first_and_ties_take_turns() -> None:
    egress = EgressState()
    load = {A: 0, B: 0, V6: 0}
    picked = []
    for _ in range(6):
        source = egress.choose(POOL, MX, {4}, load.__getitem__, 0.0)
        assert source is not None
        load[source] += 1
        picked.append(source)
    assert picked.count(A) == picked.count(B) == 3 and V6 not in picked  # IPv4 only there
    load[A] = 10
    assert egress.choose(POOL, MX, {4}, load.__getitem__, 0.0) == B


def test_a_blocklisted_source_is_out_for_that_destination_only_until_its_hold_ends() -> None:
    egress = EgressState()
    assert egress.exclude(MX, A, 100.0, 3600.0)
    assert not egress.exclude(MX, A, 200.0, 3600.0)  # one episode: the hold is not extended
    never = {A: 0, B: 99}.__getitem__  # A would win on load
    assert egress.choose((A, B), MX, {4}, never, 200.0) == B
    assert egress.choose((A, B), "mx.other.test", {4}, never, 200.0) == A
    assert egress.choose((A,), MX, {4}, never, 200.0) is None
    assert egress.usable_after((A,), MX, {4}, 200.0) == 3700.0
    assert egress.usable_after((A,), MX, {6}, 200.0) is None  # no source of that family out
    assert egress.choose((A,), MX, {4}, never, 3700.0) == A
    assert egress.snapshot(MX, A, 200.0)["source_excluded_until"] == 3700.0
    assert egress.snapshot(MX, B, 200.0)["source_excluded_until"] is None


def test_a_site_that_refused_ipv6_gets_ipv4_while_it_has_ipv4() -> None:
    egress = EgressState()
    addresses = ["2001:db8::25", "192.0.2.25"]
    assert egress.families(MX, addresses, 0.0) == {4, 6}
    assert egress.refuse_ipv6(MX, 10.0) and not egress.refuse_ipv6(MX, 11.0)
    assert egress.families(MX, addresses, 12.0) == {4}
    assert egress.families(MX, ["2001:db8::25"], 12.0) == {6}  # IPv6 alone: what it has
    assert egress.families(MX, addresses, 11.0 + IPV4_HOLD) == {4, 6}


def test_the_state_survives_a_restart_without_what_expired() -> None:
    egress = EgressState()
    egress.exclude(MX, A, 0.0, 100.0)
    egress.exclude(MX, V6, 0.0, 10.0)
    egress.refuse_ipv6("mx.gmail.test", 0.0)
    again = EgressState()
    again.restore(egress.encode(50.0))
    assert again.excluded(MX, A, 50.0) and not again.excluded(MX, V6, 5.0)
    assert again.ipv4_only("mx.gmail.test", 50.0)
    with pytest.raises(ValueError):
        again.restore(b"{not json")


def test_pools_by_class_then_tenant() -> None:
    cfg = config.load(
        None,
        [
            'pools.bulk.sources=["192.0.2.11", {address = "2001:DB8::11", helo = "six"}]',
            'pools.shop.sources=["192.0.2.20"]',
            "classes.p2.pool=bulk",
            "tenants.shop.pool=shop",
        ],
    )
    pools = Pools(cfg)
    bulk = pools.for_message("p2", "shop")
    assert bulk is not None and bulk.name == "bulk"  # the class's pool wins
    assert bulk.sources == (Source("192.0.2.11"), Source("2001:db8::11", "six"))
    assert [s.family for s in bulk.sources] == [4, 6]
    shop = pools.for_message("p1", "shop")
    assert shop is not None and shop.name == "shop"
    assert pools.for_message("p1", None) is None and pools.for_message("p0", "blog") is None
