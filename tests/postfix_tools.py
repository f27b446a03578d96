"""Postfix's programs around a private instance (tests/postfix_instance.py), loopback only.

    postfix_available() -> bool          root, and Debian's postfix package installed
    POSTFIX_TOOLS                        the package's programs used here (/usr/sbin/...)
    parse_loopback("127.0.0.1:2625") -> ("127.0.0.1", 2625)   anything else is refused
    SmtpSink(listen).start() / .count() / .stop()   smtp-sink -c: 250 to all, counts messages
    Postgrey(listen, dbdir, delay, auto_whitelist=0)  postgrey as a policy service (a child)
    smtp_source(target, sessions, messages, size) -> seconds   Postfix's load generator
    received(maillog) -> dict            what a receive-mode instance accepted and refused
    port_free, unused_port, wait_banner, run_on_tty, check_reachable, tail, queue_files,
    stop_process, remove_paths: the small helpers the instances (and the benchmarks) use

Binaries are Debian's (``/usr/sbin``): ``postfix``, ``postconf``, ``postqueue``,
``smtp-source``, ``smtp-sink`` (all from the ``postfix`` package) and ``postgrey``.
"""

from __future__ import annotations

import grp
import ipaddress
import os
import pty
import pwd
import re
import select
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Self

POSTFIX = "/usr/sbin/postfix"
POSTCONF = "/usr/sbin/postconf"
POSTQUEUE = "/usr/sbin/postqueue"
SMTP_SOURCE = "/usr/sbin/smtp-source"
SMTP_SINK = "/usr/sbin/smtp-sink"
POSTFIX_TOOLS = (POSTFIX, POSTCONF, POSTQUEUE, SMTP_SOURCE, SMTP_SINK)  # all from `postfix`

POSTGREY = "/usr/sbin/postgrey"
# Queues that hold messages (not the per-message log directories defer/, bounce/, trace/).
MESSAGE_QUEUES = ("maildrop", "incoming", "active", "deferred", "hold")


def postfix_available() -> bool:
    """True when a private Postfix instance can be run here (binaries present, running as root)."""
    return os.geteuid() == 0 and all(os.access(t, os.X_OK) for t in POSTFIX_TOOLS)


def parse_loopback(address: str, ipv6: bool = False) -> tuple[str, int]:
    """``"127.0.0.1:2625"`` or ``"[127.0.0.1]:2625"`` -> ``("127.0.0.1", 2625)``.

    Only IPv4 loopback addresses are accepted, and with ``ipv6`` also ``"[::1]:2625"``
    (an instance listening there runs with inet_protocols = all).
    """
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"expected a literal loopback IPv4 address, got {address!r}") from None
    if not ip.is_loopback or (ip.version != 4 and not ipv6):
        allowed = "127.0.0.0/8 or ::1" if ipv6 else "IPv4 loopback addresses (127.0.0.0/8)"
        raise ValueError(f"only {allowed} may be used: {address!r}")
    return str(ip), int(port)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def port_free(host: str, port: int) -> bool:
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Postfix's master does
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def unused_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_banner(host: str, port: int, timeout: float) -> None:
    """Wait until an SMTP server on host:port answers with a 220 greeting."""
    deadline = time.monotonic() + timeout
    last: Exception | str = "no answer"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=2) as s:  # either family
                greeting = s.recv(512)
                if greeting.startswith(b"220"):
                    s.sendall(b"QUIT\r\n")
                    return
                last = repr(greeting)
        except OSError as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"no SMTP greeting from {host}:{port} within {timeout}s: {last}")


