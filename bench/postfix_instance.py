"""A private, throwaway Postfix instance to benchmark mtaqueue against, in the same run.

Everything lives under one work directory: ``conf/`` (main.cf, master.cf), ``queue/``,
``data/`` and ``maillog``. The instance is started with ``postfix -c WORKDIR/conf start``;
the system Postfix (``/etc/postfix``) is neither used nor touched, and nothing but loopback
addresses is ever configured: smtpd listens on one loopback address:port, mail goes to
``[127.0.0.1]:PORT`` and DNS is off (no MX lookups, no client name lookups).

Modes:

- ``defer``: accept durably (the message is fsynced in Postfix's queue before the 250), never
  deliver (``defer_transports = smtp``), so accept throughput is measured alone.
- ``relay``: deliver everything to ``relay`` (a sink such as ``smtp-sink``), with Postfix's
  default concurrency (20 per destination) and on-demand connection caching.
- ``hold``: accept durably straight into the hold queue (``smtpd_data_restrictions =
  check_client_access static:HOLD``), so the queue manager does no work at all: accept alone
  with nothing behind it. ``defer`` still costs qmgr, error and defer-log work per message.
- ``receive``: Postfix as the *provider*: accepts mail for ``domains`` only (relay domains
  whose transport is ``discard:``, so an accepted message is logged and dropped), asks an
  optional ``policy`` service (``check_policy_service``, e.g. postgrey: :class:`Postgrey`)
  at RCPT, and applies its anvil limits to loopback clients too
  (``smtpd_client_event_limit_exceptions`` empty; the limits themselves go in ``main_cf``).
  :func:`received` reads what it accepted and refused from the maillog. Mail for its
  ``mailboxes`` domains is kept instead: Postfix's virtual(8) delivers it to a Maildir
  per domain, ``WORKDIR/mail/DOMAIN/`` (every address of the domain), and
  :meth:`PostfixInstance.stored` returns the messages as delivered (with the
  Return-Path, Delivered-To and Received fields Postfix adds).

    with PostfixInstance("/tmp/pfx", listen="127.0.0.1:2625", mode="defer") as pf:
        secs = smtp_source("127.0.0.1:2625", sessions=20, messages=10000, size=2048)
        pf.wait_settled(60)  # until qmgr has moved everything to the deferred queue
        assert pf.queue_count() == 10000

    with SmtpSink("127.0.0.1:2700") as sink, PostfixInstance(
        "/tmp/pfx", listen="127.0.0.1:2625", mode="relay", relay="127.0.0.1:2700"
    ) as pf:
        secs = smtp_source("127.0.0.1:2625", 20, 10000, 2048)
        secs += pf.wait_drained(600)
        assert sink.count() == 10000

Needs root (Postfix's master runs as root) and Debian's ``postfix`` package, which also
ships ``smtp-source`` and ``smtp-sink``. Run as a script it starts an instance and keeps it
up until Ctrl-C/SIGTERM, or measures it with ``--measure N`` (see ``--help``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import grp
import ipaddress
import os
import pty
import pwd
import re
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Self

from common import stop_process

POSTFIX = "/usr/sbin/postfix"
POSTCONF = "/usr/sbin/postconf"
POSTQUEUE = "/usr/sbin/postqueue"
SMTP_SOURCE = "/usr/sbin/smtp-source"
SMTP_SINK = "/usr/sbin/smtp-sink"

MODES = ("defer", "relay", "hold", "receive")
POSTGREY = "/usr/sbin/postgrey"
MARKER = ".postfix_instance"  # in workdir: its conf/, queue/, data/ are ours to delete
# Queues that hold messages (not the per-message log directories defer/, bounce/, trace/).
_MESSAGE_QUEUES = ("maildrop", "incoming", "active", "deferred", "hold")

# Default master.cf minus TLS, local/virtual/lmtp delivery and the pipe examples; chroot off
# (a chroot would need copies of /etc files in the queue directory). The smtpd line is added
# in front, bound to the one address given.
_MASTER_CF = """\
pickup    unix  n       -       n       60      1       pickup
cleanup   unix  n       -       n       -       0       cleanup
qmgr      unix  n       -       n       300     1       qmgr
rewrite   unix  -       -       n       -       -       trivial-rewrite
bounce    unix  -       -       n       -       0       bounce
defer     unix  -       -       n       -       0       bounce
trace     unix  -       -       n       -       0       bounce
verify    unix  -       -       n       -       1       verify
flush     unix  n       -       n       1000?   0       flush
proxymap  unix  -       -       n       -       -       proxymap
proxywrite unix -       -       n       -       1       proxymap
smtp      unix  -       -       n       -       -       smtp
relay     unix  -       -       n       -       -       smtp
showq     unix  n       -       n       -       -       showq
error     unix  -       -       n       -       -       error
retry     unix  -       -       n       -       -       error
discard   unix  -       -       n       -       -       discard
anvil     unix  -       -       n       -       1       anvil
scache    unix  -       -       n       -       1       scache
postlog   unix-dgram n  -       n       -       1       postlogd
"""
# smtpd's TLS needs it (without: "no entropy for TLS key generation: disabling TLS support",
# and 454 4.7.0 to STARTTLS).
TLSMGR = "tlsmgr    unix  -       -       n       1000?   1       tlsmgr\n"
# Delivery to the mailboxes' Maildirs (receive mode's `mailboxes`).
VIRTUAL = "virtual   unix  -       n       n       -       -       virtual\n"


def postfix_available() -> bool:
    """True when a private Postfix instance can be run here (binaries present, running as root)."""
    tools = (POSTFIX, POSTCONF, POSTQUEUE, SMTP_SOURCE, SMTP_SINK)
    return os.geteuid() == 0 and all(os.access(t, os.X_OK) for t in tools)


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


def _port_free(host: str, port: int) -> bool:
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Postfix's master does
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _unused_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait_banner(host: str, port: int, timeout: float) -> None:
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


def _queue_files(directory: Path, names: set[str]) -> None:
    """Add the names of the files under directory (recursively) to names; files may move."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                _queue_files(Path(entry.path), names)
            elif entry.is_file(follow_symlinks=False):
                names.add(entry.name)
        except FileNotFoundError:
            pass


