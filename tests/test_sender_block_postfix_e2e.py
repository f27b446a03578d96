"""A real Postfix as the provider that refuses our address (issue 22, point 3): the daemon
keeps the mail, pauses the destination, says so, and delivers into Postfix once delisted.

The provider is a private Postfix (tests/postfix_instance.py, receive mode, example.org kept
in a Maildir) whose smtpd checks our address on a DNSBL (`reject_rbl_client`, looked up in
the test DNS, which also serves the daemon's MX records) and refuses at RCPT with a reply
of the corpus (tests/data/provider_replies.toml) word for word (`rbl_reply_maps`), or with
Postfix's own DNSBL reply. Delisting is the DNSBL record removed, as at Spamhaus, and a
`postfix reload` (each smtpd keeps the DNSBL answers it got for its life). DSNs go to a
scripted peer (sender.test). Needs root and Debian's postfix package (the
`postfix_installed` fixture fails the test, naming the package, when either is missing).
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
from dns_server import DnsServer
from e2e_helpers import BODY, FAST, ctl_json, events, wait_for
from postfix_instance import PostfixInstance, received
from postfix_tools import port_free
from smtp_peer import SmtpPeer

from mtaqueue.policy.classify import classify
from mtaqueue.policy.replies import Reply
from mtaqueue.policy.verdict import REFUSES_SOURCE

CORPUS = Path(__file__).parent / "data" / "provider_replies.toml"
ZONE = "zen.spamhaus.org"
LISTING = "1.0.0.127." + ZONE  # our address, 127.0.0.1, as a DNSBL query names it
FAST_ALERTS = ("alerts.interval=0.5s", "shaping.release_spread=1s")
PAUSE = 10  # seconds: shaping.sender_block_pause in the test that waits it out


def corpus_reply(provider: str, code: int, says: str) -> str:
    """The corpus's reply of `provider` with `code` whose text has `says`, a refusal of our
    address at RCPT, as the wire carries it: "CODE TEXT"."""
    [entry] = [
        e
        for e in tomllib.loads(CORPUS.read_text(encoding="utf-8"))["reply"]
        if (e["provider"], e["code"]) == (provider, code) and says in e["text"]
    ]
    verdict = classify(Reply.parse(entry["phase"], entry["code"], entry["text"]))
    assert entry["decision"] == "about_us" and verdict.kind in REFUSES_SOURCE, entry
    assert entry["phase"] == "rcpt" and "\n" not in entry["text"]  # where and as smtpd says it
    return f"{code} {entry['text']}"


# Exchange Online's Spamhaus refusal, and Postfix's own for a client without a PTR record.
SPAMHAUS_5XX = corpus_reply("Exchange Online", 550, "blocked using Spamhaus")
NO_PTR_4XX = corpus_reply("Postfix", 450, "cannot find your hostname")


@dataclass
class Provider:
    dns: DnsServer
    postfix: PostfixInstance
    home: SmtpPeer  # sender.test's MX: where DSNs go

    def daemon_overrides(self) -> tuple[str, ...]:
        return (
            f'dns.nameservers=["{self.dns.address}"]',
            f"delivery.port={self.postfix.port}",
            *FAST,
        )

    def delist(self) -> None:
        """Off the list; and new smtpd processes, as each keeps its DNSBL answers for its
        life (smtpd_rbl_cache; 100 sessions or 100 s idle at a real site)."""
        self.dns.remove(LISTING)
        self.postfix.reload()

    def refusals(self) -> int:
        """RCPTs Postfix refused so far (its maillog)."""
        return received(self.postfix.maillog)["by_command"].get("RCPT", 0)

    def delivered(self) -> int:
        return len(self.postfix.stored("example.org"))


def dns_on_port_53() -> DnsServer:
    """The test DNS on port 53 of a free loopback address: a resolv.conf names no port."""
    for _ in range(30):
        host = f"127.53.{random.randint(0, 255)}.{random.randint(1, 254)}"
        try:
            return DnsServer(port=53, host=host).start()
        except OSError:
            continue
    raise RuntimeError("no loopback address has port 53 free")


@pytest.fixture
def start_provider(postfix_installed) -> Iterator:
    """Factory: start_provider(reply, access=None) -> Provider: Postfix on 127.0.0.1
    listing us on zen.spamhaus.org with `reply` (None: Postfix's own), and with an `access`
    action for 127.0.0.1 first in its access map if given; the home peer on 127.0.0.9, on
    the same port (the daemon has one delivery.port)."""
    started: list[Provider] = []
    workdir = Path(tempfile.mkdtemp(prefix="pfx-sb-", dir="/tmp"))  # the postfix user enters
    workdir.chmod(0o755)

    def start(reply: str | None = None, access: str | None = None) -> Provider:
        dns = dns_on_port_53()
        for _ in range(20):
            home = SmtpPeer("127.0.0.9", 0).start()
            if port_free("127.0.0.1", home.port):
                break
            home.stop()
        else:
            raise RuntimeError("no port free on both 127.0.0.9 and 127.0.0.1")
        provider = Provider(
            dns,
            PostfixInstance(
                workdir / f"pf{len(started)}",
                listen=f"127.0.0.1:{home.port}",
                mode="receive",
                mailboxes=("example.org",),
                resolver=dns.host,
                dnsbl={ZONE: reply},
                client_access={"127.0.0.1/32": access} if access else None,
                main_cf={"myhostname": "mx.provider.test"},
            ),
            home,
        )
        started.append(provider)
        for domain, mx, address in [
            ("example.org", "mx.provider.test", "127.0.0.1"),
            ("sender.test", "mx.sender.test", "127.0.0.9"),
        ]:
            dns.add(domain, "MX", f"10 {mx}")
            dns.add(mx, "A", address)
        dns.add(LISTING, "A", "127.0.0.2")  # listed
        dns.add(LISTING, "TXT", '"https://www.spamhaus.org/query/ip/127.0.0.1"')
        provider.postfix.start()
        return provider

    yield start
    for provider in started:
        provider.postfix.stop()
        provider.home.stop()
        provider.dns.stop()
    shutil.rmtree(workdir, ignore_errors=True)


def stamp(event: dict) -> float:
    """A log event's time, epoch seconds."""
    return datetime.fromisoformat(event["timestamp"]).timestamp()


def recipient_states(daemon, ids: list[str]) -> set[str]:
    queue = daemon.messages()
    assert set(ids) <= set(queue)  # every message is still ours
    return {r["state"] for i in ids for r in queue[i]["recipients"]}


def blocked_entry(daemon) -> dict:
    [entry] = [d for d in ctl_json(daemon, "domains") if "example.org" in d["domains"]]
    return entry


def test_a_5xx_about_us_from_postfix_pauses_keeps_the_mail_and_delivers_once_delisted(
    start_provider, start_daemon
):
    provider = start_provider(SPAMHAUS_5XX)
    daemon = start_daemon(
        *provider.daemon_overrides(),
        *FAST_ALERTS,
        f"shaping.sender_block_pause={PAUSE}s",
        "shaping.breaker_cooldown=1s",  # the pause is the longer of the two
    )
    ids = [
        daemon.send("app@sender.test", [f"a{i}@example.org", f"b{i}@example.org"], BODY)
        for i in range(6)
    ]
    [blocked] = wait_for(lambda: events(daemon, "sender_blocked"), what="sender_blocked")
    # Delisted at once: what follows in the pause is the daemon's doing, not Postfix's.
    refused = provider.refusals()
    provider.delist()
    assert blocked["reply"] == SPAMHAUS_5XX  # Postfix's reply, word for word
    assert blocked["domains"] == ["example.org"]
    assert blocked["until"] == pytest.approx(stamp(blocked) + PAUSE, abs=0.5)
    attempts = events(daemon, "delivery")
    assert {(e["kind"], e["code"], e["state"]) for e in attempts} == {
        ("blocklist", 550, "deferred")
    }
    assert 1 <= refused <= 4  # transactions in flight only: the pause stops the rest

    # During the pause: every message kept, nothing bounced or suppressed, the reply shown.
    assert recipient_states(daemon, ids) <= {"queued", "deferred"}
    assert not events(daemon, "suppressed") and ctl_json(daemon, "suppress", "list") == []
    entry = blocked_entry(daemon)
    assert entry["circuit"] == "open" and entry["blocked_by"] == SPAMHAUS_5XX
    alert = wait_for(
        lambda: [e for e in events(daemon, "alert") if e["name"] == "sender_blocked"],
        what="the sender_blocked alert",
    )
    assert alert[0]["state"] == "firing" and alert[0]["subject"] == entry["destination"]

    # After it: one probe is accepted, the rest follows; nothing was tried in between.
    wait_for(lambda: not daemon.messages(), timeout=PAUSE + 20, what="the queue to drain")
    wait_for(lambda: provider.delivered() == 12, what="12 deliveries into the Maildir")
    delivered = [e for e in events(daemon, "delivery") if e["outcome"] == "delivered"]
    assert len(delivered) == 12 and min(map(stamp, delivered)) >= blocked["until"]
    assert provider.refusals() == refused
    assert not provider.home.messages  # no DSN
    assert blocked_entry(daemon)["blocked_by"] is None
    wait_for(
        lambda: [e for e in events(daemon, "alert") if e["state"] == "cleared"],
        what="the alert to clear",
    )


def test_a_4xx_about_us_from_postfix_pauses_until_a_flush(start_provider, start_daemon):
    provider = start_provider(NO_PTR_4XX)
    # The shipped pause (30 minutes); what a flush lets go is spread over 1 s, not 30.
    daemon = start_daemon(*provider.daemon_overrides(), *FAST_ALERTS)
    ids = [daemon.send("app@sender.test", [f"u{i}@example.org"], BODY) for i in range(3)]
    [blocked] = wait_for(lambda: events(daemon, "sender_blocked"), what="sender_blocked")
    assert blocked["reply"] == NO_PTR_4XX
    assert blocked["until"] > time.time() + 1700
    assert {e["kind"] for e in events(daemon, "delivery")} == {"reputation"}
    assert recipient_states(daemon, ids) <= {"queued", "deferred"}
    assert blocked_entry(daemon)["blocked_by"] == NO_PTR_4XX
    refused = provider.refusals()

    provider.delist()  # a PTR record published, say
    assert ctl_json(daemon, "flush", "--all") == [{"flushed": 3}]
    wait_for(lambda: not daemon.messages(), timeout=20, what="the queue to drain")
    wait_for(lambda: provider.delivered() == 3, what="3 deliveries into the Maildir")
    assert provider.refusals() == refused  # the probe after the flush went through
    assert not provider.home.messages and ctl_json(daemon, "suppress", "list") == []


def test_on_sender_block_bounce_returns_postfix_s_own_dnsbl_reply(start_provider, start_daemon):
    provider = start_provider()  # Postfix's own reply
    daemon = start_daemon(*provider.daemon_overrides(), "classes.p1.on_sender_block=bounce")
    queue_id = daemon.send("app@sender.test", ["a@example.org"], BODY)
    [blocked] = wait_for(lambda: events(daemon, "sender_blocked"), what="sender_blocked")
    # Postfix's default_rbl_reply, with the list's TXT record as the reason.
    assert blocked["reply"] == (
        "554 5.7.1 Service unavailable; Client host [127.0.0.1] blocked using "
        "zen.spamhaus.org; https://www.spamhaus.org/query/ip/127.0.0.1"
    )
    wait_for(lambda: queue_id not in daemon.messages(), what="the bounce")
    [dsn] = provider.home.wait_messages(1, 20)
    assert dsn.rcpt_tos == ["app@sender.test"]
    assert "blocked using zen.spamhaus.org" in dsn.content.decode(errors="replace")
    assert ctl_json(daemon, "suppress", "list") == []  # the recipient did nothing wrong
    assert provider.delivered() == 0


def test_postfix_s_access_map_refusal_of_our_address_is_a_sender_block(
    start_provider, start_daemon
):
    # An access map listing our address, with Postfix's own words (access_map_reject_code).
    provider = start_provider(access="REJECT")
    daemon = start_daemon(*provider.daemon_overrides(), *FAST_ALERTS)
    ids = [daemon.send("app@sender.test", [f"u{i}@example.org"], BODY) for i in range(3)]
    [blocked] = wait_for(lambda: events(daemon, "sender_blocked"), what="sender_blocked")
    assert blocked["reply"] == "554 5.7.1 <unknown[127.0.0.1]>: Client host rejected: Access denied"
    assert {e["kind"] for e in events(daemon, "delivery")} == {"blocklist"}
    assert recipient_states(daemon, ids) <= {"queued", "deferred"}  # not bounced

    # Lifted: the map rewritten without us, postfix reload, then a flush.
    provider.postfix.client_access = {}
    provider.delist()
    assert ctl_json(daemon, "flush", "--all") == [{"flushed": 3}]
    wait_for(lambda: not daemon.messages(), timeout=20, what="the queue to drain")
    wait_for(lambda: provider.delivered() == 3, what="3 deliveries into the Maildir")
    assert not provider.home.messages and ctl_json(daemon, "suppress", "list") == []
