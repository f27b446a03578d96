"""MTA-STS (RFC 8461) end to end: the daemon as a subprocess, the test DNS zone publishing
`_mta-sts` TXT records, an HTTPS policy server (127.0.0.3) and SMTP peers whose
certificates come from a test CA the daemon trusts through mta_sts.ca_file.

Peers: 127.0.0.2 offers STARTTLS with a certificate from the CA for its MX names;
127.0.0.4 offers no STARTTLS; 127.0.0.5 a self-signed certificate.
"""

from __future__ import annotations

import time

import pytest
from e2e_helpers import BODY, FAST, MailNet, events, wait_for
from policy_server import PolicyServer, TestCa, policy_text
from smtp_peer import self_signed_context

GOOD, PLAIN, SELF_SIGNED = "127.0.0.2", "127.0.0.4", "127.0.0.5"
DNS_TTL_FLOOR = 5.5  # seconds: the daemon caches any answer at least 5 s (dnscache.py)
DOMAINS = ("example.org", "example.net", "example.com", "example.info")  # with policies
GOOD_NAMES = ("mx.example.org", "mx.example.info", "other.example.org")


class World(MailNet):
    def __init__(self, start_daemon, tmp_path) -> None:
        self.ca = TestCa(tmp_path / "ca")
        # One port on all three addresses, chosen with retries (another test's socket may
        # hold the first peer's port on the others' addresses).
        super().__init__(
            [GOOD, PLAIN, SELF_SIGNED],
            per_host={
                PLAIN: {"starttls": None},
                SELF_SIGNED: {"starttls": self_signed_context(tmp_path, "mx.x")},
            },
            starttls=self.ca.server_context(*GOOD_NAMES),
        )
        self.good, self.plain, self.bad = self.peers
        self.policy = PolicyServer(
            "127.0.0.3", self.ca.server_context(*(f"mta-sts.{d}" for d in DOMAINS))
        )
        self.policy.start()
        self._start_daemon = start_daemon

    def publish(self, domain: str, mx_address: str, mode: str | None, *listed: str) -> None:
        """MX mx.<domain> at `mx_address`; with a mode, a policy (id 1) listing `listed`
        (default: mx.<domain>). TTLs of 1 s, so that tests can change them."""
        mx = f"mx.{domain}"
        self.dns.add(domain, "MX", f"10 {mx}", ttl=1)
        self.dns.add(mx, "A", mx_address)
        if mode is not None:
            self.set_id(domain, "1")
            self.dns.add(f"mta-sts.{domain}", "A", self.policy.host)
            self.policy.policies[domain] = policy_text(mode, *(listed or (mx,)))

    def set_id(self, domain: str, ident: str) -> None:
        self.dns.remove(f"_mta-sts.{domain}", "TXT")
        self.dns.add(f"_mta-sts.{domain}", "TXT", f'"v=STSv1; id={ident};"', ttl=1)

    def daemon(self, *overrides: str):
        return self._start_daemon(
            *self.daemon_overrides(),
            *FAST,
            f"mta_sts.ca_file={self.ca.path}",
            f"mta_sts.https_port={self.policy.port}",
            *overrides,
        )

    def close(self) -> None:
        self.policy.stop()
        super().close()


@pytest.fixture
def world(start_daemon, tmp_path):
    with World(start_daemon, tmp_path) as w:
        yield w


def deferred(daemon, rcpt: str) -> dict:
    def found():
        return next(
            (
                e
                for e in events(daemon, "delivery")
                if e["rcpt"] == rcpt and e["state"] != "delivered"
            ),
            None,
        )

    return wait_for(found, what=f"a deferral of {rcpt}")


def test_enforce_delivers_over_verified_tls_and_a_new_id_is_refetched(world):
    world.publish("example.org", GOOD, "enforce")
    daemon = world.daemon()
    daemon.send("app@sender.test", ["a@example.org"], BODY)
    (received,) = world.good.wait_messages(1)
    assert received.tls
    assert world.policy.requests == ["example.org"]
    policy = daemon.wait_event("mta_sts_policy")
    assert policy["mode"] == "enforce" and policy["mx"] == ["mx.example.org"]

    daemon.send("app@sender.test", ["b@example.org"], BODY)
    world.good.wait_messages(2)
    assert world.policy.requests == ["example.org"]  # cached: not fetched again

    world.set_id("example.org", "2")
    world.policy.policies["example.org"] = policy_text("testing", "mx.example.org")
    time.sleep(DNS_TTL_FLOOR)  # the old TXT record leaves the daemon's cache
    daemon.send("app@sender.test", ["c@example.org"], BODY)
    world.good.wait_messages(3)
    assert world.policy.requests == ["example.org", "example.org"]
    assert not events(daemon, "mta_sts_violation")


def test_cached_policy_outlives_the_policy_server_and_a_restart(world):
    world.publish("example.org", GOOD, "enforce")
    daemon = world.daemon()
    daemon.send("app@sender.test", ["a@example.org"], BODY)
    world.good.wait_messages(1)
    world.policy.stop()
    # The domain's MX now names a host the cached policy does not list (an attacker's).
    world.dns.remove("example.org", "MX")
    world.dns.add("example.org", "MX", "10 other.example.org", ttl=1)
    world.dns.add("other.example.org", "A", GOOD)
    time.sleep(DNS_TTL_FLOOR)  # the old MX record leaves the daemon's cache
    daemon.send("app@sender.test", ["b@example.org"], BODY)
    connections = world.good.connections
    failed = deferred(daemon, "b@example.org")
    assert failed["kind"] == "tls" and "MTA-STS" in failed["text"], failed
    assert world.good.connections == connections  # never connected to the unlisted host
    violation = daemon.wait_event("mta_sts_violation")
    assert violation["host"] == "other.example.org" and violation["action"] == "host skipped"

    daemon.stop()
    daemon = world.daemon()  # the policy comes from mta_sts.json: the server is down
    daemon.send("app@sender.test", ["c@example.org"], BODY)
    failed = deferred(daemon, "c@example.org")
    assert failed["kind"] == "tls" and "no MX host matches" in failed["text"], failed
    assert len(world.good.messages) == 1


def test_enforce_defers_without_tls_testing_logs_no_policy_as_usual(world):
    world.publish("example.net", PLAIN, "enforce")  # no STARTTLS
    world.publish("example.com", SELF_SIGNED, "enforce")  # a certificate not from the CA
    world.publish("example.info", SELF_SIGNED, "testing")
    world.publish("example.biz", SELF_SIGNED, None)  # no _mta-sts record
    daemon = world.daemon()
    for domain in ("example.net", "example.com", "example.info", "example.biz"):
        daemon.send("app@sender.test", [f"x@{domain}"], BODY)

    for rcpt in ("x@example.net", "x@example.com"):
        failed = deferred(daemon, rcpt)
        assert failed["kind"] == "tls" and failed["phase"] == "starttls", failed
        assert "requires TLS with a valid certificate" in failed["text"], failed
    assert not world.plain.messages  # never in clear text

    received = {m.rcpt_tos[0]: m for m in world.bad.wait_messages(2)}
    assert set(received) == {"x@example.info", "x@example.biz"}
    assert received["x@example.biz"].tls  # opportunistic, unverified, as without MTA-STS
    violations = {e["domain"]: e for e in events(daemon, "mta_sts_violation")}
    assert violations["example.info"]["action"] == "delivered as usual"
    assert violations["example.com"]["action"] == "deferred"
    assert "example.biz" not in violations
    assert sorted(world.policy.requests) == ["example.com", "example.info", "example.net"]
