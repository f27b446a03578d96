"""Delivery to peers that misbehave: the daemon, the test DNS and real (scripted) SMTP peers.

Whatever a peer does, nothing is recorded delivered that the peer did not take with a 2xx
to the final dot, every attempt is charged and classified, and a session in doubt (a
timeout, a reply out of step, garbage) never carries another command.
"""

from __future__ import annotations

import re
import time

import pytest
from e2e_helpers import BODY, FAST, MailNet, events, wait_for
from smtp_peer import Late, Raw, SmtpPeer

QUEUE_ID = re.compile(rb"\(mtaqueue\) with \S+ id (\S+)")
ONE_CONNECTION = (
    "shaping.default.max_connections=1",
    "shaping.default.initial_connections=1",
    "shaping.default.reserved_p0=0",
)
QUICK = (
    "delivery.timeouts.banner=1s",
    "delivery.timeouts.mail=1s",
    "delivery.timeouts.rcpt=1s",
    "delivery.timeouts.data_start=1s",
    "delivery.timeouts.data_done=1s",
)


@pytest.fixture
def net(start_daemon):
    """One peer (mx.faulty.test, the only MX) and the sender's home for DSNs."""
    with MailNet(["127.0.0.2", "127.0.0.9"]) as net:
        net.add_domain("faulty.test", "127.0.0.2")
        net.add_domain("sender.test", "127.0.0.9")
        net.peer, net.home = net.peers
        net.daemon = lambda *o: start_daemon(*net.daemon_overrides(), *FAST, *o)
        yield net


def taken(peer: SmtpPeer) -> dict[str, int]:
    """Queue id -> copies the peer answered with a 2xx after the final dot."""
    copies: dict[str, int] = {}
    for received in list(peer.messages):
        if received.replied and received.reply.startswith("2"):
            queue_id = QUEUE_ID.search(received.content)[1].decode()
            copies[queue_id] = copies.get(queue_id, 0) + 1
    return copies


def assert_honest(daemon, peer: SmtpPeer) -> None:
    """Every delivery the daemon recorded is one the peer took (a real 2xx after the dot)."""
    delivered = {e["id"] for e in events(daemon, "delivery") if e["outcome"] == "delivered"}
    assert delivered <= set(taken(peer)), (delivered, taken(peer))


@pytest.mark.parametrize(
    ("step", "reply"),
    [("banner", "250 mx.faulty.test hi"), ("mail", "252 2.1.0 Ok"), ("data", "250 2.0.0 Ok")],
)
def test_a_2xx_out_of_step_is_a_protocol_error_not_a_delivery(net, step, reply):
    if step == "banner":
        net.peer.banner = reply
    else:
        net.peer.on(step, reply)
    daemon = net.daemon()
    queue_id = daemon.send("app@sender.test", ["bob@faulty.test"], BODY)
    first = wait_for(lambda: events(daemon, "delivery"), what="the first attempt")[0]
    assert first["outcome"] == "transient" and first["kind"] == "protocol"
    assert first["phase"] == step and first["code"] == int(reply[:3])
    rcpt = daemon.messages()[queue_id]["recipients"][0]
    assert rcpt["state"] == "deferred" and rcpt["attempts"] == 1
    suspended = wait_for(lambda: events(daemon, "host_suspended"))[0]
    assert suspended["host"] == "mx.faulty.test"
    # Nothing more was said on that connection: its state is in doubt.
    commands = [e.phase for e in net.peer.log if e.connection == 1]
    assert commands[commands.index(step) + 1 :] in ([], ["close"])
    assert net.peer.messages == []
    # The peer mends its ways: the message goes, once.
    if step == "banner":
        net.peer.banner = "220 mx.faulty.test ESMTP"
    else:
        net.peer.on(step, None)
    wait_for(lambda: not daemon.messages(), timeout=20, what="the retry")
    assert taken(net.peer) == {queue_id: 1}
    assert_honest(daemon, net.peer)


@pytest.mark.parametrize(
    ("policy", "garbage"),
    [
        ("retry", Raw(b"this is no reply\r\n")),
        ("retry", Raw(b"250 " + b"x" * 9000 + b"\r\n")),  # a reply over aiosmtplib's limit
        ("assume-delivered", Raw(b"this is no reply\r\n")),
    ],
)
def test_garbage_after_the_dot_is_ambiguous_and_charged(net, policy, garbage):
    net.peer.on("data_end", garbage, times=1)
    daemon = net.daemon(f"delivery.ambiguous={policy}")
    queue_id = daemon.send("app@sender.test", ["bob@faulty.test"], BODY)
    first = wait_for(lambda: events(daemon, "delivery"), what="the first attempt")[0]
    assert first["phase"] == "data_end" and first["attempt"] == 1
    if policy == "retry":
        assert first["outcome"] == "ambiguous" and first["network"] == "protocol"
        wait_for(lambda: not daemon.messages(), timeout=20, what="the retry")
        assert len(net.peer.messages) + len(net.peer.rejected) == 2  # the price: a duplicate
        assert_honest(daemon, net.peer)
    else:
        assert first["outcome"] == "delivered" and first["kind"] == "ambiguous"
        wait_for(lambda: not daemon.messages(), what="assumed delivery")
        time.sleep(1)
        assert len(net.peer.rejected) == 1 and net.peer.messages == []
    assert not events(daemon, "attempt_failed")
    assert queue_id


