"""TLS-RPT (RFC 8460) end to end: the daemon as a subprocess, a domain under MTA-STS
enforce whose MX presents a certificate from the trusted test CA for another name, and
its `_smtp._tls` record naming an https: collector (the policy server's /tlsrpt) or a
mailto: address whose MX is a test SMTP peer. `mtaqueue-ctl tls-report send --today`
sends today's report without waiting for the day to end.

Peers: 127.0.0.2 has a certificate for its MX names (mx.example.net, mx.reports.example);
127.0.0.6 one for wrong.example, the MX of example.org.
"""

from __future__ import annotations

import base64
import gzip
import json
from pathlib import Path

import pytest
from dkim_keys import write_key
from e2e_helpers import BODY, FAST, MailNet, events, wait_for
from policy_server import PolicyServer, TestCa, policy_text
from smtp_peer import SmtpPeer

GOOD, MISNAMED = "127.0.0.2", "127.0.0.6"
COLLECTOR = "tlsrpt.example.org"


class World(MailNet):
    def __init__(self, start_daemon, tmp_path) -> None:
        self.ca = TestCa(tmp_path / "ca")
        self.tmp_path = tmp_path
        super().__init__(
            [GOOD], starttls=self.ca.server_context("mx.example.net", "mx.reports.example")
        )
        (self.good,) = self.peers
        self.misnamed = SmtpPeer(
            MISNAMED, self.good.port, starttls=self.ca.server_context("wrong.example")
        ).start()
        self.web = PolicyServer(
            "127.0.0.3", self.ca.server_context("mta-sts.example.org", COLLECTOR)
        )
        self.web.start()
        self.dns.add(COLLECTOR, "A", self.web.host)
        # example.org: enforce; its MX's certificate names another host.
        self.dns.add("example.org", "MX", "10 mx.example.org")
        self.dns.add("mx.example.org", "A", MISNAMED)
        self.dns.add("_mta-sts.example.org", "TXT", '"v=STSv1; id=1;"')
        self.dns.add("mta-sts.example.org", "A", self.web.host)
        self.web.policies["example.org"] = policy_text("enforce", "mx.example.org")
        # example.net: no policy, good TLS, no _smtp._tls record (no report).
        self.add_domain("example.net", GOOD)
        self.add_domain("reports.example", GOOD)
        self._start_daemon = start_daemon

    def rua(self, uri: str) -> None:
        self.dns.add("_smtp._tls.example.org", "TXT", f'"v=TLSRPTv1; rua={uri}"')

    def daemon(self, *overrides: str):
        return self._start_daemon(
            *self.daemon_overrides(),
            *FAST,
            f"mta_sts.ca_file={self.ca.path}",
            f"mta_sts.https_port={self.web.port}",
            "tls_rpt.enabled=true",
            "tls_rpt.organization=Sender Test",
            "tls_rpt.from=tlsrpt@sender.test",
            *overrides,
        )

    def close(self) -> None:
        self.web.stop()
        self.misnamed.stop()
        super().close()


@pytest.fixture
def world(start_daemon, tmp_path):
    with World(start_daemon, tmp_path) as w:
        yield w


def _failed_and_delivered(world: World, daemon) -> None:
    daemon.send("app@sender.test", ["a@example.org"], BODY)
    daemon.send("app@sender.test", ["b@example.net"], BODY)
    world.good.wait_messages(1)
    wait_for(
        lambda: any(e["rcpt"] == "a@example.org" for e in events(daemon, "delivery")),
        what="the deferral of a@example.org",
    )
    assert not world.misnamed.messages  # enforce: never without a valid certificate


def _send_reports(daemon) -> list[dict]:
    result = daemon.ctl("tls-report", "send", "--today", "--json")
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def _starttls_clients(world: World) -> set[str]:
    """The client addresses the misnamed MX saw at STARTTLS (its end of those sessions)."""
    clients = {e.client_ip for e in world.misnamed.log if e.phase == "starttls"}
    assert clients
    return clients


def _check_report(document: dict, clients: set[str]) -> None:
    assert document["organization-name"] == "Sender Test"
    assert document["contact-info"] == "tlsrpt@sender.test"
    assert document["date-range"]["start-datetime"].endswith("T00:00:00Z")
    (entry,) = document["policies"]
    assert entry["policy"]["policy-type"] == "sts"
    assert entry["policy"]["policy-domain"] == "example.org"
    assert entry["policy"]["mx-host"] == ["mx.example.org"]
    assert "mode: enforce" in entry["policy"]["policy-string"]
    assert entry["summary"]["total-successful-session-count"] == 0
    assert entry["summary"]["total-failure-session-count"] >= 1
    (detail,) = entry["failure-details"]
    assert detail["result-type"] == "certificate-host-mismatch", detail
    assert detail["receiving-mx-hostname"] == "mx.example.org"
    assert detail["receiving-ip"] == MISNAMED
    assert detail["sending-mta-ip"] in clients  # RFC 8460 4.4: our end of the session
    assert "Hostname mismatch" in detail["failure-reason-code"]


