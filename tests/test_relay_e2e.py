"""Routes by class and tenant through an authenticated smarthost, end to end.

The daemon as a subprocess; a smarthost peer on 127.0.0.5 ("smarthost.test" in the test DNS)
that requires STARTTLS, then AUTH, before MAIL (as a submission port, 587, does), with a
self-signed certificate the daemon trusts through relay_tls_ca; the ordinary MX of the
recipient domains on 127.0.0.2. Retry times are scaled down.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from e2e_helpers import BODY, FAST, MailNet, events, wait_for
from smtp_peer import SmtpPeer, self_signed_cert, self_signed_context

SMARTHOST = "127.0.0.5"
P0 = b"X-Mtaqueue-Class: p0\r\n" + BODY


class World(MailNet):
    """The MX of example.org and example.net, and smarthost.test's address."""

    def __init__(self, start_daemon, tmp_path) -> None:
        super().__init__(["127.0.0.2"])
        (self.mx,) = self.peers
        self.add_domain("example.org", "127.0.0.2", host="mx.example.org")
        self.add_domain("example.net", "127.0.0.2", host="mx.example.org")
        self.dns.add("smarthost.test", "A", SMARTHOST)
        self.tmp = tmp_path
        self.cert, _ = self_signed_cert(tmp_path / "certs", "smarthost.test")
        self.smarthosts: list[SmtpPeer] = []
        self._start_daemon = start_daemon

    def smarthost(self, hostname: str = "smarthost.test", **options) -> SmtpPeer:
        """A smarthost peer; by default STARTTLS and then AUTH (user acct) are required."""
        options = {
            "starttls": self_signed_context(self.tmp / "certs", hostname),
            "require_starttls": True,
            "auth": {"acct": "s3cret"},
            "auth_required": True,
        } | options
        peer = SmtpPeer(SMARTHOST, 0, hostname=hostname, **options).start()
        self.smarthosts.append(peer)
        return peer

    def password(self, text: str, name: str = "acct.password") -> str:
        path = self.tmp / name
        path.write_text(text + "\n")
        return str(path)

    def relay(
        self, table: str, peer: SmtpPeer, user: str = "acct", password: str = "s3cret", **keys
    ) -> list[str]:
        """Overrides that route `table` ("classes.p0", "tenants.shop") through `peer`."""
        keys = {
            "relayhost": f"[smarthost.test]:{peer.port}",
            "relay_user": user,
            "relay_password_file": self.password(password, f"{user}.password"),
            "relay_tls_ca": str(self.cert),
        } | keys
        return [f"{table}.{key}={value}" for key, value in keys.items() if value]

    def daemon(self, *overrides: str):
        return self._start_daemon(*self.daemon_overrides(), *FAST, *overrides)

    def close(self) -> None:
        for peer in self.smarthosts:
            peer.stop()
        super().close()


@pytest.fixture
def world(start_daemon, tmp_path):
    with World(start_daemon, tmp_path) as w:
        yield w


def attempted(daemon, queue_id: str) -> list[dict]:
    """The message's recipients, once each has had an attempt."""

    def done() -> list[dict] | None:
        rcpts = daemon.messages()[queue_id]["recipients"]
        return rcpts if all(r["attempts"] for r in rcpts) else None

    return wait_for(done, what="an attempt")


def destination(daemon, key: str) -> dict:
    result = daemon.ctl("domains", "--json")
    assert result.returncode == 0, result.stderr
    found = [d for d in map(json.loads, result.stdout.splitlines()) if d["destination"] == key]
    assert found, result.stdout
    return found[0]


def test_p0_goes_whole_through_the_authenticated_smarthost_and_p1_to_its_mx(world):
    smarthost = world.smarthost()
    daemon = world.daemon(*world.relay("classes.p0", smarthost))
    key = f"relay:acct@smarthost.test:{smarthost.port}"
    # Recipients in two domains: with a class relay, all of them go to the smarthost.
    daemon.send("app@sender.test", ["a@example.org", "b@example.net"], P0)
    (relayed,) = smarthost.wait_messages(1)
    assert sorted(relayed.rcpt_tos) == ["a@example.org", "b@example.net"]
    assert relayed.auth_user == "acct" and relayed.tls
    (attempt,) = smarthost.auth_attempts
    assert attempt.ok and attempt.tls and attempt.mechanism == "PLAIN"  # PLAIN when offered

    daemon.send("app@sender.test", ["c@example.org"], BODY)  # p1: its domain's MX
    (direct,) = world.mx.wait_messages(1)
    assert direct.rcpt_tos == ["c@example.org"] and direct.auth_user is None
    assert len(smarthost.messages) == 1

    delivered = wait_for(
        lambda: len(events(daemon, "delivery")) == 3 and events(daemon, "delivery")
    )
    mx = f"mx.example.org:{world.mx.port}"  # (delivery.port: the test's)
    assert sorted(e["destination"] for e in delivered) == sorted([key, key, mx])
    assert destination(daemon, key)["relay"] == "classes.p0"


