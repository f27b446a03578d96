"""Without -c, the daemon and mtaqueue-ctl look for their config the same way:
$MTAQUEUE_CONFIG, else /etc/mtaqueue/mtaqueue.toml if it exists, else the built-in
defaults. So a bare `mtaqueue-ctl status` finds a bare `mtaqueue`'s socket."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from daemon_process import DaemonProcess

from mtaqueue import config
from mtaqueue.config import loading
from mtaqueue.control.ctl import main as ctl
from mtaqueue.daemon import main as daemon_main


def test_default_path_order(tmp_path, monkeypatch):
    system = tmp_path / "system.toml"
    monkeypatch.setattr(loading, "SYSTEM_CONFIG", str(system))
    monkeypatch.delenv("MTAQUEUE_CONFIG", raising=False)
    assert config.default_path() is None  # nothing there: the built-in defaults
    system.write_text("")
    assert config.default_path() == str(system)
    monkeypatch.setenv("MTAQUEUE_CONFIG", "/somewhere/else.toml")
    assert config.default_path() == "/somewhere/else.toml"


def test_ctl_without_a_config_finds_a_daemon_on_the_built_in_defaults(
    start_daemon, tmp_path, monkeypatch, capsys
):
    # The daemon's spool and socket where the defaults put them, relative to its cwd.
    daemon = start_daemon("spool.path=spool", "control.socket=")
    monkeypatch.setattr(loading, "SYSTEM_CONFIG", str(tmp_path / "absent.toml"))
    monkeypatch.delenv("MTAQUEUE_CONFIG", raising=False)
    monkeypatch.chdir(daemon.workdir)
    assert ctl.main(["status", "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and json.loads(out)["pid"] == daemon.proc.pid


def test_daemon_and_ctl_both_read_mtaqueue_config(tmp_path):
    # The socket is in the file too, where the ctl looks for it (-o is the daemon's alone).
    socket = tmp_path / "control.sock"
    daemon = DaemonProcess(
        tmp_path, config=f'[control]\nsocket = "{socket}"\n[submission]\ndefault_class = "p2"\n'
    )
    assert daemon.socket == socket
    daemon.config_in_env = True  # no -c
    try:
        daemon.start()
        queue_id = daemon.send("a@sender.test", ["b@rcpt.test"], b"Subject: x\r\n\r\nx\r\n")
        result = subprocess.run(
            [sys.executable, "-m", "mtaqueue.control.ctl.main", "list", "--json"],  # no -c, no -s
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "MTAQUEUE_CONFIG": str(daemon.config_path)},
        )
        assert result.returncode == 0, result.stderr
        [message] = map(json.loads, result.stdout.splitlines())
        assert message["id"] == queue_id
        assert message["class"] == "p2"  # the daemon read the file
        status = json.loads(daemon.ctl("status", "--json").stdout)
        assert status["config"] == str(daemon.config_path)
    finally:
        daemon.kill()


def test_daemon_help_explains_c_and_o(capsys):
    with pytest.raises(SystemExit):
        daemon_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"$MTAQUEUE_CONFIG, else {config.SYSTEM_CONFIG} if it exists" in text
    assert "-o SECTION.KEY=VALUE set one config key over the file (repeatable)" in text
