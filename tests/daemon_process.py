"""Run the real daemon as a subprocess for end-to-end tests.

The daemon binds port 0 and announces its address in the `ready` log event;
every log line (JSON) is kept so tests can assert on events.
"""

from __future__ import annotations

import json
import os
import signal
import smtplib
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO

from mtaqueue.spool import journal
from mtaqueue.spool.layout import SpoolLayout
from mtaqueue.spool.message_file import read_message_file

READY_TIMEOUT = 30.0


class DaemonProcess:
    def __init__(self, workdir: Path, *overrides: str, config: str | None = None) -> None:
        self.workdir = workdir
        self.spool = workdir / "spool"
        self.socket = workdir / "control.sock"
        self.config_path = workdir / "mtaqueue.toml"
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(config or "")
        self.overrides = [
            f"spool.path={self.spool}",
            f"control.socket={self.socket}",
            "listen.address=127.0.0.1:0",
            "listen.hostname=mx.test",
            "delivery.enabled=false",  # submission tests keep their mail queued
            *overrides,
        ]
        self.events: list[dict] = []
        self.env: dict[str, str] = {}  # added to the daemon's environment
        self.config_in_env = False  # name the config in $MTAQUEUE_CONFIG instead of -c
        self.proc: subprocess.Popen | None = None
        self.port = 0

    # -- life ---------------------------------------------------------------------

    def start(self) -> DaemonProcess:
        self.events = []  # this run's log only
        args = [sys.executable, "-m", "mtaqueue.daemon"]
        env = {**os.environ, **self.env}
        if self.config_in_env:
            env["MTAQUEUE_CONFIG"] = str(self.config_path)
        else:
            args += ["-c", str(self.config_path)]
        for item in self.overrides:
            args += ["-o", item]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=self.workdir, env=env
        )
        ready = threading.Event()
        threading.Thread(target=self._read_log, args=(self.proc, ready), daemon=True).start()
        if not ready.wait(READY_TIMEOUT) or self.port == 0:
            self.kill()
            raise RuntimeError(f"daemon did not become ready; log: {self.events[-5:]}")
        return self

    def _read_log(self, proc: subprocess.Popen, ready: threading.Event) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            try:
                event = json.loads(line)
            except ValueError:
                event = {"event": "non_json", "text": line.decode(errors="replace")}
            self.events.append(event)
            if event.get("event") == "ready":
                self.port = int(event["listen"][0].rsplit(":", 1)[1])
                ready.set()
        ready.set()  # exited before ready

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> DaemonProcess:
        if self.proc is not None and self.proc.poll() is None:
            assert self.stop() == 0
        return self.start()

    # -- talking to it -------------------------------------------------------------

    def smtp(self) -> smtplib.SMTP:
        client = smtplib.SMTP("127.0.0.1", self.port, timeout=30)
        client.ehlo("client.test")
        return client

    def send(self, sender: str, recipients: list[str], content: bytes, **kw) -> str:
        """Submit one message; returns the queue id from the 250 reply."""
        with self.smtp() as client:
            client.mail(sender, kw.get("mail_options", []))
            for rcpt in recipients:
                code, reply = client.rcpt(rcpt, kw.get("rcpt_options", []))
                assert code == 250, reply
            code, reply = client.data(content)
        assert code == 250, reply
        return reply.decode().rsplit(" ", 1)[1]

    def open_data(self, envelope: bytes, timeout: float = 30.0) -> tuple[socket.socket, BinaryIO]:
        """A raw session (smtplib would fix the line endings of what is sent) past EHLO
        and `envelope` (MAIL, RCPT, DATA: each accepted) up to the 354."""
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        reader = sock.makefile("rb")
        reader.readline()
        sock.sendall(b"EHLO c\r\n")
        while not reader.readline().startswith(b"250 "):
            pass
        sock.sendall(envelope)
        assert [reader.readline()[:3] for _ in range(3)] == [b"250", b"250", b"354"]
        return sock, reader

    def stored(self, queue_id: str) -> bytes:
        """A queued message's content as the spool holds it: in its file, or, while its
        file waits (spool/filing.py), in the journal."""
        layout = SpoolLayout(self.spool)
        path = layout.message_path(queue_id)
        if not path.exists():
            waiting = journal.replay(layout.journal, repair=False).state.unfiled
            if queue_id in waiting:
                return waiting[queue_id][1]
        _, content = read_message_file(path)  # (written meanwhile, if not waiting)
        return content

    def ctl(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "mtaqueue.control.ctl.main", "-s", str(self.socket), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    def messages(self) -> dict[str, dict]:
        result = self.ctl("list", "--json")
        assert result.returncode == 0, result.stderr
        return {m["id"]: m for m in map(json.loads, result.stdout.splitlines())}

    def wait_event(self, name: str, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in list(self.events):
                if event.get("event") == name:
                    return event
            time.sleep(0.02)
        raise AssertionError(f"no {name!r} event in {timeout}s")


def environment_has_root() -> bool:
    return os.geteuid() == 0
