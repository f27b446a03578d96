"""The provider down while mail queues, then back, then `mtaqueue-ctl flush --all`.

    run_mtaqueue_flush(s, workdir, timeout, tag, overrides) -> recovery_storm.Run

The other storms queue with delivery off and release by a restart. Here the daemon runs
all along with the shipped config, as it would in production: the provider refuses every
connection (`421 4.3.2 Service not available`, synthetic_peer.py --start-down) while the
backlog is submitted and for the rest of the outage, so its hosts get suspended and its
breaker may open; then the provider comes back (SIGUSR1) and the admin runs `flush --all`
(the release, t = 0). What follows is what the admin waits for: the first MAIL after the
flush (`first_attempt_s`: idle seconds that only a suspension nobody lifted would cause),
the drain and its ratio to the provider's minimum, p0 latency, throttle replies,
blocklistings. Postfix's comparison (`recovery_storm.run_postfix`) is its defer mode and a
`postqueue -f` at the same moment: a sender that kept no memory of the outage.
"""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

from recovery_storm import (
    MTAQUEUE_PORT,
    SINK_IP,
    Daemon,
    PeerProcess,
    Run,
    Scenario,
    drain_mtaqueue,
    mtaqueue_config,
    plan,
    provider_dns,
    read_daemon_log,
    submit,
    wait_outage,
)
from synthetic_peer import SyntheticPeer


def run_mtaqueue_flush(
    s: Scenario,
    workdir: Path,
    timeout: float,
    tag: str,
    overrides: tuple[str, ...] | list[str] = (),
) -> Run:
    run = Run("flush", "mtaqueue (shipped config), outage then flush --all", plan(s.messages, tag))
    workdir = workdir / run.name
    workdir.mkdir()
    duration = s.outage * s.scale + timeout + 600
    peer = PeerProcess(workdir, s, duration=duration)
    peer.args.append("--start-down")
    peer.start()
    sink = SyntheticPeer([f"{SINK_IP}:0"]).start()
    dns = provider_dns()
    daemon = None
    try:
        cfg = mtaqueue_config(
            s, workdir / "spool", peer.port, sink.port, dns.address, naive=False, admin=False
        )
        daemon = Daemon(workdir, "release", cfg, overrides)  # read_daemon_log's name
        daemon.start()
        first = time.time()
        run.submit_s = submit("127.0.0.1", MTAQUEUE_PORT, run.planned, s.sessions, s.size)
        wait_outage(first, s)
        assert peer.proc is not None
        peer.proc.send_signal(signal.SIGUSR1)  # the provider is back
        run.release = time.time()
        [flushed] = daemon.ask("flush", {"all": True})
        run.startup_s = time.time() - run.release  # how long the flush command took
        run.notes.append(f"flush --all: {flushed}")
        drain_mtaqueue(run, daemon, peer, timeout)
    except Exception as exc:  # the run broke: keep what we have
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        if daemon is not None:
            with contextlib.suppress(Exception):
                run.extra["hosts_after"] = daemon.ask("hosts")
            daemon.stop()
        dns.stop()
        run.dsns = sink.stop()["messages"]["accepted"]
        run.report = peer.stop()
    run.extra["log"] = read_daemon_log(workdir / "release.log")
    run.extra["outage"] = run.report.get("outage")
    return run
