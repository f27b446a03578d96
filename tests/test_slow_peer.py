"""bench/slow_peer.py: the provider that only slows (silent throttling), in-process and CLI.

Real SMTP over loopback. What the provider did is read from its report (exact); what the
client saw is timed, lower bounds only.
"""

from __future__ import annotations

import json
import select
import smtplib
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
from slow_peer import RECORD_FIELDS, SlowPeer  # noqa: E402

CLIENT = "client.test"  # never let smtplib call getfqdn()
SLACK = 0.95  # a sleep may end a hair early by the client's clock


def msg(mid: str) -> bytes:
    return f"From: a@sender.test\r\nTo: b@rcpt.test\r\nMessage-ID: {mid}\r\n\r\nHi.\r\n".encode()


def connect(peer: SlowPeer) -> smtplib.SMTP:
    return smtplib.SMTP(peer.host, peer.port, local_hostname=CLIENT, timeout=20)


def timed(call, *args):
    started = time.monotonic()
    result = call(*args)
    return result, time.monotonic() - started


def records(peer: SlowPeer) -> dict[str, dict]:
    comfort = peer.report()["comfort"]
    return {r[2]: dict(zip(RECORD_FIELDS, r, strict=True)) for r in comfort["records"]}


def wait_open(peer: SlowPeer, count: int) -> None:
    peer.wait(lambda r: r["connections"]["open"] == count)


@pytest.fixture
def make_peer():
    started: list[SlowPeer] = []

    def make(**kw) -> SlowPeer:
        peer = SlowPeer(kw.pop("listen", ["127.0.0.2:0"]), **kw).start()
        started.append(peer)
        return peer

    yield make
    for peer in started:
        assert peer.stop()["errors"] == []


def test_past_the_session_comfort_banner_and_final_reply_wait_more_the_more_sessions(make_peer):
    factor = 0.25
    peer = make_peer(comfort_sessions=1, session_factor=factor)
    one = connect(peer)  # 1 session: at the comfort level, not past it
    two, took = timed(connect, peer)  # 2 sessions: the banner waits 1 x factor
    assert took >= factor * SLACK
    three, took = timed(connect, peer)  # 3 sessions: 2 x factor
    assert took >= 2 * factor * SLACK
    refused, took = timed(three.sendmail, "a@sender.test", ["b@rcpt.test"], msg("<3@s>"))
    assert refused == {} and took >= 2 * factor * SLACK
    for client in (two, three):
        client.quit()
    wait_open(peer, 1)
    assert one.sendmail("a@sender.test", ["b@rcpt.test"], msg("<1@s>")) == {}
    one.quit()

    seen = records(peer)
    assert seen["<3@s>"]["sessions"] == 3 and seen["<3@s>"]["past"] is True
    assert seen["<3@s>"]["delay"] == pytest.approx(2 * factor)
    assert seen["<1@s>"]["sessions"] == 1 and seen["<1@s>"]["past"] is False
    assert seen["<1@s>"]["delay"] == 0
    assert seen["<3@s>"]["reply"] - seen["<3@s>"]["dot"] >= 2 * factor * SLACK
    comfort = peer.report()["comfort"]
    assert (comfort["accepted"], comfort["past"], comfort["past_sessions"]) == (2, 1, 1)
    assert comfort["past_rate"] == 0 and comfort["banner_delays"] == 2
    assert comfort["delay_s"]["banner"] == pytest.approx(3 * factor)
    assert comfort["delay_s"]["dot_throttle"] == pytest.approx(2 * factor)
    assert comfort["delay_s"]["max"] == pytest.approx(2 * factor)
    assert comfort["max_sessions"] == 3 and comfort["connections"] == 3
    assert peer.report()["reply_classes"]["4xx"] == 0  # it slows; it never says no


def test_dot_only_opens_connections_fast_and_delays_only_the_final_reply(make_peer):
    factor = 0.3
    peer = make_peer(comfort_sessions=0, session_factor=factor, dot_only=True)
    with connect(peer) as client:  # 1 session, past a comfort of 0
        assert client.noop()[0] == 250
        refused, took = timed(client.sendmail, "a@sender.test", ["b@rcpt.test"], msg("<d@s>"))
    assert refused == {} and took >= factor * SLACK
    comfort = peer.report()["comfort"]
    assert comfort["banner_delays"] == 0 and comfort["delay_s"]["banner"] == 0
    assert comfort["delay_s"]["dot_throttle"] == pytest.approx(factor)
    assert records(peer)["<d@s>"]["past"] is True


def test_past_the_rate_comfort_replies_wait_until_the_window_forgets(make_peer):
    # R = 1 message/s over a 2 s window: the 3rd MAIL within it is 1.5/s (50% over),
    # the 4th 2/s (100% over). The window then passes and the 5th is at 0.5/s.
    factor = 0.4
    peer = make_peer(comfort_rate=1, rate_window=2.0, rate_factor=factor)
    with connect(peer) as client:
        for i in range(1, 5):
            assert client.sendmail("a@sender.test", ["b@rcpt.test"], msg(f"<r{i}@s>")) == {}
        time.sleep(2.1)
        assert client.sendmail("a@sender.test", ["b@rcpt.test"], msg("<r5@s>")) == {}
    seen = records(peer)
    assert [seen[f"<r{i}@s>"]["rate"] for i in range(1, 6)] == [0.5, 1.0, 1.5, 2.0, 0.5]
    assert [seen[f"<r{i}@s>"]["past"] for i in range(1, 6)] == [False, False, True, True, False]
    delays = [seen[f"<r{i}@s>"]["delay"] for i in range(1, 6)]
    assert delays == pytest.approx([0, 0, 0.5 * factor, factor, 0])
    comfort = peer.report()["comfort"]
    assert (comfort["past"], comfort["past_rate"], comfort["past_sessions"]) == (2, 2, 0)


