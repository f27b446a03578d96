"""A private, throwaway Postfix instance, for tests and benchmarks, loopback only.

    PostfixInstance(workdir, listen, mode, relay, **options)   a context manager
        .start() / .stop() / .reload() / .set_mode(mode, relay) / .set_tls(cert, key)
        .stored(domain) -> [bytes]     receive mode: what it delivered to a Maildir
        .queue_count() / .in_flight() / .wait_settled(t) / .wait_drained(t) / .flush()
        .maillog                       its log file (received() reads it)
    MODES = ("defer", "relay", "hold", "receive")
    and, from tests/postfix_tools.py: postfix_available, parse_loopback, SmtpSink,
    Postgrey, smtp_source, received; from tests/postfix_config.py: TLSMGR

Everything lives under one work directory: ``conf/`` (main.cf, master.cf), ``queue/``,
``data/`` and ``maillog``. The instance is started with ``postfix -c WORKDIR/conf start``;
the system Postfix (``/etc/postfix``) is neither used, started nor touched, and nothing but
loopback addresses is ever configured: smtpd listens on one loopback address:port, mail goes
to ``[127.0.0.1]:PORT`` and DNS is off (no MX lookups, no client name lookups), unless a
``resolver`` is given: then smtpd alone runs chrooted in ``queue/`` with its own
``queue/etc/resolv.conf`` naming that one loopback nameserver (port 53, as resolv.conf
allows no other), for its DNSBL lookups (``dnsbl``).

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
ships ``smtp-source`` and ``smtp-sink``. ``bench/postfix_measure.py`` runs an instance from
the command line.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Self

import postfix_config
from postfix_config import TLSMGR
from postfix_tools import (
    MESSAGE_QUEUES,
    POSTFIX,
    POSTQUEUE,
    Postgrey,
    SmtpSink,
    check_reachable,
    parse_loopback,
    port_free,
    postfix_available,
    queue_files,
    received,
    remove_paths,
    run_on_tty,
    smtp_source,
    tail,
    wait_banner,
)

__all__ = [
    "MODES",
    "TLSMGR",
    "PostfixInstance",
    "Postgrey",
    "SmtpSink",
    "parse_loopback",
    "postfix_available",
    "received",
    "smtp_source",
]

MODES = ("defer", "relay", "hold", "receive")
MARKER = ".postfix_instance"  # in workdir: its conf/, queue/, data/ are ours to delete


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
    ``resolver`` (a loopback IPv4 address with a DNS server on port 53) is the one
    nameserver smtpd asks, chrooted in ``queue/``. ``dnsbl`` maps DNSBL zones to the reply
    for a listed client (``{"zen.spamhaus.org": None}``: Postfix's own, ``default_rbl_reply``;
    a text such as ``"550 5.7.1 ..."``: that, verbatim, via ``rbl_reply_maps``), checked
    after ``client_access`` (``reject_rbl_client ZONE``); it needs a ``resolver``.
    Attributes changed after the start take effect with :meth:`reload`.
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
        resolver: str | None = None,
        dnsbl: Mapping[str, str | None] | None = None,
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
        self.maillog_enabled = maillog
        self.extra = dict(main_cf or {})
        self.services = services
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        self.tls = (str(tls_cert), str(tls_key)) if tls_cert is not None else None
        if self.tls and TLSMGR not in services:
            self.services += TLSMGR
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
        self.resolver = resolver
        if resolver is not None:
            parse_loopback(f"{resolver}:53")
        self.dnsbl = dict(dnsbl or {})
        if self.dnsbl and resolver is None:
            raise ValueError("dnsbl needs a resolver (smtpd looks the client up there)")
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
        if busy := [f"{h}:{p}" for h, p in self.addresses if not port_free(h, p)]:
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
            check_reachable(self.workdir)  # by the postfix user, e.g. not under /root
            (self.workdir / MARKER).touch()
            remove_paths(ours)  # a previous run's leftovers: every run starts empty
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
                wait_banner(host, port, self._start_timeout)
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
            self._waitport_free()
        if self._cleanup if cleanup is None else cleanup:
            self.remove_files()

    def _waitport_free(self, timeout: float = 10.0) -> None:
        # smtpd children hold the listening socket until they notice master is gone.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(port_free(*a) for a in self.addresses):
            time.sleep(0.05)

    def _paths(self) -> list[Path]:
        return [self.config_dir, self.queue_dir, self.data_dir, self.maillog, self.mail_dir]

    def remove_files(self) -> None:
        """Delete what the instance created under workdir, and workdir if then empty."""
        if self._running:
            raise RuntimeError("stop the instance first")
        if (self.workdir / MARKER).exists():  # else nothing of ours is there
            remove_paths([*self._paths(), self.workdir / MARKER])
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
        return postfix_config.main_cf(self)

    def _write_config(self) -> None:
        postfix_config.write_config(self)

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
        self.tls = (str(cert), str(key))
        if TLSMGR not in self.services:
            self.services += TLSMGR
        self._restart()

    def stored(self, domain: str) -> list[bytes]:
        """The messages virtual(8) delivered to a ``mailboxes`` domain, oldest first."""
        new = self.mail_dir / domain / "new"
        files = sorted(new.iterdir(), key=lambda f: f.stat().st_mtime) if new.is_dir() else []
        return [f.read_bytes() for f in files]

    def reload(self) -> None:
        """Rewrite the configuration from the attributes (``client_access``, ``dnsbl``,
        ``extra``, ...) and ``postfix reload``: new smtpd processes take it; a session
        already open keeps the old one until it ends."""
        self._write_config()
        self._postfix("reload", timeout=30)

    def _restart(self) -> None:
        self._write_config()
        if self._running:
            self._postfix("stop", timeout=30)
            self._waitport_free()
            self._postfix("start", timeout=self._start_timeout)
            for host, port in self.addresses:
                wait_banner(host, port, self._start_timeout)

    # -- commands ------------------------------------------------------------------------------

    def _postfix(self, command: str, timeout: float) -> None:
        code, output = run_on_tty([POSTFIX, "-c", str(self.config_dir), command], timeout)
        if code != 0:
            log = (
                f"\n--- {self.maillog} (tail) ---\n{tail(self.maillog)}"
                if self.maillog_enabled
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
        for queue in MESSAGE_QUEUES:
            queue_files(self.queue_dir / queue, names)
        return len(names)

    def in_flight(self) -> int:
        """Messages not yet parked or delivered (maildrop, incoming and active queues)."""
        names: set[str] = set()
        for queue in ("maildrop", "incoming", "active"):
            queue_files(self.queue_dir / queue, names)
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