def test_https_report_of_a_certificate_host_mismatch(world):
    world.rua(f"https://{COLLECTOR}:{world.web.port}/tlsrpt")
    daemon = world.daemon()
    _failed_and_delivered(world, daemon)
    world.web.report_status = 503  # the first try fails: kept for a retry

    first = {r["domain"]: r for r in _send_reports(daemon)}
    assert first["example.net"]["result"] == "no _smtp._tls record"
    failed = first["example.org"]
    assert failed["result"] == "failed, will retry", failed
    assert "HTTP 503" in failed["errors"][failed["rua"][0]]
    assert daemon.wait_event("tls_report_failed")["report_id"] == failed["report_id"]
    world.web.report_status = 201
    sent = {r["domain"]: r for r in _send_reports(daemon)}
    assert sent["example.org"]["result"] == "sent", sent
    assert sent["example.org"]["report_id"] == failed["report_id"]  # the same report
    assert "example.net" not in sent  # no _smtp._tls record: dropped at the first try
    (report,) = world.web.reports
    content_type, body = report
    assert content_type == "application/tlsrpt+gzip"
    document = json.loads(gzip.decompress(body))
    _check_report(document, _starttls_clients(world))
    assert document["report-id"] == sent["example.org"]["report_id"]
    assert daemon.wait_event("tls_report_sent")["domain"] == "example.org"


def test_mailto_report_is_queued_and_delivered_counts_kept_over_a_restart(world):
    world.rua("mailto:tls@reports.example")
    daemon = world.daemon()
    (unsigned,) = events(daemon, "tls_rpt_unsigned")  # no key signs tlsrpt@sender.test
    assert unsigned["sender"] == "tlsrpt@sender.test", unsigned
    _failed_and_delivered(world, daemon)
    daemon.stop()
    saved = json.loads((Path(daemon.spool) / "tls_reports.json").read_bytes())
    (day,) = saved.values()
    assert set(day) == {"example.org", "example.net"}
    # The counts come from tls_reports.json; a key for sender.test signs the report now.
    key = write_key(world.tmp_path, "ed25519-sha256")
    daemon = world.daemon(
        "dkim.sender.test.selector=s1",
        f"dkim.sender.test.key_file={key}",
        "dkim.sender.test.algorithm=ed25519-sha256",
    )
    assert events(daemon, "tls_rpt_unsigned") == []

    sent = {r["domain"]: r for r in _send_reports(daemon)}
    assert sent["example.org"]["result"] == "sent", sent
    received = wait_for(
        lambda: next(
            (m for m in world.good.messages if m.rcpt_tos == ["tls@reports.example"]), None
        ),
        what="the report mail",
    )
    assert received.mail_from == "tlsrpt@sender.test"
    message = received.message
    assert "d=sender.test;" in message["DKIM-Signature"]
    assert message.get_content_type() == "multipart/report"
    assert message.get_param("report-type") == "tlsrpt"
    report_id = sent["example.org"]["report_id"]
    assert message["Subject"] == (
        f"Report Domain: example.org Submitter: {message['TLS-Report-Submitter']}"
        f" Report-ID: <{report_id}>"
    )
    attachment = message.get_payload()[1]
    assert attachment.get_content_type() == "application/tlsrpt+gzip"
    assert attachment.get_filename().startswith(f"{message['TLS-Report-Submitter']}!example.org!")
    document = json.loads(gzip.decompress(base64.b64decode(attachment.get_payload())))
    _check_report(document, _starttls_clients(world))


def test_a_report_to_the_failing_domain_itself_is_delivered_and_not_counted(world):
    """RFC 8460 3: report mail is delivered despite TLS failures, and its session is not
    in the next report. example.org's own MX fails its enforce policy (a certificate for
    another name), and its report goes to an address at example.org: the mail of others
    waits, the report goes to that MX, and no session of it is counted."""
    world.rua("mailto:tls@example.org")
    daemon = world.daemon()
    _failed_and_delivered(world, daemon)
    held = daemon.ctl("hold", "--all", "--json")  # no more tries of a@example.org
    assert held.returncode == 0 and json.loads(held.stdout) == {"held": 1}, held
    sent = {r["domain"]: r for r in _send_reports(daemon)}
    assert sent["example.org"]["result"] == "sent", sent
    received = world.misnamed.wait_messages(1)
    assert received[0].rcpt_tos == ["tls@example.org"]
    assert received[0].message.get_param("report-type") == "tlsrpt"
    (delivered,) = wait_for(
        lambda: [e for e in events(daemon, "delivery") if e["rcpt"] == "tls@example.org"],
        what="the report's delivery event",
    )
    assert delivered["outcome"] == "delivered" and delivered["attempt"] == 1
    (other,) = wait_for(
        lambda: len(q := daemon.messages()) == 1 and q, what="the report gone"
    ).values()
    # a@example.org still waits for valid TLS (held)
    assert [r["address"] for r in other["recipients"]] == ["a@example.org"]
    daemon.stop()
    saved = json.loads((Path(daemon.spool) / "tls_reports.json").read_bytes())
    # Reported, and the report's session (TLS, unverified: it would count as a success)
    # not counted since; a try of a@example.org in flight as it was held may be.
    after = [day["example.org"] for day in saved.values() if "example.org" in day]
    assert not any(p["successes"] for entry in after for p in entry["policies"].values()), saved
