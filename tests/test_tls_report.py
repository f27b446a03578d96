"""TLS-RPT, the pure part (policy/tls_report.py): result types, counting, the record, the
report and its mail."""

from __future__ import annotations

import base64
import calendar
import email
import email.policy
import gzip
import json
import re

from mtaqueue.delivery.tls_reports import report_mail
from mtaqueue.policy.mta_sts import ENFORCE, Applied
from mtaqueue.policy.tls_report import (
    CERTIFICATE_EXPIRED,
    CERTIFICATE_HOST_MISMATCH,
    CERTIFICATE_NOT_TRUSTED,
    MAX_DETAILS,
    REPORT_WINDOW,
    RETRIES,
    STARTTLS_NOT_SUPPORTED,
    STS_POLICY_FETCH_ERROR,
    STS_POLICY_INVALID,
    STS_WEBPKI_INVALID,
    VALIDATION_FAILURE,
    Pending,
    Reporter,
    Session,
    TlsCounts,
    failed_try,
    fetch_result_type,
    filename,
    gzipped,
    parse_record,
    report,
    report_time,
    result_type,
)

# As the delivery side words them (smtp/client.py around ssl.SSLCertVerificationError).
VERIFY = "TLS session failed: TLS failed: [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify"
OPENSSL = {
    f"{VERIFY} failed: Hostname mismatch, certificate is not valid for 'mx.example.org'."
    " (_ssl.c:1000)": CERTIFICATE_HOST_MISMATCH,
    f"{VERIFY} failed: IP address mismatch, certificate is not valid for '192.0.2.1'."
    " (_ssl.c:1000)": CERTIFICATE_HOST_MISMATCH,
    f"{VERIFY} failed: certificate has expired (_ssl.c:1000)": CERTIFICATE_EXPIRED,
    f"{VERIFY} failed: certificate is not yet valid (_ssl.c:1000)": CERTIFICATE_EXPIRED,
    f"{VERIFY} failed: unable to get local issuer certificate (_ssl.c:1000)": (
        CERTIFICATE_NOT_TRUSTED
    ),
    f"{VERIFY} failed: self-signed certificate (_ssl.c:1000)": CERTIFICATE_NOT_TRUSTED,
    f"{VERIFY} failed: self signed certificate in certificate chain (_ssl.c:1131)": (
        CERTIFICATE_NOT_TRUSTED
    ),
    f"{VERIFY} failed: certificate signature failure (_ssl.c:1000)": CERTIFICATE_NOT_TRUSTED,
    "mx.example.org does not offer TLS": STARTTLS_NOT_SUPPORTED,
    "TLS session failed: TLS failed: [SSL: WRONG_VERSION_NUMBER] wrong version number"
    " (_ssl.c:1000)": VALIDATION_FAILURE,
    "TLS session failed: connection lost during starttls": VALIDATION_FAILURE,
}
POLICY = Applied("example.org", ENFORCE, ("mx.example.org",), "1", 86400)
DAY = "2026-12-01"
NOON = calendar.timegm((2026, 12, 1, 12, 0, 0))
BY = Reporter("Example Sender", "postmaster@sender.test", "mta.sender.test")


def test_result_types_of_openssl_errors():
    for text, kind in OPENSSL.items():
        assert result_type(text) == kind, text
    assert result_type("TLS not available due to temporary reason", 454) == STARTTLS_NOT_SUPPORTED


def test_fetch_result_types():
    assert fetch_result_type("version is not STSv1", invalid=True) == STS_POLICY_INVALID
    cert = "Cannot connect to host mta-sts.example.org:443 ssl:True [SSLCertVerificationError:"
    cert += " (1, '[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed')]"
    assert fetch_result_type(cert, invalid=False) == STS_WEBPKI_INVALID
    assert fetch_result_type("HTTP 404 (only 200 is a policy)", False) == STS_POLICY_FETCH_ERROR


def _counted() -> TlsCounts:
    counts = TlsCounts()
    mismatch = next(t for t, k in OPENSSL.items() if k == CERTIFICATE_HOST_MISMATCH)
    for _ in range(3):
        counts.record(Session("example.org", POLICY, "mx.example.org", "192.0.2.1"), NOON)
    for _ in range(2):
        failed = Session(
            "example.org",
            POLICY,
            "mx.example.org",
            "192.0.2.1",
            CERTIFICATE_HOST_MISMATCH,
            mismatch,
            "198.51.100.7",
        )
        counts.record(failed, NOON)
    counts.record(Session("example.net", None, "mx.example.net", "192.0.2.2"), NOON)
    return counts


