"""A private, throwaway Exim 4 daemon as a receiving provider, loopback only.

    EximInstance(workdir, listen="127.0.0.1:2526", domains=("example.org",),
                 pipelining=True, chunking=True, main=None)       a context manager
        .start() / .stop(cleanup=None) / .running / .remove_files()
        .main_options() -> {option: value}   its configuration's main section
        .stored(domain) -> [bytes]      what it delivered for domain, oldest first
        .mainlog / .rejectlog / .paniclog / .debuglog        its log files
        .sessions() -> [[(">>" | "<<", line)]]  each SMTP session as Exim read and wrote it
        .commands() -> [[str]]          the commands Exim read, a list a session
        .exim                           the EximBinary (tests/exim_fetch.py) it runs

Debian's exim4 (fetched and unpacked by tests/exim_fetch.py, never installed) runs as
``exim4 -C WORKDIR/conf/exim.conf -bdf -d-all+receive``: a daemon in the foreground, our
child, with its own configuration, spool (``spool/``), logs (``log/mainlog``,
``log/rejectlog``, ``log/paniclog``) and pid file under ``workdir``; nothing of the
system's MTA configuration is read or written. It listens on one loopback address:port,
accepts mail for ``domains`` (an ``accept`` router, delivered by appendfile to a Maildir a
domain, ``WORKDIR/mail/DOMAIN/new/``) and refuses every other recipient at RCPT with
``550 relay not permitted`` (its ACL, as Debian's default configuration words it). It has
no router or transport that sends anything anywhere: a bounce stays frozen in its spool.
No DNS: no host lookups, no ident, no sender verification. No TLS.

PIPELINING (``pipelining_advertise_hosts``) and CHUNKING (``chunking_advertise_hosts``)
are advertised to everyone, as Exim's defaults (PIPECONNECT too, by default with
PIPELINING); ``pipelining=False`` or ``chunking=False`` empties that list. Exim enforces
synchronization (``smtp_enforce_sync``, on by default): without PIPELINING, input sent
before the reply it waits for gets ``554 SMTP synchronization error`` and the connection
is dropped, logged; with it, it checks after DATA, but only where a predata ACL is set, as
here (``acl_smtp_predata``, one that accepts): content sent before the 354 is caught
too. ``main`` adds or overrides main options (``{"smtp_accept_max": "5"}``).

The log selector adds ``+pipelining`` (an accept line has ``L`` when the client pipelined,
``L-`` when PIPELINING was offered and not used, with ``.`` after the L when PIPECONNECT
was offered and not used; no field when PIPELINING was not offered) and ``K`` marks a
message that came by BDAT (always logged). The daemon's debug output (``-d-all+receive``:
``SMTP<< command`` for each command read, ``SMTP>> reply``, a line each, by process) goes
to ``debuglog``; :meth:`sessions` and :meth:`commands` read it.

Runs as root (Exim binds and then drops to ``exim_user``, here ``nobody``). With ``-C``
Exim keeps no privilege for what it re-executes (the spec's "-C" entry: no
TRUSTED_CONFIG_LIST entry of ours, that file is the system's), so its deliveries run as
nobody, said outright by ``deliver_drop_privilege`` (without it Exim logs a panic about
the lost privilege, and the delivery processes log to their stderr only). ``workdir`` and the binary
must be reachable by nobody (under /tmp, not /root).

    with EximInstance("/tmp/exim", listen="127.0.0.1:2526") as exim:
        ...  # deliver to a@example.org on 127.0.0.1:2526
        assert b"Subject: hello" in exim.stored("example.org")[0]
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import re
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Self

from exim_fetch import EximBinary, ensure_exim
from postfix_tools import (
    check_reachable,
    parse_loopback,
    port_free,
    remove_paths,
    tail,
    wait_banner,
)

__all__ = ["EximInstance"]

MARKER = ".exim_instance"  # in workdir: what the instance made there is ours to delete
USER, GROUP = "nobody", "nogroup"
LOG_SELECTOR = (
    "+smtp_connection +pipelining +received_recipients +smtp_protocol_error "
    "+smtp_syntax_error +smtp_incomplete_transaction +incoming_port"
)
DEBUG_LINE = re.compile(r"^\s*(\d+) (SMTP<<|SMTP>>|      ) ?(.*)$")

CONFIG = """\
# Written by tests/exim_instance.py: a private Exim, loopback only, nothing sent anywhere.
domainlist local_domains = {domains}
{main}

begin acl

