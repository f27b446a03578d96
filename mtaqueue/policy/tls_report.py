"""TLS-RPT (RFC 8460), sans-IO: counting TLS sessions by policy domain and UTC day, the
result types, the `_smtp._tls` record, the JSON report and when it is due.

The I/O (the TXT lookup, the HTTPS POST, the report mail, the state file) is
delivery/tls_reports.py's; this module only counts and builds, with `now` passed in.

A session is one connection to an MX host of a recipient domain (its own MX, as for
MTA-STS) on which TLS was attempted: counted once, under the policy it went by (the
domain's MTA-STS policy, else "no-policy-found"), for the domain of the mail that opened
it. Failure details are bounded per domain-day (MAX_DETAILS); failures past them still
count in the summary.
"""

from __future__ import annotations

import calendar
import gzip
import hashlib
import json
import re
import time

import msgspec

from ..routing.sts import Applied
from .mta_sts import Policy, render_policy

# RFC 8460 4.3: the result types we can tell apart.
STARTTLS_NOT_SUPPORTED = "starttls-not-supported"
CERTIFICATE_HOST_MISMATCH = "certificate-host-mismatch"
CERTIFICATE_EXPIRED = "certificate-expired"
CERTIFICATE_NOT_TRUSTED = "certificate-not-trusted"
VALIDATION_FAILURE = "validation-failure"
STS_POLICY_FETCH_ERROR = "sts-policy-fetch-error"
STS_POLICY_INVALID = "sts-policy-invalid"
STS_WEBPKI_INVALID = "sts-webpki-invalid"

STS = "sts"
NO_POLICY = "no-policy-found"
MAX_DETAILS = 100  # failure-detail rows per domain-day: a hostile MX farm stays bounded
REPORT_WINDOW = 4 * 3600  # seconds into the next UTC day over which reports are spread
RETRIES = (900.0, 3600.0, 4 * 3600.0)  # waits between tries of a report that failed
DAY = 86400
MEDIA_TYPE = "application/tlsrpt+gzip"

# OpenSSL's verify errors (as ssl.SSLCertVerificationError words them) by result type;
# the first that matches wins, anything else at STARTTLS is a validation failure.
_BY_TEXT: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), kind)
    for pattern, kind in (
        (r"does not offer TLS|STARTTLS not (offered|supported)", STARTTLS_NOT_SUPPORTED),
        (r"hostname mismatch|IP address mismatch|not valid for", CERTIFICATE_HOST_MISMATCH),
        (r"certificate has expired|certificate is not yet valid", CERTIFICATE_EXPIRED),
        (
            r"unable to get (local )?issuer certificate|self[- ]signed certificate"
            r"|certificate signature failure|unable to verify the first certificate"
            r"|invalid CA certificate|certificate revoked|unsuitable certificate purpose",
            CERTIFICATE_NOT_TRUSTED,
        ),
    )
)


def result_type(text: str, code: int = 0) -> str:
    """The RFC 8460 result type of a failed STARTTLS (the Reply's text and code): a
    refused STARTTLS command (454, 502...) is as one not offered."""
    for pattern, kind in _BY_TEXT:
        if pattern.search(text):
            return kind
    return STARTTLS_NOT_SUPPORTED if 400 <= code < 600 else VALIDATION_FAILURE


def fetch_result_type(error: str, invalid: bool) -> str:
    """The result type of a failed MTA-STS policy fetch: `invalid`, a policy file that
    parse_policy refused; a certificate the policy host presented that does not verify;
    anything else (no answer, HTTP 404, a redirect)."""
    if invalid:
        return STS_POLICY_INVALID
    if result_type(error) != VALIDATION_FAILURE or "certificate verify failed" in error:
        return STS_WEBPKI_INVALID
    return STS_POLICY_FETCH_ERROR


# -- counting -------------------------------------------------------------------------------


class Session(msgspec.Struct, frozen=True):
    """One TLS attempt, as the delivery side saw it."""

    domain: str  # the policy domain: the recipient domain
    sts: Applied | None  # the MTA-STS policy it went by, None: no policy
    host: str  # receiving-mx-hostname ("" for a policy fetch)
    ip: str  # receiving-ip
    failure: str = ""  # a result type; "" succeeded
    reason: str = ""  # the failure's text (failure-reason-code)
    source: str = ""  # sending-mta-ip: our end of the connection ("" for a policy fetch)


