"""SIGHUP: the config is read again; a bad one is refused and the old one stays."""

from __future__ import annotations

import signal

from e2e_helpers import wait_for


def test_reload_applies_a_valid_config_and_refuses_an_invalid_one(start_daemon):
    daemon = start_daemon(config="[listen]\nmax_recipients = 5\n")
    queued = daemon.send("app@example.com", ["a@example.org"], b"Subject: x\r\n\r\nx\r\n")

    daemon.config_path.write_text('[listen]\nmax_recipients = 1\n[log]\nlevel = "debug"\n')
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: any(e.get("event") == "reloaded" for e in daemon.events))
    with daemon.smtp() as client:
        client.mail("app@example.com")
        assert client.rcpt("a@example.org")[0] == 250
        code, reply = client.rcpt("b@example.org")
        assert code == 452 and b"4.5.3" in reply  # the new limit, without a restart

    daemon.config_path.write_text("[listen]\nmax_recipients = 1\nbogus = 1\n")
    daemon.proc.send_signal(signal.SIGHUP)
    failed = wait_for(
        lambda: [e for e in daemon.events if e.get("event") == "reload_failed"],
        what="the refusal",
    )
    assert failed[0]["error"] == "listen.bogus: unknown key"
    with daemon.smtp() as client:  # still serving, with the last good config
        client.mail("app@example.com")
        assert client.rcpt("a@example.org")[0] == 250
        assert client.rcpt("b@example.org")[0] == 452
    assert queued in daemon.messages()  # queue state untouched

    daemon.config_path.write_text('[metrics]\naddress = "127.0.0.1:2999"\n')
    daemon.proc.send_signal(signal.SIGHUP)
    warned = wait_for(
        lambda: [e for e in daemon.events if e.get("event") == "reload_needs_restart"],
        what="the restart warning",
    )
    assert warned[0]["key"] == "metrics.address"
