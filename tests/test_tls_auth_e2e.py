"""STARTTLS and SMTP AUTH against the daemon, with a real certificate and real TLS."""

from __future__ import annotations

import smtplib
import ssl
import subprocess
import sys

import pytest

from mtaqueue.smtp.auth import hash_password

BODY = b"Subject: auth\r\n\r\nhello\r\n"


@pytest.fixture
def tls_daemon(start_daemon, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=mx.test", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    users = tmp_path / "users"
    users.write_text(f"# app credentials\nshop:{hash_password('s3cret', iterations=1000)}\n")
    return start_daemon(
        f"listen.tls_cert={cert}",
        f"listen.tls_key={key}",
        f"listen.auth_file={users}",
        'listen.mynetworks=["192.0.2.0/24"]',  # loopback may not relay without AUTH
    )


def client_context() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # self-signed test certificate
    return context


def test_auth_is_offered_only_after_starttls(tls_daemon):
    with smtplib.SMTP("127.0.0.1", tls_daemon.port, timeout=10) as client:
        client.ehlo()
        assert client.has_extn("starttls") and not client.has_extn("auth")
        code, _ = client.docmd("AUTH", "PLAIN AHNob3AAczNjcmV0")
        assert code == 538
        client.starttls(context=client_context())
        client.ehlo()
        assert client.has_extn("auth") and not client.has_extn("starttls")
        assert "PLAIN" in client.esmtp_features["auth"]


def test_without_auth_relaying_is_denied(tls_daemon):
    with smtplib.SMTP("127.0.0.1", tls_daemon.port, timeout=10) as client:
        client.starttls(context=client_context())
        client.ehlo()
        client.mail("app@example.com")
        code, reply = client.rcpt("a@example.org")
    assert code == 554 and b"Relay access denied" in reply


@pytest.mark.parametrize("mechanism", ["PLAIN", "LOGIN"])
def test_authenticated_client_relays_and_is_the_tenant(tls_daemon, mechanism):
    with smtplib.SMTP("127.0.0.1", tls_daemon.port, timeout=10) as client:
        client.starttls(context=client_context())
        client.ehlo()
        client.user, client.password = "shop", "s3cret"
        code, _ = client.auth(mechanism, getattr(client, f"auth_{mechanism.lower()}"))
        assert code == 235
        client.sendmail("app@example.com", ["a@example.org"], BODY)
    (message,) = tls_daemon.messages().values()
    assert message["tenant"] == "shop"


def test_wrong_password_is_refused(tls_daemon):
    with smtplib.SMTP("127.0.0.1", tls_daemon.port, timeout=10) as client:
        client.starttls(context=client_context())
        client.ehlo()
        with pytest.raises(smtplib.SMTPAuthenticationError) as refused:
            client.login("shop", "wrong")
        assert refused.value.smtp_code == 535
        with pytest.raises(smtplib.SMTPAuthenticationError):
            client.login("nobody", "s3cret")
    assert any(e.get("event") == "auth_failed" for e in tls_daemon.events)


def test_bad_auth_file_stops_the_start(tmp_path):
    users = tmp_path / "users"
    users.write_text("shop:plaintext-password\n")
    result = subprocess.run(
        [sys.executable, "-m", "mtaqueue.daemon", "-o", f"listen.auth_file={users}"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith("mtaqueue: listen.auth_file:")
    assert len(result.stderr.strip().splitlines()) == 1
