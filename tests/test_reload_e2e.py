"""SIGHUP: the config is read again; a bad one is refused and the old one stays."""

from __future__ import annotations

import signal

from e2e_helpers import events, wait_for


def reload(daemon, config: str, event: str) -> dict:
    """Write `config`, send SIGHUP and wait for `event` (reloaded, reload_failed...)."""
    daemon.config_path.write_text(config)
    daemon.proc.send_signal(signal.SIGHUP)
    return wait_for(lambda: events(daemon, event), what=event)[0]


def test_reload_applies_a_valid_config_and_refuses_an_invalid_one(start_daemon):
    daemon = start_daemon(config="[listen]\nmax_recipients = 5\n")
    queued = daemon.send("app@example.com", ["a@example.org"], b"Subject: x\r\n\r\nx\r\n")

    reload(daemon, '[listen]\nmax_recipients = 1\n[log]\nlevel = "debug"\n', "reloaded")
    with daemon.smtp() as client:
        client.mail("app@example.com")
        assert client.rcpt("a@example.org")[0] == 250
        code, reply = client.rcpt("b@example.org")
        assert code == 452 and b"4.5.3" in reply  # the new limit, without a restart

    failed = reload(daemon, "[listen]\nmax_recipients = 1\nbogus = 1\n", "reload_failed")
    assert failed["error"] == "listen.bogus: unknown key"
    with daemon.smtp() as client:  # still serving, with the last good config
        client.mail("app@example.com")
        assert client.rcpt("a@example.org")[0] == 250
        assert client.rcpt("b@example.org")[0] == 452
    assert queued in daemon.messages()  # queue state untouched

    warned = reload(daemon, '[metrics]\naddress = "127.0.0.1:2999"\n', "reload_needs_restart")
    assert warned["key"] == "metrics.address"
