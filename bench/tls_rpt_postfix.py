"""TLS-RPT (RFC 8460) against software we did not write: Unbound for the DNS, a private
Postfix as the recipient domains' MX host and as the reports' mailto: collector, parsedmarc
reading the report mail Postfix stored, dkimpy verifying its signature.

    python bench/tls_rpt_postfix.py [--keep]

Requirements: root, Debian's postfix and unbound packages, openssl, dkimpy (a test
dependency) and parsedmarc (`pip install parsedmarc`; the bench's alone, not the project's).
Loopback only; parsedmarc runs offline (no DNS, no downloads).

One Unbound (bench/unbound_instance.py) serves every zone: each recipient domain's MX and
A records, rcpt-sts.test's `_mta-sts` TXT and `mta-sts.` A record (its policy, mode
testing, served by `openssl s_server -WWW`: mta_sts_unbound.PolicyHost), the `_smtp._tls`
TXT `v=TLSRPTv1; rua=mailto:tlsrpt@reports.test` of rcpt-sts.test and rcpt-plain.test
(rcpt-norpt.test has none), reports.test's MX, and the DKIM key of sender.test (the
reports' From). Every MX host is one Postfix instance (tests/postfix_instance.py, receive
mode): it discards the recipient domains' mail and delivers reports.test's to a Maildir
(virtual(8)). Its STARTTLS certificate changes between three phases (a restart each, once
every session has ended): one from the CA mtaqueue trusts (mta_sts.ca_file) for another
name, then one for the MX name from another CA, then a good one; so under the testing
policy rcpt-sts.test's sessions fail verification (certificate-host-mismatch, then
certificate-not-trusted; the mail still goes, over unverified TLS) and then succeed.
rcpt-plain.test and rcpt-norpt.test (no policy) get opportunistic TLS in the last phase.

The daemon (this tree's code) runs on the shipped conf/mtaqueue.toml with only what this
needs on top: dns.nameservers, delivery.port, mta_sts.ca_file and https_port, [tls_rpt]
(enabled, organization, contact, from), a DKIM key for sender.test, and a source pool
(127.0.0.9, for class p1: the test mail's and the report mail's) so that the sending IP
is not the receiving one. Then `mtaqueue-ctl tls-report send --today`; the report mails go
through Postfix into its Maildir; parsedmarc.parse_report_email() must take each as an
SMTP TLS report whose figures are what Postfix's maillog says happened: sessions that
completed TLS (successes), handshakes that failed (by phase: the result type), the
client IP Postfix logged (sending-mta-ip), its own address (receiving-ip), the MX name;
and the organization, contact, report id, UTC day and the policy served (its mx-host
from the JSON itself: parsedmarc looks for a key "mx-host-pattern", RFC 8460 4.4's is
"mx-host"). The message's structure is checked against RFC 8460 5.3 (multipart/report;
report-type="tlsrpt", the TLS-Report-Domain and TLS-Report-Submitter fields, the
Subject, the gzip'd application/tlsrpt+gzip attachment and its filename's ABNF), and
dkimpy verifies its DKIM signature (no l=, RFC 8460 3) with the key from Unbound. Prints
a Markdown table; exits 1 if any check fails, 2 without root, Postfix, Unbound, openssl
or parsedmarc.
"""

from __future__ import annotations

import argparse
import calendar
import contextlib
import email
import email.policy
import gzip
import json
import re
import shutil
import smtplib
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))  # policy_server.TestCa
sys.path.insert(0, str(REPO))
import dkim  # noqa: E402
from common import dkim_key, free_port, print_checks, work_directory  # noqa: E402
from mta_sts_unbound import (  # noqa: E402
    PolicyHost,
    Session,
    describe,
    sessions,
    sts_record,
    unbound_txt,
    wait_until,
)
from policy_server import TestCa, policy_text  # noqa: E402
from postfix_instance import PostfixInstance, postfix_available  # noqa: E402
from postfix_smarthost import Mtaqueue  # noqa: E402
from unbound_instance import UnboundInstance, txt, unbound_available  # noqa: E402

