"""bench/silent_throttle.py's arithmetic: comfort minimum, the shipped config it runs, and
the figures of a run computed from a made-up provider report (no daemon, no network)."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
from recovery_storm import Planned, Run  # noqa: E402
from silent_throttle import PROVIDERS, Provider, scenario, shipped_config  # noqa: E402
from silent_throttle_figures import figures, table, targets  # noqa: E402
from slow_peer import RECORD_FIELDS  # noqa: E402

SHIPPED = tomllib.loads((BENCH.parent / "conf" / "mtaqueue.toml").read_text())


def test_comfort_minimum_of_each_kind_of_provider():
    cap = SHIPPED["shaping"]["default"]["max_connections"]
    assert Provider("s", sessions=3, dot_delay=0.25).comfort_min(120) == pytest.approx(10.0)
    assert Provider("r", rate=15, dot_delay=0.1).comfort_min(150) == pytest.approx(10.0)
    assert Provider("b", sessions=4, rate=10).comfort_min(100) == pytest.approx(10.0)
    assert Provider("g", sessions=3, greylist=3).comfort_min(120) == pytest.approx(13.0)
    assert Provider("slow", dot_delay=1.0).throughput == cap  # no session level: the cap
    assert PROVIDERS["dot-only"].peer_args(0.01)[-1] == "--dot-only"
    assert "--greylist" in PROVIDERS["grey"].peer_args(0.01)  # 3 s real = 300 s unscaled
    args = PROVIDERS["grey"].peer_args(0.01)
    assert float(args[args.index("--greylist") + 1]) == pytest.approx(300)


def test_the_run_uses_the_shipped_file_with_only_bench_changes(tmp_path):
    s = scenario(100, 0.01, 20, 2048)
    cfg = shipped_config(s, tmp_path / "spool", 2600, 2601, "127.0.0.1:5353")
    assert cfg["shaping"]["default"] == SHIPPED["shaping"]["default"]  # nothing for the provider
    assert cfg["shaping"]["latency_factor"] == SHIPPED["shaping"]["latency_factor"]
    assert cfg["shaping"]["destinations"] == []
    assert cfg["delivery"]["port"] == 2600 and cfg["dns"]["nameservers"] == ["127.0.0.1:5353"]
    assert cfg["retry"]["schedule"] == ["3s", "9s", "18s", "36s"]  # scaled by 0.01
    assert cfg["delivery"]["timeouts"] == SHIPPED["delivery"]["timeouts"]


def made_up_run(release: float) -> Run:
    """Four backlog messages and one live p0: two accepted in the learning period (one
    past comfort), three after it (two past)."""
    planned = [Planned(i, "p0" if i == 0 else "p2", f"<b{i}@t>", f"u{i}@example.org")
               for i in range(4)]  # fmt: skip
    run = Run("mtaqueue", "mtaqueue (shipped config)", planned, release=release)
    run.drained_at = 60.0
    rows = [  # dot, reply (s after release), message_id, past
        (1.0, 1.5, "<b0@t>", False),
        (10.0, 11.0, "<b1@t>", True),
        (31.0, 32.0, "<b2@t>", True),
        (35.0, 36.0, "<live@t>", False),
        (39.0, 40.0, "<b3@t>", True),
        (41.0, 41.5, "<b3@t>", False),  # a duplicate: only the first acceptance counts
    ]
    records = [
        [release + dot, release + reply, mid, "127.0.0.1", 4, 1.0, past, reply - dot]
        for dot, reply, mid, past in rows
    ]
    run.report = {
        "comfort": {
            "records_fields": RECORD_FIELDS, "records": records, "connections": 7,
            "max_sessions": 5, "samples": [[release + 40, "127.0.0.1", 4, 2.0]],
            "delay_s": {"banner": 2.0, "dot_throttle": 3.0, "dot_fixed": 1.0},
            "banner_delays": 2,
        },
        "messages": {"duplicate_deliveries": 1},
        "reply_classes": {"4xx": 0, "5xx": 0},
        "errors": [],
    }  # fmt: skip
    run.extra["live"] = {"submitted": {"<live@t>": release + 34.0}, "failed": []}
    run.extra["latency_lessons"] = [["t1", "rate", 600.0, 240.0], ["t2", "rate", 240.0, 300.0]]
    return run


def test_figures_of_a_made_up_run():
    release = 1_000_000.0
    run = made_up_run(release)
    p = Provider("sessions", sessions=3, dot_delay=0.25)  # 12/s: 5 messages in 5/12 s
    f = figures(run, p, learning=30)
    assert (f["messages"], f["delivered"]) == (5, 5)
    assert (f["after_learning"], f["past_after"]) == (3, 2)
    assert f["share_past"] == pytest.approx(2 / 3)
    assert f["share_past_all"] == pytest.approx(3 / 5)
    assert f["drain_s"] == pytest.approx(40.0)  # the last first acceptance's 250
    assert f["ratio"] == pytest.approx(40.0 / (5 / 12))
    assert f["p0_live_p99"] == pytest.approx(2.0)  # 250 at the provider 2 s after submission
    assert f["p0_backlog_p99"] == pytest.approx(1.5)
    assert f["throttle_delay_s"] == 5.0 and f["sessions_p50_after"] == 4
    assert (f["latency_cuts"], f["latency_rate_min"]) == (1, 240.0)
    assert targets(f, p) == {"share": False, "ratio": False, "throughput": None}
    text = table([(p, run)], 30)
    assert "67% (2 of 3); 60% ✗" in text and "| 5; 1; 0 / 0 (0) |" in text


def test_no_drain_figure_until_every_message_is_accepted():
    run = made_up_run(0.0)
    run.report["comfort"]["records"] = run.report["comfort"]["records"][:3]
    f = figures(run, PROVIDERS["slow"], learning=30)
    assert f["delivered"] == 3 and f["drain_s"] is None and f["ratio"] is None
    assert f["share_past"] is None  # no comfort level: nothing to be past
    assert targets(f, PROVIDERS["slow"]) == {"share": None, "ratio": False, "throughput": False}