def test_sessions_and_rate_add_up_and_the_delay_is_capped(make_peer):
    peer = make_peer(
        comfort_sessions=0, comfort_rate=0.5, rate_window=2.0, session_factor=0.1,
        rate_factor=1.0, max_delay=0.35,
    )  # fmt: skip
    with connect(peer) as client:
        for i in (1, 2):
            assert client.sendmail("a@sender.test", ["b@rcpt.test"], msg(f"<c{i}@s>")) == {}
    seen = records(peer)
    # 1st: 1 session over 0 (0.1) and 0.5/s, at R (0): 0.1. 2nd: 0.1 + 1.0 x (1.0/0.5 - 1)
    # = 1.1, capped at 0.35.
    assert seen["<c1@s>"]["delay"] == pytest.approx(0.1)
    assert seen["<c2@s>"]["delay"] == pytest.approx(0.35)
    assert peer.report()["comfort"]["delay_s"]["max"] == pytest.approx(0.35)


def test_slow_at_any_load_delays_every_final_reply_and_is_never_past_comfort(make_peer):
    peer = make_peer(dot_delay=0.3)
    took: dict[int, float] = {}

    def send(i: int) -> None:
        with connect(peer) as client:
            _, took[i] = timed(client.sendmail, "a@sender.test", ["b@rcpt.test"], msg(f"<s{i}@s>"))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(took) == 5 and min(took.values()) >= 0.3 * SLACK
    seen = records(peer)
    assert {r["delay"] for r in seen.values()} == {0.3}
    assert not any(r["past"] for r in seen.values())
    comfort = peer.report()["comfort"]
    assert comfort["past"] == 0 and comfort["banner_delays"] == 0
    assert comfort["delay_s"]["dot_fixed"] == pytest.approx(1.5)
    assert comfort["delay_s"]["dot_throttle"] == 0


def test_greylisting_still_defers_and_only_accepted_messages_are_recorded(make_peer):
    peer = make_peer(comfort_sessions=0, session_factor=0.1, greylist=30, time_scale=0.01)
    with connect(peer) as client, pytest.raises(smtplib.SMTPRecipientsRefused) as refused:
        client.sendmail("a@sender.test", ["b@rcpt.test"], msg("<g@s>"))
    assert refused.value.recipients["b@rcpt.test"][0] == 450
    time.sleep(0.35)  # the 0.3 s window
    with connect(peer) as client:
        assert client.sendmail("a@sender.test", ["b@rcpt.test"], msg("<g@s>")) == {}
    report = peer.report()
    assert report["replies"]["450 4.2.0"] == 1
    assert [r[2] for r in report["comfort"]["records"]] == ["<g@s>"]
    assert report["comfort"]["accepted"] == 1 and report["comfort"]["banner_delays"] == 2


def test_sessions_are_sampled_while_open(make_peer):
    peer = make_peer(sample_every=0.05)
    with connect(peer) as one, connect(peer) as two:
        assert one.noop()[0] == two.noop()[0] == 250
        peer.wait(lambda r: any(s[2] == 2 for s in r["comfort"]["samples"]))
    samples = peer.report()["comfort"]["samples"]
    assert all(s[1] == "127.0.0.1" for s in samples)


def test_bad_settings_are_refused():
    for bad in (
        {"comfort_sessions": -1}, {"comfort_rate": 0}, {"rate_window": 0},
        {"dot_delay": -1}, {"session_factor": -0.1},
    ):  # fmt: skip
        with pytest.raises(ValueError):
            SlowPeer(["127.0.0.2:0"], **bad)


def test_cli_writes_the_comfort_report(tmp_path):
    report_path = tmp_path / "report.json"
    proc = subprocess.Popen(
        [
            sys.executable, str(BENCH / "slow_peer.py"), "--listen", "127.0.0.2:0",
            "--comfort-sessions", "0", "--session-factor", "0.2", "--dot-only",
            "--dot-delay", "0.1", "--idle-exit", "0.5", "--duration", "30",
            "--report", str(report_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        port = None
        deadline = time.monotonic() + 10
        while port is None and time.monotonic() < deadline:
            if select.select([proc.stderr], [], [], 0.1)[0]:
                line = proc.stderr.readline()
                if line.startswith("synthetic_peer: listening on "):
                    port = int(line.split()[-1].rpartition(":")[2])
        assert port is not None, "the CLI did not start"
        with smtplib.SMTP("127.0.0.2", port, local_hostname=CLIENT, timeout=10) as client:
            assert client.sendmail("a@sender.test", ["b@rcpt.test"], msg("<cli@s>")) == {}
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "slow_peer: 1 of 1 accepted past comfort" in proc.stderr.read()
    comfort = json.loads(report_path.read_text())["comfort"]
    assert comfort["settings"]["dot_only"] is True
    assert comfort["settings"]["comfort_sessions"] == 0
    (record,) = comfort["records"]
    assert record[2] == "<cli@s>" and record[6] is True
    assert record[7] == pytest.approx(0.3)  # 0.1 at any load + 0.2 for 1 session over 0