from mtaqueue.config import load  # noqa: E402
from mtaqueue.dkim.keys import load_keys  # noqa: E402

LOCAL = "127.0.0.1"  # Postfix's only bindable loopback address: every MX host is here
SOURCE = "127.0.0.9"  # mtaqueue's source address (a pool), as Postfix must log it
POLICY_IP = "127.0.0.21"  # mta-sts.rcpt-sts.test (s_server)
STS, PLAIN, NORPT = "rcpt-sts.test", "rcpt-plain.test", "rcpt-norpt.test"
REPORTS, SENDER_DOMAIN = "reports.test", "sender.test"
RUA = f"mailto:tlsrpt@{REPORTS}"
SUBMITTER = "mtaqueue.test"  # listen.hostname (postfix_smarthost.Mtaqueue sets it)
ORGANIZATION, CONTACT = "Sender Test Ltd", f"tls-admin@{SENDER_DOMAIN}"
REPORT_FROM, SELECTOR = f"tlsrpt@{SENDER_DOMAIN}", "tlsrpt2026"
SENDER = f"app@{SENDER_DOMAIN}"
BODY = b"From: App <app@sender.test>\r\nSubject: tls-rpt\r\n\r\nyour code is 123456\r\n"
POLICY = policy_text("testing", f"mx.{STS}")
# RFC 8460 5.3: sender "!" policy-domain "!" begin-timestamp "!" end-timestamp
# [ "!" unique-id ] "." extension; unique-id = 1*(ALPHA / DIGIT).
FILENAME = re.compile(
    r"(?P<sender>[A-Za-z0-9.-]+)!(?P<domain>[A-Za-z0-9.-]+)!(?P<begin>\d+)!(?P<end>\d+)"
    r"(?:!(?P<unique>[A-Za-z0-9]+))?\.json\.gz"
)


def mx(domain: str) -> str:
    return f"mx.{domain}"


@dataclass(frozen=True)
class Phase:
    name: str
    certificate: str  # key of the certificates made in servers()
    result_type: str  # what a failed verification of rcpt-sts.test's MX is reported as
    mail: tuple[tuple[str, int], ...]  # (domain, messages), one domain after the other


PHASES = (
    Phase("mismatch", "wrong-name", "certificate-host-mismatch", ((STS, 2),)),
    Phase("untrusted", "other-ca", "certificate-not-trusted", ((STS, 1),)),
    Phase("good", "good", "", ((STS, 3), (PLAIN, 2), (NORPT, 1))),
)


@dataclass
class Row:
    number: str
    check: str
    mtaqueue: str
    third_party: str
    ok: bool


# -- the third-party servers ---------------------------------------------------------------


def zones(dkim_record: str) -> dict[str, list[str]]:
    """Each recipient domain's MX (on Postfix) and `_smtp._tls`; rcpt-sts.test's MTA-STS
    records; reports.test's MX; sender.test's DKIM key (a zone file line)."""
    out: dict[str, list[str]] = {}
    for domain in (STS, PLAIN, NORPT, REPORTS):
        out[domain] = [f"{domain}. 300 IN MX 10 {mx(domain)}.", f"{mx(domain)}. 300 IN A {LOCAL}"]
    for domain in (STS, PLAIN):
        out[domain].append(txt(f"_smtp._tls.{domain}.", f"v=TLSRPTv1; rua={RUA}"))
    out[STS] += [sts_record(STS, "1"), f"mta-sts.{STS}. 300 IN A {POLICY_IP}"]
    out[SENDER_DOMAIN] = [dkim_record]
    return out


@dataclass
class Servers:
    dns: UnboundInstance
    postfix: PostfixInstance
    policy: PolicyHost
    ca: TestCa
    https_port: int
    certificates: dict[str, tuple[Path, Path]]
    dkim_override: str