class Detail(msgspec.Struct):
    result_type: str
    host: str
    ip: str
    reason: str
    source: str = ""  # sending-mta-ip (state files from before it: "")
    count: int = 0


class PolicyCounts(msgspec.Struct):
    """One policy's sessions for a domain-day."""

    type: str  # STS or NO_POLICY
    lines: list[str]  # policy-string: the policy file's lines
    mx: list[str]  # mx-host: its patterns
    successes: int = 0
    failures: int = 0
    details: list[Detail] = msgspec.field(default_factory=list)


class Pending(msgspec.Struct):
    """A report of a domain-day under way: its id, its tries, the rua sent to."""

    id: str
    tries: int = 0
    next_try: float = 0.0
    sent: list[str] = msgspec.field(default_factory=list)


class DomainDay(msgspec.Struct):
    policies: dict[str, PolicyCounts] = msgspec.field(default_factory=dict)  # by policy-string
    report: Pending | None = None


# day ("2026-12-01") -> policy domain -> counts
Counts = dict[str, dict[str, DomainDay]]
_STATE = msgspec.json.Decoder(Counts)


def day_of(now: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(now))


def day_start(day: str) -> int:
    return calendar.timegm(time.strptime(day, "%Y-%m-%d"))


class TlsCounts:
    """The sessions counted and the reports under way (the state file's content)."""

    def __init__(self, days: Counts | None = None) -> None:
        self.days: Counts = days or {}

    def record(self, session: Session, now: float) -> None:
        entry = self.days.setdefault(day_of(now), {}).setdefault(session.domain, DomainDay())
        lines, mx = _policy(session.sts)
        key = "\n".join(lines)
        counts = entry.policies.get(key)
        if counts is None:
            kind = STS if session.sts is not None else NO_POLICY
            counts = entry.policies[key] = PolicyCounts(kind, lines, mx)
        if not session.failure:
            counts.successes += 1
            return
        counts.failures += 1
        what = (session.failure, session.host, session.ip, session.reason, session.source)
        detail = next((d for d in counts.details if _what(d) == what), None)
        if detail is None:
            if sum(len(p.details) for p in entry.policies.values()) >= MAX_DETAILS:
                return  # in the summary only
            detail = Detail(*what)
            counts.details.append(detail)
        detail.count += 1

    def due(self, now: float, salt: str, *, today: bool = False) -> list[tuple[str, str]]:
        """The (day, domain) whose report is due by `now`: days that have ended, each
        domain at its own time in REPORT_WINDOW (from `salt`, our host name: stable across
        restarts), a retry at its time; `today`: every ended day at once, and today (the
        operator's `tls-report send`)."""
        current = day_of(now)
        found = []
        for day, domains in sorted(self.days.items()):
            if day == current and not today:
                continue
            for domain, entry in domains.items():
                if today:
                    found.append((day, domain))
                elif entry.report is not None:
                    if entry.report.next_try <= now:
                        found.append((day, domain))
                elif report_time(day, domain, salt) <= now:
                    found.append((day, domain))
        return found

    def get(self, day: str, domain: str) -> DomainDay | None:
        return self.days.get(day, {}).get(domain)

    def remove(self, day: str, domain: str) -> None:
        domains = self.days.get(day, {})
        domains.pop(domain, None)
        if not domains:
            self.days.pop(day, None)

    def encode(self) -> bytes:
        return msgspec.json.encode(self.days)

    @classmethod
    def decode(cls, data: bytes) -> TlsCounts:
        return cls(_STATE.decode(data))


def _what(detail: Detail) -> tuple[str, ...]:
    return (detail.result_type, detail.host, detail.ip, detail.reason, detail.source)


def failed_try(pending: Pending, now: float) -> bool:
    """Count a try that left some rua unsent: False once RETRIES are spent (drop it)."""
    if pending.tries > len(RETRIES):
        return False
    pending.next_try = now + RETRIES[pending.tries - 1]
    return True


