"""Metrics scraped over HTTP from the running daemon, and alerts in its log."""

from __future__ import annotations

import urllib.request

from e2e_helpers import BODY, FAST, MailNet, wait_for
from prometheus_client.parser import text_string_to_metric_families


def scrape(daemon) -> dict[tuple[str, tuple], float]:
    (address,) = next(e for e in daemon.events if e.get("event") == "metrics_listening")["address"]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_queue_metrics_and_an_alert_that_starts_and_clears(start_daemon):
    daemon = start_daemon(
        "metrics.address=127.0.0.1:0",
        "alerts.interval=0.3s",
        'alerts.rules=[{type="oldest_age", class="p1", over="1s"}]',
    )
    queue_id = daemon.send("app@example.com", ["a@example.org"], BODY)
    daemon.send("app@example.com", ["b@example.org"], b"X-Mtaqueue-Class: p0\r\n" + BODY)
    samples = scrape(daemon)
    assert samples[("mtaqueue_queue_messages", (("class", "p1"),))] == 1
    assert samples[("mtaqueue_queue_messages", (("class", "p0"),))] == 1
    assert samples[("mtaqueue_queue_messages", (("class", "p2"),))] == 0
    assert samples[("mtaqueue_spool_free_bytes", ())] > 0
    assert samples[("mtaqueue_spool_journal_bytes", ())] > 0

    firing = wait_for(
        lambda: [e for e in daemon.events if e.get("event") == "alert"], what="the alert"
    )
    assert firing[0]["state"] == "firing" and firing[0]["subject"] == "p1"
    active = scrape(daemon)
    assert any(name == "mtaqueue_alert_active" and v == 1 for (name, _), v in active.items())
    assert daemon.ctl("delete", queue_id).returncode == 0
    cleared = wait_for(
        lambda: [e for e in daemon.events if e.get("event") == "alert"][1:], what="the clearing"
    )
    assert cleared[0]["state"] == "cleared"
    assert len([e for e in daemon.events if e.get("event") == "alert"]) == 2  # once each


def test_delivery_attempts_and_connect_latency_are_counted(start_daemon):
    with MailNet(["127.0.0.2"]) as net:
        (peer,) = net.peers
        net.add_domain("example.org", "127.0.0.2")
        daemon = start_daemon(*net.daemon_overrides(), *FAST, "metrics.address=127.0.0.1:0")
        daemon.send("app@example.com", ["a@example.org"], BODY)
        wait_for(lambda: peer.messages, what="delivery")
        wait_for(lambda: not daemon.messages(), what="the queue to empty")
        samples = scrape(daemon)
        attempts = {
            dict(labels)["reply"]: value
            for (name, labels), value in samples.items()
            if name == "mtaqueue_delivery_attempts_total"
        }
        assert attempts.get("2xx") == 1
        connects = [
            v for (name, _), v in samples.items() if name == "mtaqueue_connect_seconds_count"
        ]
        assert sum(connects) == 1
        latency = [
            v for (name, labels), v in samples.items()
            if name == "mtaqueue_delivery_latency_seconds_count" and ("class", "p1") in labels
        ]  # fmt: skip
        assert latency == [1]
        scheduled = {
            dict(labels)["reason"]: value
            for (name, labels), value in samples.items()
            if name == "mtaqueue_scheduled_total"
        }
        assert scheduled["accepted"] == 1 and scheduled["retry"] == 0  # delivered at once


def test_deferral_rate_alert_driven_by_a_deferring_peer(start_daemon):
    with MailNet(["127.0.0.2"]) as net:
        (peer,) = net.peers
        net.add_domain("example.org", "127.0.0.2")
        peer.on("rcpt", "451 4.3.0 mailbox busy")
        daemon = start_daemon(
            *net.daemon_overrides(), *FAST,
            'retry.schedule=["60s"]', "alerts.interval=0.3s",
            'alerts.rules=[{type="deferral_rate", over=0.5, window="5m", min_attempts=3}]',
        )  # fmt: skip
        for i in range(3):
            daemon.send("app@example.com", [f"d{i}@example.org"], BODY)
        alerts = lambda: [e for e in daemon.events if e.get("event") == "alert"]  # noqa: E731
        (firing,) = wait_for(alerts, what="the deferral alert")
        assert firing["state"] == "firing" and firing["value"] == 1.0
        peer.on("rcpt", None)  # the receiver recovers
        for i in range(4):
            daemon.send("app@example.com", [f"ok{i}@example.org"], BODY)
        assert daemon.ctl("flush", "--all").returncode == 0
        wait_for(lambda: not daemon.messages(), what="everything delivered")
        firing, cleared = wait_for(lambda: alerts()[1:] and alerts(), what="the clearing")
        assert cleared["state"] == "cleared"
