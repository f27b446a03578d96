"""bench/synthetic_peer.py: the synthetic large provider, driven in-process and as a CLI.

Windows are compressed with time_scale; timing checks only assert lower bounds.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import smtplib
import subprocess
import sys
import time
from pathlib import Path

import aiosmtplib
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
from synthetic_peer import (  # noqa: E402
    SyntheticPeer,
    message_id,
    parse_listen,
    parse_rate,
    reply_key,
)

CLIENT = "client.test"  # never let smtplib call getfqdn()
OTHER_IP = "127.0.0.9"  # a second client IP (any 127.0.0.0/8 address is local)


def msg(mid: str | None = "<m1@sender.test>", rcpt: str = "b@rcpt.test") -> bytes:
    head = f"From: a@sender.test\r\nTo: {rcpt}\r\nSubject: hi\r\n"
    if mid is not None:
        head += f"Message-ID: {mid}\r\n"
    return (head + "\r\nHello.\r\nMessage-ID: <not-a-header@body>\r\n").encode()


def connect(peer: SyntheticPeer, host: str | None = None, source: str | None = None):
    return smtplib.SMTP(
        host or peer.host,
        peer.port,
        local_hostname=CLIENT,
        timeout=10,
        source_address=(source, 0) if source else None,
    )


def send(peer: SyntheticPeer, rcpts=("b@rcpt.test",), mid="<m1@sender.test>", **kw) -> dict:
    with connect(peer, **kw) as client:
        return client.sendmail("a@sender.test", list(rcpts), msg(mid))


@pytest.fixture
def make_peer():
    started: list[SyntheticPeer] = []

    def make(**kw) -> SyntheticPeer:
        peer = SyntheticPeer(kw.pop("listen", ["127.0.0.2:0"]), **kw).start()
        started.append(peer)
        return peer

    yield make
    for peer in started:
        assert peer.stop()["errors"] == []


# -- helpers ------------------------------------------------------------------------------


def test_message_id_is_read_from_the_header_section_only():
    assert message_id(msg("<a@b>")) == "<a@b>"
    assert message_id(msg(None)) is None  # the body's "Message-ID:" line does not count
    folded = b"Subject: x\r\nmessage-id:\r\n  <folded@b>\r\nX: y\r\n\r\nbody\r\n"
    assert message_id(folded) == "<folded@b>"
    assert message_id(b"Message-Id: <lf@only>\nSubject: x\n\nbody\n") == "<lf@only>"
    assert message_id(b"X-Message-ID: <no@b>\r\n\r\n") is None


def test_parsers():
    assert parse_rate("100/min") == (100, 60.0)
    assert parse_rate("5/10s") == (5, 10.0)
    assert parse_rate("3600/h") == (3600, 3600.0)
    for bad in ("100", "0/min", "5/0s", "x/min", "5/fortnight"):
        with pytest.raises(ValueError):
            parse_rate(bad)
    assert parse_listen("127.0.0.2:2600") == ("127.0.0.2", 2600)
    for bad in ("10.0.0.1:25", "0.0.0.0:25", "localhost:25", "[::1]:25", "127.0.0.2"):
        with pytest.raises(ValueError):
            parse_listen(bad)
    assert reply_key("450 4.2.0 Greylisted, please try again in 3 seconds") == "450 4.2.0"
    assert reply_key("250 OK") == "250"
    assert reply_key("250-mx\r\n250 HELP") == "250"


# -- behaviours ---------------------------------------------------------------------------


def test_greylisting_defers_a_new_triplet_until_the_window_has_passed(make_peer):
    # 40 s scaled by 0.01 = 0.4 s; two MX addresses share the state.
    peer = make_peer(listen=["127.0.0.2:0", "127.0.0.3:0"], greylist=40, time_scale=0.01)
    (mx1, port), (mx2, port2) = peer.addresses
    assert port == port2  # port 0: one shared ephemeral port, like MX hosts on port 25
    with pytest.raises(smtplib.SMTPRecipientsRefused) as refused:
        send(peer, host=mx1)
    first = time.monotonic()  # the peer saw the triplet before this
    code, text = refused.value.recipients["b@rcpt.test"]
    assert code == 450
    assert text.decode().startswith("4.2.0 Greylisted, please try again in ")
    assert text.decode().endswith(" seconds")
    with pytest.raises(smtplib.SMTPRecipientsRefused):  # still inside the window
        send(peer, host=mx2)

    time.sleep(max(0.0, first + 0.42 - time.monotonic()))
    assert send(peer, host=mx2) == {}  # the other MX knows the triplet: accepted
    assert send(peer, host=mx1) == {}  # remembered for good
    with pytest.raises(smtplib.SMTPRecipientsRefused):  # another client IP: a new triplet
        send(peer, source=OTHER_IP)

    report = peer.report()
    assert report["greylist"] == {"deferrals": 3, "triplets_seen": 2}
    assert report["replies"]["450 4.2.0"] == 3
    assert report["messages"]["accepted"] == 2
    assert report["mx"][f"{mx2}:{port}"]["accepted"] == 1
    assert report["settings"]["effective"]["greylist_s"] == pytest.approx(0.4)


def test_rate_limit_answers_421_4_7_28_at_mail_and_closes(make_peer):
    # 3/min scaled by 0.02: a burst of 3, then one token every 0.4 s.
    peer = make_peer(rate="3/min", time_scale=0.02)
    with connect(peer) as client:
        for n in range(3):
            assert client.sendmail("a@sender.test", ["b@rcpt.test"], msg(f"<r{n}@s>")) == {}
        code, text = client.mail("a@sender.test")
        assert code == 421
        assert text.decode().startswith("4.7.28 ")
        assert b"temporarily rate limited" in text
        with pytest.raises(smtplib.SMTPServerDisconnected):
            client.noop()
    assert send(peer, source=OTHER_IP) == {}  # the limit is per client IP
    time.sleep(0.45)  # one token back
    assert send(peer, mid="<r4@s>") == {}

    report = peer.report()
    assert report["rate_limited"] == 1 and report["replies"]["421 4.7.28"] == 1
    assert report["clients"]["127.0.0.1"]["rate_limited"] == 1
    assert report["messages"]["accepted"] == 5


def test_rate_limit_yahoo_style(make_peer):
    peer = make_peer(rate="1/min", rate_style="yahoo")
    with connect(peer) as client:
        client.sendmail("a@sender.test", ["b@rcpt.test"], msg())
        code, text = client.mail("a@sender.test")
    assert code == 421 and text.decode().startswith("4.7.0 [TSS04] ")


def test_connection_cap_answers_421_4_7_0_at_the_greeting(make_peer):
    peer = make_peer(max_connections=2)
    one, two = connect(peer), connect(peer)
    with pytest.raises(smtplib.SMTPConnectError) as refused:
        connect(peer)
    assert refused.value.smtp_code == 421
    assert refused.value.smtp_error.decode().startswith(
        "4.7.0 Too many concurrent SMTP connections from this IP address"
    )
    connect(peer, source=OTHER_IP).quit()  # per client IP
    one.quit()
    peer.wait(lambda r: r["connections"]["open"] <= 1)
    three = connect(peer)  # a slot is free again
    three.quit()
    two.quit()

    report = peer.report()
    assert report["connection_limited"] == 1 and report["replies"]["421 4.7.0"] == 1
    assert report["connections"]["max_concurrent_per_client"] == 2


def test_hammering_after_421_is_blocklisted_then_released(make_peer):
    # Scaled by 0.01: watch 0.6 s after a 421, blocklisted for 0.5 s, 1 message per 0.6 s.
    peer = make_peer(
        rate="1/min", blocklist_after=2, blocklist_for=50, blocklist_window=60, time_scale=0.01
    )
    with connect(peer) as client:
        client.sendmail("a@sender.test", ["b@rcpt.test"], msg())
        sent = time.monotonic()
        assert client.mail("a@sender.test")[0] == 421
    connect(peer).close()  # 1st and 2nd connection inside the watch: tolerated
    connect(peer).close()
    with pytest.raises(smtplib.SMTPConnectError) as refused:  # 3rd: blocklisted
        connect(peer)
    listed = time.monotonic()
    assert refused.value.smtp_code == 550
    assert refused.value.smtp_error.decode() == (
        "5.7.1 Service unavailable; client [127.0.0.1] blocked using our blocklist"
    )
    with pytest.raises(smtplib.SMTPConnectError):  # still blocked
        connect(peer)
    assert send(peer, source=OTHER_IP) == {}  # only that client

    time.sleep(max(0.0, listed + 0.55 - time.monotonic()))
    assert connect(peer).quit()[0] == 221  # released
    time.sleep(max(0.0, sent + 0.65 - time.monotonic()))  # and the rate allows one more
    assert send(peer, mid="<after@s>") == {}

    report = peer.report()
    assert report["blocklist"] == {"listings": 1, "hits": 2, "clients": ["127.0.0.1"]}
    assert report["replies"]["550 5.7.1"] == 2
    assert report["clients"]["127.0.0.1"]["blocklisted"] == 1


def test_mail_commands_after_a_421_count_towards_the_blocklist(make_peer):
    peer = make_peer(max_connections=1, blocklist_after=2)
    with connect(peer) as keep:
        keep.ehlo()
        with pytest.raises(smtplib.SMTPConnectError):  # 421 4.7.0: the watch starts
            connect(peer)
        codes = []
        for _ in range(3):  # the open session keeps sending at full speed
            codes.append(keep.mail("a@sender.test")[0])
            keep.rset()
        assert codes == [250, 250, 550]
        code, text = keep.mail("a@sender.test")
        assert (code, text[:5]) == (550, b"5.7.1")  # blocked at MAIL; the session stays
    assert peer.report()["blocklist"]["hits"] == 2


def mail_once(peer: SyntheticPeer) -> int:
    """One connection, one MAIL: its reply code."""
    with connect(peer) as client:
        client.ehlo()
        return client.mail("a@sender.test")[0]


def test_a_handful_of_throttle_replies_within_the_window_is_blocklisted(make_peer):
    # Scaled by 0.01: a 1 s window, blocklisted for 0.5 s; one MAIL per 10 s; the watch
    # after a 421 (blocklist_after) is off, so only the count of 421s lists the client.
    peer = make_peer(rate="1/1000s", blocklist_throttles=2, blocklist_for=50,
                     blocklist_window=100, time_scale=0.01)  # fmt: skip
    assert send(peer) == {}
    assert [mail_once(peer) for _ in range(3)] == [421, 421, 421]  # the 3rd lists it
    with pytest.raises(smtplib.SMTPConnectError) as refused:
        connect(peer)
    assert refused.value.smtp_code == 550
    report = peer.report()
    assert report["blocklist"]["listings"] == 1
    assert report["settings"]["blocklist_throttles"] == 2
    time.sleep(0.55)  # released; two more 421s in a fresh window are tolerated
    assert [mail_once(peer) for _ in range(2)] == [421, 421]
    assert peer.report()["blocklist"]["listings"] == 1


def test_throttle_replies_spread_beyond_the_window_are_not_blocklisted(make_peer):
    # A 0.2 s window: three 421s 0.25 s apart never make two inside it.
    peer = make_peer(rate="1/1000s", blocklist_throttles=1, blocklist_window=20,
                     time_scale=0.01)  # fmt: skip
    assert send(peer) == {}
    for _ in range(3):
        assert mail_once(peer) == 421
        time.sleep(0.25)
    assert peer.report()["blocklist"]["listings"] == 0


def test_hard_bounces_for_listed_mailboxes(make_peer):
    peer = make_peer(bounces=["Gone@Example.org"])
    refused = send(peer, rcpts=["ok@example.org", "gone@EXAMPLE.org"])
    code, text = refused["gone@EXAMPLE.org"]
    assert code == 550
    assert text.decode().startswith("5.1.1 The email account that you tried to reach does not")
    report = peer.report()
    assert report["hard_bounces"] == 1 and report["replies"]["550 5.1.1"] == 1
    assert report["recipients"] == {"ok@example.org": 1}


def test_duplicates_by_message_id_and_by_recipient(make_peer):
    peer = make_peer()

    async def deliver(sends):
        client = aiosmtplib.SMTP(
            hostname=peer.host, port=peer.port, local_hostname=CLIENT, timeout=10
        )
        await client.connect(start_tls=False)
        try:
            for mid, rcpts in sends:
                await client.sendmail("a@sender.test", rcpts, msg(mid))
        finally:
            client.close()

    async def main():
        await asyncio.gather(
            deliver([("<dup@s>", ["a@r.test"]), ("<split@s>", ["a@r.test"]), (None, ["c@r.test"])]),
            deliver([("<dup@s>", ["a@r.test", "b@r.test"]), ("<split@s>", ["b@r.test"])]),
            deliver([(f"<many{n}@s>", ["m@r.test"]) for n in range(50)]),
        )

    asyncio.run(main())
    report = peer.report()
    m = report["messages"]
    assert m["accepted"] == 55 and m["recipients_accepted"] == 56
    assert m["unique_message_ids"] == 52 and m["without_message_id"] == 1
    # <split@s> went to a and b in two transactions: same Message-ID, no duplicate delivery.
    assert m["duplicate_message_ids"] == 2 and m["duplicate_transactions"] == 2
    assert m["duplicate_deliveries"] == 1
    assert report["duplicates"] == {
        "<dup@s>": {"transactions": 2, "recipients": {"a@r.test": 2}},
        "<split@s>": {"transactions": 2, "recipients": {}},
    }
    assert report["recipients"]["m@r.test"] == 50
    assert report["timeline_fields"][:3] == ["time", "message_id", "rcpts"]
    assert len(report["timeline"]) == 55
    assert report["reply_classes"]["4xx"] == report["reply_classes"]["5xx"] == 0


def test_silent_throttling_slows_banner_and_replies_past_the_threshold(make_peer):
    factor = 0.15
    peer = make_peer(slow_banner_at=1, slow_factor=factor)
    one = connect(peer)  # 1 session: not over the threshold

    started = time.monotonic()
    two = connect(peer)  # 2 sessions: banner and replies wait 1 x factor
    assert time.monotonic() - started >= factor * 0.95
    started = time.monotonic()
    assert two.noop()[0] == 250
    assert time.monotonic() - started >= factor * 0.95

    started = time.monotonic()
    three = connect(peer)  # 3 sessions: 2 x factor, for every session of that IP
    assert time.monotonic() - started >= 2 * factor * 0.95
    started = time.monotonic()
    assert one.noop()[0] == 250
    assert time.monotonic() - started >= 2 * factor * 0.95

    for client in (one, two, three):
        client.close()
    throttling = peer.report()["throttling"]
    assert throttling["delayed_replies"] >= 4
    assert throttling["delay_max_s"] == pytest.approx(2 * factor)


def test_duration_ends_the_run(make_peer):
    peer = SyntheticPeer(["127.0.0.2:0"]).start(duration=0.2)
    time.sleep(0.5)
    assert peer.stop()["exit_reason"] == "duration"


# -- the command line ---------------------------------------------------------------------


def start_cli(*args: str) -> tuple[subprocess.Popen, int]:
    """Start the CLI; returns (process, port) once it says it is listening."""
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / "synthetic_peer.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], 0.1)
        if ready:
            line = proc.stderr.readline()
            if line.startswith("synthetic_peer: listening on "):
                return proc, int(line.split()[-1].rpartition(":")[2])
            if not line:
                break
    proc.kill()
    raise AssertionError(f"the CLI did not start: {proc.communicate()}")


def test_cli_exits_when_idle_and_writes_the_report(tmp_path):
    bounce_file = tmp_path / "bounces.txt"
    bounce_file.write_text("# mailboxes that do not exist\n\ngone@example.org\n")
    report_path = tmp_path / "report.json"
    proc, port = start_cli(
        "--listen", "127.0.0.2:0", "--listen", "127.0.0.3:0",
        "--greylist", "30", "--time-scale", "0.01", "--rate", "100/min",
        "--bounce", "gone2@example.org", "--bounce-file", str(bounce_file),
        "--idle-exit", "0.5", "--duration", "30", "--report", str(report_path),
    )  # fmt: skip
    try:

        def client(host: str) -> smtplib.SMTP:
            return smtplib.SMTP(host, port, local_hostname=CLIENT, timeout=10)

        with client("127.0.0.2") as c, pytest.raises(smtplib.SMTPRecipientsRefused):
            c.sendmail("a@sender.test", ["b@rcpt.test", "gone@example.org"], msg())
        time.sleep(0.35)  # the 0.3 s greylist window
        with client("127.0.0.3") as c:
            refused = c.sendmail("a@sender.test", ["b@rcpt.test", "gone2@example.org"], msg())
        assert set(refused) == {"gone2@example.org"}
        assert proc.wait(timeout=15) == 0  # --idle-exit, long before --duration
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read()
    assert "synthetic_peer: idle; accepted 1" in stderr

    report = json.loads(report_path.read_text())
    assert report["exit_reason"] == "idle"
    assert report["listen"] == [f"127.0.0.2:{port}", f"127.0.0.3:{port}"]
    assert report["messages"]["accepted"] == 1
    assert report["greylist"]["deferrals"] == 1 and report["hard_bounces"] == 2
    assert report["mx"] == {
        f"127.0.0.2:{port}": {"connections": 1, "accepted": 0},
        f"127.0.0.3:{port}": {"connections": 1, "accepted": 1},
    }
    (entry,) = report["timeline"]
    assert entry[1:5] == ["<m1@sender.test>", ["b@rcpt.test"], "127.0.0.1", f"127.0.0.3:{port}"]
    assert report["settings"]["effective"]["rate_period_s"] == pytest.approx(0.6)


def test_cli_sigterm_writes_the_report_to_stdout():
    proc, _port = start_cli("--listen", "127.0.0.2:0", "--duration", "30")
    try:
        os.kill(proc.pid, signal.SIGTERM)
        stdout, _stderr = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    report = json.loads(stdout)
    assert report["exit_reason"] == "signal:SIGTERM"
    assert report["messages"]["accepted"] == 0


def test_cli_refuses_non_loopback_addresses():
    result = subprocess.run(
        [sys.executable, str(BENCH / "synthetic_peer.py"), "--listen", "0.0.0.0:2600"],
        capture_output=True,
        text=True,
        timeout=15,
    )
    assert result.returncode == 2 and "only loopback" in result.stderr