def test_a_tenant_has_its_own_account_and_a_class_relay_wins_over_it(world):
    smarthost = world.smarthost(auth={"acct": "s3cret", "shop": "sh0p"})
    daemon = world.daemon(
        "submission.tenant_header=X-Tenant",
        *world.relay("classes.p0", smarthost),
        *world.relay("tenants.shop", smarthost, user="shop", password="sh0p"),
    )
    shop = b"X-Tenant: shop\r\n"
    daemon.send("app@sender.test", ["a@example.org"], shop + BODY)  # p1 of shop: its relay
    daemon.send("app@sender.test", ["b@example.org"], shop + P0)  # p0 of shop: p0's relay
    daemon.send("app@sender.test", ["c@example.org"], b"X-Tenant: blog\r\n" + BODY)  # its MX
    smarthost.wait_messages(2)
    world.mx.wait_messages(1)
    by_rcpt = {m.rcpt_tos[0]: m.auth_user for m in smarthost.messages}
    assert by_rcpt == {"a@example.org": "shop", "b@example.org": "acct"}
    assert [m.rcpt_tos for m in world.mx.messages] == [["c@example.org"]]
    # Two accounts, two destinations: each its own pacing and breaker.
    wait_for(lambda: len(events(daemon, "delivery")) == 3)
    names = {e["destination"] for e in events(daemon, "delivery")}
    port = smarthost.port
    assert names == {
        f"relay:shop@smarthost.test:{port}",
        f"relay:acct@smarthost.test:{port}",
        f"mx.example.org:{world.mx.port}",
    }


def test_implicit_tls_smarthost_and_auth_login(world):
    context = self_signed_context(world.tmp / "certs", "smarthost.test")
    smarthost = world.smarthost(
        starttls=None, require_starttls=False, implicit_tls=context, auth_mechanisms=("LOGIN",)
    )
    # Port 465 would be implicit by itself ("auto"); the test's port needs saying so.
    daemon = world.daemon(*world.relay("classes.p0", smarthost, relay_tls="implicit"))
    daemon.send("app@sender.test", ["a@example.org"], P0)
    (relayed,) = smarthost.wait_messages(1)
    assert relayed.auth_user == "acct" and relayed.tls
    (attempt,) = smarthost.auth_attempts
    assert attempt.ok and attempt.mechanism == "LOGIN"  # the only one offered
    assert "starttls" not in [entry.phase for entry in smarthost.log]


def test_wrong_password_defers_stops_the_relay_and_a_reload_with_the_right_one_sends(world):
    smarthost = world.smarthost()
    daemon = world.daemon(*world.relay("classes.p0", smarthost, password="Wr0ng-pa55"))
    key = f"relay:acct@smarthost.test:{smarthost.port}"
    first = daemon.send("app@sender.test", ["a@example.org"], P0)
    refused = daemon.wait_event("relay_auth_failed")
    assert refused["destination"] == key and refused["relay"] == "classes.p0"
    assert refused["reply"].startswith("535 ") and "Wr0ng-pa55" not in json.dumps(daemon.events)
    (rcpt,) = attempted(daemon, first)
    assert rcpt["state"] == "deferred" and rcpt["last_reply"].startswith("535 ")
    assert destination(daemon, key)["circuit"] == "open"
    # The relay is left alone while its circuit is open: the next p0 mail waits, no login.
    second = daemon.send("app@sender.test", ["b@example.org"], P0)
    time.sleep(1.5)
    assert len(smarthost.auth_attempts) == 1 and smarthost.transactions == 0
    assert not events(daemon, "dsn_queued")  # nothing bounced

    (world.tmp / "acct.password").write_text("s3cret\n")
    daemon.proc.send_signal(signal.SIGHUP)
    daemon.wait_event("relay_reconfigured")
    wait_for(lambda: len(smarthost.messages) == 2, timeout=30, what="both after the reload")
    assert {m.auth_user for m in smarthost.messages} == {"acct"}
    wait_for(lambda: not {first, second} & daemon.messages().keys())
    assert not events(daemon, "dsn_queued")


def test_a_smarthost_without_starttls_never_sees_the_password(world):
    # AUTH offered in clear text, as a careless server might: it must not be used.
    smarthost = world.smarthost(starttls=None, require_starttls=False, auth_require_tls=False)
    daemon = world.daemon(*world.relay("classes.p0", smarthost))
    queue_id = daemon.send("app@sender.test", ["a@example.org"], P0)
    failed = daemon.wait_event("relay_tls_failed")
    assert "does not offer TLS" in failed["reply"]
    (rcpt,) = attempted(daemon, queue_id)
    assert rcpt["state"] == "deferred"
    assert smarthost.auth_attempts == [] and smarthost.transactions == 0
    assert "auth" not in [entry.phase for entry in smarthost.log]
    assert not events(daemon, "dsn_queued")


@pytest.mark.parametrize("problem", ["untrusted", "other name"])
def test_a_smarthost_certificate_that_does_not_verify_gets_no_password(world, problem):
    if problem == "untrusted":  # a self-signed certificate, checked against the system CAs
        smarthost = world.smarthost()
        overrides = world.relay("classes.p0", smarthost, relay_tls_ca="")
    else:  # trusted, but for another name than the relayhost's
        smarthost = world.smarthost(hostname="elsewhere.test")
        cert, _ = self_signed_cert(world.tmp / "certs", "elsewhere.test")
        overrides = world.relay("classes.p0", smarthost, relay_tls_ca=str(cert))
    daemon = world.daemon(*overrides)
    queue_id = daemon.send("app@sender.test", ["a@example.org"], P0)
    failed = daemon.wait_event("relay_tls_failed")
    assert "certificate verify failed" in failed["reply"]
    (rcpt,) = attempted(daemon, queue_id)
    assert rcpt["state"] == "deferred"
    assert smarthost.auth_attempts == [] and smarthost.transactions == 0


def test_an_unreadable_password_file_stops_the_start(tmp_path):
    missing = tmp_path / "nope.password"
    result = subprocess.run(
        [sys.executable, "-m", "mtaqueue.daemon",
         "-o", "classes.p0.relayhost=[smtp.esp.example]:587",
         "-o", "classes.p0.relay_user=acct",
         "-o", f"classes.p0.relay_password_file={missing}"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith("mtaqueue: classes.p0.relay_password_file: cannot read")
    assert len(result.stderr.strip().splitlines()) == 1
