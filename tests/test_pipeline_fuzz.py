"""A fuzzing server against the pipelining client: each command and each content gets a
reply drawn at random, valid or not (a refusal, a 421, a reply to another command, two
replies, garbage, a multi-line reply with mixed codes, none at all). Whatever it does:
every recipient gets an outcome, and none is delivered unless the server answered 2xx to
that message's content. (Replies split across reads: test_reply_stream.py.)

One script is out of any client's reach with CHUNKING: a server that answers one command
of a group twice and another (BDAT) not at all. With DATA the 354 is a reply no other
command gets, so a shift shows; in a BDAT group every reply may be a 250, and two faults
that cancel out leave a count that fits. With DATA the same holds when the reply shifted into
DATA's place is itself a 354 (drawn for a recipient): the client sees MAIL 250, RCPT 250,
DATA 354 — a conversation in step. The same when a content draws no reply and the group
written behind it is cut short by a 421: MAIL's 250 lands in the content's place, the
RCPT's 421 in MAIL's, and a server that took the message, then refused the next MAIL and
closed, says exactly that (taking it for a shift would send every such message twice).
For such a group only the first property is asserted (smtp/pipeline.py says so too);
every other script must meet both."""

from __future__ import annotations

import asyncio

import pytest
from group_peer import GroupPeer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_pipeline import pipeline_of

from mtaqueue.config import TimeoutsConfig
from mtaqueue.policy.classify import classify
from mtaqueue.smtp.client import ClientSettings, SmtpConnection

TIMEOUTS = TimeoutsConfig(mail=0.3, rcpt=0.3, data_start=0.3, data_done=0.3)
SETTINGS = ClientSettings("mx.test", TIMEOUTS, "off")

REPLIES = [
    None,  # the default: 250 / 354
    None,
    None,
    "250 2.1.0 ok",
    "251 2.1.5 forwarded",
    "354 go",
    "550 5.1.1 no such user",
    "451 4.3.0 try later",
    "503 5.5.1 bad sequence",
    "421 4.7.0 closing",
    "252 2.1.0 what",
    "220 hello again",
    "250 ok\r\n250 twice",
    "250-first\r\n250 last",
    "250-first\r\n550 last",
    "hello garbage",
    "",  # no reply: a stall
]


@pytest.mark.parametrize("keywords", [("PIPELINING",), ("PIPELINING", "CHUNKING")])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_nothing_is_delivered_without_a_2xx_to_its_content(keywords, data):
    faults: dict[str, set[str]] = {}  # this group's: "twice", "none"
    go_ahead: list[str] = []  # this group's 354s drawn for a command other than DATA
    cancelled: set[str] = set()  # messages whose group's faults cancel out
    stalled: list[str] = []  # the message whose content drew no reply, until the next content

    def answer(verb: str, arg: str) -> str | None:
        if verb in ("EHLO", "QUIT"):
            return None
        if verb == "MAIL":
            faults.clear()
            go_ahead.clear()
        reply = data.draw(st.sampled_from(REPLIES), label=f"{verb} {arg}")
        if reply is not None and "\r\n250 " in reply:
            faults.setdefault("twice", set())
        if reply == "":
            faults.setdefault("none", set())
        if reply is not None and reply.startswith("354") and verb != "DATA":
            go_ahead.append(verb)
        cancels = faults.keys() == {"twice", "none"} and ("CHUNKING" in keywords or go_ahead)
        if verb == "DOT" and cancels:
            cancelled.add(arg)
        if verb == "DOT":
            stalled[:] = [arg] if reply == "" else []
        elif stalled and reply is not None and reply.startswith("421"):
            cancelled.update(stalled)  # the closing 421 ends the stream before a shift shows
        return reply

    peer = GroupPeer(keywords, answer)
    tags = [f"m{i}" for i in range(4)]

    async def go():
        port = await peer.start()
        try:
            conn = await SmtpConnection.open("mx.example.org", "127.0.0.2", port, SETTINGS)
            results = await pipeline_of(conn, tags, rcpts=("a@example.org", "b@example.org"))
            await conn.quit()
            return results
        finally:
            await peer.stop()

    results = asyncio.run(asyncio.wait_for(go(), 60))
    for tag, replies in zip(tags, results, strict=False):
        assert len(replies) == 2 and all(reply is not None for reply in replies)
        for reply in replies:
            if classify(reply).outcome == "delivered" and tag not in cancelled:
                assert peer.messages.get(tag, "").startswith("2"), (tag, reply, peer.messages)
