"""The control socket end to end: a real ControlServer on a temp socket, driven by
`mtaqueue-ctl`'s main() and by raw protocol lines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncGenerator, Coroutine, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from loop_ticks import ticks_during

from mtaqueue.control import protocol
from mtaqueue.control.commands import queue_commands
from mtaqueue.control.ctl import main as ctl
from mtaqueue.control.ctl import render
from mtaqueue.control.operations import operation_commands
from mtaqueue.control.server import Command, CommandError, ControlError, ControlServer
from mtaqueue.ids import IdGenerator
from mtaqueue.model import RECIPIENT_STATES, Message, Recipient
from mtaqueue.spool import walk
from mtaqueue.spool.records import MessageMap

REPO = Path(__file__).resolve().parents[1]
NOW = 1_700_000_000.0
_ids = IdGenerator()

URGENT = Message(
    id=_ids.next(NOW),
    sender="alice@example.com",
    recipients=(
        Recipient(
            "bob@gmail.com",
            state="deferred",
            attempts=2,
            next_attempt=NOW + 300,
            last_reply="451 4.7.1 try again later",
        ),
        Recipient("carol@example.net"),
    ),
    created=NOW,
    size=2048,
    klass="p0",
    tenant="webapp",
    client="127.0.0.1",
)
HELD = Message(
    id=_ids.next(NOW + 1),
    sender="shop@example.com",
    recipients=(
        Recipient("dave@Yahoo.com"),
        Recipient("erin@example.net", state="delivered", attempts=1, last_reply="250 2.0.0 ok"),
    ),
    created=NOW + 1,
    size=4096,
    klass="p1",
    held=True,
    idempotency_key="order-17",
)
BULK = Message(
    id=_ids.next(NOW + 2),
    sender="news@example.com",
    recipients=(
        Recipient(
            "frank@gmail.com",
            orcpt="rfc822;frank@gmail.com",
            notify="FAILURE,DELAY",
            state="bounced",
            attempts=1,
            last_reply="550 5.1.1 no such user",
        ),
    ),
    created=NOW + 2,
    size=100_000,
    klass="p2",
    envid="news-42",
    ret="HDRS",
    body="8BITMIME",
)
DSN = Message(
    id=_ids.next(NOW + 3),
    sender="",
    recipients=(Recipient("josé@exämple.com", state="expired", attempts=9),),
    created=NOW + 3,
    size=900,
    klass="p0",
    expires=NOW + 86400,
    smtputf8=True,
)
MESSAGES = {m.id: m for m in (URGENT, HELD, BULK, DSN)}
INFO = {"version": "0.1.0", "pid": 4242, "uptime": 3725.4, "listen": ["127.0.0.1:25", "[::1]:25"]}


class LoopThread:
    """An asyncio loop in a background thread, as the daemon's loop would be."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.stop()


def serve(
    loop: LoopThread, path: str, commands: dict[str, Command], mode: int = 0o600
) -> ControlServer:
    server = ControlServer(path, mode, commands)
    loop.run(server.start())
    return server


def _commands(messages: dict[str, Message]) -> dict[str, Command]:
    return queue_commands(lambda: messages, lambda: dict(INFO))


@pytest.fixture
def sock_path(loop: LoopThread, tmp_path: Path) -> Iterator[str]:
    path = str(tmp_path / "control.sock")
    server = serve(loop, path, _commands(MESSAGES))
    yield path
    loop.run(server.close())


@pytest.fixture
def big_queue(loop: LoopThread, tmp_path: Path) -> Iterator[str]:
    """A queue big enough that a reply fills the socket and pipe buffers."""
    messages = {}
    for i in range(5000):
        msg = Message(
            id=_ids.next(NOW + i),
            sender="news@example.com",
            recipients=(Recipient(f"user{i}@example.org"),),
            created=NOW + i,
            size=1000,
            klass="p2",
        )
        messages[msg.id] = msg
    path = str(tmp_path / "big.sock")
    server = serve(loop, path, _commands(messages))
    yield path
    loop.run(server.close())