def queue_files(directory: Path, names: set[str]) -> None:
    """Add the names of the files under directory (recursively) to names; files may move."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                queue_files(Path(entry.path), names)
            elif entry.is_file(follow_symlinks=False):
                names.add(entry.name)
        except FileNotFoundError:
            pass


def run_on_tty(cmd: list[str], timeout: float) -> tuple[int, str]:
    """Run cmd with stdout and stderr on a pseudo-terminal; return (exit code, output).

    Postfix commands print their errors on stderr only when it is a terminal (otherwise they
    go to the log, which may not exist yet). A pty, not a pipe, also means master, which
    daemonizes, cannot keep us waiting for end-of-file.
    """
    parent, child = pty.openpty()
    try:
        try:
            proc = subprocess.run(
                cmd, stdin=subprocess.DEVNULL, stdout=child, stderr=child, timeout=timeout
            )
        finally:
            os.close(child)
        output = b""
        while select.select([parent], [], [], 0.1)[0]:
            try:
                chunk = os.read(parent, 65536)
            except OSError:  # EIO: no process has the terminal open any more
                break
            if not chunk:
                break
            output += chunk
    finally:
        os.close(parent)
    return proc.returncode, output.decode(errors="replace").replace("\r\n", "\n").strip()


def check_reachable(directory: Path, user: str = "postfix") -> None:
    """Postfix daemons run as the postfix user (Exim's, tests/exim_instance.py, as nobody):
    every directory above queue/ must let that user in."""
    pw = pwd.getpwnam(user)
    groups = {g.gr_gid for g in grp.getgrall() if user in g.gr_mem} | {pw.pw_gid}
    for d in (directory, *directory.parents):
        st = d.stat()
        if st.st_uid == pw.pw_uid:
            ok = st.st_mode & stat.S_IXUSR
        elif st.st_gid in groups:
            ok = st.st_mode & stat.S_IXGRP
        else:
            ok = st.st_mode & stat.S_IXOTH
        if not ok:
            raise RuntimeError(
                f"the {user} user cannot enter {d} (mode {st.st_mode & 0o7777:o}); "
                "use a workdir it can reach, e.g. under /tmp"
            )


def tail(path: Path, size: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def remove_paths(paths: list[Path]) -> None:
    """Delete these files and directories (a private instance's), whatever is there."""
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def stop_process(proc: subprocess.Popen | None, timeout: float) -> None:
    """Stop a child: SIGTERM if it still runs, wait up to `timeout` s, then SIGKILL it."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class SmtpSink:
    """``smtp-sink -c`` on a loopback address: answers 250 to everything, counts messages."""

    def __init__(
        self, listen: str = "127.0.0.1:2700", backlog: int = 100, options: tuple[str, ...] = ()
    ) -> None:
        """`options`: more smtp-sink options, e.g. ("-D", DIR/sink): every transaction
        appended to that file (DIR must be writable by nobody when we run as root)."""
        self.listen = listen
        self.options = options
        self.host, self.port = parse_loopback(listen)
        self.backlog = backlog
        self._proc: subprocess.Popen[bytes] | None = None
        self._out: Path | None = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> Self:
        if not port_free(self.host, self.port):
            raise RuntimeError(f"{self.listen} is already in use")
        fd, name = tempfile.mkstemp(prefix="smtp-sink-", suffix=".out")
        self._out = Path(name)
        cmd = [SMTP_SINK, "-c"]
        if os.geteuid() == 0:
            cmd += ["-u", "nobody"]  # smtp-sink refuses to run as root without -u
        cmd += list(self.options)
        cmd += [f"{self.host}:{self.port}", str(self.backlog)]
        try:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.STDOUT
            )
        finally:
            os.close(fd)
        try:
            wait_banner(self.host, self.port, 10)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def count(self) -> int:
        """Messages received so far (the last ``mesg=N`` of smtp-sink's counter)."""
        found = re.findall(r"mesg=(\d+)", tail(self._out, 400)) if self._out else []
        return int(found[-1]) if found else 0

    def stop(self) -> None:
        stop_process(self._proc, 5)
        self._proc = None
        if self._out is not None:
            self._out.unlink(missing_ok=True)
            self._out = None


class Postgrey:
    """postgrey (Debian's package) as a policy service on a loopback port, its database in
    its own directory, run in the foreground as a child process as the ``postgrey`` user.

    ``auto_whitelist`` is its ``--auto-whitelist-clients`` (0: off, so every new triplet is
    greylisted once, whoever sends it; postgrey's default is 5)."""

    def __init__(
        self, listen: str, dbdir: str | os.PathLike[str], delay: int = 300, auto_whitelist: int = 0
    ) -> None:
        self.listen = listen
        self.host, self.port = parse_loopback(listen)
        self.dbdir = Path(dbdir)
        self.delay, self.auto_whitelist = delay, auto_whitelist
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> Self:
        if not port_free(self.host, self.port):
            raise RuntimeError(f"{self.listen} is already in use")
        self.dbdir.mkdir(parents=True, exist_ok=True)
        pw = pwd.getpwnam("postgrey")
        os.chown(self.dbdir, pw.pw_uid, pw.pw_gid)
        self._proc = subprocess.Popen(
            [
                POSTGREY, f"--inet={self.host}:{self.port}", f"--dbdir={self.dbdir}",
                f"--delay={self.delay}", f"--auto-whitelist-clients={self.auto_whitelist}",
                f"--pidfile={self.dbdir}/postgrey.pid", "--lookup-by-host",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(self.dbdir / "postgrey.log", "wb"),  # noqa: SIM115 (the child keeps it)
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while port_free(self.host, self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"postgrey did not start: {tail(self.dbdir / 'postgrey.log')}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        stop_process(self._proc, 10)
        self._proc = None


_LOG_TIME = re.compile(r"^(\w{3} +\d+ [\d:.]+) ")
# smtpd's lines about a client: "connect from unknown[::1]", "QUEUEID: client=unknown[IP]",
# "NOQUEUE: reject: RCPT from unknown[IP]: ...", "NOQUEUE: permit: RCPT from ...".
_CLIENT_EVENT = re.compile(
    r": (?:\w+: )?(?P<what>connect|client|reject|permit)(?: from |=|: \w+ from )"
    r"[^\s\[]*\[(?P<ip>[0-9A-Fa-f:.]+)\]"
)


def _log_time(line: str, year: int) -> float | None:
    """Epoch seconds of a maillog line ("Dec  1 09:40:01.123456 host ...": postlogd's
    timestamps carry microseconds)."""
    m = _LOG_TIME.match(line)
    if not m:
        return None
    stamp = m[1] if "." in m[1] else m[1] + ".0"
    return time.mktime(time.strptime(f"{year} {stamp.split('.')[0]}", "%Y %b %d %H:%M:%S")) + (
        float("0." + stamp.split(".")[1])
    )


def received(maillog: Path) -> dict[str, object]:
    """What a ``receive``-mode instance accepted and refused, from its maillog: the accepted
    messages as ``[(time, message-id)]`` (cleanup's ``message-id=`` line, written once a
    message is being queued), and the refusals counted by reply (digits and addresses
    replaced: ``450 4.7.1 Error: too much mail from N.N.N.N``) and by command, and the
    greylisting refusals by recipient.

    By client IP, ``clients``: its ``connections``, ``messages`` queued (smtpd's
    ``client=`` line), ``refused`` replies, and the ``helo`` names its reject lines gave
    (and its permit lines, with ``smtpd_log_access_permit_actions = static:all``); and
    ``sessions``, every connect, refusal (its whole reply) and queued message in log
    order, as ``(time, "connect" | "reject" | "queued", client, text)``."""
    year = time.localtime().tm_year
    accepted: list[tuple[float, str]] = []
    refusals: dict[str, int] = {}
    by_command: dict[str, int] = {}
    greylisted: dict[str, int] = {}  # recipient -> greylisting refusals
    clients: dict[str, dict[str, Any]] = {}
    sessions: list[tuple[float, str, str, str]] = []

    counted = {"connect": "connections", "queued": "messages", "reject": "refused"}
    for line in maillog.read_text(errors="replace").splitlines():
        if "/smtpd[" in line and (m := _CLIENT_EVENT.search(line)):
            ip = m["ip"]
            about = clients.setdefault(ip, {name: 0 for name in counted.values()} | {"helo": set()})
            if helo := re.search(r" helo=<([^>]*)>", line):
                about["helo"].add(helo[1])
            kind = "queued" if m["what"] == "client" else m["what"]
            if kind in counted:
                about[counted[kind]] += 1
                text = ""
                if kind == "reject":  # the reply, without smtpd's "; from=<...> ..." after it
                    text = line.split(f"[{ip}]: ", 1)[1].split("; from=<", 1)[0]
                sessions.append((_log_time(line, year) or 0.0, kind, ip, text))
        if "/cleanup[" in line and " message-id=" in line:
            t = _log_time(line, year)
            if t is not None:
                accepted.append((t, line.rsplit(" message-id=", 1)[1].strip()))
        elif "NOQUEUE: reject: " in line or ": reject: " in line:
            m = re.search(r"reject: (\w+) from \S+: (\d{3} [\d.]+ .*?)(?:; from=|$)", line)
            if m:
                by_command[m[1]] = by_command.get(m[1], 0) + 1
                if "Greylisted" in m[2]:
                    rcpt = re.search(r"<([^>]*)>", m[2])
                    key = rcpt[1].lower() if rcpt else ""
                    greylisted[key] = greylisted.get(key, 0) + 1
                text = re.sub(r"<[^>]*>", "<...>", m[2])
                text = re.sub(r"\d+\.\d+\.\d+\.\d+", "N.N.N.N", text)
                text = re.sub(r"https?://\S+", "URL", text)
                refusals[text] = refusals.get(text, 0) + 1
        elif "warning: " in line and " limit exceeded: " in line:
            m = re.search(r"warning: (.* limit exceeded): ", line)
            if m:
                key = f"(anvil) {m[1]}"
                refusals[key] = refusals.get(key, 0) + 1
    return {
        "accepted": accepted,
        "refusals": refusals,
        "by_command": by_command,
        "greylisted": greylisted,
        "clients": clients,
        "sessions": sessions,
    }


def smtp_source(
    target: str,
    sessions: int,
    messages: int,
    size: int,
    sender: str = "bench@example.com",
    rcpt: str = "rcpt@example.org",
    timeout: float | None = None,
) -> float:
    """Run ``smtp-source`` (one message per connection) and return the elapsed seconds.

    Raises RuntimeError if smtp-source fails (it stops at the first rejected command).
    """
    parse_loopback(target)
    cmd = [
        SMTP_SOURCE,
        "-s",
        str(sessions),
        "-m",
        str(messages),
        "-l",
        str(size),
        "-f",
        sender,
        "-t",
        rcpt,
        target,
    ]
    start = time.monotonic()
    result = subprocess.run(
        cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False
    )
    elapsed = time.monotonic() - start
    if result.returncode != 0:
        err = (result.stderr or result.stdout).decode(errors="replace").strip()
        raise RuntimeError(f"{' '.join(cmd)} exited {result.returncode}: {err}")
    return elapsed