def test_a_late_reply_to_the_dot_is_never_read_as_the_next_reply(net):
    # Pre-fix the connection was reused after the data_done timeout: the late 250 answered
    # the next MAIL, every reply after it shifted by one, and a message never sent was
    # logged delivered.
    net.peer.on("data_end", Late(2.5, "250 2.0.0 Ok: late"), times=1)
    daemon = net.daemon(*ONE_CONNECTION, "delivery.timeouts.data_done=1s")
    ids = [daemon.send("app@sender.test", [f"r{i}@faulty.test"], BODY) for i in range(3)]
    wait_for(lambda: not daemon.messages(), timeout=30, what="all three")
    assert_honest(daemon, net.peer)
    copies = taken(net.peer)
    assert set(copies) == set(ids)
    ambiguous = [e for e in events(daemon, "delivery") if e["outcome"] == "ambiguous"]
    assert len(ambiguous) == 1 and copies[ambiguous[0]["id"]] == 2  # retried: a duplicate
    late = next(e.connection for e in net.peer.log if e.reply == "250 2.0.0 Ok: late")
    assert [e.phase for e in net.peer.log if e.connection == late][-2:] == ["data_end", "close"]


def test_hangs_are_charged_and_end_their_connection(net):
    net.peer.hang("mail", times=1)
    net.peer.hang("data_end", times=1)
    daemon = net.daemon(*ONE_CONNECTION, *QUICK)
    ids = [daemon.send("app@sender.test", [f"h{i}@faulty.test"], BODY) for i in range(2)]
    wait_for(lambda: not daemon.messages(), timeout=40, what="both, after the hangs")
    assert_honest(daemon, net.peer)
    assert set(taken(net.peer)) == set(ids)
    attempts = events(daemon, "delivery")
    failed = [e for e in attempts if e["outcome"] != "delivered"]
    assert sorted((e["phase"], e["network"]) for e in failed) == [
        ("data_end", "timeout"),
        ("mail", "timeout"),
    ]
    for queue_id in ids:  # every attempt charged, none lost
        counted = [e["attempt"] for e in attempts if e["id"] == queue_id]
        assert counted == list(range(1, len(counted) + 1))
    # A hung connection carries nothing more.
    for entry in [e for e in net.peer.log if e.reply == "hang"]:
        after = [e.phase for e in net.peer.log if e.connection == entry.connection]
        assert after[after.index(entry.phase) + 1 :] in ([], ["close"])


def test_421_to_rset_is_logged_and_ends_the_session(net):
    net.peer.on("mail", "451 4.3.0 local problem", times=1)
    net.peer.on("rset", "421 4.7.0 too many errors, closing", times=1)
    daemon = net.daemon()
    queue_id = daemon.send("app@sender.test", ["bob@faulty.test"], BODY)
    failed = wait_for(lambda: events(daemon, "rset_failed"), what="the RSET refusal logged")[0]
    assert failed["host"] == "mx.faulty.test" and failed["reply"].startswith("421 4.7.0")
    wait_for(lambda: not daemon.messages(), timeout=20, what="the retry")
    assert taken(net.peer) == {queue_id: 1}
    assert net.peer.connections == 2


def test_hosts_on_one_address_and_different_ports_are_suspended_apart(start_daemon):
    with MailNet(["127.0.0.2"]) as net:
        (working,) = net.peers
        broken = SmtpPeer("127.0.0.2", 0).start()
        broken_port = broken.port
        broken.stop()  # nothing listens there: connections are refused
        daemon = start_daemon(
            *net.daemon_overrides(),
            *FAST,
            "delivery.host_suspend=60s",
            f"routes.broken.test=[127.0.0.2]:{broken_port}",
            f"routes.working.test=[127.0.0.2]:{working.port}",
        )
        daemon.send("app@sender.test", ["a@broken.test"], BODY)
        wait_for(lambda: events(daemon, "host_suspended"), what="the broken port suspended")
        queue_id = daemon.send("app@sender.test", ["b@working.test"], BODY)
        wait_for(lambda: taken(working), timeout=10, what="delivery on the other port")
        assert taken(working) == {queue_id: 1}
        (suspended,) = events(daemon, "host_suspended")
        assert (suspended["host"], suspended["port"]) == ("127.0.0.2", broken_port)


def test_a_repeated_wait_on_suspended_hosts_is_charged_with_the_reason(net):
    net.peer.refuse_connections()
    daemon = net.daemon(*ONE_CONNECTION, "delivery.host_suspend=2s")
    daemon.send("app@sender.test", ["first@faulty.test"], BODY)
    wait_for(lambda: events(daemon, "host_suspended"), what="the host suspended")
    waiting = [daemon.send("app@sender.test", [f"w{i}@faulty.test"], BODY) for i in range(3)]
    # Released, the host fails the first of them again: the others, suspended once more,
    # are charged an attempt that says why, rather than waiting uncharged again.
    charged = wait_for(
        lambda: [
            e
            for e in events(daemon, "delivery")
            if e["id"] in waiting and "temporarily suspended" in e["text"]
        ],
        timeout=20,
        what="a repeated wait charged",
    )
    assert charged[0]["outcome"] == "transient" and charged[0]["attempt"] == 1
    assert (charged[0]["phase"], charged[0]["network"]) == ("connect", "refused")
    assert charged[0]["text"].startswith("127.0.0.2 refused (delivery to mx.faulty.test:")
    rcpt = daemon.messages()[charged[0]["id"]]["recipients"][0]
    assert rcpt["attempts"] >= 1 and "temporarily suspended" in rcpt["last_reply"]
