"""Replies as the world writes them (tests/data/provider_replies.toml) get the decision the
corpus gives them from the real classifier (mtaqueue.policy.classify), issue 22.

    DECISIONS: decision name -> the check of a Verdict it stands for
    one test per reply, named provider-code-status-index; one test of the corpus's breadth
"""

from __future__ import annotations

import collections
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

from mtaqueue.policy.classify import classify
from mtaqueue.policy.replies import PHASES, Reply
from mtaqueue.policy.shaper import _CONNECTIONS
from mtaqueue.policy.verdict import (
    ABOUT_US,
    CONTENT,
    DESTINATION,
    GREYLISTING,
    MAILBOX,
    MAILBOX_FULL,
    MESSAGE,
    OTHER,
    PERMANENT,
    POLICY,
    RECIPIENT,
    SIZE,
    THROTTLING,
    TOO_MANY_RECIPIENTS,
    TRANSIENT,
    Verdict,
)

CORPUS = Path(__file__).parent / "data" / "provider_replies.toml"
ENTRIES: list[dict] = tomllib.loads(CORPUS.read_text(encoding="utf-8"))["reply"]
FIELDS = {"provider", "source", "phase", "code", "status", "text", "decision", "why", "shape"}


def _about_us(reply: Reply, v: Verdict) -> None:
    # Our source refused: deferred for the whole destination, never a bounce.
    assert (v.outcome, v.scope, v.suppress) == (TRANSIENT, DESTINATION, False)
    assert v.kind in ABOUT_US


def _recipient(reply: Reply, v: Verdict) -> None:
    assert (v.outcome, v.scope, v.kind, v.suppress) == (PERMANENT, RECIPIENT, MAILBOX, True)


def _pace(reply: Reply, v: Verdict) -> None:
    assert v.outcome == TRANSIENT and v.kind == THROTTLING
    # Gmail's 4.2.1 limits one mailbox: that stays with the recipient.
    assert v.scope == (RECIPIENT if reply.enhanced == "4.2.1" else DESTINATION)


def _greylist(reply: Reply, v: Verdict) -> None:
    assert (v.outcome, v.kind) == (TRANSIENT, GREYLISTING)


def _mailbox_full(reply: Reply, v: Verdict) -> None:
    assert (v.outcome, v.kind, v.suppress) == (TRANSIENT, MAILBOX_FULL, False)


def _message(reply: Reply, v: Verdict) -> None:
    # This message only: a 5xx bounces it without suppressing anyone; a 4xx waits.
    assert not v.suppress and v.kind not in ABOUT_US
    if reply.code // 100 == 5:
        assert (v.outcome, v.scope) == (PERMANENT, MESSAGE)
        assert v.kind in (CONTENT, SIZE, POLICY)
    else:
        assert v.outcome == TRANSIENT
        assert v.kind in (CONTENT, SIZE, POLICY, TOO_MANY_RECIPIENTS, THROTTLING)


def _other_transient(reply: Reply, v: Verdict) -> None:
    assert (v.outcome, v.kind, v.suppress) == (TRANSIENT, OTHER, False)


DECISIONS: dict[str, Callable[[Reply, Verdict], None]] = {
    "about_us": _about_us,
    "recipient": _recipient,
    "pace": _pace,
    "greylist": _greylist,
    "mailbox_full": _mailbox_full,
    "message": _message,
    "other_transient": _other_transient,
}


def _id(i: int, entry: dict) -> str:
    provider = entry["provider"].replace(" ", "_")
    return f"{provider}-{entry['code']}-{entry['status'] or '-'}-{i}"


@pytest.mark.parametrize("entry", ENTRIES, ids=[_id(i, e) for i, e in enumerate(ENTRIES)])
def test_reply_gets_its_decision(entry: dict) -> None:
    assert entry.keys() >= FIELDS and entry["phase"] in PHASES
    assert entry["decision"] in DECISIONS and entry["shape"] in ("verbatim", "documented code")
    reply = Reply.parse(entry["phase"], entry["code"], entry["text"])
    assert reply.enhanced == entry["status"]  # the corpus says what the parser must find
    verdict = classify(reply)
    DECISIONS[entry["decision"]](reply, verdict)
    # The shaper learns a concurrency from connection caps, and only from them.
    if entry["decision"] == "pace":
        assert (_CONNECTIONS.search(reply.text) is not None) == entry.get("connection_cap", False)


def test_corpus_is_broad() -> None:
    assert len(ENTRIES) >= 90
    assert sum(e["shape"] == "verbatim" for e in ENTRIES) >= 60
    assert len({e["provider"] for e in ENTRIES}) >= 10
    counts = collections.Counter(e["decision"] for e in ENTRIES)
    for decision in DECISIONS:
        assert counts[decision] >= (2 if decision in ("mailbox_full", "other_transient") else 5)
    assert all(e["source"].startswith(("https://", "http://")) for e in ENTRIES)
