"""The systemd notify protocol, with a datagram socket standing in for systemd."""

from __future__ import annotations

import socket
import time

import pytest
from daemon_process import DaemonProcess

from mtaqueue.sdnotify import Notifier


@pytest.fixture
def systemd(tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(10)
    yield path, sock
    sock.close()


def receive_until(sock: socket.socket, wanted: str, seen: list[str]) -> list[str]:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        message = sock.recv(4096).decode()
        seen.append(message)
        if wanted in message.splitlines():
            return seen
    raise AssertionError(f"no {wanted} in {seen}")


def test_ready_watchdog_and_stopping(systemd, tmp_path):
    path, sock = systemd
    daemon = DaemonProcess(tmp_path / "d")
    daemon.env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"}
    daemon.start()
    try:
        seen = receive_until(sock, "READY=1", [])
        ready = next(m for m in seen if "READY=1" in m.splitlines())
        assert "STATUS=accepting on 127.0.0.1:" in ready
        assert f"MAINPID={daemon.proc.pid}" in ready.splitlines()
        pings = [m for m in receive_until(sock, "WATCHDOG=1", []) if m == "WATCHDOG=1"]
        pings += [m for m in receive_until(sock, "WATCHDOG=1", []) if m == "WATCHDOG=1"]
        assert len(pings) >= 2  # every half of WatchdogSec, from the event loop
        daemon.proc.send_signal(15)
        stopping = receive_until(sock, "STOPPING=1", [])
        assert any("STATUS=stopping" in m for m in stopping)
        assert daemon.proc.wait(30) == 0
    finally:
        daemon.kill()


def test_outside_systemd_nothing_is_sent():
    assert Notifier({}).send("READY=1") is False
    assert Notifier({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}).watchdog_interval is None


def test_abstract_socket_address():
    assert Notifier({"NOTIFY_SOCKET": "@mtaqueue-test"}).address == "\0mtaqueue-test"


def test_unit_file_passes_systemd_analyze(tmp_path):
    import shutil
    import subprocess
    from pathlib import Path

    analyze, daemon = shutil.which("systemd-analyze"), shutil.which("mtaqueue")
    if analyze is None or daemon is None:
        pytest.skip("systemd-analyze (or the installed mtaqueue script) is not on this machine")
    unit = (Path(__file__).parent.parent / "systemd" / "mtaqueue.service").read_text()
    assert "Type=notify" in unit and "WatchdogSec=" in unit and "ExecReload=" in unit
    assert "NoNewPrivileges=yes" in unit and "ProtectSystem=strict" in unit
    # The unit names the usual install path; check it against where it is installed here.
    local = tmp_path / "mtaqueue.service"
    local.write_text(unit.replace("/usr/local/bin/mtaqueue", daemon))
    result = subprocess.run([analyze, "verify", str(local)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