acl_check_rcpt:
  accept domains = +local_domains
  deny message = relay not permitted

acl_check_predata:
  accept

begin routers

local:
  driver = accept
  domains = +local_domains
  transport = maildir

begin transports

maildir:
  driver = appendfile
  directory = {mail}/${{domain_data}}
  maildir_format
  create_directory
  delivery_date_add
  envelope_to_add
  return_path_add
  user = {user}
  group = {group}
"""


class EximInstance:
    """A private Exim daemon under ``workdir``; a context manager that always stops it.
    ``cleanup`` removes what it made there (and workdir, if that leaves it empty) on stop."""

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        listen: str = "127.0.0.1:2526",
        domains: tuple[str, ...] = ("example.org",),
        *,
        pipelining: bool = True,
        chunking: bool = True,
        main: Mapping[str, str] | None = None,
        cleanup: bool = True,
        start_timeout: float = 30.0,
    ) -> None:
        self.workdir = Path(workdir).absolute()
        self.listen = listen
        self.host, self.port = parse_loopback(listen)
        if not domains or any(not re.fullmatch(r"[A-Za-z0-9.-]+", d) for d in domains):
            raise ValueError(f"domains must be plain domain names, got {domains!r}")
        self.domains = tuple(domains)
        self.pipelining, self.chunking = pipelining, chunking
        self.extra = dict(main or {})
        self.config = self.workdir / "conf" / "exim.conf"
        self.spool_dir = self.workdir / "spool"
        self.log_dir = self.workdir / "log"
        self.mail_dir = self.workdir / "mail"
        self.pid_file = self.workdir / "exim.pid"
        self.mainlog = self.log_dir / "mainlog"
        self.rejectlog = self.log_dir / "rejectlog"
        self.paniclog = self.log_dir / "paniclog"
        self.debuglog = self.workdir / "debug.log"
        self._cleanup = cleanup
        self._start_timeout = start_timeout
        self._proc: subprocess.Popen | None = None
        self.exim: EximBinary | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> Self:
        if self._proc is not None:
            raise RuntimeError("instance already started")
        if os.geteuid() != 0:
            raise RuntimeError("a private Exim daemon needs root (it binds, then drops)")
        self.exim = ensure_exim()
        if not (self.workdir / MARKER).exists() and any(p.exists() for p in self._paths()):
            raise RuntimeError(
                f"{self.workdir} holds files not made by this module; use an empty or new one"
            )
        self._stop_stale()
        if not port_free(self.host, self.port):
            raise RuntimeError(f"{self.listen} already in use")
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
            self.workdir.chmod(0o755)
            check_reachable(self.workdir, USER)
            check_reachable(self.exim.path.parent, USER)  # it executes itself again
            (self.workdir / MARKER).touch()
            remove_paths(self._paths())  # a previous run's leftovers: every run starts empty
            self.config.parent.mkdir(mode=0o755)
            self.config.write_text(self._config())  # root's, 0644: as Exim requires
            self.config.chmod(0o644)
            nobody = pwd.getpwnam(USER)
            for directory in (self.spool_dir, self.log_dir, self.mail_dir):
                directory.mkdir(mode=0o750)
                os.chown(directory, nobody.pw_uid, nobody.pw_gid)
            with open(self.debuglog, "wb") as debug:
                self._proc = subprocess.Popen(
                    [str(self.exim.path), "-C", str(self.config), "-bdf", "-d-all+receive"],
                    stdin=subprocess.DEVNULL,
                    stdout=debug,
                    stderr=debug,
                    env=self.exim.env(),
                    cwd=self.workdir,
                    start_new_session=True,  # its process group: the sessions it forks too
                )
            atexit.register(self.stop)
            self._wait_started()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_started(self) -> None:
        deadline = time.monotonic() + self._start_timeout
        assert self._proc is not None
        while port_free(self.host, self.port):  # until the daemon has bound it
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"exim did not start on {self.listen}:\n{self._tails()}")
            time.sleep(0.05)
        wait_banner(self.host, self.port, max(1.0, deadline - time.monotonic()))

    def stop(self, cleanup: bool | None = None) -> None:
        """Stop the daemon and the processes it forked (idempotent); remove its files
        unless cleanup is False."""
        proc, self._proc = self._proc, None
        if proc is not None:
            atexit.unregister(self.stop)
            self._kill_group(proc.pid, proc)
        if self._cleanup if cleanup is None else cleanup:
            self.remove_files()

    @staticmethod
    def _kill_group(pgid: int, proc: subprocess.Popen | None = None) -> None:
        """SIGTERM the daemon's process group (the daemon, its sessions, its deliveries),
        then SIGKILL what is left after a few seconds."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            if proc is not None:
                proc.poll()  # reap the daemon, our child: a zombie would count as running
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)

    def _stop_stale(self) -> None:
        """Stop a daemon left running on this workdir's configuration by a killed run."""
        with contextlib.suppress(OSError, ValueError):
            pid = int(self.pid_file.read_text().split()[0])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if str(self.config).encode() in cmdline and os.getpgid(pid) == pid:
                self._kill_group(pid)

    def _paths(self) -> list[Path]:
        return [
            self.config.parent,
            self.spool_dir,
            self.log_dir,
            self.mail_dir,
            self.pid_file,
            self.debuglog,
        ]

    def remove_files(self) -> None:
        """Delete what the instance created under workdir, and workdir if then empty."""
        if self.running:
            raise RuntimeError("stop the instance first")
        if (self.workdir / MARKER).exists():
            remove_paths([*self._paths(), self.workdir / MARKER])
        with contextlib.suppress(OSError):
            self.workdir.rmdir()  # only if empty

    # -- configuration -----------------------------------------------------------------------

    def main_options(self) -> dict[str, str]:
        """The main section: ours, then ``main`` over them."""
        assert self.exim is not None
        return {
            "exim_user": USER,
            "exim_group": GROUP,
            "exim_path": str(self.exim.path),  # what it executes to deliver
            "keep_environment": "LD_LIBRARY_PATH",  # for that: the unpacked libraries
            "deliver_drop_privilege": "true",
            "primary_hostname": "exim.test",
            "qualify_domain": "exim.test",
            "spool_directory": str(self.spool_dir),
            "log_file_path": f"{self.log_dir}/%slog",
            "pid_file_path": str(self.pid_file),
            "log_selector": LOG_SELECTOR,
            "local_interfaces": f"<; {self.host}.{self.port}",
            "tls_advertise_hosts": "",
            "host_lookup": "",
            "rfc1413_hosts": "",
            "smtp_accept_queue_per_connection": "0",  # deliver at once, however many
            "pipelining_advertise_hosts": "*" if self.pipelining else "",
            "chunking_advertise_hosts": "*" if self.chunking else "",
            "acl_smtp_rcpt": "acl_check_rcpt",
            "acl_smtp_predata": "acl_check_predata",
            **self.extra,
        }

    def _config(self) -> str:
        main = "\n".join(f"{key} = {value}".rstrip() for key, value in self.main_options().items())
        return CONFIG.format(
            domains=" : ".join(self.domains), main=main, mail=self.mail_dir, user=USER, group=GROUP
        )

    # -- what it did -------------------------------------------------------------------------

    def stored(self, domain: str) -> list[bytes]:
        """The messages delivered to domain's Maildir, oldest first."""
        new = self.mail_dir / domain / "new"
        files = sorted(new.iterdir(), key=lambda f: f.stat().st_mtime_ns) if new.is_dir() else []
        return [f.read_bytes() for f in files]

    def sessions(self) -> list[list[tuple[str, str]]]:
        """Each SMTP session, in the order they began, as the debug log has it: ("<<", a
        command Exim read) and (">>", a reply line it wrote, continuation lines each)."""
        by_pid: dict[str, list[tuple[str, str]]] = {}
        text = self.debuglog.read_text(errors="replace") if self.debuglog.exists() else ""
        for line in text.splitlines():
            m = DEBUG_LINE.match(line)
            if m is None:
                continue
            pid, mark, rest = m.groups()
            if mark == "SMTP<<":
                by_pid.setdefault(pid, []).append(("<<", rest))
            elif mark == "SMTP>>" and not rest.startswith("("):  # "(close on process exit)"
                by_pid.setdefault(pid, []).append((">>", rest))
            elif pid in by_pid and by_pid[pid][-1][0] == ">>" and re.match(r"\d{3}[ -]", rest):
                by_pid[pid].append((">>", rest))  # a reply's further lines
        return list(by_pid.values())

    def commands(self) -> list[list[str]]:
        """The commands Exim read, a list for each session (its start probe included)."""
        return [[line for mark, line in s if mark == "<<"] for s in self.sessions()]

    def _tails(self) -> str:
        return "\n".join(
            f"--- {path} ---\n{tail(path)}"
            for path in (self.debuglog, self.mainlog, self.paniclog)
            if path.exists()
        )
