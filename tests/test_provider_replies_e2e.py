"""Replies from the corpus (tests/data/provider_replies.toml), sent on the wire by
scriptable peers as the providers send them (multi-line included), read by the daemon's
real SMTP client: each decision class ends as the corpus says (issue 22, point 3).

One daemon, one peer (its own loopback address and domain) per chosen reply: every
decision class, multi-line replies first, at least two phases where the corpus has them.
"""

from __future__ import annotations

import time
import tomllib
from pathlib import Path

import pytest
from e2e_helpers import BODY, FAST, MailNet, ctl_json, events, wait_for

from mtaqueue.policy.classify import classify
from mtaqueue.policy.replies import Reply

CORPUS = Path(__file__).parent / "data" / "provider_replies.toml"
ENTRIES: list[dict] = tomllib.loads(CORPUS.read_text(encoding="utf-8"))["reply"]
PEER_PHASES = ("banner", "ehlo", "mail", "rcpt", "data", "data_end")


def chosen() -> list[dict]:
    """Per decision: a multi-line reply if there is one, then one at another phase."""
    picks: list[dict] = []
    for decision in sorted({e["decision"] for e in ENTRIES}):
        usable = [e for e in ENTRIES if e["decision"] == decision and e["phase"] in PEER_PHASES]
        usable.sort(key=lambda e: "\n" not in e["text"])  # multi-line first
        first = usable[0]
        other = next((e for e in usable if e["phase"] != first["phase"]), None)
        picks += [first] if other is None else [first, other]
    return picks


PICKS = chosen()


def wire(entry: dict) -> str:
    """The reply as the peer writes it: the code on every line."""
    return "\n".join(f"{entry['code']} {line}" for line in entry["text"].splitlines())


@pytest.fixture
def net():
    addresses = [f"127.0.0.{10 + i}" for i in range(len(PICKS))] + ["127.0.0.9"]
    with MailNet(addresses) as mail:
        for i, address in enumerate(addresses[:-1]):
            mail.add_domain(f"d{i}.test", address)
        mail.add_domain("sender.test", "127.0.0.9")
        yield mail


def test_the_corpus_covers_each_decision_and_multi_line_replies():
    assert {e["decision"] for e in PICKS} == {e["decision"] for e in ENTRIES}
    assert sum("\n" in e["text"] for e in PICKS) >= 3
    assert len({e["phase"] for e in PICKS}) >= 4


def test_each_decision_class_ends_as_the_corpus_says(net, start_daemon):
    for peer, entry in zip(net.peers, PICKS, strict=False):
        peer.on(entry["phase"], wire(entry))
    daemon = start_daemon(*net.daemon_overrides(), *FAST, 'retry.schedule=["10m"]')
    sent = {
        i: daemon.send("app@sender.test", [f"user{i}@d{i}.test"], BODY) for i in range(len(PICKS))
    }

    def answered() -> set[str]:
        """Queue ids with an attempt settled, or put back uncharged by a site's pacing."""
        return {e["id"] for e in events(daemon, "delivery")} | {
            e["id"] for e in events(daemon, "requeued")
        }

    wait_for(lambda: answered() >= set(sent.values()), timeout=30, what="one answer per reply")
    time.sleep(1)  # DSNs and suppressions follow their settlement
    queue = daemon.messages()
    suppressed = {s["address"] for s in ctl_json(daemon, "suppress", "list")}
    suspended = {h["host"].split(":")[0] for h in ctl_json(daemon, "hosts")}
    home = net.peers[-1]
    bounced_to = [m.rcpt_tos for m in home.messages]
    for i, entry in enumerate(PICKS):
        rcpt = f"user{i}@d{i}.test"
        what = f"{entry['provider']} {entry['code']} {entry['status']} ({entry['decision']})"
        expected = classify(Reply.parse(entry["phase"], entry["code"], entry["text"]))
        attempts = [e for e in events(daemon, "delivery") if e["rcpt"] == rcpt]
        if attempts:
            # The wire and the client's parser change nothing: the verdict of the table.
            got = (attempts[0]["kind"], attempts[0]["outcome"], attempts[0]["code"])
            assert got == (expected.kind, expected.outcome, entry["code"]), what
        else:  # a site pacing the whole destination: back in its queue, uncharged
            assert entry["decision"] == "pace" and expected.kind == "throttling", what
            [requeued, *_] = [e for e in events(daemon, "requeued") if e["id"] == sent[i]]
            assert requeued["reason"].startswith(str(entry["code"])), what
        permanent = entry["decision"] == "recipient" or expected.outcome == "permanent"
        if permanent:
            assert sent[i] not in queue, what  # bounced at once
        else:
            [state] = [r["state"] for r in queue[sent[i]]["recipients"]]
            assert state == ("deferred" if attempts else "queued"), what
        assert (rcpt in suppressed) == (entry["decision"] == "recipient"), what
        if entry["decision"] in ("about_us", "pace"):
            # About us, or pacing: never the host's fault, never its only host suspended.
            assert f"mx.d{i}.test" not in suspended, what
    # A DSN went for each bounce, and none for the rest.
    bounces = sum(
        1 for i, e in enumerate(PICKS) if e["decision"] == "recipient" or sent[i] not in queue
    )
    wait_for(lambda: len(home.messages) == bounces, what="the DSNs")
    assert all(rcpts == ["app@sender.test"] for rcpts in bounced_to)
