"""Hung destinations cannot starve the rest, end to end: the daemon, the test DNS, 60
destinations whose MX accepts TCP and never greets (more than the 20 global slots here),
and one real SMTP peer that answers.

The healthy mail goes within 2 s of submission; each hung destination holds one
connection at a time; its banner timeout is one outage (its breaker opens), so of its
messages only the one that went on that connection is charged an attempt.
"""

from __future__ import annotations

import collections
import time
from datetime import datetime

from e2e_helpers import BODY, FAST, MailNet, events, wait_for
from hung_listeners import HungListeners, hung_addresses

HUNG = 60
PER_DESTINATION = 3
SLOTS = 20


def submit_many(daemon, recipients: list[str]) -> None:
    """One message per recipient, over one SMTP session."""
    with daemon.smtp() as client:
        for rcpt in recipients:
            assert client.sendmail("app@sender.test", [rcpt], BODY) == {}


def timeouts(daemon) -> list[dict]:
    """The attempts of the hung destinations' mail."""
    return [e for e in events(daemon, "delivery") if e["outcome"] != "delivered"]


def delivered_within(daemon, peer, rcpt: str, seconds: float) -> float:
    """Submit to `rcpt` at the healthy peer; the seconds until the peer took it."""
    submitted = time.time()
    daemon.send("app@sender.test", [rcpt], BODY)
    got = wait_for(
        lambda: [m for m in list(peer.messages) if rcpt in m.rcpt_tos],
        timeout=seconds + 5,
        what=f"{rcpt} delivered",
    )
    latency = got[0].time - submitted
    assert latency <= seconds, f"{rcpt}: {latency:.2f} s"
    return latency


def test_hung_destinations_do_not_starve_the_one_that_answers(start_daemon):
    with MailNet(["127.0.0.2", "127.0.0.9"]) as net:
        healthy, _home = net.peers
        net.add_domain("healthy.test", "127.0.0.2")
        net.add_domain("sender.test", "127.0.0.9")
        addresses = hung_addresses(HUNG)
        for i, address in enumerate(addresses):
            net.add_domain(f"hung{i}.test", address)
        with HungListeners(addresses, healthy.port) as hung:
            daemon = start_daemon(
                *net.daemon_overrides(),
                *FAST,
                f"delivery.max_connections={SLOTS}",
                "delivery.timeouts.banner=2s",
            )
            recipients = [f"u{j}@hung{i}.test" for j in range(PER_DESTINATION) for i in range(HUNG)]
            submit_many(daemon, recipients)
            # At once, while the hung destinations' connects take every slot there is.
            first = delivered_within(daemon, healthy, "a@healthy.test", 2.0)
            # Their banner timeouts: one attempt charged per destination, the rest wait.
            wait_for(
                lambda: len(timeouts(daemon)) >= HUNG,
                timeout=20,
                what="every hung destination's banner timeout",
            )
            later = delivered_within(daemon, healthy, "b@healthy.test", 2.0)
            time.sleep(1.0)  # a second round of attempts would show by now
            assert max(hung.most_open[a] for a in addresses) == 1
            assert max(hung.accepts[a] for a in addresses) == 1  # the breaker holds them
            charged: collections.Counter[str] = collections.Counter()
            for message in daemon.messages().values():
                (rcpt,) = message["recipients"]
                domain = rcpt["address"].split("@")[1]
                assert rcpt["attempts"] <= 1, rcpt
                charged[domain] += rcpt["attempts"]
                if rcpt["attempts"] == 0:  # waited as one: no attempt, no retry time
                    assert rcpt["next_attempt"] is None, rcpt
                else:  # the one charged: the first rung of the ladder (2 s, FAST)
                    (attempt,) = [e for e in timeouts(daemon) if e["rcpt"] == rcpt["address"]]
                    at = datetime.fromisoformat(attempt["timestamp"]).timestamp()
                    assert attempt["next_attempt"] == rcpt["next_attempt"], (attempt, rcpt)
                    assert rcpt["next_attempt"] - at >= 2 * 0.95 - 0.05, (attempt, rcpt)
            assert charged == {f"hung{i}.test": 1 for i in range(HUNG)}
            assert len(timeouts(daemon)) == HUNG
            assert {(e["phase"], e["network"]) for e in timeouts(daemon)} == {("banner", "timeout")}
            print(f"healthy latency: {first:.3f} s at once, {later:.3f} s after the timeouts")