@contextlib.contextmanager
def servers(workdir: Path, keep: bool) -> Iterator[Servers]:
    ca, other_ca = TestCa(workdir / "ca"), TestCa(workdir / "other-ca")
    certificates = {
        "wrong-name": ca.issue("wrong.name.test"),
        "other-ca": other_ca.issue(mx(STS)),
        "good": ca.issue(*(mx(d) for d in (STS, PLAIN, NORPT, REPORTS))),
    }
    for files in certificates.values():
        for path in files:
            path.chmod(0o600)  # smtpd reads them as root, before dropping privileges
    key_file = dkim_key(workdir, "rsa-sha256")
    override = f'dkim.{SENDER_DOMAIN}={{selector = "{SELECTOR}", key_file = "{key_file}"}}'
    record = load_keys(load(None, [override]).dkim)[SENDER_DOMAIN][0].record()
    https_port = free_port(POLICY_IP)
    with contextlib.ExitStack() as stack:
        dns = stack.enter_context(
            UnboundInstance(workdir, zones(txt(f"{SELECTOR}._domainkey.{SENDER_DOMAIN}.", record)))
        )
        cert, key = ca.issue(f"mta-sts.{STS}")
        policy = PolicyHost(workdir / "www" / STS, POLICY_IP, https_port, cert, key)
        stack.callback(policy.stop)
        policy.publish(POLICY)
        wrong = certificates[PHASES[0].certificate]
        postfix = stack.enter_context(
            PostfixInstance(
                workdir / "postfix",
                listen=f"{LOCAL}:{free_port(LOCAL)}",
                mode="receive",
                domains=(STS, PLAIN, NORPT),
                mailboxes=(REPORTS,),
                tls_cert=wrong[0],
                tls_key=wrong[1],
                cleanup=not keep,
            )
        )
        yield Servers(dns, postfix, policy, ca, https_port, certificates, override)


def daemon(workdir: Path, s: Servers) -> Mtaqueue:
    return Mtaqueue(
        workdir / "mtaqueue",
        f'dns.nameservers=["{s.dns.address}"]',
        f"delivery.port={s.postfix.port}",
        f"mta_sts.ca_file={s.ca.path}",
        f"mta_sts.https_port={s.https_port}",
        "tls_rpt.enabled=true",
        f"tls_rpt.organization={ORGANIZATION}",
        f"tls_rpt.contact={CONTACT}",
        f"tls_rpt.from={REPORT_FROM}",
        s.dkim_override,
        f'pools.out.sources=["{SOURCE}"]',
        "classes.p1.pool=out",  # submission.default_class and dsn.class (the report mail)
        config=REPO / "conf" / "mtaqueue.toml",  # the shipped config, its timers
        retry=None,
    )


# -- what Postfix logged -------------------------------------------------------------------


def settled(maillog: Path, offset: int, accepted: set[str], timeout: float = 30) -> list[Session]:
    """The smtpd sessions since `offset`, once every one of them has ended (mtaqueue
    closes an idle connection after delivery.connection_idle) and `accepted` are all in."""

    def done() -> bool:
        log = sessions(maillog, offset)
        return all(s.commands for s in log) and accepted <= {r for s in log for r in s.accepted}

    wait_until(done, timeout, "Postfix's sessions to end")
    return sessions(maillog, offset)


