"""The test harness itself: subprocesses run this tree, and no test can spin forever."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TREE = Path(__file__).resolve().parent.parent


def test_subprocesses_import_the_work_tree_not_an_installed_copy(tmp_path):
    # From a foreign cwd, as tests/daemon_process.py starts the daemon.
    result = subprocess.run(
        [sys.executable, "-c", "import mtaqueue; print(mtaqueue.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(result.stdout.strip()).resolve().is_relative_to(TREE / "mtaqueue")


def test_every_test_has_a_timeout(request):
    assert request.config.pluginmanager.hasplugin("timeout"), "pytest-timeout is not installed"
    assert float(request.config.getini("timeout")) > 0
