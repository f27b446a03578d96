"""The tree stays ruff-clean (lint and format), as the house style asks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, str(ROOT)], capture_output=True, text=True
    )


def test_ruff_check():
    result = ruff("check", "--no-cache")
    assert result.returncode == 0, result.stdout


def test_ruff_format():
    result = ruff("format", "--check", "--no-cache")
    assert result.returncode == 0, result.stdout
