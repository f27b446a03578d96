"""Destinations that learn their limits, end to end: the daemon with the shipped shaping
defaults (nothing about the provider) against a strict synthetic provider: a per-client
message rate answered 421 4.7.28, a connection cap answered 421 4.7.0 "Too many concurrent
SMTP connections", and a blocklist for a client that keeps sending after a 421."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

from dns_server import DnsServer
from e2e_helpers import BODY, FAST, MailNet, events, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from synthetic_peer import SyntheticPeer

RATE = 10  # messages a second the provider takes from one client IP
# One: at 10 a second on loopback a connection or two carry everything, and a daemon that
# resumes one message at a time after a cool-down seldom opens more; a cap of 1 is met.
CONNECTIONS = 1
MESSAGES = 200


def throttle_replies(report: dict) -> int:
    return sum(n for key, n in report["replies"].items() if key.startswith("421"))


def test_a_strict_provider_is_learned_politely_and_remembered(start_daemon):
    peer = SyntheticPeer(
        ["127.0.0.2:0"],
        rate=(RATE, 1.0),
        max_connections=CONNECTIONS,
        blocklist_after=5,  # more than 5 MAILs within 2 s of a 421: blocklisted
        blocklist_window=2.0,
        blocklist_for=600.0,
    )
    dns = DnsServer().start()
    try:
        peer.start()
        dns.add("example.org", "MX", "10 mx.example.org")
        dns.add("mx.example.org", "A", "127.0.0.2")
        overrides = (f'dns.nameservers=["{dns.address}"]', f"delivery.port={peer.port}", *FAST)
        # A backlog queued while the provider was out of reach, then flushed at once.
        daemon = start_daemon(*overrides, "delivery.enabled=false")
        for i in range(MESSAGES):
            daemon.send("app@sender.test", [f"u{i}@example.org"], BODY)
        assert daemon.stop() == 0
        daemon.overrides.append("delivery.enabled=true")
        started = time.monotonic()
        daemon.start()
        wait_for(lambda: not daemon.messages(), timeout=150, what="the backlog to drain")
        drain = time.monotonic() - started
        report = peer.report()

        assert report["messages"]["accepted"] == MESSAGES
        assert report["blocklist"]["listings"] == 0
        assert report["reply_classes"]["5xx"] == 0, json.dumps(report["replies"])
        # It learned the rate and the connection cap from a few throttle replies...
        assert throttle_replies(report) <= 12, report["replies"]
        assert report["connections"]["max_concurrent_per_client"] <= CONNECTIONS + 1
        assert drain <= 3 * MESSAGES / RATE, drain
        # ... and never took a throttling greeting for a broken host (its only MX).
        assert not events(daemon, "host_suspended")
        # (The connections that worked when one more was refused, as we count them: the
        # provider may still count one that is closing.)
        learned = [e for e in events(daemon, "limit_learned") if e["what"] == "concurrency"]
        capped = sum(n for key, n in report["replies"].items() if "Too many concurrent" in key)
        if capped or learned:
            assert learned and CONNECTIONS <= learned[-1]["new"] <= CONNECTIONS + 1
        else:  # paced under the cap throughout (a loaded machine's run): nothing to learn
            assert report["connections"]["max_concurrent_per_client"] <= CONNECTIONS
        (dest,) = (json.loads(daemon.ctl("domains", "--json").stdout.splitlines()[0]),)
        lesson = dest["learned"]
        # Taught by a 421 4.7.28 (or, on a loaded machine, by a latency far over its
        # baseline: the other throttle signal).
        assert lesson["rate_reply"].startswith(("421 4.7.28", "latency"))
        if learned:
            assert lesson["concurrency"] == learned[-1]["new"]
        assert lesson["rate_per_minute"] <= 1.3 * RATE * 60  # converged near the limit

        # What it learned survives a restart: the next mail goes at that rate, not the
        # slow start, and with the cap.
        assert daemon.stop() == 0
        daemon.start()
        daemon.send("app@sender.test", ["again@example.org"], BODY)
        wait_for(lambda: not daemon.messages(), timeout=30, what="the mail after the restart")
        (dest,) = (json.loads(daemon.ctl("domains", "--json").stdout.splitlines()[0]),)
        after = dest["learned"]
        assert after["rate_reply"] == lesson["rate_reply"]
        assert after["concurrency"] == lesson["concurrency"]
        assert after["rate_per_minute"] >= 0.9 * lesson["rate_per_minute"]
        assert after["rate_per_minute"] != 120.0  # not the slow start
    finally:
        peer.stop()
        dns.stop()


def test_a_connection_is_not_spent_on_refusals(start_daemon):
    """A strict receiver tarpits a session that keeps drawing 4xx (Postfix: a second per
    reply after 10, a hang-up after 20): a greylisted wave is spread over connections of
    at most 3 refusals each instead of being fed to one."""
    with MailNet(["127.0.0.2"]) as net:
        (peer,) = net.peers
        net.add_domain("example.org", "127.0.0.2")
        peer.on("rcpt", "450 4.2.0 <u@example.org>: Recipient address rejected: Greylisted")
        daemon = start_daemon(*net.daemon_overrides(), *FAST, "delivery.enabled=false")
        for i in range(9):
            daemon.send("app@sender.test", [f"u{i}@example.org"], BODY)
        assert daemon.stop() == 0
        daemon.overrides.append("delivery.enabled=true")
        daemon.start()
        wait_for(
            lambda: len([e for e in events(daemon, "delivery") if e["code"] == 450]) >= 9,
            what="the greylisted wave",
        )
        refusals = Counter(e.connection for e in list(peer.log) if e.reply.startswith("450"))
        assert sum(refusals.values()) >= 9
        assert max(refusals.values()) <= 3, refusals


def test_a_damaged_state_file_only_means_learning_again(start_daemon):
    with MailNet(["127.0.0.2"]) as net:
        net.add_domain("example.org", "127.0.0.2")
        daemon = start_daemon(*net.daemon_overrides(), *FAST, "delivery.enabled=true")
        assert daemon.stop() == 0
        (daemon.spool / "learned.json").write_bytes(b'{"destinations": {"mx.exa')
        daemon.start()
        daemon.wait_event("learned_unreadable")
        daemon.send("app@sender.test", ["a@example.org"], BODY)
        wait_for(lambda: not daemon.messages(), what="delivery")
        assert daemon.stop() == 0  # and at stop the state is written anew (one message
        # at the slow start taught nothing worth keeping)
        saved = json.loads((daemon.spool / "learned.json").read_bytes())
        assert saved == {"destinations": {}, "version": 1}


def test_a_throttling_greeting_paces_and_suspends_not_the_only_host(start_daemon):
    with MailNet(["127.0.0.2"]) as net:
        (peer,) = net.peers
        net.add_domain("example.org", "127.0.0.2")
        refusal = "421 4.7.0 mx.example.org Error: too many connections from 127.0.0.1"
        peer.on("banner", refusal, times=1)
        daemon = start_daemon(*net.daemon_overrides(), *FAST)
        daemon.send("app@sender.test", ["a@example.org"], BODY)
        wait_for(lambda: peer.messages, what="delivery after the refused greeting")
        assert not events(daemon, "host_suspended")
        # Pacing, not an attempt: back to the ready queue, delivered at the first attempt.
        (requeued,) = events(daemon, "requeued")
        assert requeued["reason"] == refusal
        (delivered,) = wait_for(lambda: events(daemon, "delivery"), what="the delivery event")
        assert (delivered["outcome"], delivered["attempt"]) == ("delivered", 1)
        (dest,) = [json.loads(line) for line in daemon.ctl("domains", "--json").stdout.splitlines()]
        assert (dest["mode"], dest["circuit"], dest["suspended_hosts"]) == ("normal", "closed", {})


def test_an_operator_makes_a_destination_learn_anew(start_daemon):
    """`mtaqueue-ctl forget`: a destination that taught a low rate (a provider's incident,
    since over) starts again from the slow start, and the lesson is not saved; one only
    remembered from before a restart (nothing routed to it yet) is dropped by its name."""
    with MailNet(["127.0.0.2"]) as net:
        (peer,) = net.peers
        net.add_domain("example.org", "127.0.0.2")
        peer.on("banner", "421 4.7.28 rate limited, try again later", times=1)
        daemon = start_daemon(*net.daemon_overrides(), *FAST)
        daemon.send("app@sender.test", ["a@example.org"], BODY)
        wait_for(lambda: peer.messages, what="delivery after the throttled greeting")
        (dest,) = [json.loads(line) for line in daemon.ctl("domains", "--json").stdout.splitlines()]
        assert dest["learned"]["rate_reply"].startswith("421 4.7.28")
        assert dest["learned"]["rate_per_minute"] < 120.0  # cut below the slow start

        forgot = daemon.ctl("forget", "--domain", "example.org")
        assert forgot.returncode == 0 and forgot.stdout == "applied to 1 destination(s)\n"
        (dest,) = [json.loads(line) for line in daemon.ctl("domains", "--json").stdout.splitlines()]
        assert dest["learned"]["rate_per_minute"] == 120.0
        assert (dest["learned"]["rate_reply"], dest["learned"]["phase"]) == ("", "slow-start")
        assert daemon.stop() == 0
        saved = json.loads((daemon.spool / "learned.json").read_bytes())
        assert saved == {"destinations": {}, "version": 1}

        # A lesson remembered from before a restart, for a destination nothing has routed
        # to since: named as `domains` and learned.json name it.
        key = dest["destination"]
        lesson = {"rate": 0.5, "good": 0.6, "rate_reply": "421 4.7.28 slow down", "at": time.time()}
        (daemon.spool / "learned.json").write_text(
            json.dumps({"destinations": {key: lesson}, "version": 1})
        )
        daemon.start()
        assert daemon.ctl("forget", "--domain", key).stdout == "applied to 1 destination(s)\n"
        assert daemon.ctl("forget", "--domain", "example.net").stdout == (
            "applied to 0 destination(s)\n"
        )
        assert [e["destination"] for e in events(daemon, "learned_forgotten")] == [key]
        assert daemon.stop() == 0
        saved = json.loads((daemon.spool / "learned.json").read_bytes())
        assert saved == {"destinations": {}, "version": 1}
