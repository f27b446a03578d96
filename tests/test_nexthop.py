"""Next hop per domain: routes, relay host, MX (mtaqueue.routing.nexthop)."""

from __future__ import annotations

import pytest

from mtaqueue.routing.nexthop import NextHop, next_hop


@pytest.mark.parametrize(
    ("hop", "expected"),
    [
        ("[relay.test]:2525", NextHop("relay.test", 2525, mx=False)),
        ("[relay.test]", NextHop("relay.test", 25, mx=False)),
        ("relay.test:2525", NextHop("relay.test", 2525, mx=True)),
        ("relay.test", NextHop("relay.test", 25, mx=True)),
        ("[Relay.TEST]", NextHop("relay.test", 25, mx=False)),
        ("[127.0.0.2]:2525", NextHop("127.0.0.2", 2525, mx=False)),
        ("[::1]:2525", NextHop("::1", 2525, mx=False)),
        ("[::1]", NextHop("::1", 25, mx=False)),
        # An IP address has no MX records, brackets or not.
        ("127.0.0.2:2525", NextHop("127.0.0.2", 2525, mx=False)),
        ("127.0.0.2", NextHop("127.0.0.2", 25, mx=False)),
    ],
)
def test_next_hop_syntax(hop, expected):
    assert next_hop("example.org", hop, {}, 25) == expected  # as relay host
    assert next_hop("example.org", "", {"example.org": hop}, 25) == expected  # as route


def test_no_route_no_relayhost_is_the_domains_mx():
    assert next_hop("example.org", "", {}, 25) == NextHop("example.org", 25, mx=True)
    assert next_hop("Example.ORG", "", {}, 2525) == NextHop("example.org", 2525, mx=True)


def test_relayhost_applies_to_every_domain_without_a_route():
    routes = {"other.test": "[other-relay.test]"}
    assert next_hop("example.org", "[relay.test]:587", routes, 25) == NextHop(
        "relay.test", 587, mx=False
    )


def test_route_wins_over_relayhost():
    routes = {"example.org": "[special.test]:26"}
    assert next_hop("example.org", "[relay.test]", routes, 25) == NextHop(
        "special.test", 26, mx=False
    )


def test_route_matches_the_domain_case_insensitively():
    routes = {"example.org": "[special.test]"}  # config lower-cases route keys
    assert next_hop("EXAMPLE.org", "", routes, 25) == NextHop("special.test", 25, mx=False)


def test_empty_route_is_the_domains_own_mx_bypassing_relayhost():
    routes = {"example.org": ""}
    assert next_hop("example.org", "[relay.test]", routes, 25) == NextHop(
        "example.org", 25, mx=True
    )


@pytest.mark.parametrize(
    ("domain", "expected"),
    [
        ("[127.0.0.2]", NextHop("127.0.0.2", 25, mx=False)),
        ("[IPv6:::1]", NextHop("::1", 25, mx=False)),
    ],
)
def test_address_literal_domain_is_the_host_itself(domain, expected):
    assert next_hop(domain, "", {}, 25) == expected


def test_address_literal_domain_still_goes_through_relayhost():
    assert next_hop("[127.0.0.2]", "[relay.test]", {}, 25) == NextHop("relay.test", 25, mx=False)


def test_invalid_next_hop_raises():
    # config.load refuses these; next_hop does not guess.
    with pytest.raises(ValueError):
        next_hop("example.org", "[relay.test", {}, 25)
