"""Issue 31, the suite's short soak: on the running daemon, what has ended leaves every
map (idempotency keys past the dedupe window, ended suppressions, the metrics' routes of
delivered mail) and the gauges that show it are scraped: each process's RSS, the
daemon's tasks, each map's entries. `bench/soak.py` is the long run."""

from __future__ import annotations

from e2e_helpers import BODY, FAST, MailNet, wait_for
from test_metrics_e2e import scrape

KEYS = 12


def entries(daemon) -> dict[str, float]:
    return {
        dict(labels)["map"]: value
        for (name, labels), value in scrape(daemon).items()
        if name == "mtaqueue_memory_entries"
    }


def test_what_has_ended_leaves_every_map_and_the_gauges_show_it(start_daemon):
    with MailNet(["127.0.0.2"]) as net:
        (peer,) = net.peers
        net.add_domain("example.org", "127.0.0.2")
        daemon = start_daemon(
            *net.daemon_overrides(),
            *FAST,
            "metrics.address=127.0.0.1:0",
            "submission.dedupe_window=3s",  # pruned every 1.5 s (at most every minute)
            "delivery.connection_idle=60s",
        )
        for i in range(KEYS):
            keyed = f"X-Mtaqueue-Idempotency-Key: order-{i}\r\n".encode() + BODY
            daemon.send("app@example.com", [f"user{i}@example.org"], keyed)
        assert daemon.ctl("suppress", "add", "gone@example.org", "--for", "2s").returncode == 0
        assert daemon.ctl("suppress", "add", "kept@example.org", "--for", "1h").returncode == 0
        wait_for(lambda: len(peer.messages) == KEYS, what="delivery")
        wait_for(lambda: not daemon.messages(), what="the queue to empty")
        live = entries(daemon)
        # Its connection still open, the destination is live (no sweep has retired it),
        # yet it holds no id of the mail delivered there: dropped as each was settled.
        assert live["destinations"] == 1 and live["destination_messages"] == 0
        assert live["idempotency_keys"] >= 1  # the window is still open for the last ones
        samples = scrape(daemon)
        resident = {
            dict(labels)["process"]: value
            for (name, labels), value in samples.items()
            if name == "mtaqueue_process_resident_bytes"
        }
        assert resident["daemon"] > 10 * 2**20 and resident["writer"] > 5 * 2**20
        assert samples[("mtaqueue_process_tasks", ())] > 0
        expected = {"idempotency_keys", "suppressions", "queue_messages", "dns_cache"}
        assert expected <= live.keys() and "metrics_routes" in live

        ended = wait_for(
            lambda: (e := entries(daemon))["idempotency_keys"] == 0 and e, what="the prune"
        )
        assert ended["suppressions"] == 1  # the one that has not ended stays
        assert ended["queue_messages"] == 0 and ended["metrics_routes"] == 0
