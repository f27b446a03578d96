"""Django's SMTP mail backend as the app that submits (a client we did not write): one
connection for a batch, a multipart message with an attachment past the stream threshold,
our headers set as an app sets them, a resend under the same idempotency key, and a
suppressed recipient refused in a way Django raises to the app."""

from __future__ import annotations

import email
import os
import smtplib

import django
import pytest
from django.conf import settings
from django.core import mail
from django.core.mail.utils import DNS_NAME

ATTACHMENT = os.urandom(300 * 1024)  # over the 256 KiB stream threshold: the streamed path


@pytest.fixture
def django_mail(daemon):
    """Django's mail settings pointed at the daemon (configured once per process)."""
    if not settings.configured:
        settings.configure(EMAIL_BACKEND="django.core.mail.backends.smtp.EmailBackend")
        django.setup()
        DNS_NAME._fqdn = "app.test"  # its EHLO and Message-ID name, not the machine's lookup
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", daemon.port
    settings.EMAIL_USE_TLS = settings.EMAIL_USE_SSL = False
    return daemon


def test_a_django_batch_and_an_attachment_are_queued_as_sent(django_mail):
    daemon = django_mail
    headers = {"X-Mtaqueue-Class": "p0", "X-Mtaqueue-Idempotency-Key": "reset-7"}
    reset = mail.EmailMessage("Reset", "click", "app@sender.test", ["u0@example.org"],
                              headers=headers)  # fmt: skip
    batch = [
        mail.EmailMessage(f"News {i}", "hello", "news@sender.test", [f"n{i}@example.org"])
        for i in range(3)
    ]
    report = mail.EmailMultiAlternatives(
        "Report", "see attached", "app@sender.test", ["boss@example.org", "cc@example.net"]
    )
    report.attach_alternative("<p>see <b>attached</b></p>", "text/html")
    report.attach("report.bin", ATTACHMENT, "application/octet-stream")
    with mail.get_connection() as connection:  # one SMTP session for all of them
        assert connection.send_messages([reset, *batch, report]) == 5
    assert mail.get_connection().send_messages([reset]) == 1  # resent: the same key

    queue = daemon.messages()
    assert len(queue) == 5  # the resend was taken, not queued twice
    by_rcpt = {r["address"]: m for m in queue.values() for r in m["recipients"]}
    assert by_rcpt["u0@example.org"]["class"] == "p0"
    assert by_rcpt["u0@example.org"]["idempotency_key"] == "reset-7"
    assert {by_rcpt[f"n{i}@example.org"]["class"] for i in range(3)} == {"p1"}
    queued = by_rcpt["boss@example.org"]
    assert [r["address"] for r in queued["recipients"]] == ["boss@example.org", "cc@example.net"]
    parsed = email.message_from_bytes(daemon.stored(queued["id"]))
    parts = {p.get_content_type(): p for p in parsed.walk()}
    assert parts["application/octet-stream"].get_payload(decode=True) == ATTACHMENT
    assert b"<b>attached</b>" in parts["text/html"].get_payload(decode=True)
    stored_reset = daemon.stored(by_rcpt["u0@example.org"]["id"])
    assert b"X-Mtaqueue" not in stored_reset  # ours, taken out of what is delivered


def test_a_suppressed_recipient_reaches_django_as_a_refusal(django_mail):
    daemon = django_mail
    added = daemon.ctl("suppress", "add", "gone@example.org", "--reason", "hard bounce")
    assert added.returncode == 0, added.stderr
    message = mail.EmailMessage("Hi", "hello", "app@sender.test", ["gone@example.org"])
    with pytest.raises(smtplib.SMTPRecipientsRefused) as refused:
        message.send()
    code, text = refused.value.recipients["gone@example.org"]
    assert code == 550 and b"5.1.1" in text and b"suppressed" in text and b"hard bounce" in text
    assert daemon.messages() == {}