def _run_on_tty(cmd: list[str], timeout: float) -> tuple[int, str]:
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


def _check_reachable(directory: Path) -> None:
    """Postfix daemons run as the postfix user: every directory above queue/ must let it in."""
    pw = pwd.getpwnam("postfix")
    groups = {g.gr_gid for g in grp.getgrall() if "postfix" in g.gr_mem} | {pw.pw_gid}
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
                f"the postfix user cannot enter {d} (mode {st.st_mode & 0o7777:o}); "
                "use a workdir it can reach, e.g. under /tmp"
            )


def _tail(path: Path, size: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class PostfixInstance:
    """A private Postfix under ``workdir``; a context manager that always stops it.

    ``relay`` (HOST:PORT of an SMTP sink) is required in relay mode. ``main_cf`` adds or
    overrides main.cf parameters (for tuning experiments); ``services`` adds master.cf
    lines (``tlsmgr``, which smtpd's TLS needs, say). ``also_listen`` are further smtpd
    addresses (``"[::1]:2625"`` too: then inet_protocols = all). ``client_access`` maps
    client CIDRs to access(5) actions (``{"127.0.0.12/32": "REJECT listed"}``), checked
    first at RCPT (``smtpd_client_restrictions = check_client_access cidr:...``).
    ``reply_lines`` maps a regexp to further lines for the 4xx/5xx replies it matches
    (``smtpd_reject_footer_maps``): a refusal of several lines, as Gmail's (smtpd logs
    the first line only).
    ``maillog=False`` sends Postfix's log to /dev/null instead of ``WORKDIR/maillog``.
    ``cleanup`` removes what the instance created in ``workdir`` (and ``workdir`` itself
    when that leaves it empty) on stop. ``tls_cert`` and ``tls_key`` (PEM files) make
    smtpd offer STARTTLS with them (``smtpd_tls_security_level = may``, sessions logged at
    ``smtpd_tls_loglevel = 1``); :meth:`set_tls` swaps them (a restart). ``mailboxes``
    (receive mode): domains whose mail is delivered to ``WORKDIR/mail/DOMAIN/`` (a Maildir,
    owned by ``nobody``) rather than discarded; :meth:`stored` reads it.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        listen: str = "127.0.0.1:2625",
        mode: str = "defer",
        relay: str | None = None,
        *,
        domains: tuple[str, ...] = (),
        policy: str | None = None,
        also_listen: tuple[str, ...] = (),
        client_access: Mapping[str, str] | None = None,
        reply_lines: Mapping[str, tuple[str, ...]] | None = None,
        main_cf: Mapping[str, str] | None = None,
        services: str = "",
        maillog: bool = True,
        cleanup: bool = True,
        start_timeout: float = 60.0,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        mailboxes: tuple[str, ...] = (),
    ) -> None:
        self.workdir = Path(workdir).absolute()
        self.listen = listen
        self.host, self.port = parse_loopback(listen)
        self.addresses = [(self.host, self.port), *(parse_loopback(a, True) for a in also_listen)]
        self.client_access = dict(client_access or {})
        self.reply_lines = dict(reply_lines or {})
        self.name = f"pfbench-{self.port}"
        self.config_dir = self.workdir / "conf"
        self.queue_dir = self.workdir / "queue"
        self.data_dir = self.workdir / "data"
        self.maillog = self.workdir / "maillog"
        self.mail_dir = self.workdir / "mail"  # mailboxes' Maildirs
        self._maillog_enabled = maillog
        self._extra = dict(main_cf or {})
        self._services = services
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        self._tls = (str(tls_cert), str(tls_key)) if tls_cert is not None else None
        if self._tls and TLSMGR not in services:
            self._services += TLSMGR
        self._cleanup = cleanup
        self._start_timeout = start_timeout
        self._running = False
        self._check_mode(mode, relay)
        self.mode = mode
        self.relay = relay
        self.domains = domains
        self.mailboxes = mailboxes
        if mailboxes and mode != "receive":
            raise ValueError("mailboxes are for receive mode")
        self.policy = policy
        if policy:
            parse_loopback(policy)
        # public/ and private/ sockets must fit in sun_path (108 bytes).
        if len(str(self.queue_dir / "private" / "proxywrite")) > 100:
            raise ValueError(f"workdir path too long for Postfix's unix sockets: {self.workdir}")

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._running

    def start(self) -> Self:
        if self._running:
            raise RuntimeError("instance already started")
        if not postfix_available():
            raise RuntimeError("postfix, postqueue, smtp-source, smtp-sink and root are needed")
        self._stop_stale()
        if busy := [f"{h}:{p}" for h, p in self.addresses if not _port_free(h, p)]:
            raise RuntimeError(f"{', '.join(busy)} already in use")
        ours = self._paths()
        if not (self.workdir / MARKER).exists() and any(p.exists() for p in ours):
            raise RuntimeError(
                f"{self.workdir} holds conf/, queue/, data/ or maillog not made by this module; "
                "use an empty or new workdir"
            )
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
            self.workdir.chmod(0o755)
            _check_reachable(self.workdir)  # by the postfix user, e.g. not under /root
            (self.workdir / MARKER).touch()
            self._remove(ours)  # a previous run's leftovers: every run starts empty
            self.config_dir.mkdir(mode=0o755)
            self.queue_dir.mkdir(mode=0o755)  # root-owned; post-install creates the rest
            if self.mailboxes:  # virtual(8) makes the Maildirs in it, as nobody
                self.mail_dir.mkdir(mode=0o755)
                nobody = pwd.getpwnam("nobody")
                os.chown(self.mail_dir, nobody.pw_uid, nobody.pw_gid)
            self._write_config()
            self._running = True
            atexit.register(self.stop)
            # post-install create-missing (run by "postfix start") creates queue/ subdirs and
            # data/ with the right owners (postfix, postdrop) from /etc/postfix/postfix-files.
            self._postfix("start", timeout=self._start_timeout)
            for host, port in self.addresses:
                _wait_banner(host, port, self._start_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, cleanup: bool | None = None) -> None:
        """Stop the instance (idempotent); remove its files unless cleanup is False."""
        if self._running:
            self._running = False
            atexit.unregister(self.stop)
            try:
                self._postfix("stop", timeout=30)
            except (RuntimeError, subprocess.TimeoutExpired, OSError):
                self._kill_master()
            self._wait_port_free()
        if self._cleanup if cleanup is None else cleanup:
            self.remove_files()

    def _wait_port_free(self, timeout: float = 10.0) -> None:
        # smtpd children hold the listening socket until they notice master is gone.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(_port_free(*a) for a in self.addresses):
            time.sleep(0.05)

    def _paths(self) -> list[Path]:
        return [self.config_dir, self.queue_dir, self.data_dir, self.maillog, self.mail_dir]

    @staticmethod
    def _remove(paths: list[Path]) -> None:
        for path in paths:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def remove_files(self) -> None:
        """Delete what the instance created under workdir, and workdir if then empty."""
        if self._running:
            raise RuntimeError("stop the instance first")
        if (self.workdir / MARKER).exists():  # else nothing of ours is there
            self._remove([*self._paths(), self.workdir / MARKER])
        with contextlib.suppress(OSError):
            self.workdir.rmdir()  # only if empty

    def _stop_stale(self) -> None:
        """Stop an instance left running in this workdir by an earlier, killed run."""
        if not (self.workdir / MARKER).exists() or not (self.config_dir / "main.cf").exists():
            return
        status = subprocess.run(
            [POSTFIX, "-c", str(self.config_dir), "status"],
            capture_output=True,
            stdin=subprocess.DEVNULL,
            timeout=30,
            check=False,
        )
        if status.returncode == 0:
            try:
                self._postfix("stop", timeout=30)
            except (RuntimeError, subprocess.TimeoutExpired):
                self._kill_master()

    def _kill_master(self) -> None:
        """Last resort: kill master's process group (postfix-script stop does the same)."""
        with contextlib.suppress(OSError, ValueError):
            pid = int((self.queue_dir / "pid" / "master.pid").read_text().split()[0])
            if Path(f"/proc/{pid}/comm").read_text().strip() != "master":
                return  # stale pid file
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, sig)
                time.sleep(1)

    # -- configuration -----------------------------------------------------------------------

    def _check_mode(self, mode: str, relay: str | None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "relay" and not relay:
            raise ValueError("relay mode needs relay=HOST:PORT (an SMTP sink)")
        if relay:
            parse_loopback(relay)

    def main_cf(self) -> dict[str, str]:
        """The main.cf parameters for the current mode."""
        if self.mode == "relay":
            assert self.relay is not None
            relay_host, relay_port = parse_loopback(self.relay)
            relayhost, defer = f"[{relay_host}]:{relay_port}", ""
        else:  # an unused port: nothing is ever attempted, defer_transports stops it first
            relayhost, defer = f"[127.0.0.1]:{_unused_port()}", "smtp"
        if self.mode == "receive":  # nothing is sent on: a port nobody listens on
            relayhost, defer = f"[127.0.0.1]:{_unused_port()}", ""
        hold = "check_client_access static:HOLD" if self.mode == "hold" else ""
        logfile = str(self.maillog) if self._maillog_enabled else "/dev/null"
        params = {
            "compatibility_level": "3.6",
            "config_directory": str(self.config_dir),
            "queue_directory": str(self.queue_dir),
            "data_directory": str(self.data_dir),
            "meta_directory": "/etc/postfix",  # postfix-files, used by post-install
            "multi_instance_name": self.name,
            "multi_instance_enable": "no",  # not registered with the system's postmulti
            "syslog_name": self.name,
            "maillog_file": logfile,
            "maillog_file_prefixes": logfile if not self._maillog_enabled else str(self.workdir),
            "myhostname": f"{self.name}.localdomain",
            "mydomain": "localdomain",
            "myorigin": "$myhostname",
            "inet_interfaces": ", ".join(f"[{h}]" if ":" in h else h for h, _ in self.addresses),
            "inet_protocols": "all" if any(":" in h for h, _ in self.addresses) else "ipv4",
            "mydestination": "",
            "mynetworks": "127.0.0.0/8",
            "smtpd_relay_restrictions": "permit_mynetworks, reject",
            "smtpd_recipient_restrictions": "",
            "smtpd_peername_lookup": "no",  # no reverse DNS of clients
            "local_transport": "error:local delivery is disabled",
            "local_recipient_maps": "",
            "alias_maps": "",
            "alias_database": "",
            "biff": "no",
            "relayhost": relayhost,
            "defer_transports": defer,
            "smtpd_data_restrictions": hold,
            "smtp_dns_support_level": "disabled",  # no DNS at all: relayhost is a literal IP
            "smtp_host_lookup": "native",
            "smtp_tls_security_level": "none",
            "smtpd_tls_security_level": "none",
        }
        if self.mode == "receive":
            policy = f"check_policy_service inet:{self.policy}" if self.policy else ""
            params |= {
                "relay_domains": ", ".join(self.domains),
                "relay_transport": "discard:",
                "default_transport": "discard:",
                "smtpd_relay_restrictions": "reject_unauth_destination",
                "smtpd_recipient_restrictions": policy,
                "smtpd_client_event_limit_exceptions": "",  # anvil limits apply to loopback
            }
            if self.mailboxes:  # kept: each domain's mail in its Maildir, as nobody
                nobody = pwd.getpwnam("nobody")
                params |= {
                    "virtual_mailbox_domains": ", ".join(self.mailboxes),
                    "virtual_mailbox_base": str(self.mail_dir),
                    "virtual_mailbox_maps": f"texthash:{self.config_dir / 'mailboxes'}",
                    "virtual_uid_maps": f"static:{nobody.pw_uid}",
                    "virtual_gid_maps": f"static:{nobody.pw_gid}",
                }
        if self._tls is not None:
            params |= {
                "smtpd_tls_cert_file": self._tls[0],
                "smtpd_tls_key_file": self._tls[1],
                "smtpd_tls_security_level": "may",
                "smtpd_tls_loglevel": "1",
            }
        if self.client_access:
            cidr = self.config_dir / "client_access.cidr"
            params["smtpd_client_restrictions"] = f"check_client_access cidr:{cidr}"
        if self.reply_lines:
            params["smtpd_reject_footer_maps"] = f"regexp:{self.config_dir / 'reply_lines.regexp'}"
        params.update(self._extra)
        return params

    def _write_config(self) -> None:
        main = "".join(f"{k} = {v}\n" for k, v in self.main_cf().items())
        smtpd = "".join(
            f"{f'[{h}]' if ':' in h else h}:{p} inet n - n - - smtpd\n" for h, p in self.addresses
        )
        if self.client_access:  # cidr: tables are read as they are, no postmap
            (self.config_dir / "client_access.cidr").write_text(
                "".join(f"{net} {action}\n" for net, action in self.client_access.items())
            )
        if self.reply_lines:  # "\c": no empty line between the reply and its footer
            (self.config_dir / "reply_lines.regexp").write_text(
                "".join(
                    f"/{pattern}/ \\c" + "".join(f"\\n{line}" for line in lines) + "\n"
                    for pattern, lines in self.reply_lines.items()
                )
            )
        services = self._services
        if self.mailboxes:  # "@domain domain/": every address, one Maildir (the "/")
            (self.config_dir / "mailboxes").write_text(
                "".join(f"@{domain} {domain}/\n" for domain in self.mailboxes)
            )
            services += VIRTUAL
        (self.config_dir / "main.cf").write_text(
            "# generated by bench/postfix_instance.py\n" + main
        )
        (self.config_dir / "master.cf").write_text(smtpd + _MASTER_CF + services)

    def set_mode(self, mode: str, relay: str | None = None) -> None:
        """Switch between defer and relay: rewrite main.cf and restart, keeping the queue.

        A restart rather than ``postfix reload``, so that no old qmgr is still deferring mail
        when this returns. Deferred mail waits for :meth:`flush`: so defer mode, fill the
        queue, ``set_mode("relay", sink)``, ``flush()``, ``wait_drained()`` times delivery
        alone.
        """
        self._check_mode(mode, relay)
        self.mode, self.relay = mode, relay
        self._restart()

    def set_tls(self, cert: str | os.PathLike[str], key: str | os.PathLike[str]) -> None:
        """smtpd's certificate and key from now on: main.cf rewritten, then a restart (no
        smtpd of the old configuration is left to take a connection). Sessions still open
        are cut: wait for them to end first."""
        self._tls = (str(cert), str(key))
        if TLSMGR not in self._services:
            self._services += TLSMGR
        self._restart()

    def stored(self, domain: str) -> list[bytes]:
        """The messages virtual(8) delivered to a ``mailboxes`` domain, oldest first."""
        new = self.mail_dir / domain / "new"
        files = sorted(new.iterdir(), key=lambda f: f.stat().st_mtime) if new.is_dir() else []
        return [f.read_bytes() for f in files]

    def _restart(self) -> None:
        self._write_config()
        if self._running:
            self._postfix("stop", timeout=30)
            self._wait_port_free()
            self._postfix("start", timeout=self._start_timeout)
            for host, port in self.addresses:
                _wait_banner(host, port, self._start_timeout)

    # -- commands ------------------------------------------------------------------------------

    def _postfix(self, command: str, timeout: float) -> None:
        code, output = _run_on_tty([POSTFIX, "-c", str(self.config_dir), command], timeout)
        if code != 0:
            log = (
                f"\n--- {self.maillog} (tail) ---\n{_tail(self.maillog)}"
                if self._maillog_enabled
                else ""
            )
            raise RuntimeError(
                f"postfix -c {self.config_dir} {command} failed (exit {code}):\n{output}{log}"
            )

    def flush(self) -> None:
        """``postqueue -f``: attempt delivery of all deferred mail now."""
        subprocess.run(
            [POSTQUEUE, "-c", str(self.config_dir), "-f"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=60,
            check=True,
        )

    def queue_count(self) -> int:
        """Messages in the queue (maildrop, incoming, active, deferred, hold), from the files.

        A file keeps its queue id as its name in every queue and the queues are scanned in
        the order mail moves through them, so a message moving meanwhile is counted exactly
        once. Mail coming back from deferred to active (retries, :meth:`flush`) can make it
        a snapshot that is off by a few; :meth:`wait_settled` or :meth:`wait_drained` first.
        """
        names: set[str] = set()
        for queue in _MESSAGE_QUEUES:
            _queue_files(self.queue_dir / queue, names)
        return len(names)

    def in_flight(self) -> int:
        """Messages not yet parked or delivered (maildrop, incoming and active queues)."""
        names: set[str] = set()
        for queue in ("maildrop", "incoming", "active"):
            _queue_files(self.queue_dir / queue, names)
        return len(names)

    def wait_settled(self, timeout: float, poll: float = 0.1) -> float:
        """Poll until no message is in flight (twice in a row); return the seconds waited.

        In defer mode every accepted message is then in the deferred queue, in hold mode in
        the hold queue.
        """
        return self._wait(self.in_flight, "in flight", timeout, poll)

    def wait_drained(self, timeout: float, poll: float = 0.1) -> float:
        """Poll until the queue is empty (twice in a row); return the seconds waited."""
        return self._wait(self.queue_count, "still queued", timeout, poll)

    def _wait(self, count: Callable[[], int], what: str, timeout: float, poll: float) -> float:
        start = time.monotonic()
        zeros = 0
        while zeros < 2:
            n = count()
            zeros = zeros + 1 if n == 0 else 0
            if zeros < 2:
                if time.monotonic() - start > timeout:
                    raise TimeoutError(f"{n} messages {what} after {timeout}s")
                time.sleep(poll)
        return time.monotonic() - start

    def postqueue_count(self) -> int:
        """Messages as ``postqueue -j`` lists them (slower; a cross-check of queue_count)."""
        result = subprocess.run(
            [POSTQUEUE, "-c", str(self.config_dir), "-j"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=300,
            check=True,
        )
        return sum(1 for line in result.stdout.splitlines() if line.strip())


class SmtpSink:
    """``smtp-sink -c`` on a loopback address: answers 250 to everything, counts messages."""

    def __init__(self, listen: str = "127.0.0.1:2700", backlog: int = 100) -> None:
        self.listen = listen
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
        if not _port_free(self.host, self.port):
            raise RuntimeError(f"{self.listen} is already in use")
        fd, name = tempfile.mkstemp(prefix="smtp-sink-", suffix=".out")
        self._out = Path(name)
        cmd = [SMTP_SINK, "-c"]
        if os.geteuid() == 0:
            cmd += ["-u", "nobody"]  # smtp-sink refuses to run as root without -u
        cmd += [f"{self.host}:{self.port}", str(self.backlog)]
        try:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.STDOUT
            )
        finally:
            os.close(fd)
        try:
            _wait_banner(self.host, self.port, 10)
        except BaseException:
            self.stop()
            raise
        return self

    def count(self) -> int:
        """Messages received so far (the last ``mesg=N`` of smtp-sink's counter)."""
        found = re.findall(r"mesg=(\d+)", _tail(self._out, 400)) if self._out else []
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
        if not _port_free(self.host, self.port):
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
        while _port_free(self.host, self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"postgrey did not start: {_tail(self.dbdir / 'postgrey.log')}")
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


# -- measurements --------------------------------------------------------------------------------


def measure(
    pf: PostfixInstance,
    sessions: int,
    messages: int,
    size: int,
    sink: SmtpSink | None = None,
    drain_timeout: float = 600.0,
) -> dict[str, float]:
    """Inject ``messages`` into a started instance and time it.

    defer and hold modes: ``accept_s``/``accept_rate`` (smtp-source time) and ``queued``.
    relay mode: also ``total_s``/``total_rate`` (start of injection until the queue is
    empty, i.e. accepted and relayed) and ``delivered`` (the sink's count, given a sink).
    """
    before = pf.queue_count()
    base = sink.count() if sink is not None else 0
    start = time.monotonic()
    accept_s = smtp_source(pf.listen, sessions, messages, size)
    result = {"messages": messages, "accept_s": accept_s, "accept_rate": messages / accept_s}
    if pf.mode != "relay":
        pf.wait_settled(drain_timeout)
        result["queued"] = pf.queue_count() - before
    else:
        pf.wait_drained(drain_timeout)
        total = time.monotonic() - start
        result |= {"total_s": total, "total_rate": messages / total}
    if sink is not None:
        result["delivered"] = sink.count() - base
    return result


def measure_delivery(
    pf: PostfixInstance,
    sink: SmtpSink,
    sessions: int,
    messages: int,
    size: int,
    drain_timeout: float = 600.0,
) -> dict[str, float]:
    """Delivery alone: fill the queue in defer mode, switch to relay to sink, flush, drain."""
    pf.set_mode("defer")
    base = sink.count()
    accept_s = smtp_source(pf.listen, sessions, messages, size)
    pf.wait_settled(drain_timeout)
    queued = pf.queue_count()
    pf.set_mode("relay", sink.listen)
    start = time.monotonic()
    pf.flush()
    pf.wait_drained(drain_timeout)
    deliver_s = time.monotonic() - start
    return {
        "messages": messages,
        "accept_s": accept_s,
        "queued": queued,
        "deliver_s": deliver_s,
        "deliver_rate": queued / deliver_s,
        "delivered": sink.count() - base,
    }


# -- command line --------------------------------------------------------------------------------


@contextlib.contextmanager
def _maybe_sink(listen: str | None) -> Iterator[SmtpSink | None]:
    if listen is None:
        yield None
    else:
        with SmtpSink(listen) as sink:
            yield sink


def _fmt(result: Mapping[str, float]) -> str:
    return " ".join(
        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()
    )


def _raise_interrupt(signum: int, frame: object) -> None:
    # Once: a second signal must not interrupt the stop and cleanup it started.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Run a private Postfix instance (loopback only) for benchmarks."
    )
    p.add_argument(
        "--workdir",
        default=None,
        help="directory for conf/, queue/, data/, maillog (default: a temp dir)",
    )
    p.add_argument("--listen", default="127.0.0.1:2625", help="smtpd address (default %(default)s)")
    p.add_argument("--mode", choices=MODES, default="defer")
    p.add_argument(
        "--relay",
        default="127.0.0.1:2700",
        help="relay mode: where mail goes (default %(default)s)",
    )
    p.add_argument(
        "--sink",
        action="store_true",
        help="also run smtp-sink on the relay address (implied by --measure/--delivery)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PARAM=VALUE",
        help="extra main.cf parameter (repeatable)",
    )
    p.add_argument("--no-maillog", action="store_true", help="log to /dev/null")
    p.add_argument("--keep", action="store_true", help="keep the workdir after stopping")
    p.add_argument(
        "--measure",
        type=int,
        metavar="N",
        help="inject N messages with smtp-source, print the figures, stop",
    )
    p.add_argument(
        "--delivery",
        type=int,
        metavar="N",
        help="queue N messages deferred, then time relaying them all to the sink",
    )
    p.add_argument("--sessions", type=int, default=20)
    p.add_argument("--size", type=int, default=2048)
    args = p.parse_args(argv)

    if not postfix_available():
        print("postfix_instance: needs root and Debian's postfix package", file=sys.stderr)
        return 2
    if bad := [kv for kv in args.set if "=" not in kv]:
        p.error(f"--set wants PARAM=VALUE, got {bad[0]!r}")
    extra = dict(kv.split("=", 1) for kv in args.set)
    workdir = args.workdir or tempfile.mkdtemp(prefix="pfbench-")
    measuring = args.measure is not None or args.delivery is not None
    relay = args.relay if args.mode == "relay" else None
    sink_at = args.relay if (args.sink or measuring) and (relay or args.delivery) else None

    # SIGTERM (and SIGINT, even where a shell ignores it for background jobs) end the run
    # like Ctrl-C in a terminal does, so the context managers stop everything.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        with (
            _maybe_sink(sink_at) as sink,
            PostfixInstance(
                workdir,
                args.listen,
                args.mode,
                relay,
                main_cf=extra,
                maillog=not args.no_maillog,
                cleanup=not args.keep,
            ) as pf,
        ):
            print(
                f"postfix instance {pf.name}: {args.mode} mode, smtpd on {pf.listen}, "
                f"workdir {pf.workdir}" + (f", relaying to {relay}" if relay else ""),
                flush=True,
            )
            if args.measure is not None:
                res = measure(pf, args.sessions, args.measure, args.size, sink)
                print(f"{args.mode}: {_fmt(res)}", flush=True)
            if args.delivery is not None:
                assert sink is not None
                res = measure_delivery(pf, sink, args.sessions, args.delivery, args.size)
                print(f"delivery: {_fmt(res)}", flush=True)
            if not measuring:
                print("running; Ctrl-C or SIGTERM stops it", flush=True)
                while True:
                    signal.pause()
    except KeyboardInterrupt:
        pass
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
