"""The pipelining client against a real Postfix smtpd (issue 30): with PIPELINING and
CHUNKING on (Postfix's defaults), with CHUNKING discarded from its EHLO, and with both
discarded (`smtpd_discard_ehlo_keywords`). Each message has recipients Postfix takes and
one it refuses (not a domain it relays for: "554 5.7.1 Relay access denied") in the same
group; every recipient must get its own reply, and Postfix must have what was accepted.

Postfix's disconnect line counts the commands it read ("bdat=3", "data=3"): which mode
went on the wire. Needs root and Debian's postfix package (`postfix_installed`).
"""

from __future__ import annotations

import asyncio
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from postfix_instance import PostfixInstance
from postfix_tools import unused_port
from test_pipeline import pipeline_of

from mtaqueue.config import TimeoutsConfig
from mtaqueue.smtp.client import ClientSettings, SmtpConnection

TIMEOUTS = TimeoutsConfig(mail=10, rcpt=10, data_start=10, data_done=10)
SETTINGS = ClientSettings("client.test", TIMEOUTS, "off")
RCPTS = ("a@example.org", "x@other.test", "b@example.org")
TAGS = ["m0", "m1", "m2"]


@pytest.mark.parametrize(
    ("discard", "mode", "pipelining"),
    [("", "bdat", True), ("chunking", "data", True), ("pipelining, chunking", "data", False)],
)
def test_each_recipient_gets_its_own_reply_from_a_real_postfix(
    postfix_installed, discard, mode, pipelining
):
    workdir = Path(tempfile.mkdtemp(prefix="pfx-pipe-", dir="/tmp"))  # the postfix user enters
    workdir.chmod(0o755)
    try:
        run_against(workdir, discard, mode, pipelining)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_against(workdir: Path, discard: str, mode: str, pipelining: bool) -> None:
    listen = f"127.0.0.1:{unused_port()}"
    cf = {"smtpd_discard_ehlo_keywords": discard} if discard else {}
    with PostfixInstance(
        workdir / "pf",
        listen=listen,
        mode="receive",
        domains=("example.org",),
        mailboxes=("example.org",),
        main_cf=cf,
    ) as postfix:

        async def go():
            conn = await SmtpConnection.open("mx.example.org", postfix.host, postfix.port, SETTINGS)
            assert conn.pipeline is not None and conn.pipeline.pipelining == pipelining
            results = await pipeline_of(conn, TAGS, rcpts=RCPTS)
            timed = conn.pipeline.timed()
            await conn.quit()
            return results, conn.handshake, timed

        results, handshake, timed = asyncio.run(asyncio.wait_for(go(), 60))
        # Its replies timed for the destination's latency (issue 29): the handshake's, and
        # the reply after each final dot.
        assert [kind for kind, _ in handshake] == ["connect", "banner", "ehlo"]
        assert [kind for kind, _ in timed].count("dot") == len(TAGS), timed
        assert all(0 < seconds < 10 for _, seconds in handshake + timed), (handshake, timed)
        for replies in results:
            codes = [(r.phase, r.code) for r in replies]
            assert codes == [("data_end", 250), ("rcpt", 554), ("data_end", 250)], replies
            assert "Relay access denied" in replies[1].text
        deadline = time.monotonic() + 30
        while len(postfix.stored("example.org")) < 2 * len(TAGS):  # one copy a recipient
            assert time.monotonic() < deadline, "Postfix did not store every copy"
            time.sleep(0.1)
        subjects = sorted(
            re.search(rb"^Subject: (\S+)", m, re.MULTILINE)[1]
            for m in postfix.stored("example.org")
        )
        assert subjects == sorted([t.encode() for t in TAGS] * 2)
        sessions = re.findall(r"disconnect from \S+ (.*)", postfix.maillog.read_text())
        (stats,) = [line for line in sessions if "mail=" in line]  # (not its start probe)
        assert f"{mode}=3" in stats and "rcpt=6/9" in stats, stats
        assert "rset" not in stats  # no RSET after a transaction that ended cleanly
