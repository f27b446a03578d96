"""bench/soak.py runs end to end (issue 31): a 30-second soak at 10 msg/s with the writer
killed at 15 s loses no acknowledged message and delivers none twice. Its figures (the
growth per hour) mean nothing over 30 s and are not checked here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "soak.py"


def test_short_soak_loses_nothing(postfix_installed, unbound_installed, tmp_path) -> None:
    figures = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--minutes", "0.5", "--warmup", "0", "--rate", "10",
         "--sample-every", "10", "--json", str(figures)],
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    checks = json.loads(figures.read_text())["checks"]
    assert checks["acked"] >= 250, checks
    assert checks["lost"] == 0 and checks["duplicates"] == 0, checks
    assert checks["bad_recipient_without_dsn"] == 0, checks
    assert any("killed" in event for event in json.loads(figures.read_text())["events"])
