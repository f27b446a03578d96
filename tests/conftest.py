from __future__ import annotations

import os
from pathlib import Path

import pytest
from daemon_process import DaemonProcess
from hypothesis import settings

# Properties check behaviour, not speed: hypothesis' per-example deadline (200 ms) would
# turn a loaded CI machine into failures. Speed belongs in bench/.
settings.register_profile("mtaqueue", deadline=None)
settings.load_profile("mtaqueue")

# Every subprocess a test starts (`python -m mtaqueue.daemon`, the writer, the ctl) imports
# this tree, never an installed copy: after `pip install .` the tests still test the work tree.
TREE = str(Path(__file__).resolve().parent.parent)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [TREE, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
)


@pytest.fixture
def start_daemon(tmp_path):
    """Factory: start_daemon("section.key=value", ..., config="toml", env={...}) -> running
    DaemonProcess (`env`: added to its environment)."""
    started: list[DaemonProcess] = []

    def start(
        *overrides: str, config: str | None = None, workdir=None, env: dict | None = None
    ) -> DaemonProcess:
        daemon = DaemonProcess(workdir or tmp_path, *overrides, config=config)
        daemon.env.update(env or {})
        started.append(daemon)
        return daemon.start()

    yield start
    for daemon in started:
        daemon.kill()


@pytest.fixture
def daemon(start_daemon) -> DaemonProcess:
    return start_daemon()