def test_counted_by_domain_day_and_policy():
    counts = _counted()
    assert set(counts.days) == {DAY}
    (sts,) = counts.get(DAY, "example.org").policies.values()
    assert (sts.type, sts.successes, sts.failures) == ("sts", 3, 2)
    assert sts.lines == ["version: STSv1", "mode: enforce", "mx: mx.example.org", "max_age: 86400"]
    (detail,) = sts.details
    assert (detail.result_type, detail.host, detail.ip, detail.source, detail.count) == (
        CERTIFICATE_HOST_MISMATCH,
        "mx.example.org",
        "192.0.2.1",
        "198.51.100.7",
        2,
    )
    (none,) = counts.get(DAY, "example.net").policies.values()
    assert (none.type, none.successes, none.failures, none.lines) == ("no-policy-found", 1, 0, [])


def test_details_bounded_failures_still_counted():
    counts = TlsCounts()
    for i in range(MAX_DETAILS + 50):
        ip = f"192.0.2.{i % 250}" if i < 250 else "198.51.100.1"
        counts.record(Session("e.org", None, f"mx{i}.e.org", ip, VALIDATION_FAILURE, "x"), NOON)
    (policy,) = counts.get(DAY, "e.org").policies.values()
    assert len(policy.details) == MAX_DETAILS and policy.failures == MAX_DETAILS + 50


def test_state_round_trip():
    counts = _counted()
    counts.get(DAY, "example.org").report = Pending("r1", tries=1, sent=["https://a.example/"])
    again = TlsCounts.decode(counts.encode())
    assert again.days == counts.days


def test_each_sending_address_is_a_detail_of_its_own():
    """RFC 8460 4.4: a failure detail names the sending MTA's IP; from two of our source
    addresses, the same failure is two rows (the summary counts both)."""
    counts = TlsCounts()
    for source in ("198.51.100.7", "198.51.100.8", "198.51.100.8"):
        session = Session(
            "e.org", None, "mx.e.org", "192.0.2.1", STARTTLS_NOT_SUPPORTED, "", source
        )
        counts.record(session, NOON)
    document = report(counts.get(DAY, "e.org"), DAY, "e.org", "r", BY)
    (entry,) = document["policies"]
    rows = {d["sending-mta-ip"]: d["failed-session-count"] for d in entry["failure-details"]}
    assert rows == {"198.51.100.7": 1, "198.51.100.8": 2}
    assert entry["summary"]["total-failure-session-count"] == 3


def test_a_state_file_from_before_the_sending_address_still_loads():
    old = (
        b'{"2026-12-01": {"e.org": {"policies": {"": {"type": "no-policy-found", "lines": [],'
        b' "mx": [], "successes": 0, "failures": 1, "details": [{"result_type":'
        b' "starttls-not-supported", "host": "mx.e.org", "ip": "192.0.2.1", "reason": "",'
        b' "count": 1}]}}, "report": null}}}'
    )
    (policy,) = TlsCounts.decode(old).get(DAY, "e.org").policies.values()
    assert policy.details[0].source == "" and policy.details[0].count == 1
    (entry,) = report(TlsCounts.decode(old).get(DAY, "e.org"), DAY, "e.org", "r", BY)["policies"]
    assert "sending-mta-ip" not in entry["failure-details"][0]  # not known: left out


def test_due_after_the_day_at_a_jittered_time():
    counts = _counted()
    assert counts.due(NOON, "salt") == []
    assert sorted(counts.due(NOON, "salt", today=True)) == [
        (DAY, "example.net"),
        (DAY, "example.org"),
    ]
    next_day = calendar.timegm((2026, 12, 2, 0, 0, 0))
    times = {d: report_time(DAY, d, "salt") for d in ("example.org", "example.net")}
    assert all(next_day <= t < next_day + REPORT_WINDOW for t in times.values())
    first = min(times, key=times.get)
    assert counts.due(times[first], "salt") == [(DAY, first)]
    assert len(counts.due(next_day + REPORT_WINDOW, "salt")) == 2
    counts.remove(DAY, "example.org")
    counts.remove(DAY, "example.net")
    assert counts.days == {}


def test_retries_then_dropped():
    pending = Pending("r1")
    now = 1000.0
    for wait in RETRIES:
        pending.tries += 1
        assert failed_try(pending, now) and pending.next_try == now + wait
    pending.tries += 1
    assert not failed_try(pending, now)


def test_record():
    uris = parse_record(["v=TLSRPTv1; rua=mailto:tls@example.org,https://r.example.org/v1"])
    assert uris == ["mailto:tls@example.org", "https://r.example.org/v1"]
    assert parse_record(["v=TLSRPTv1;rua=https://r.example/"]) == ["https://r.example/"]
    assert parse_record(["v=spf1 -all", "v=TLSRPTv1; rua=mailto:a@b"]) == ["mailto:a@b"]
    assert parse_record(["v=TLSRPTv1; rua=mailto:a@b", "v=TLSRPTv1; rua=mailto:c@d"]) == []
    assert parse_record(["v=TLSRPTv1 rua=mailto:a@b"]) == []  # no ";" after the version
    assert parse_record(["v=TLSRPTv1; rua=http://insecure.example/"]) == []
    assert parse_record([]) == []


