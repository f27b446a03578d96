"""Routes by class and tenant: which smarthost a message goes to (mtaqueue.routing.relays)."""

from __future__ import annotations

import pytest

from mtaqueue import config
from mtaqueue.routing.nexthop import NextHop
from mtaqueue.routing.relays import IMPLICIT, STARTTLS, relays, unrouted
from mtaqueue.routing.resolver import RouteFailure


def cfg(*overrides: str) -> config.Config:
    return config.load(None, overrides)


ESP = (
    "classes.p0.relayhost=[smtp.esp.example]:587",
    "classes.p0.relay_user=tx",
    "classes.p0.relay_password_file=/etc/mtaqueue/tx.password",
)


def test_no_relay_leaves_each_recipient_to_its_domains_route():
    table = relays(cfg("delivery.relayhost=[relay.internal]:25"))
    assert table.for_message("p0", None) is None
    assert table.for_message("p1", "shop") is None


def test_the_class_relay_wins_then_the_tenants():
    table = relays(
        cfg(*ESP, "tenants.shop.relayhost=[smtp.other.example]:2525", "tenants.blog.relayhost=")
    )
    p0 = table.for_message("p0", "shop")
    assert p0 is not None and p0.source == "classes.p0" and p0.user == "tx"
    shop = table.for_message("p1", "shop")
    assert shop is not None and shop.source == "tenants.shop"
    assert shop.hop == NextHop("smtp.other.example", 2525, mx=False)
    assert table.for_message("p1", "blog") is None  # a tenant table without a relayhost
    assert table.for_message("p1", None) is None


def test_the_destination_is_the_smarthost_and_the_user():
    table = relays(
        cfg(
            *ESP,
            "classes.p1.relayhost=[smtp.esp.example]:587",
            "classes.p1.relay_user=bulk",
            "classes.p1.relay_password_file=/etc/mtaqueue/bulk.password",
            "classes.p2.relayhost=[SMTP.esp.example]:587",  # p1's account, shared
            "classes.p2.relay_user=bulk",
            "classes.p2.relay_password_file=/etc/mtaqueue/bulk.password",
            "tenants.shop.relayhost=smtp.esp.example",  # no AUTH, MX lookup, port 25
        )
    )
    keys = {name: r.key for name, r in table.classes.items()} | {
        f"tenant {name}": r.key for name, r in table.tenants.items()
    }
    assert keys == {
        "p0": "relay:tx@smtp.esp.example:587",
        "p1": "relay:bulk@smtp.esp.example:587",
        "p2": "relay:bulk@smtp.esp.example:587",
        "tenant shop": "relay:smtp.esp.example:25",
    }
    assert table.classes["p2"].source == "classes.p1"  # one destination, named by the first
    assert table.tenants["shop"].hop.mx
    assert set(table.by_key()) == set(keys.values())
    ipv6 = relays(cfg("classes.p0.relayhost=[::1]:2525")).classes["p0"]
    assert ipv6.key == "relay:[::1]:2525"


def test_one_destination_with_two_settings_is_refused():
    with pytest.raises(config.ConfigError, match=r"^classes.p1.relayhost: .*classes.p0's too"):
        relays(
            cfg(
                *ESP,
                "classes.p1.relayhost=[smtp.esp.example]:587",
                "classes.p1.relay_user=tx",
                "classes.p1.relay_password_file=/etc/mtaqueue/other.password",
            )
        )


@pytest.mark.parametrize(
    ("keys", "tls"),
    [
        ({"relayhost": "[esp.example]:465"}, IMPLICIT),  # auto: SMTPS on 465
        ({"relayhost": "[esp.example]:465", "relay_tls": "starttls"}, STARTTLS),
        ({"relayhost": "[esp.example]:2465", "relay_tls": "implicit"}, IMPLICIT),
        ({"relayhost": "[esp.example]:587", "relay_tls": "starttls"}, STARTTLS),
        # AUTH means TLS, required: a password never goes in clear text.
        (
            {"relayhost": "[esp.example]:587", "relay_user": "u", "relay_password_file": "f"},
            STARTTLS,
        ),
        ({"relayhost": "[esp.example]:25", "relay_tls_ca": "/etc/ssl/ca.pem"}, STARTTLS),
        # Neither AUTH nor a CA: as delivery.tls (opportunistic by default).
        ({"relayhost": "[relay.internal]:25"}, ""),
        ({"relayhost": "[relay.internal]:587"}, ""),
    ],
)
def test_tls_mode(keys, tls):
    table = relays(cfg(*(f"classes.p0.{k}={v}" for k, v in keys.items())))
    assert table.classes["p0"].tls == tls


def test_a_smarthost_that_does_not_resolve_defers_never_bounces():
    relay = relays(cfg("classes.p0.relayhost=esp.example:587")).classes["p0"]
    gone = RouteFailure(True, "5.1.2", "esp.example: domain does not exist (NXDOMAIN)")
    deferred = unrouted(relay, gone)
    assert not deferred.permanent and deferred.status == "4.4.3"
    assert "classes.p0.relayhost" in deferred.text and "NXDOMAIN" in deferred.text
    failing = RouteFailure(False, "4.4.3", "esp.example: MX lookup failed: timeout")
    assert unrouted(relay, failing) is failing
