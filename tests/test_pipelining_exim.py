"""The pipelining client against Debian's Exim 4 as the receiver (issue 30), a private
daemon (tests/exim_instance.py): with PIPELINING and CHUNKING advertised (Exim's
defaults), with CHUNKING off, with both off, and with CHUNKING alone (where Exim enforces
strict synchronization even around BDAT). Each message has recipients Exim takes and one
it refuses at RCPT ("550 relay not permitted") in the same group; every recipient must
get its own reply, and Exim must have stored each accepted copy, under the message id of
the reply that recipient got. A second test puts groups whose every recipient is refused
(Exim answers DATA or BDAT with a 503 of three lines) between accepted ones.

What Exim read comes from its own debug transcript (``SMTP<<``: each command, in order);
its log's accept lines say whether the client pipelined (``L``; ``L.``: PIPECONNECT was
offered too, not used) and whether the content came by BDAT (``K``). What we wrote, a
write at a time, shows the next transaction riding behind the final dot. Needs root
(`exim_available`: the package is fetched, never installed).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from exim_instance import EximInstance
from postfix_tools import unused_port
from test_pipeline import content, pipeline_of

from mtaqueue.config import TimeoutsConfig
from mtaqueue.smtp.client import ClientSettings, SmtpConnection

TIMEOUTS = TimeoutsConfig(mail=10, rcpt=10, data_start=10, data_done=10)
SETTINGS = ClientSettings("client.test", TIMEOUTS, "off")
RCPTS = ("a@example.org", "x@other.test", "b@example.org")
TAGS = ["m0", "m1", "m2"]
MODES = [
    pytest.param(True, True, id="pipelining+chunking"),
    pytest.param(True, False, id="pipelining"),
    pytest.param(False, False, id="neither"),
    pytest.param(False, True, id="chunking"),
]
TROUBLE = re.compile(r"synchroni[sz]ation|protocol error|syntax error|lost|PANIC", re.I)


@contextlib.contextmanager
def private_exim(pipelining: bool, chunking: bool):
    workdir = Path(tempfile.mkdtemp(prefix="exim-pipe-", dir="/tmp"))  # nobody enters
    workdir.chmod(0o755)
    try:
        with EximInstance(
            workdir / "exim",
            listen=f"127.0.0.1:{unused_port()}",
            pipelining=pipelining,
            chunking=chunking,
        ) as exim:
            yield exim
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def session(exim: EximInstance, pipelining: bool, chunking: bool, tags, rcpts):
    """pipeline_of(tags) on one connection: (each message's replies, what we wrote, a
    write at a time)."""

    async def go():
        conn = await SmtpConnection.open("mx.example.org", exim.host, exim.port, SETTINGS)
        assert conn.pipeline.pipelining == pipelining
        assert ("chunking" in conn.pipeline.extensions) == chunking
        stream, writes = conn.pipeline.stream, []
        write = stream.write

        def record(data: bytes) -> None:
            writes.append(bytes(data))
            write(data)

        stream.write = record
        results = await pipeline_of(conn, tags, rcpts=rcpts)
        assert conn.usable and not conn.pipeline.out_of_step
        await conn.quit()
        return results, writes

    return asyncio.run(asyncio.wait_for(go(), 60))


def group(tag: str, rcpts: tuple[str, ...], chunking: bool) -> list[str]:
    """The commands of one transaction as Exim reads them."""
    size = len(content(tag))
    last = f"BDAT {size} LAST" if chunking else "DATA"
    return [f"MAIL FROM:<app@sender.test> SIZE={size}", *(f"RCPT TO:<{r}>" for r in rcpts), last]


def read_by_exim(exim: EximInstance) -> list[str]:
    """The commands of our session (not the start probe's), once Exim logged our QUIT: on a
    loaded machine its debug log may trail the replies we already read."""
    deadline = time.monotonic() + 10
    while True:
        ours = [c for c in exim.commands() if c and c[0].startswith("EHLO")]
        if (len(ours) == 1 and ours[0][-1] == "QUIT") or time.monotonic() > deadline:
            (commands,) = ours
            return commands
        time.sleep(0.05)


def stored(exim: EximInstance, count: int) -> list[tuple[str, str, str]]:
    """(Subject, Exim's message id, Envelope-to) of each copy in example.org's Maildir."""
    deadline = time.monotonic() + 30
    while len(exim.stored("example.org")) < count:
        assert time.monotonic() < deadline, f"Exim did not store {count} copies"
        time.sleep(0.05)
    copies = exim.stored("example.org")
    assert len(copies) == count
    for copy in copies:
        assert b"\n.leading dot\n" in copy  # dot-stuffed by us for DATA, not for BDAT
    return sorted(
        (
            re.search(rb"^Subject: (\S+)", c, re.M)[1].decode(),
            re.search(rb"^\tid ([^\s;]+)", c, re.M)[1].decode(),  # in Exim's Received:
            re.search(rb"^Envelope-to: (\S+)", c, re.M)[1].decode(),
        )
        for c in copies
    )


def accepted_id(reply) -> str:
    assert reply.phase == "data_end" and reply.code == 250, reply
    # Exim answers BDAT LAST with two lines: "250- N byte chunk, total N", "250 OK id=..."
    return re.fullmatch(r"(?:\d+ byte chunk, total \d+ / )?OK id=(\S+)", reply.text)[1]


def accept_line(pipelining: bool, chunking: bool, rcpts: str) -> re.Pattern[str]:
    flags = (" L." if pipelining else "") + (" K" if chunking else "")
    return re.compile(
        rf"^\S+ \S+ (\S+) <= app@sender\.test H=\(client\.test\) \[127\.0\.0\.1\]:\d+ "
        rf"P=esmtp{re.escape(flags)} S=\d+ for {re.escape(rcpts)}$",
        re.M,
    )


@pytest.mark.parametrize(("pipelining", "chunking"), MODES)
def test_each_recipient_gets_its_own_reply_from_exim(exim_available, pipelining, chunking):
    with private_exim(pipelining, chunking) as exim:
        results, writes = session(exim, pipelining, chunking, TAGS, RCPTS)

        # Each recipient its own reply; the two accepted get the reply after the content.
        ids = []
        for replies in results:
            assert [(r.phase, r.code) for r in replies] == [
                ("data_end", 250),
                ("rcpt", 550),
                ("data_end", 250),
            ], replies
            assert replies[1].text == "relay not permitted"
            assert replies[0] == replies[2]
            ids.append(accepted_id(replies[0]))
        assert len(set(ids)) == len(TAGS)

        # Exim stored a copy for each accepted recipient, under the id its reply named.
        assert stored(exim, 2 * len(TAGS)) == sorted(
            (tag, id_, rcpt)
            for tag, id_ in zip(TAGS, ids, strict=True)
            for rcpt in ("a@example.org", "b@example.org")
        )

        # What Exim read, command by command.
        assert read_by_exim(exim) == [
            "EHLO client.test",
            *(c for tag in TAGS for c in group(tag, RCPTS, chunking)),
            "QUIT",
        ]

        # Its log: one accept line a message, with the ids we got; pipelined (L.) only
        # when PIPELINING was offered, by BDAT (K) only when CHUNKING was; each refusal;
        # no synchronization or protocol error; the session ended by our QUIT.
        log = exim.mainlog.read_text()
        assert (
            accept_line(pipelining, chunking, "a@example.org b@example.org").findall(log) == ids
        ), log
        refused = "F=<app@sender.test> rejected RCPT <x@other.test>: relay not permitted"
        assert log.count(refused) == len(TAGS)
        assert not TROUBLE.search(log), log
        assert re.search(r"SMTP connection from \(client\.test\) \S+ closed by QUIT", log)
        assert not exim.paniclog.exists()

        # What we wrote: with PIPELINING, a message's MAIL, RCPTs and DATA in one write,
        # the next one's right behind the final dot (BDAT: the content in that write too);
        # without it, one command a write (BDAT's content goes with BDAT).
        mails = [w.count(b"MAIL FROM:") for w in writes]
        dots = [w.count(b"\r\n.\r\n") for w in writes]
        if pipelining and chunking:
            assert (mails, dots) == ([1, 1, 1, 0], [0, 0, 0, 0])
        elif pipelining:
            assert (mails, dots) == ([1, 1, 1, 0, 0], [0, 1, 1, 1, 0])
            assert all(w.find(b"\r\n.\r\nMAIL FROM:") > 0 for w in writes[1:3])
        else:
            first = [re.match(rb"[A-Za-z]+", w)[0].decode() for w in writes]
            one = ["MAIL", "RCPT", "RCPT", "RCPT", *(["BDAT"] if chunking else ["DATA", "Subject"])]
            assert first == one * len(TAGS) + ["QUIT"]
            commands = [
                w for w, f in zip(writes, first, strict=True) if f not in ("BDAT", "Subject")
            ]
            assert all(w.count(b"\r\n") == 1 for w in commands)


ALL_REFUSED = {
    "r0": ("x@other.test", "y@other.test"),
    "m1": ("a@example.org", "x@other.test"),
    "r2": ("x@other.test",),  # written behind m1's final dot where Exim pipelines
    "m3": ("b@example.org",),
}


@pytest.mark.parametrize(("pipelining", "chunking"), MODES)
def test_a_group_exim_refuses_whole_keeps_each_refusal_and_the_session_in_step(
    exim_available, pipelining, chunking
):
    tags = list(ALL_REFUSED)
    with private_exim(pipelining, chunking) as exim:
        results, writes = session(exim, pipelining, chunking, tags, ALL_REFUSED)

        assert [[(r.phase, r.code) for r in replies] for replies in results] == [
            [("rcpt", 550), ("rcpt", 550)],
            [("data_end", 250), ("rcpt", 550)],
            [("rcpt", 550)],
            [("data_end", 250)],
        ]
        ids = [accepted_id(results[1][0]), accepted_id(results[3][0])]
        assert stored(exim, 2) == [("m1", ids[0], "a@example.org"), ("m3", ids[1], "b@example.org")]

        # With PIPELINING the whole group went, DATA or BDAT included (Exim answers it
        # "503-All RCPT commands were rejected with this error:" / "503-relay not
        # permitted" / "503 Valid RCPT command must precede DATA", and skips BDAT's
        # chunk); in lock-step we stop before it. Then RSET either way.
        def refused(tag: str) -> list[str]:
            commands = group(tag, ALL_REFUSED[tag], chunking)
            return [*(commands if pipelining else commands[:-1]), "RSET"]

        assert read_by_exim(exim) == [
            "EHLO client.test",
            *refused("r0"),
            *group("m1", ALL_REFUSED["m1"], chunking),
            *refused("r2"),
            *group("m3", ALL_REFUSED["m3"], chunking),
            "QUIT",
        ]
        if pipelining and not chunking:  # r2's group went behind m1's final dot
            r2 = "".join(f"{c}\r\n" for c in group("r2", ALL_REFUSED["r2"], False))
            (m1,) = [w for w in writes if w.startswith(b"Subject: m1\r\n")]
            assert m1.endswith(b"\r\n.\r\n" + r2.encode())
        log = exim.mainlog.read_text()
        assert accept_line(pipelining, chunking, "a@example.org").findall(log) == ids[:1]
        assert accept_line(pipelining, chunking, "b@example.org").findall(log) == ids[1:]
        assert log.count("incomplete transaction (RSET) from <app@sender.test>") == 2
        assert not TROUBLE.search(log), log