def tls_problems(maillog: Path, offset: int) -> list[str]:
    """smtpd's "TLS library problem" warnings since `offset` (the alert the client sent)."""
    with open(maillog, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    found = re.findall(r"smtpd\[\d+\]: warning: TLS library problem: (.*)", text)
    return list(dict.fromkeys(re.sub(r"^error:\w+:", "", p) for p in found))


@dataclass
class Expected:
    """One domain's sessions as Postfix saw them: the report's figures must be these."""

    successes: int = 0
    failures: Counter | None = None  # (result type, client IP) -> failed handshakes

    def __post_init__(self) -> None:
        self.failures = self.failures or Counter()


def domain_of(session: Session) -> str:
    domains = {r.rpartition("@")[2] for r in session.accepted}
    return domains.pop() if len(domains) == 1 else ""


# -- the run -------------------------------------------------------------------------------


class Bench:
    def __init__(self, workdir: Path, s: Servers) -> None:
        self.workdir, self.s = workdir, s
        self.rows: list[Row] = []
        self.expected = {d: Expected() for d in (STS, PLAIN, NORPT)}
        self.sent = 0
        self.day = time.strftime("%Y-%m-%d", time.gmtime())  # the run's UTC day

    def send(self, mq: Mtaqueue, domain: str, count: int) -> list[dict]:
        rcpts = []
        with smtplib.SMTP(LOCAL, mq.port, timeout=30) as client:
            for _ in range(count):
                self.sent += 1
                rcpts.append(f"user{self.sent}@{domain}")
                client.sendmail(SENDER, [rcpts[-1]], BODY)
        return [mq.wait("delivery", 60, rcpt=r)[0] for r in rcpts]

    def phase(self, mq: Mtaqueue, number: str, phase: Phase) -> None:
        pf = self.s.postfix
        pf.set_tls(*self.s.certificates[phase.certificate])
        for domain, count in phase.mail:
            offset = pf.maillog.stat().st_size
            events = self.send(mq, domain, count)
            log = settled(pf.maillog, offset, {e["rcpt"] for e in events})
            failed = [s for s in log if not s.tls and not s.accepted and s.errors]
            carried = [s for s in log if s.tls and s.accepted and domain_of(s) == domain]
            expected = self.expected[domain]
            if phase.result_type:  # a failed handshake, then unverified TLS (testing)
                expected.failures.update((phase.result_type, s.client) for s in failed)
            else:
                expected.successes += len(carried)
            states = Counter(e["state"] for e in events)
            others = [s for s in log if s not in failed and s not in carried]
            problems = tls_problems(pf.maillog, offset)
            ok = (
                states == {"delivered": count}
                and not others  # every session: a failed handshake, or TLS that carried mail
                and (bool(failed) == bool(phase.result_type))
                and all(s.client == SOURCE for s in log)
                and sum(len(s.accepted) for s in carried) == count
            )
            policy = "MTA-STS testing" if domain == STS else "no policy"
            self.rows.append(
                Row(
                    f"{number}{'abc'[phase.mail.index((domain, count))]}",
                    f"{phase.name} certificate ({phase.certificate}): {count} message(s) "
                    f"to {domain} ({policy})",
                    ", ".join(f"{n} {state}" for state, n in states.items()),
                    f"{len(log)} sessions from {', '.join(sorted({s.client for s in log}))}: "
                    + describe(log)
                    + (f"; smtpd: TLS library problem: {'; '.join(problems)}" if problems else ""),
                    ok,
                )
            )

    def send_reports(self, mq: Mtaqueue) -> tuple[dict[str, dict], str]:
        """`mtaqueue-ctl tls-report send --today` (its text, as printed), what came of each
        domain (the daemon's tls_report_sent and tls_report_unwanted events)."""

        def queried(domain: str) -> int:  # Unbound's log-queries lines
            return self.s.dns.log().count(f" _smtp._tls.{domain}. TXT IN")

        before = {d: queried(d) for d in (STS, PLAIN, NORPT)}
        if self.day != time.strftime("%Y-%m-%d", time.gmtime()):
            self.day = ""  # the sessions are in two days' counts: no figure can match
        text = mq.ctl("tls-report", "send", "--today")
        sent = {e["domain"]: e for e in mq.events if e.get("event") == "tls_report_sent"}
        unwanted = {e["domain"] for e in mq.events if e.get("event") == "tls_report_unwanted"}
        asked = {d: queried(d) - n for d, n in before.items()}
        ok = (
            sent.keys() == {STS, PLAIN}
            and all(e["rua"] == [RUA] for e in sent.values())
            and unwanted == {NORPT}
            and all(f"{d} " in text for d in (STS, PLAIN, NORPT))
            and all(asked.values())
        )
        self.rows.append(
            Row(
                "4",
                "`mtaqueue-ctl tls-report send --today`",
                "; ".join(line.split(" ", 1)[0] + ": " + line.rpartition(": ")[2]
                          for line in text.splitlines()),
                "Unbound: " + ", ".join(f"{n} _smtp._tls.{d} TXT" for d, n in asked.items()),
                ok,
            )
        )  # fmt: skip
        return sent, text

    def sent_once(self, mq: Mtaqueue) -> None:
        """Once the report mails are in: the same command sends neither report again, and
        reports.test is not there: the report mails' own sessions are not counted (RFC
        8460 3 SHOULD NOT)."""
        lines = mq.ctl("tls-report", "send", "--today", "--json").splitlines()
        again = {r["domain"]: r["result"] for r in map(json.loads, lines)}
        own = " (the report mails' own session, counted)" if REPORTS in again else ""
        self.rows.append(
            Row(
                "5b",
                "the same command again, once the report mails are in",
                "; ".join(f"{d}: {r}" for d, r in again.items()) + own or "no TLS report due",
                f"Postfix's Maildir: still {len(self.s.postfix.stored(REPORTS))} report mails",
                not {STS, PLAIN, REPORTS} & again.keys()
                and len(self.s.postfix.stored(REPORTS)) == 2,
            )
        )

    def collected(self, mq: Mtaqueue, results: dict[str, dict]) -> dict[str, bytes]:
        """The report mails as Postfix stored them, by TLS-Report-Domain."""
        pf = self.s.postfix
        want = list(results)
        with contextlib.suppress(TimeoutError):  # what did come is the finding
            wait_until(lambda: len(pf.stored(REPORTS)) >= len(want), 60, "the report mails")
        stored = pf.stored(REPORTS)
        log = pf.maillog.read_text(errors="replace")
        delivered = re.findall(
            rf"virtual\[\d+\]: \w+: to=<(tlsrpt@{REPORTS})>.*status=sent \(([^)]*)\)", log
        )
        by_domain = {}
        for raw in stored:
            message = email.message_from_bytes(raw, policy=email.policy.default)
            by_domain[str(message["TLS-Report-Domain"])] = raw
        queued = [e["to"] for e in mq.events if e.get("event") == "tls_report_queued"]
        outcomes = ", ".join(sorted({d[1] for d in delivered}))
        self.rows.append(
            Row(
                "5",
                f"the report mails, through Postfix into {REPORTS}'s Maildir",
                f"{len(queued)} tls_report_queued (to {', '.join(sorted(set(queued)))})",
                f"virtual(8): {len(delivered)} x {outcomes}; Maildir: {len(stored)} messages "
                f"(TLS-Report-Domain: {', '.join(sorted(by_domain))})",
                sorted(by_domain) == sorted(want) and len(stored) == len(want) == len(delivered),
            )
        )
        return by_domain

    def check_report(self, number: str, domain: str, raw: bytes, result: dict, parsed) -> None:
        """parsedmarc's reading against what Postfix saw, and the message's structure."""
        expected = self.expected[domain]
        today = self.day  # the UTC day the mail went (a run across midnight fails here)
        begin = calendar.timegm(time.strptime(today, "%Y-%m-%d")) if today else 0
        report = parsed["report"] if parsed.get("report_type") == "smtp_tls" else {}
        policies = report.get("policies", [])
        policy = policies[0] if len(policies) == 1 else {}
        sts = domain == STS
        details = Counter(
            {
                (d.get("result_type"), d.get("sending_mta_ip")): d.get("failed_session_count")
                for d in policy.get("failure_details", [])
            }
        )
        where = {
            (d.get("receiving_mx_hostname"), d.get("receiving_ip"))
            for d in policy.get("failure_details", [])
        }
        checks = {
            "report_type smtp_tls": parsed.get("report_type") == "smtp_tls",
            "organization": report.get("organization_name") == ORGANIZATION,
            "contact": report.get("contact_info") == CONTACT,
            "report id": report.get("report_id") == result["report_id"],
            "date range": (report.get("begin_date"), report.get("end_date"))
            == (f"{today}T00:00:00Z", f"{today}T23:59:59Z"),
            "policy": (policy.get("policy_type"), policy.get("policy_domain"))
            == ("sts" if sts else "no-policy-found", domain),
            "policy strings": policy.get("policy_strings")
            == (POLICY.splitlines() if sts else None),
            "successes": policy.get("successful_session_count") == expected.successes,
            "failures": policy.get("failed_session_count") == sum(expected.failures.values()),
            "failure details": details == expected.failures,
            "MX host, receiving IP": where
            == ({(mx(STS), self.s.postfix.host)} if expected.failures else set()),
        }
        shown = (
            f"parse_report_email: {parsed.get('report_type')}; organization "
            f"{report.get('organization_name')!r}, contact {report.get('contact_info')}, "
            f"id {report.get('report_id')}, "
            f"{report.get('begin_date')} - {report.get('end_date')}; policy "
            f"{policy.get('policy_type')} {policy.get('policy_domain')}"
            + (f" {policy.get('policy_strings')}" if sts else "")
            + (f", mx_host_patterns {policy.get('mx_host_patterns')}" if sts else "")
            + f"; successful {policy.get('successful_session_count')}, failed "
            f"{policy.get('failed_session_count')}"
        )
        for d in policy.get("failure_details", []):
            shown += (
                f"; {d.get('failed_session_count')} x {d.get('result_type')} "
                f"{d.get('sending_mta_ip', '(no sending_mta_ip)')} -> "
                f"{d.get('receiving_mx_hostname')} [{d.get('receiving_ip')}] "
                f"({d.get('failure_reason_code', '')})"
            )
        failures = ", ".join(f"{n} x {t} from {ip}" for (t, ip), n in expected.failures.items())
        wrong = [name for name, ok in checks.items() if not ok]
        self.rows.append(
            Row(
                f"{number}a",
                f"{domain}'s report read by parsedmarc vs Postfix's maillog",
                f"Postfix saw: {expected.successes} TLS sessions carrying mail"
                + (f", failed handshakes: {failures}" if failures else ", no failed handshake"),
                shown + (f" -- differs: {', '.join(wrong)}" if wrong else ""),
                not wrong,
            )
        )
        self.rows.append(self.structure(f"{number}b", domain, raw, result, begin))
        self.rows.append(self.signature(f"{number}c", domain, raw))

    def structure(self, number: str, domain: str, raw: bytes, result: dict, begin: int) -> Row:
        message = email.message_from_bytes(raw, policy=email.policy.default)
        parts = list(message.iter_parts()) if message.is_multipart() else []
        attachment = parts[1] if len(parts) == 2 else None
        name = (attachment.get_filename() if attachment else None) or ""
        match = FILENAME.fullmatch(name)
        body = attachment.get_payload(decode=True) if attachment else b""
        try:
            document = json.loads(gzip.decompress(body))
        except (OSError, ValueError):
            document = {}
        subject = (
            f"Report Domain: {domain} Submitter: {SUBMITTER} Report-ID: <{result['report_id']}>"
        )
        checks = {
            "Content-Type": message.get_content_type() == "multipart/report"
            and message.get_param("report-type") == "tlsrpt",
            "TLS-Report-Domain": message["TLS-Report-Domain"] == domain,
            "TLS-Report-Submitter": message["TLS-Report-Submitter"] == SUBMITTER,
            "Subject": message["Subject"] == subject,
            "From": message["From"] == REPORT_FROM,
            "first part text/plain": bool(parts) and parts[0].get_content_type() == "text/plain",
            "attachment": attachment is not None
            and attachment.get_content_type() == "application/tlsrpt+gzip"
            and attachment["Content-Transfer-Encoding"] == "base64"
            and attachment.get_content_disposition() == "attachment",
            "gzip": body[:2] == b"\x1f\x8b" and document.get("report-id") == result["report_id"],
            "filename (RFC 8460 5.3 ABNF)": match is not None
            and (match["sender"], match["domain"]) == (SUBMITTER, domain)
            and (int(match["begin"]), int(match["end"])) == (begin, begin + 86399),
            "mx-host": document.get("policies", [{}])[0].get("policy", {}).get("mx-host")
            == ([mx(STS)] if domain == STS else None),
        }
        wrong = [k for k, ok in checks.items() if not ok]
        ctype = message["Content-Type"]
        return Row(
            number,
            f"{domain}'s report mail: RFC 8460 5.3 structure (Python's email package)",
            f"Content-Type: {re.sub(r'; boundary=.*', '', str(ctype))}; TLS-Report-Domain: "
            f"{message['TLS-Report-Domain']}; TLS-Report-Submitter: "
            f"{message['TLS-Report-Submitter']}; part 2: "
            f"{attachment.get_content_type() if attachment else '-'} "
            f"({attachment['Content-Transfer-Encoding'] if attachment else '-'}), "
            f'filename="{name}"',
            "as RFC 8460 5.3 asks" + (f" except: {', '.join(wrong)}" if wrong else ""),
            not wrong,
        )

    def signature(self, number: str, domain: str, raw: bytes) -> Row:
        wire = re.sub(rb"\r?\n", b"\r\n", raw)  # the Maildir keeps LF line ends
        dnsfunc = unbound_txt(self.s.dns)
        try:
            verified = dkim.verify(wire, dnsfunc=dnsfunc)
        except dkim.DKIMException as exc:
            verified, error = False, str(exc)
        else:
            error = ""
        message = email.message_from_bytes(raw, policy=email.policy.default)
        tags = dict(
            t.strip().split("=", 1)
            for t in str(message.get("DKIM-Signature", "")).split(";")
            if "=" in t
        )
        return Row(
            number,
            f"{domain}'s report mail: DKIM",
            f"DKIM-Signature d={tags.get('d')} s={tags.get('s')} a={tags.get('a')}"
            + (f" l={tags['l']}" if "l" in tags else " (no l=)"),
            f"dkimpy, the key from Unbound: {'verified' if verified else 'NOT verified'}"
            + (f" ({error})" if error else ""),
            verified and tags.get("d") == SENDER_DOMAIN and "l" not in tags,  # RFC 8460 3
        )


def run(workdir: Path, keep: bool, parse_report_email) -> tuple[list[Row], str]:
    with servers(workdir, keep) as s:
        bench = Bench(workdir, s)
        mq = daemon(workdir, s)
        try:
            for number, phase in enumerate(PHASES, 1):
                bench.phase(mq, str(number), phase)
            results, text = bench.send_reports(mq)
            mails = bench.collected(mq, results)
            bench.sent_once(mq)
        finally:
            mq.stop()
        bench.rows[0].third_party += f" (policy fetched {s.policy.fetches()}x from s_server)"
        for number, domain in (("6", STS), ("7", PLAIN)):
            raw = mails.get(domain)
            if raw is None:
                bench.rows.append(Row(number, f"{domain}'s report", "-", "no report mail", False))
                continue
            try:
                parsed = parse_report_email(raw, offline=True, always_use_local_files=True)
            except Exception as exc:  # parsedmarc's ParserError: its words are the finding
                parsed = {"report_type": f"refused: {type(exc).__name__}: {exc}"}
            bench.check_report(number, domain, raw, results[domain], parsed)  # Unbound: DKIM
    return bench.rows, text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    if not (postfix_available() and unbound_available() and shutil.which("openssl")):
        print("needs root, Debian's postfix and unbound packages, openssl", file=sys.stderr)
        return 2
    try:
        from parsedmarc import parse_report_email
    except ImportError:
        print("needs parsedmarc: pip install parsedmarc", file=sys.stderr)
        return 2
    version = subprocess.run(
        [sys.executable, "-m", "pip", "show", "parsedmarc"], capture_output=True, text=True
    ).stdout
    postfix = subprocess.run(
        ["postconf", "-d", "-h", "mail_version"], capture_output=True, text=True
    ).stdout.strip()
    print(
        f"parsedmarc {re.search(r'Version: (.*)', version)[1] if 'Version' in version else '?'}"
        f", Postfix {postfix}"
    )
    with work_directory("mtaqueue-tlsrpt-", keep=args.keep) as workdir:
        rows, text = run(workdir, args.keep, parse_report_email)
    print("\n`mtaqueue-ctl tls-report send --today`:")
    print("\n".join(f"    {line}" for line in text.splitlines()))
    return print_checks(
        ["checked", "mtaqueue", "Postfix, Unbound, parsedmarc, dkimpy"],
        [(r.number, [r.check, r.mtaqueue, r.third_party], r.ok) for r in rows],
    )


if __name__ == "__main__":
    sys.exit(main())
