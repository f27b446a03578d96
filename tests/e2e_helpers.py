"""Shared bits of the end-to-end delivery tests."""

from __future__ import annotations

import time

FAST = (
    "delivery.enabled=true",
    'retry.schedule=["2s", "4s"]',
    'retry.then=["6s", "8s"]',
    "retry.jitter=0.05",
    "retry.greylist_min=2s",
    "retry.restart_spread=0.5s",
    "delivery.host_suspend=3s",
    "delivery.timeouts.connect=2s",
    "delivery.timeouts.banner=3s",
    "dns.timeout=1s",
)
BODY = b"Subject: hello\r\nFrom: app@sender.test\r\n\r\nhello world\r\n"


def wait_for(condition, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def events(daemon, name: str) -> list[dict]:
    return [e for e in daemon.events if e.get("event") == name]