def run_ctl(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = ctl.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def raw(path: str, payload: bytes) -> list[dict[str, Any]]:
    """Send raw bytes and return every reply line, decoded."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        # The server may answer and hang up before it has read everything.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(payload)
        replies = []
        with sock.makefile("rb") as lines:
            for line in lines:
                replies.append(json.loads(line))
                if "ok" in replies[-1]:
                    break  # reading on could meet a reset when the server left data unread
        return replies


# --- status, list, show through mtaqueue-ctl


def test_status_json(sock_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_ctl(capsys, "-s", sock_path, "status", "--json")
    assert (code, err) == (0, "")
    [line] = out.splitlines()
    status = json.loads(line)
    assert status["messages"] == 4
    assert status["recipients"] == 6
    assert status["by_state"] == {
        "queued": 1,
        "deferred": 1,
        "delivered": 1,
        "bounced": 1,
        "expired": 1,
        "held": 1,
    }
    assert status["by_class"] == {"p0": 2, "p1": 1, "p2": 1}
    assert status["version"] == "0.1.0"
    assert status["pid"] == 4242


def test_status_human(sock_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_ctl(capsys, "-s", sock_path, "status")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["messages", "4"]
    assert "  deferred" in out
    assert any(line.split() == ["classes", "p0", "2,", "p1", "1,", "p2", "1"] for line in lines)
    assert any(line.split() == ["version", "0.1.0"] for line in lines)
    # Units and plain lists, not a float and a Python repr.
    assert any(line.split() == ["uptime", "1h", "02m", "05s"] for line in lines)
    assert any(line.split() == ["listen", "127.0.0.1:25,", "[::1]:25"] for line in lines)


# A destination as `domains --json` gave it against a provider taking 10 messages a second
# and 3 connections (docs/runbooks.md), replies shortened.
PROBING = {
    "destination": "mx.example.org:25",
    "routed": True,
    "domains": ["example.org"],
    "queued": {"p0": 0, "p1": 331, "p2": 0},
    "deferred": {"p1": 4},
    "active": 2,
    "limit": 3,
    "mode": "normal",
    "stage": 0,
    "circuit": "closed",
    "messages_per_minute": 662.4563250000001,
    "connections_per_minute": 0.0,
    "learned": {
        "rate_per_minute": 662.4563250000001,
        "good_per_minute": 723.4999999999999,
        "rate_reply": "421 4.7.28 [127.0.0.1] Our system has detected an unusual rate",
        "concurrency": 3,
        "concurrency_reply": "421 4.7.0 Too many concurrent SMTP connections",
        "phase": "probing",
        "probing": True,
        "paused_until": None,
    },
    "override": None,
    "suspended_hosts": {},
    "deferral_rate": 0.02,
    "last_replies": [],
}


def test_domains_human_shows_a_learned_rate_plainly(
    loop: LoopThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async def domains(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        yield PROBING

    path = str(tmp_path / "c.sock")
    server = serve(loop, path, {"domains": domains})
    try:
        code, out, _ = run_ctl(capsys, "-s", path, "domains")
    finally:
        loop.run(server.close())
    assert code == 0
    lines = out.splitlines()
    # A tenth of a message a minute, not six decimals; "probing" said once.
    assert "  rates       662.5/min messages, unlimited connections" in lines
    assert "  learned     rate 662.5/min (probing), it took 723.5/min" in lines
    assert "  learned     at most 3 connections" in lines


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (12.5, "12s"), (185, "3m 05s"), (7210, "2h 00m 10s"), (86400, "1d 00h 00m 00s")],
)
def test_durations_have_units(seconds: float, text: str) -> None:
    assert render.duration(seconds) == text


def test_list_json_contract(sock_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_ctl(capsys, "-s", sock_path, "list", "--json")
    assert (code, err) == (0, "")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [row["id"] for row in rows] == list(MESSAGES)
    for row in rows:
        assert isinstance(row["id"], str)
        assert isinstance(row["class"], str)
        assert isinstance(row["sender"], str)
        assert isinstance(row["created"], int | float)
        assert isinstance(row["size"], int)
        assert isinstance(row["held"], bool)
        assert row["recipients"]
        for rcpt in row["recipients"]:
            assert isinstance(rcpt["address"], str)
            assert rcpt["state"] in RECIPIENT_STATES
            assert isinstance(rcpt["attempts"], int)
            assert rcpt["next_attempt"] is None or isinstance(rcpt["next_attempt"], int | float)
            assert rcpt["last_reply"] is None or isinstance(rcpt["last_reply"], str)
    urgent = rows[0]
    assert urgent["class"] == "p0"
    assert urgent["created"] == NOW
    assert urgent["recipients"][0]["next_attempt"] == NOW + 300
    assert urgent["recipients"][0]["last_reply"] == "451 4.7.1 try again later"
    assert rows[3]["sender"] == ""
    assert rows[3]["recipients"][0]["address"] == "josé@exämple.com"


def test_held_message_shows_pending_recipients_as_held(
    sock_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out, _ = run_ctl(capsys, "-s", sock_path, "show", HELD.id, "--json")
    shown = json.loads(out)
    assert shown["held"] is True
    assert [r["state"] for r in shown["recipients"]] == ["held", "delivered"]


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        (["--class", "p0"], [URGENT, DSN]),
        (["--state", "deferred"], [URGENT]),
        (["--state", "held"], [HELD]),
        (["--state", "queued"], [URGENT]),  # the held message's queued recipient shows as held
        (["--domain", "GMAIL.com"], [URGENT, BULK]),
        (["--domain", "yahoo.com"], [HELD]),
        (["--sender", "ALICE@example.com"], [URGENT]),
        (["--sender", "<>"], [DSN]),
        (["--held"], [HELD]),
        (["--not-held"], [URGENT, BULK, DSN]),
        (["--class", "p0", "--domain", "gmail.com"], [URGENT]),
        (["--class", "p9"], []),
    ],
)
def test_list_filters(
    sock_path: str,
    capsys: pytest.CaptureFixture[str],
    filters: list[str],
    expected: list[Message],
) -> None:
    code, out, _ = run_ctl(capsys, "-s", sock_path, "list", "--json", *filters)
    assert code == 0
    assert [json.loads(line)["id"] for line in out.splitlines()] == [m.id for m in expected]


def test_list_human(sock_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_ctl(capsys, "-s", sock_path, "list")
    assert code == 0
    lines = out.splitlines()
    first = lines[0].split()
    assert first[:2] == [URGENT.id, "2048"]
    assert first[3:] == ["p0", "alice@example.com"]
    assert lines[1].startswith("    bob@gmail.com  deferred, 2 attempts, next ")
    assert lines[1].endswith(": 451 4.7.1 try again later")
    assert lines[2] == "    carol@example.net  queued"
    assert lines[3].endswith("shop@example.com  (held)")
    assert any(line.split()[-1] == "<>" for line in lines if line.startswith(DSN.id))
    assert lines[-1] == "-- 4 messages, 107044 bytes"


def test_show_json_has_every_field(sock_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_ctl(capsys, "-s", sock_path, "show", BULK.id, "--json")
    assert code == 0
    shown = json.loads(out)
    assert shown["envid"] == "news-42"
    assert shown["ret"] == "HDRS"
    assert shown["body"] == "8BITMIME"
    assert set(shown) >= {"expires", "tenant", "idempotency_key", "client", "smtputf8"}
    [rcpt] = shown["recipients"]
    assert rcpt["orcpt"] == "rfc822;frank@gmail.com"
    assert rcpt["notify"] == "FAILURE,DELAY"


def test_show_human(sock_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_ctl(capsys, "-s", sock_path, "show", URGENT.id)
    assert code == 0
    fields = {line.split()[0]: line.split(maxsplit=1)[1] for line in out.splitlines()}
    assert fields["id"] == URGENT.id
    assert fields["class"] == "p0"
    assert fields["tenant"] == "webapp"
    assert fields["envid"] == "-"
    assert fields["held"] == "no"
    assert fields["created"].startswith("2023-11-1")  # ISO time, local zone
    assert "recipient        bob@gmail.com" in out
    assert "  last_reply     451 4.7.1 try again later" in out


# --- errors


def test_unknown_id(sock_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_ctl(capsys, "-s", sock_path, "show", "NOPE")
    assert (code, out) == (1, "")
    assert err == "mtaqueue-ctl: no message with id NOPE\n"


def test_missing_socket(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "none.sock")
    code, out, err = run_ctl(capsys, "-s", path, "status")
    assert (code, out) == (1, "")
    assert err == (
        f"mtaqueue-ctl: cannot connect to {path}: No such file or directory"
        " (is the daemon running?)\n"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["frobnicate"],
        [],
        ["list", "--held", "--not-held"],
        ["show"],
        ["list", "--state", "stuck"],
        ["-c", "x.toml", "-s", "y.sock", "status"],
    ],
)
def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    code, out, err = run_ctl(capsys, *argv)
    assert (code, out) == (2, "")
    assert err.startswith("mtaqueue-ctl: ")
    assert err.count("\n") == 1


def test_ctl_takes_o_like_the_daemon(
    sock_path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # No -c: the defaults, with the socket the daemon was told with -o.
    code, out, _ = run_ctl(capsys, "-o", f"control.socket={sock_path}", "status", "--json")
    assert code == 0 and json.loads(out.splitlines()[0])["messages"] == len(MESSAGES)
    # Over a file: the -o wins, as for the daemon.
    conf = tmp_path / "mtaqueue.toml"
    conf.write_text(f'[control]\nsocket = "{tmp_path / "elsewhere.sock"}"\n')
    code, _, _ = run_ctl(capsys, "-c", str(conf), "-o", f"control.socket={sock_path}", "status")
    assert code == 0
    # A bad override: the config's one-line error, exit 1.
    code, out, err = run_ctl(capsys, "-o", "control.nosuch=1", "status")
    assert (code, out, err) == (1, "", "mtaqueue-ctl: control.nosuch: unknown key\n")


def test_unreadable_config_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("mtaqueue.config")
    code, out, err = run_ctl(capsys, "-c", str(tmp_path / "missing.toml"), "status")
    assert (code, out) == (1, "")
    assert err.startswith("mtaqueue-ctl: ")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (b'{"cmd": "nope"}\n', "unknown command 'nope'"),
        (b"{not json\n", "malformed request"),
        (b'{"cmd": "list", "args": []}\n', "malformed request"),
        (b'{"cmd": "list", "args": {"bogus": 1}}\n', "bad list filter"),
        (b'{"cmd": "list", "args": {"held": "yes"}}\n', "bad list filter"),
        (b'{"cmd": "show", "args": {}}\n', "show needs a message id"),
        (b"x" * (protocol.MAX_REQUEST + 10) + b"\n", "request longer than"),
    ],
)
def test_bad_requests_get_an_error_line(sock_path: str, payload: bytes, error: str) -> None:
    [reply] = raw(sock_path, payload)
    assert reply["ok"] is False
    assert reply["error"].startswith(error)


def test_deeply_nested_request_is_refused_and_the_server_goes_on(sock_path: str) -> None:
    deep = b'{"cmd": "status", "args": {"a": ' + b"[" * 5000 + b"]" * 5000 + b"}}\n"
    [reply] = raw(sock_path, deep)
    assert reply == {"ok": False, "error": "malformed request: nested too deeply"}
    status, end = raw(sock_path, b'{"cmd": "status"}\n')
    assert status["messages"] == 4 and end == {"ok": True}


def test_command_errors_end_the_stream(loop: LoopThread, tmp_path: Path) -> None:
    async def fails_late(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        yield {"n": 1}
        raise CommandError("gave up\nhalfway")

    async def crashes(args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        raise RuntimeError("boom")
        yield {}

    path = str(tmp_path / "c.sock")
    server = serve(loop, path, {"late": fails_late, "crash": crashes})
    try:
        assert raw(path, b'{"cmd": "late"}\n') == [
            {"n": 1},
            {"ok": False, "error": "gave up halfway"},
        ]
        [reply] = raw(path, b'{"cmd": "crash"}\n')
        assert reply == {"ok": False, "error": "internal error in crash: boom"}
    finally:
        loop.run(server.close())


# --- the socket itself


def test_socket_mode_and_cleanup(loop: LoopThread, tmp_path: Path) -> None:
    path = tmp_path / "control.sock"
    server = serve(loop, str(path), _commands(MESSAGES))
    assert stat.S_ISSOCK(path.stat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loop.run(server.close())
    assert not path.exists()
    server = serve(loop, str(path), _commands(MESSAGES), mode=0o660)
    assert stat.S_IMODE(path.stat().st_mode) == 0o660
    loop.run(server.close())


def test_stale_socket_is_replaced(loop: LoopThread, tmp_path: Path) -> None:
    path = str(tmp_path / "control.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(path)  # bound and closed without unlinking: what a killed daemon leaves
    server = serve(loop, path, _commands(MESSAGES))
    try:
        assert raw(path, b'{"cmd": "status"}\n')[-1] == {"ok": True}
    finally:
        loop.run(server.close())


def test_live_socket_is_not_taken_over(sock_path: str, loop: LoopThread) -> None:
    with pytest.raises(ControlError, match="another daemon uses"):
        serve(loop, sock_path, {})
    assert raw(sock_path, b'{"cmd": "status"}\n')[-1] == {"ok": True}


def test_other_files_are_not_removed(loop: LoopThread, tmp_path: Path) -> None:
    path = tmp_path / "control.sock"
    path.write_text("precious")
    with pytest.raises(ControlError, match="not a socket"):
        serve(loop, str(path), {})
    assert path.read_text() == "precious"


def test_silent_client_does_not_block_others(
    sock_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.connect(sock_path)
        silent.sendall(b'{"cmd": "sta')  # and never finishes the line
        code, out, _ = run_ctl(capsys, "-s", sock_path, "status", "--json")
        assert code == 0
        assert json.loads(out)["messages"] == 4


def test_client_that_stops_reading_does_not_block_others(
    big_queue: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stalled:
        stalled.connect(big_queue)
        stalled.sendall(b'{"cmd": "list"}\n')  # a reply of megabytes it never reads
        code, out, _ = run_ctl(capsys, "-s", big_queue, "status", "--json")
        assert code == 0
        assert json.loads(out)["messages"] == 5000
        code, out, _ = run_ctl(capsys, "-s", big_queue, "list", "--json")
        assert len(out.splitlines()) == 5000


def test_broken_pipe_is_quiet(big_queue: str) -> None:
    script = "import sys; from mtaqueue.control.ctl.main import main; sys.exit(main())"
    with subprocess.Popen(
        [sys.executable, "-c", script, "-s", big_queue, "list", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        json.loads(proc.stdout.readline())
        proc.stdout.close()  # like `| head -1`
        assert proc.wait(timeout=30) == 1
        assert proc.stderr.read() == b""


# --- who may connect (needs root to act as another user)

NOBODY = 65534


@pytest.fixture
def open_dir() -> Iterator[str]:
    """A directory other users can reach (pytest's tmp_path is private to us)."""
    path = tempfile.mkdtemp(prefix="mtaqueue-ctl-")
    os.chmod(path, 0o755)
    yield path
    os.rmdir(path)


def _status_as_nobody(path: str, gid: int, groups: list[int]) -> list[dict[str, Any]]:
    """Ask for status from a forked child running as uid nobody with these groups."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(NOBODY)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(path)
                sock.sendall(b'{"cmd": "status"}\n')
                while chunk := sock.recv(65536):
                    os.write(write_fd, chunk)
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as reader:
        output = reader.read()
    assert os.waitpid(pid, 0)[1] == 0
    return [json.loads(line) for line in output.splitlines()]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
@pytest.mark.parametrize(
    ("mode", "group", "extra_groups", "allowed"),
    [
        (0o666, NOBODY, [], False),  # the file mode lets anyone connect; the daemon refuses
        (0o666, NOBODY, [os.getegid()], True),  # a supplementary group member
        (0o666, os.getegid(), [], True),  # primary group
    ],
)
def test_peer_credentials(
    loop: LoopThread,
    open_dir: str,
    mode: int,
    group: int,
    extra_groups: list[int],
    allowed: bool,
) -> None:
    path = os.path.join(open_dir, "control.sock")
    server = serve(loop, path, _commands(MESSAGES), mode=mode)
    try:
        replies = _status_as_nobody(path, group, extra_groups)
    finally:
        loop.run(server.close())
    if allowed:
        assert replies[0]["messages"] == 4
        assert replies[-1] == {"ok": True}
    else:
        assert replies == [
            {
                "ok": False,
                "error": f"permission denied: uid {NOBODY} may not use the control socket",
            }
        ]


def test_a_walk_over_the_queue_lets_the_event_loop_run_and_reads_as_it_goes(monkeypatch):
    # At a million queued a status or list takes seconds: the loop must go on meanwhile,
    # and the messages are read one at a time (the queue holds them encoded).
    monkeypatch.setattr(walk, "WALK_CHUNK", 2)
    queue = dict(MESSAGES)

    async def replies(name: str) -> list[dict[str, Any]]:
        return [reply async for reply in _commands(queue)[name]({})]

    def run(name: str) -> tuple[list[dict[str, Any]], int]:
        return asyncio.run(ticks_during(replies(name)))

    (status,), ticks = run("status")
    assert status["messages"] == len(MESSAGES) and ticks >= len(MESSAGES) // 2
    rows, ticks = run("qshape")
    assert rows[0]["key"] == "TOTAL" and ticks >= len(MESSAGES) // 2

    async def listed() -> list[str]:
        ids = []
        async for reply in _commands(queue)["list"]({}):
            ids.append(reply["id"])
            queue.pop(last, None)  # leaves while the list is being sent: passed over
        return ids

    last = list(queue)[-1]
    assert asyncio.run(listed()) == list(MESSAGES)[:-1]


class _Steering:
    """What a bulk command hands the delivery manager: each batch, as it was given."""

    placement = SimpleNamespace(class_rank={"p0": 0, "p1": 1, "p2": 2})

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def take(self, messages: list[Message]) -> int:
        self.batches.append([m.id for m in messages])
        return len(messages)

    hold = release = flush = requeue = delete = bounce = take


class _Journal:
    """The spool as bulk commands see it: the queue, and the wait for the writer."""

    def __init__(self, messages: dict[str, Message]) -> None:
        self.messages, self.waits = MessageMap(), 0
        for message in messages.values():
            self.messages.put(message)

    async def drained(self) -> None:
        self.waits += 1


def test_a_bulk_command_acts_a_chunk_at_a_time_and_lets_the_loop_run(monkeypatch):
    # `flush --all` after a long outage meets a million queued: the matches are decoded
    # and handed over a chunk at a time, in the step that read them (never stale), with
    # the loop running between chunks and the writer given each step's records before
    # the next; named queue ids are looked up, not searched for. The walk goes class by
    # class, the first class first (queue order within one).
    monkeypatch.setattr(walk, "WALK_CHUNK", 2)
    steering, journal = _Steering(), _Journal(dict(MESSAGES))
    hold = operation_commands(steering, journal)["hold"]  # type: ignore[arg-type]

    async def replies(args: dict[str, Any]) -> list[dict[str, Any]]:
        return [reply async for reply in hold(args)]

    (reply,), ticks = asyncio.run(ticks_during(replies({"all": True})))
    assert reply == {"held": len(MESSAGES)} and ticks >= len(MESSAGES) // 2
    walked = [i for batch in steering.batches for i in batch]
    assert walked == [URGENT.id, DSN.id, HELD.id, BULK.id]  # queued: URGENT, HELD, BULK, DSN
    assert all(len(batch) <= 2 for batch in steering.batches)
    assert journal.waits == len(steering.batches)  # what each step queued, written first
    steering.batches.clear()
    assert asyncio.run(replies({"ids": [BULK.id, "NOSUCHID", BULK.id]})) == [{"held": 1}]
    assert steering.batches == [[BULK.id]]
    with pytest.raises(CommandError, match="name messages"):
        asyncio.run(replies({}))
