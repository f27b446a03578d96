"""DKIM end to end: the daemon signs what it accepts (SMTP, the API, streamed to disk),
delivers it to real SMTP peers, and what they receive verifies with dkimpy against the TXT
records a real DNS server on loopback publishes.

Keys: example.com has two (RSA and Ed25519: two signatures), other.test one (Ed25519);
nokey.test none. Recipients are at example.org (a peer on 127.0.0.2).
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys

import pytest
from dkim_keys import dns_txt, publish, signing_key, verify_all, write_key
from e2e_helpers import FAST, MailNet, events, wait_for
from test_api_e2e import start_api  # noqa: F401  (a fixture)
from test_crash_e2e import writer_pid

from mtaqueue.spool.layout import SpoolLayout

KEYS = {  # (domain, selector): algorithm
    ("example.com", "rsa1"): "rsa-sha256",
    ("example.com", "ed1"): "ed25519-sha256",
    ("other.test", "s1"): "ed25519-sha256",
}


def message(sender: str = "app@example.com", body: bytes = b"hello  world\r\n") -> bytes:
    return f"From: App <{sender}>\r\nTo: bob@example.org\r\nSubject: signed\r\n\r\n".encode() + body


def dkim_config(tmp_path, keys=KEYS, n: int = 0, extra: str = "") -> str:
    """[[dkim."DOMAIN"]] tables for `keys`, whose PEM files are written to tmp_path."""
    text = extra
    for (domain, selector), algorithm in keys.items():
        key_file = write_key(tmp_path, algorithm, n=_index(domain, n))
        text += f'[[dkim."{domain}"]]\nselector = "{selector}"\nkey_file = "{key_file}"\n'
        text += f'algorithm = "{algorithm}"\n'
    return text


def _index(domain: str, n: int) -> int:
    """Each domain its own key (of each algorithm); `n` a later generation of them."""
    return 10 * n + sorted({d for d, _ in KEYS}).index(domain)


class World(MailNet):
    def __init__(self, tmp_path, **peer_options) -> None:
        super().__init__(["127.0.0.2"], **peer_options)
        (self.peer,) = self.peers
        self.add_domain("example.org", "127.0.0.2")
        self.tmp_path = tmp_path
        self.publish(KEYS)

    def publish(self, keys, n: int = 0) -> None:
        for (domain, selector), algorithm in keys.items():
            publish(self.dns, signing_key(domain, selector, algorithm, _index(domain, n)))

    def overrides(self) -> tuple[str, ...]:
        return (*self.daemon_overrides(), *FAST)

    def verify(self, content: bytes) -> list[bool]:
        return verify_all(content, dns_txt(self.dns.port))


@pytest.fixture
def world(tmp_path):
    with World(tmp_path) as w:
        yield w


def test_mail_over_smtp_and_over_the_api_arrives_with_both_signatures_valid(
    world,
    start_api,  # noqa: F811
):
    daemon, api = start_api(*world.overrides(), config=dkim_config(world.tmp_path))
    daemon.send("app@example.com", ["bob@example.org"], message())
    assert api.submit(**{"from": "App <app@example.com>"}, to=["bob@example.org"]).status == 202
    received = wait_for(lambda: len(world.peer.messages) == 2 and world.peer.messages)
    for mail in received:
        assert mail.content.count(b"DKIM-Signature:") == 2
        assert world.verify(mail.content) == [True, True]
        assert b"a=rsa-sha256;" in mail.content and b"a=ed25519-sha256;" in mail.content


def test_a_large_message_over_the_api_is_signed_before_the_spool_streams_it(
    world,
    start_api,  # noqa: F811
):
    _, api = start_api(*world.overrides(), config=dkim_config(world.tmp_path))
    text = "".join(f"line {i:06d} of a large message\n" for i in range(12000))  # ~370 KB
    sent = api.submit(**{"from": "App <app@other.test>"}, to=["bob@example.org"], text=text)
    assert sent.status == 202
    (mail,) = wait_for(lambda: world.peer.messages, what="delivery")
    assert len(mail.content) > 300_000 and world.verify(mail.content) == [True]


def test_a_subdomain_is_signed_with_its_parents_key_and_a_domain_without_one_not_at_all(
    world, start_daemon
):
    daemon = start_daemon(*world.overrides(), config=dkim_config(world.tmp_path))
    daemon.send("app@mail.example.com", ["bob@example.org"], message("app@mail.example.com"))
    daemon.send("app@nokey.test", ["bob@example.org"], message("app@nokey.test"))
    received = wait_for(lambda: len(world.peer.messages) == 2 and world.peer.messages)
    by_sender = {m.mail_from: m.content for m in received}
    signed = by_sender["app@mail.example.com"]
    assert signed.count(b"d=example.com;") == 2 and world.verify(signed) == [True, True]
    assert b"DKIM-Signature" not in by_sender["app@nokey.test"]


def test_a_dsn_from_our_hostname_is_signed_with_its_parent_domains_keys(world, start_daemon):
    world.add_domain("nokey.test", "127.0.0.2", host="mx.example.org")  # where DSNs go
    world.peer.on("rcpt", "550 5.1.1 <gone@example.org>: no such user", rcpt="gone@example.org")
    daemon = start_daemon(
        *world.overrides(), "listen.hostname=mx.example.com", config=dkim_config(world.tmp_path)
    )
    daemon.send("app@nokey.test", ["gone@example.org"], message("app@nokey.test"))
    (dsn,) = wait_for(lambda: world.peer.messages, what="the DSN")
    assert dsn.mail_from == "" and b"From: Mail Delivery System <MAILER-DAEMON@mx" in dsn.content
    assert world.verify(dsn.content) == [True, True]


def test_a_deferred_message_is_sent_again_as_it_was_signed_at_acceptance(world, start_daemon):
    world.peer.on("data_end", "451 4.3.0 Try again later", times=1)
    daemon = start_daemon(*world.overrides(), config=dkim_config(world.tmp_path))
    queue_id = daemon.send("app@other.test", ["bob@example.org"], message("app@other.test"))
    wait_for(lambda: world.peer.rejected, what="the deferral")
    stored = daemon.stored(queue_id)
    assert stored.count(b"DKIM-Signature:") == 1
    (mail,) = wait_for(lambda: world.peer.messages, what="the retry")
    assert mail.content == stored == world.peer.rejected[0].content  # never signed again
    assert world.verify(mail.content) == [True]
    attempts = [e["attempt"] for e in events(daemon, "delivery")]
    assert attempts == [1, 2]


def test_a_message_streamed_to_disk_is_signed_as_it_is_written(world, start_daemon):
    world.peer.on("data_end", "451 4.3.0 Try again later", times=1)
    daemon = start_daemon(
        *world.overrides(), "spool.stream_threshold=64KiB", config=dkim_config(world.tmp_path)
    )
    body = b"".join(b"line %06d of a long message  \r\n" % i for i in range(20000))  # ~660 KB
    queue_id = daemon.send("app@example.com", ["bob@example.org"], message(body=body))
    wait_for(lambda: world.peer.rejected, what="the deferral")
    # Its header was on disk before its body had come: the signature follows the content
    # in the file (its head section) and is read before it.
    data = SpoolLayout(daemon.spool).message_path(queue_id).read_bytes()
    magic, content_length, head_length = struct.unpack_from("<4sQI", data)
    start = struct.calcsize("<4sQIIII")
    assert magic == b"MTQ3" and data[start:].startswith(b"Received:")
    assert data[start + content_length :][:head_length].count(b"DKIM-Signature:") == 2
    (mail,) = wait_for(lambda: world.peer.messages, what="delivery")
    assert mail.content.count(b"DKIM-Signature:") == 2 and mail.content.endswith(body)
    assert world.verify(mail.content) == [True, True]


def test_8bit_mail_is_converted_before_it_is_signed_so_a_7bit_hop_gets_it_unchanged(
    tmp_path, start_daemon
):
    with World(tmp_path, eightbitmime=False, smtputf8=False) as world:
        daemon = start_daemon(*world.overrides(), config=dkim_config(tmp_path))
        text = "Grüße, and a line longer than SMTP allows: ".encode() + b"x" * 1200 + b"\r\n"
        daemon.send("app@example.com", ["bob@example.org"], message(body=text))
        (mail,) = wait_for(lambda: world.peer.messages, what="delivery")
        assert mail.content.isascii() and b"quoted-printable" in mail.content
        assert world.verify(mail.content) == [True, True]


def test_mail_is_still_signed_by_a_spool_writer_started_again_after_kill_9(world, start_daemon):
    """The writer makes the signature values with keys the daemon gave it: a new writer
    is given them again with the first batch that needs them."""
    daemon = start_daemon(*world.overrides(), config=dkim_config(world.tmp_path))
    daemon.send("app@example.com", ["bob@example.org"], message())
    wait_for(lambda: world.peer.messages, what="delivery")
    first = writer_pid(daemon)
    os.kill(first, signal.SIGKILL)
    daemon.wait_event("spool_writer_restarted")
    assert writer_pid(daemon) not in (0, first)
    daemon.send("app@example.com", ["bob@example.org"], message())
    wait_for(lambda: len(world.peer.messages) == 2, what="delivery")
    assert [world.verify(m.content) for m in world.peer.messages] == [[True, True]] * 2


def test_a_reload_signs_with_the_new_keys(world, start_daemon):
    daemon = start_daemon(*world.overrides(), config=dkim_config(world.tmp_path))
    rotated = {("other.test", "s2"): "ed25519-sha256"}
    world.publish(rotated, n=1)
    daemon.config_path.write_text(dkim_config(world.tmp_path, rotated, n=1))
    daemon.proc.send_signal(signal.SIGHUP)
    daemon.wait_event("reloaded")
    daemon.send("app@other.test", ["bob@example.org"], message("app@other.test"))
    (mail,) = wait_for(lambda: world.peer.messages, what="delivery")
    assert b"s=s2;" in mail.content and world.verify(mail.content) == [True]


def test_a_key_file_that_cannot_be_read_stops_the_start_naming_the_key(tmp_path):
    config = tmp_path / "mtaqueue.toml"
    config.write_text('[dkim."example.com"]\nselector = "s1"\nkey_file = "/nonexistent.pem"\n')
    command = [sys.executable, "-m", "mtaqueue.daemon", "-c", str(config)]
    result = subprocess.run(
        [*command, "-o", f"spool.path={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert result.stderr.startswith(
        'mtaqueue: dkim."example.com".key_file: cannot read /nonexistent.pem: No such file'
    )


# -- mtaqueue-ctl dkim check ---------------------------------------------------------------


def ctl_check(world: World, domain: str, *args: str, keys=KEYS):
    config = world.tmp_path / "ctl.toml"
    config.write_text(
        dkim_config(world.tmp_path, keys, extra=f'[dns]\nnameservers = ["{world.dns.address}"]\n')
    )
    command = [
        sys.executable,
        "-m",
        "mtaqueue.control.ctl.main",
        "-c",
        str(config),
        "dkim",
        "check",
    ]
    return subprocess.run([*command, domain, *args], capture_output=True, text=True, timeout=60)


def test_dkim_check_prints_the_records_and_finds_them_published(world):
    result = ctl_check(world, "example.com")
    assert result.returncode == 0, result.stderr
    rsa, ed = (signing_key("example.com", s, a) for (d, s), a in KEYS.items() if d == "example.com")
    lines = result.stdout.splitlines()
    assert "  publish:   rsa1._domainkey.example.com. IN TXT " in lines[1]
    # The 392-character RSA record in two strings of at most 255 octets.
    assert lines[1].endswith(f'"{rsa.record()[:255]}" "{rsa.record()[255:]}"')
    assert lines[2] == "  published: ok: rsa1._domainkey.example.com publishes this key"
    assert lines[4] == f'  publish:   ed1._domainkey.example.com. IN TXT "{ed.record()}"'
    assert ctl_check(world, "news.example.com").stdout == result.stdout  # the parent's keys


def test_dkim_check_fails_on_a_missing_or_different_record(world):
    world.dns.remove("ed1._domainkey.example.com")
    missing = ctl_check(world, "example.com", "--json")
    assert missing.returncode == 1
    assert missing.stderr.strip() == (
        "mtaqueue-ctl: dkim check: missing: no DKIM key record at ed1._domainkey.example.com:"
        " publish the line above"
    )
    other = signing_key("example.com", "ed1", "ed25519-sha256", n=99)
    publish(world.dns, other)
    different = ctl_check(world, "example.com")
    assert different.returncode == 1 and "mismatch: ed1._domainkey.example.com publishes" in (
        different.stderr
    )
    unknown = ctl_check(world, "nokey.test")
    assert unknown.returncode == 1 and "no [dkim] key signs mail from nokey.test" in unknown.stderr