def report_time(day: str, domain: str, salt: str) -> float:
    """When the report of `domain`'s `day` is due: a time in the first REPORT_WINDOW
    seconds of the next day, its own for each domain (RFC 8460 4.1: avoid a daily herd)."""
    digest = hashlib.sha256(f"{salt} {day} {domain}".encode()).digest()
    return day_start(day) + DAY + int.from_bytes(digest[:4]) % REPORT_WINDOW


def _policy(sts: Applied | None) -> tuple[list[str], list[str]]:
    if sts is None:
        return [], []
    text = render_policy(Policy(sts.id, sts.mode, sts.mx, sts.max_age, 0.0))
    return text.splitlines(), list(sts.mx)


# -- the record and the report ---------------------------------------------------------------


def parse_record(texts: list[str]) -> list[str]:
    """The rua URIs of a domain's `_smtp._tls` TXT records (each joined from its strings):
    RFC 8460 3: only records beginning "v=TLSRPTv1;" count, more than one is as none; only
    the mailto: and https: URIs are kept."""
    records = [t for t in texts if re.match(r"v=TLSRPTv1\s*;", t)]
    if len(records) != 1:
        return []
    for field in records[0].split(";")[1:]:
        key, _, value = field.partition("=")
        if key.strip() == "rua":
            uris = (u.strip() for u in value.split(","))
            return [u for u in uris if u.startswith(("mailto:", "https://"))]
    return []


class Reporter(msgspec.Struct, frozen=True):
    """Who sends the reports (tls_rpt.organization, contact; the daemon's host name)."""

    organization: str
    contact: str
    submitter: str


def report(entry: DomainDay, day: str, domain: str, report_id: str, by: Reporter) -> dict:
    """The RFC 8460 4.4 JSON report of `domain`'s `day`."""
    start = day_start(day)
    policies = []
    for counts in entry.policies.values():
        policy: dict = {"policy-type": counts.type, "policy-domain": domain}
        if counts.type == STS:
            policy |= {"policy-string": counts.lines, "mx-host": counts.mx}
        details = [_detail(d) for d in counts.details]
        summary = {
            "total-successful-session-count": counts.successes,
            "total-failure-session-count": counts.failures,
        }
        policies.append({"policy": policy, "summary": summary, "failure-details": details})
    return {
        "organization-name": by.organization,
        "date-range": {
            "start-datetime": _rfc3339(start),
            "end-datetime": _rfc3339(start + DAY - 1),
        },
        "contact-info": by.contact,
        "report-id": report_id,
        "policies": policies,
    }


def _detail(detail: Detail) -> dict:
    """A failure-details entry; a policy fetch's has no MX host (not known then), nor a
    connection's addresses."""
    fields = {
        "result-type": detail.result_type,
        "sending-mta-ip": detail.source,
        "receiving-mx-hostname": detail.host,
        "receiving-ip": detail.ip,
        "failed-session-count": detail.count,
        "failure-reason-code": detail.reason,
    }
    return {k: v for k, v in fields.items() if v != ""}


def gzipped(document: dict) -> bytes:
    """The report as sent (RFC 8460 5.1: gzip'd JSON); mtime 0: the same bytes on a retry."""
    return gzip.compress(json.dumps(document).encode(), mtime=0)


def filename(document: dict, submitter: str, domain: str) -> str:
    """RFC 8460 5.3: submitter!policy-domain!begin!end!unique-id.json.gz (epoch seconds),
    unique-id = 1*(ALPHA / DIGIT): the report id's letters and digits before its "@"
    (the same on a retry)."""
    dates = document["date-range"]
    begin, end = (_epoch(dates[k]) for k in ("start-datetime", "end-datetime"))
    unique = re.sub(r"[^A-Za-z0-9]", "", document["report-id"].partition("@")[0])
    return f"{submitter}!{domain}!{begin}!{end}" + (f"!{unique}" if unique else "") + ".json.gz"


def _rfc3339(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def _epoch(text: str) -> int:
    day, _, clock = text.partition("T")
    hours, minutes, seconds = (int(p) for p in clock.removesuffix("Z").split(":"))
    return day_start(day) + hours * 3600 + minutes * 60 + seconds
