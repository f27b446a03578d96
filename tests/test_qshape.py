"""qshape: counts per domain and age bucket, pure and through the ctl."""

from __future__ import annotations

import json

from mtaqueue.control.qshape import LABELS, QShape, render
from mtaqueue.model import DELIVERED, Message, Recipient

NOW = 1_000_000.0


def message(i: int, minutes: float, *domains: str, klass="p1", sender="a@s.test", tenant=None):
    return Message(
        id=f"{i:016X}",
        sender=sender,
        recipients=tuple(Recipient(f"u{i}@{d}") for d in domains),
        created=NOW - minutes * 60,
        size=100,
        klass=klass,
        tenant=tenant,
    )


def qshape(messages, now, *, top=20, **options) -> list[dict]:
    shape = QShape(now, **options)
    for msg in messages:
        shape.add(msg)
    return shape.rows(top)


def column(label: str) -> int:
    return LABELS.index(label)


def test_rows_by_domain_and_age_bucket():
    queue = [
        message(1, 1, "gmail.com"),
        message(2, 7, "gmail.com"),
        message(3, 7, "yahoo.com", "gmail.com"),
        message(4, 3000, "yahoo.com"),
        message(5, 1279.9, "example.org", klass="p2"),
    ]
    rows = qshape(queue, NOW)
    total, *domains = rows
    assert total["key"] == "TOTAL" and total["total"] == 5
    assert total["buckets"][column("5")] == 1 and total["buckets"][column("10")] == 2
    assert total["buckets"][column("1280")] == 1 and total["buckets"][column("1280+")] == 1
    by_key = {row["key"]: row for row in domains}
    assert domains[0]["key"] == "gmail.com"  # busiest first
    assert by_key["gmail.com"]["total"] == 3 and by_key["gmail.com"]["buckets"][column("10")] == 2
    assert by_key["yahoo.com"]["buckets"][column("1280+")] == 1
    assert [r["key"] for r in qshape(queue, NOW, klass="p2")] == ["TOTAL", "example.org"]
    assert len(qshape(queue, NOW, top=1)) == 2


def test_by_sender_and_tenant_and_finished_recipients_left_out():
    finished = Message(
        id="A" * 16, sender="x@y.test",
        recipients=(Recipient("z@gmail.com", state=DELIVERED),), created=NOW, size=1, klass="p1",
    )  # fmt: skip
    queue = [
        message(1, 1, "gmail.com", tenant="shop"),
        message(2, 1, "gmail.com", sender=""),
        finished,
    ]
    assert {r["key"] for r in qshape(queue, NOW, by="sender")} == {"TOTAL", "s.test", "<>"}
    assert {r["key"] for r in qshape(queue, NOW, by="tenant")} == {"TOTAL", "shop", "-"}
    assert qshape(queue, NOW)[0]["total"] == 2
    table = render(qshape(queue, NOW))
    assert table.splitlines()[0].split()[-1] == "1280+" and "gmail.com" in table


def test_qshape_through_the_ctl(daemon):
    for rcpt in ("a@gmail.com", "b@gmail.com", "c@yahoo.com"):
        daemon.send("app@example.com", [rcpt], b"Subject: q\r\n\r\nq\r\n")
    result = daemon.ctl("qshape", "--json")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert rows[0] == {"key": "TOTAL", "total": 3, "buckets": [3] + [0] * 9}
    assert rows[1]["key"] == "gmail.com" and rows[1]["total"] == 2
    human = daemon.ctl("qshape").stdout
    assert "TOTAL" in human and "yahoo.com" in human


def test_top_shows_the_busiest_destinations(start_daemon):
    daemon = start_daemon()
    daemon.send("app@example.com", ["a@example.org"], b"Subject: t\r\n\r\nt\r\n")
    result = daemon.ctl("top", "--count", "2", "--interval", "0.1")
    assert result.returncode == 0, result.stderr
    screens = result.stdout.count("destination")
    assert screens == 2 and "messages 1" in result.stdout