def test_report_has_rfc_8460_fields_and_gzip_round_trips():
    counts = _counted()
    document = report(counts.get(DAY, "example.org"), DAY, "example.org", "r-1", BY)
    assert json.loads(gzip.decompress(gzipped(document))) == document
    assert gzipped(document) == gzipped(document)  # a retry sends the same bytes
    assert set(document) == {
        "organization-name",
        "date-range",
        "contact-info",
        "report-id",
        "policies",
    }
    assert document["date-range"] == {
        "start-datetime": "2026-12-01T00:00:00Z",
        "end-datetime": "2026-12-01T23:59:59Z",
    }
    (entry,) = document["policies"]
    assert entry["policy"] == {
        "policy-type": "sts",
        "policy-domain": "example.org",
        "policy-string": [
            "version: STSv1",
            "mode: enforce",
            "mx: mx.example.org",
            "max_age: 86400",
        ],
        "mx-host": ["mx.example.org"],
    }
    assert entry["summary"] == {
        "total-successful-session-count": 3,
        "total-failure-session-count": 2,
    }
    (detail,) = entry["failure-details"]
    assert detail["result-type"] == "certificate-host-mismatch"
    assert detail["sending-mta-ip"] == "198.51.100.7"
    assert detail["receiving-mx-hostname"] == "mx.example.org"
    assert detail["receiving-ip"] == "192.0.2.1"
    assert detail["failed-session-count"] == 2
    assert "Hostname mismatch" in detail["failure-reason-code"]
    none = report(counts.get(DAY, "example.net"), DAY, "example.net", "r-2", BY)
    assert none["policies"][0]["policy"] == {
        "policy-type": "no-policy-found",
        "policy-domain": "example.net",
    }


# RFC 8460 5.3: sender "!" policy-domain "!" begin-timestamp "!" end-timestamp
# [ "!" unique-id ] "." extension, with unique-id = 1*(ALPHA / DIGIT).
FILENAME = re.compile(r"[A-Za-z0-9.-]+![A-Za-z0-9.-]+!\d+!\d+(![A-Za-z0-9]+)?\.json\.gz")


def test_filename_unique_id_is_letters_and_digits():
    """The daemon's report ids ("2026-12-01.<hex>@host") held "-", "." and "_" in the
    unique-id (parsedmarc took it; the ABNF does not)."""
    counts = _counted()
    start = calendar.timegm((2026, 12, 1, 0, 0, 0))
    ids = {
        "2026-12-01.0123abcd@mta.sender.test": "!202612010123abcd",
        "r-1@x": "!r1",
        "-.@x": "",  # nothing left: no unique-id at all
    }
    for report_id, unique in ids.items():
        document = report(counts.get(DAY, "example.org"), DAY, "example.org", report_id, BY)
        name = filename(document, "mta.sender.test", "example.org")
        assert name == f"mta.sender.test!example.org!{start}!{start + 86399}{unique}.json.gz"
        assert FILENAME.fullmatch(name), name


def test_filename_and_mail():
    counts = _counted()
    document = report(counts.get(DAY, "example.org"), DAY, "example.org", "r-1@x", BY)
    start = calendar.timegm((2026, 12, 1, 0, 0, 0))
    name = filename(document, "mta.sender.test", "example.org")
    assert name == f"mta.sender.test!example.org!{start}!{start + 86399}!r1.json.gz"
    body = gzipped(document)
    content = report_mail(
        "tlsrpt@sender.test", "tls@example.org", BY, "example.org", document, body, NOON
    )
    assert b"\r\n" in content and b"\n" not in content.replace(b"\r\n", b"")
    parsed = email.message_from_bytes(content, policy=email.policy.default)
    assert parsed["Subject"] == (
        "Report Domain: example.org Submitter: mta.sender.test Report-ID: <r-1@x>"
    )
    assert parsed["TLS-Report-Domain"] == "example.org"
    assert parsed.get_content_type() == "multipart/report"
    assert parsed.get_param("report-type") == "tlsrpt"
    text, attachment = parsed.iter_parts()
    assert text.get_content_type() == "text/plain"
    assert attachment.get_content_type() == "application/tlsrpt+gzip"
    assert attachment.get_filename() == name
    assert json.loads(gzip.decompress(base64.b64decode(attachment.get_payload()))) == document


def test_a_failed_policy_fetch_is_a_detail_without_an_mx():
    counts = TlsCounts()
    fetch = Session("example.com", None, "", "", STS_POLICY_FETCH_ERROR, "HTTP 404")
    counts.record(fetch, NOON)
    counts.record(Session("example.com", None, "mx.example.com", "192.0.2.3"), NOON)
    document = report(counts.get(DAY, "example.com"), DAY, "example.com", "r", BY)
    (entry,) = document["policies"]
    assert entry["summary"] == {
        "total-successful-session-count": 1,
        "total-failure-session-count": 1,
    }
    assert entry["failure-details"] == [
        {
            "result-type": "sts-policy-fetch-error",
            "failed-session-count": 1,
            "failure-reason-code": "HTTP 404",
        }
    ]
