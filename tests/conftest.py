from __future__ import annotations

import pytest
from daemon_process import DaemonProcess


@pytest.fixture
def start_daemon(tmp_path):
    """Factory: start_daemon("section.key=value", ..., config="toml") -> running DaemonProcess."""
    started: list[DaemonProcess] = []

    def start(*overrides: str, config: str | None = None, workdir=None) -> DaemonProcess:
        daemon = DaemonProcess(workdir or tmp_path, *overrides, config=config)
        started.append(daemon)
        return daemon.start()

    yield start
    for daemon in started:
        daemon.kill()


@pytest.fixture
def daemon(start_daemon) -> DaemonProcess:
    return start_daemon()
