"""Durable accept throughput, side by side with Postfix, plus start-up and memory.

    python bench/accept_bench.py [--messages 10000] [--sessions 20] [--size 2048]
                                 [--rounds 3] [--queued 100000 [300000 ...]]
                                 [--skip-throughput] [--rss-limit-mb 8000]
                                 [--dkim rsa-sha256 ed25519-sha256 ...]

1. Throughput: `smtp-source -s SESSIONS -m MESSAGES -l SIZE` against a private
   Postfix instance that accepts durably and defers delivery, and against
   mtaqueue, alternately for ROUNDS rounds (the disk of a shared VM drifts; the
   alternation keeps the comparison fair). Both spools live on the same file
   system. Prints msgs/s per run, the medians and their ratio. With `--dkim`, each
   round also runs mtaqueue signing every message (smtp-source's From is at
   example.com) with a key of each algorithm given (RSA: 2048 bits), or `both`: one
   of each, two signatures per message; Postfix stays unsigned.
2. Start-up, for each QUEUED size in turn: a spool holding that many 2 KiB messages to 50
   domains (written with the spool's own writer), then four starts of the daemon: the
   first and a restart (its writer merges the journal's two segments) with delivery off, each timed
   to the first 250 reply ("accepting"); delivery on with everything relayed to a local
   sink (`delivery.relayhost`), timed to accepting and to the sink's first accepted
   message (the probe's own recipient is refused there, so that is a queued one), and its
   memory and the messages delivered 30 s after the start; and the
   shipped config (delivery on, the next hops from DNS), timed to accepting.
3. Memory: resident memory (VmRSS) of the daemon and of its children (the spool writer
   and the SMTP listener's process) once settled
   after the restart, the peak of the two over all the starts, bytes per queued message
   over an empty spool's, and the growth per message from the previous size. One table,
   one column per size. A watchdog kills a daemon whose tree passes `--rss-limit-mb`.

The daemons' DNS is a loopback port that never answers (lookups time out, as with an
unreachable resolver): nothing is asked outside the machine.
"""

from __future__ import annotations

import os
import shutil
import smtplib
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # postfix_instance
# The spool filler must be the same code as the daemon it fills for (`python -m` runs the
# tree's own), not whatever mtaqueue is installed: spool formats change.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import dkim_key, load_parser, stop_process, tree_pids, work_directory
from postfix_instance import PostfixInstance, postfix_available, smtp_source
from synthetic_peer import SyntheticPeer

from mtaqueue.control import protocol
from mtaqueue.ids import IdGenerator
from mtaqueue.model import Message, Recipient
from mtaqueue.spool.layout import SpoolLayout
from mtaqueue.spool.message_file import read_message_file
from mtaqueue.spool.writer import Accept, SpoolWriter

POSTFIX_ADDR = "127.0.0.1:2625"
SINK_IP = "127.0.0.5"  # where the first-delivery measurement relays everything
DELIVERING_AT = 30.0  # seconds after the start at which the delivering daemon's RSS is taken


def blackhole_dns() -> str:
    """A loopback UDP port that takes DNS queries and never answers: lookups time out, as
    with an unreachable resolver, and nothing leaves the machine (the system's resolver
    would be asked otherwise)."""
    global _BLACKHOLE
    if _BLACKHOLE is None:
        _BLACKHOLE = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        _BLACKHOLE.bind(("127.0.0.1", 0))
    host, port = _BLACKHOLE.getsockname()
    return f"{host}:{port}"


_BLACKHOLE: socket.socket | None = None


class Mtaqueue:
    """The daemon as a subprocess on a given spool. Its DNS is `blackhole_dns()` unless the
    overrides say otherwise. It logs warnings and errors only, to nowhere, unless given a
    `log_file`: then its shipped level (info: an event a message accepted and one a
    delivery), to that file, as a Postfix instance logs each message to its maillog."""

    def __init__(
        self, spool: Path, port: int, *overrides: str, log_file: Path | None = None
    ) -> None:
        self.spool, self.port, self.log_file = spool, port, log_file
        self.overrides = (f'dns.nameservers=["{blackhole_dns()}"]', *overrides)
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def start(self) -> float:
        """Start; returns seconds until the first message is acknowledged."""
        self.launch()
        return self.wait_accepting()

    def launch(self) -> None:
        self.started = time.monotonic()
        quiet = [] if self.log_file else ["-o", "log.level=warning"]
        with open(self.log_file or os.devnull, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable, "-m", "mtaqueue.daemon",
                    "-o", f"spool.path={self.spool}",
                    "-o", f"listen.address=127.0.0.1:{self.port}",
                    *quiet,
                    *(arg for item in self.overrides for arg in ("-o", item)),
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )  # fmt: skip

    def wait_accepting(self, timeout: float = 600) -> float:
        """Seconds from launch() until a probe message got its 250."""
        assert self.proc is not None
        while True:
            left = self.started + timeout - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no 250 within {timeout:.0f} s")
            try:
                with smtplib.SMTP("127.0.0.1", self.port, timeout=min(30, left)) as client:
                    client.sendmail(
                        "probe@example.com", ["probe@example.org"], b"Subject: p\r\n\r\n"
                    )
                return time.monotonic() - self.started
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("mtaqueue exited") from None
                time.sleep(0.01)

    def rss_kib(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def queued(self) -> int:
        """Messages in the queue, asked over the control socket from this process (as
        `mtaqueue-ctl status` asks). Not through a ctl process: starting one takes ~0.1 s
        of interpreter and imports, which a timed round would count as the daemon's,
        while Postfix's queue is counted in-process (PostfixInstance.queue_count)."""
        with protocol.connect(str(self.spool / "control.sock")) as sock:
            return next(protocol.request(sock, "status", {}))["messages"]

    def stop(self) -> None:
        stop_process(self.proc, 60)


def dkim_overrides(workdir: Path, setup: str) -> tuple[str, ...]:
    """Overrides that sign example.com's mail with a new key of algorithm `setup`, or one
    of each for "both" (as [[dkim."example.com"]] would)."""
    algorithms = DKIM_SETUPS[setup]
    if len(algorithms) == 1:
        key = dkim_key(workdir, algorithms[0])
        return (
            "dkim.example.com.selector=bench",
            f"dkim.example.com.key_file={key}",
            f"dkim.example.com.algorithm={algorithms[0]}",
        )
    tables = ", ".join(
        f'{{selector = "bench{i}", key_file = "{dkim_key(workdir, a)}", algorithm = "{a}"}}'
        for i, a in enumerate(algorithms)
    )
    return (f"dkim.example.com=[{tables}]",)


DKIM_SETUPS = {
    "rsa-sha256": ("rsa-sha256",),
    "ed25519-sha256": ("ed25519-sha256",),
    "both": ("rsa-sha256", "ed25519-sha256"),
}


def signatures_in_spool(spool: Path) -> int:
    """DKIM-Signature fields of one message stored by a signing run (not the probe)."""
    for path in sorted((spool / "msg").glob("*/*/*")):
        _, content = read_message_file(path)
        if b"From: <bench@example.com>" in content:
            return content.count(b"DKIM-Signature:")
    return 0


def throughput(args, workdir: Path) -> None:
    """Every run's spool (Postfix's too) is kept until the work directory goes, after all
    rounds: ext4 without a journal skips inodes freed in the last minute or so when it
    allocates one, so a run right after another's 10,000 deletes would pay for them."""
    pf_rates: list[float] = []
    mq_rates: dict[str, list[float]] = {setup: [] for setup in ["unsigned", *args.dkim]}
    for round_ in range(args.rounds):
        if postfix_available():
            with PostfixInstance(
                workdir / f"postfix{round_}", listen=POSTFIX_ADDR, mode="defer", cleanup=False
            ) as pf:
                seconds = smtp_source(POSTFIX_ADDR, args.sessions, args.messages, args.size)
                assert pf.queue_count() >= args.messages, "postfix lost mail"
            pf_rates.append(args.messages / seconds)
            print(f"round {round_}: postfix  {pf_rates[-1]:8.0f} msgs/s", flush=True)
        for setup, rates in mq_rates.items():
            signing = () if setup == "unsigned" else dkim_overrides(workdir, setup)
            # Delivery off, as Postfix defers it: the accept path alone (and no bounce of
            # the test domain turning into suppressions that refuse the rest).
            spool = workdir / f"mq{round_}-{setup}"
            # Its shipped log level, to a file, as Postfix logs each message to its maillog.
            log_file = workdir / f"mq{round_}-{setup}.log"
            mq = Mtaqueue(spool, 2626, "delivery.enabled=false", *signing, log_file=log_file)
            mq.start()
            try:
                seconds = smtp_source("127.0.0.1:2626", args.sessions, args.messages, args.size)
                assert mq.queued() == args.messages + 1, "mtaqueue lost mail"
            finally:
                mq.stop()
            if signing:
                expected = len(DKIM_SETUPS[setup])
                assert signatures_in_spool(spool) == expected, f"{setup}: not signed"
            rates.append(args.messages / seconds)
            print(f"round {round_}: mtaqueue {setup:<14} {rates[-1]:8.0f} msgs/s", flush=True)
    for setup, rates in mq_rates.items():
        print(f"-- mtaqueue {setup}")
        print_medians(rates, pf_rates, "msgs/s")


def print_medians(mq_rates: list[float], pf_rates: list[float], unit: str) -> None:
    mq_median = statistics.median(mq_rates)
    print(f"mtaqueue median: {mq_median:.0f} {unit}")
    if pf_rates:
        pf_median = statistics.median(pf_rates)
        print(f"postfix median:  {pf_median:.0f} {unit}")
        print(f"ratio mtaqueue/postfix: {mq_median / pf_median:.2f}")


def fill_spool(spool: Path, count: int, size: int, domains: int = 50) -> None:
    """Write `count` queued messages to `domains` domains with the spool's own writer
    (fast, no SMTP)."""
    SpoolLayout(spool).create()
    writer = SpoolWriter(spool, compact_size=1 << 40, dedupe_window=86400)
    ids = IdGenerator()
    content = b"Subject: queued\r\n\r\n" + (b"x" * 62 + b"\r\n") * (size // 64)
    batch = []
    for i in range(count):
        queue_id = ids.next()
        message = Message(
            id=queue_id,
            sender="app@example.com",
            recipients=(Recipient(f"user{i}@example{i % domains}.org"),),
            created=time.time(),
            size=len(content),
            klass=("p0", "p1", "p2")[i % 3],
        )
        batch.append(Accept(message, content))
        if len(batch) == 500:
            assert not any(writer.commit(batch))
            batch = []
    if batch:
        assert not any(writer.commit(batch))
    writer.close()


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of one process, KiB; (0, 0) once it is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0, 0
    values = dict(line.split(":", 1) for line in lines if ":" in line)
    return tuple(int(values.get(k, "0 kB").split()[0]) for k in ("VmRSS", "VmHWM"))


class Watch:
    """Samples the resident memory of the daemon and of its children (the spool writer, the
    SMTP listener's process)
    every 0.25 s in a thread, keeps the peaks, and kills the daemon when the two together
    pass `limit_kib` (a run that would take the shared machine's memory)."""

    def __init__(self, mq: Mtaqueue, limit_kib: int) -> None:
        assert mq.proc is not None
        self.pid, self.proc, self.limit = mq.proc.pid, mq.proc, limit_kib
        self.daemon = self.writer = self.peak_total = 0
        self.killed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> tuple[int, int]:
        """(daemon, its children) RSS now, KiB."""
        daemon = rss_kib(self.pid)[0]
        writer = sum(rss_kib(pid)[0] for pid in tree_pids(self.pid)[1:])
        return daemon, writer

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            daemon, writer = self.sample()
            self.daemon, self.writer = max(self.daemon, daemon), max(self.writer, writer)
            self.peak_total = max(self.peak_total, daemon + writer)
            if daemon + writer > self.limit and self.proc.poll() is None:
                self.killed = True
                self.proc.kill()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def settled_rss(watch: Watch, longest: float = 60.0) -> tuple[int, int]:
    """(daemon, writer) RSS once the total stops growing (within 1% over 2 s: the start-up
    sweep is done) or after `longest` seconds."""
    deadline = time.monotonic() + longest
    last = sum(watch.sample())
    while time.monotonic() < deadline:
        time.sleep(2)
        now = watch.sample()
        if abs(sum(now) - last) <= 0.01 * last:
            return now
        last = sum(now)
    return watch.sample()


@dataclass
class Startup:
    """One queue size's figures (seconds; KiB)."""

    queued: int
    fill_s: float = 0.0
    first_s: float | None = None  # start -> first 250, first start (merges the journal)
    restart_s: float | None = None  # the same, a plain restart
    accepting_s: float | None = None  # the same, delivery on
    first_delivery_s: float | None = None  # start -> the sink accepts the first message
    shipped_s: float | None = None  # start -> first 250, shipped config (DNS unanswered)
    daemon_kib: int = 0  # settled, after the restart (delivery off)
    writer_kib: int = 0
    delivering_kib: int = 0  # daemon + writer DELIVERING_AT s after the start, delivery on
    delivered: int = 0  # messages the sink accepted by then
    peak_kib: int = 0  # daemon + writer, highest sample over every start
    failed: str = ""  # why a start gave no figure (over the memory limit, timed out)

    @property
    def total_kib(self) -> int:
        return self.daemon_kib + self.writer_kib


def timed_start(mq: Mtaqueue, row: Startup, args, sink: SyntheticPeer | None = None):
    """Start `mq`, watched: (seconds to the first 250, seconds to the first delivery at
    `sink` or None, the watch). On a failure `row.failed` says why and the daemon is
    stopped."""
    mq.launch()
    watch = Watch(mq, args.rss_limit_mb * 1024)
    started = mq.started
    try:
        accepting = mq.wait_accepting(args.start_timeout)
        delivered = None
        if sink is not None:
            while sink.first_accepted_at is None:
                if time.monotonic() - started > args.start_timeout or mq.proc.poll() is not None:
                    raise RuntimeError("no delivery")
                time.sleep(0.01)
            delivered = sink.first_accepted_at - (time.time() - (time.monotonic() - started))
        return accepting, delivered, watch
    except (RuntimeError, TimeoutError) as exc:
        watch.stop()
        row.peak_kib = max(row.peak_kib, watch.peak_total)
        mq.stop()
        row.failed = f"over {args.rss_limit_mb} MB RSS (killed)" if watch.killed else f"{exc}"
        return None, None, None


def startup(args, workdir: Path, queued: int) -> Startup:
    row = Startup(queued)
    spool = workdir / f"full{queued}"
    started = time.monotonic()
    fill_spool(spool, queued, args.size)
    row.fill_s = time.monotonic() - started
    print(f"filled a spool with {queued} messages in {row.fill_s:.1f} s", flush=True)
    off = Mtaqueue(spool, 2628, "delivery.enabled=false")
    # The first start reads the filler's journal (one segment, left as it is); the restart
    # finds two and merges them, and is left running until its memory has settled.
    for attr in ("first_s", "restart_s"):
        seconds, _, watch = timed_start(off, row, args)
        if watch is None:
            return row
        setattr(row, attr, seconds)
        if attr == "restart_s":
            row.daemon_kib, row.writer_kib = settled_rss(watch)
        watch.stop()
        row.peak_kib = max(row.peak_kib, watch.peak_total)
        off.stop()
    # Delivery on, everything relayed to a local sink: until it accepts the first message.
    # The probe is refused (and so is its DSN): the first message accepted is a queued one.
    # Suppression off: the probe's bounce must not suppress the next start's probe.
    probes = ("probe@example.org", "probe@example.com")
    with SyntheticPeer([f"{SINK_IP}:0"], timeline=False, bounces=probes) as sink:
        on = Mtaqueue(
            spool, 2628, f"delivery.relayhost=[{SINK_IP}]:{sink.port}", "suppression.enabled=false"
        )
        row.accepting_s, row.first_delivery_s, watch = timed_start(on, row, args, sink)
        if watch is not None:
            # And its memory while it delivers: at a start the whole queue is due (p0 at
            # once, the rest spread over retry.restart_spread).
            time.sleep(max(0.0, DELIVERING_AT - (time.monotonic() - on.started)))
            row.delivering_kib, row.delivered = sum(watch.sample()), sink.accepted
            watch.stop()
            row.peak_kib = max(row.peak_kib, watch.peak_total)
            on.stop()
    # Last, as the first version of this benchmark measured it: the shipped config, so
    # delivery is on and the next hops come from a resolver that never answers.
    shipped = Mtaqueue(spool, 2628)
    row.shipped_s, _, watch = timed_start(shipped, row, args)
    if watch is not None:
        watch.stop()
        row.peak_kib = max(row.peak_kib, watch.peak_total)
        shipped.stop()
    return row


def startup_and_memory(args, workdir: Path) -> None:
    empty = Mtaqueue(workdir / "empty", 2627)
    empty_start = empty.start()
    time.sleep(1)
    base = Watch(empty, 1 << 40)
    base_daemon, base_writer = base.sample()
    base.stop()
    empty.stop()
    print(
        f"empty spool: first 250 after {empty_start:.2f} s; RSS daemon {base_daemon} KiB, "
        f"children {base_writer} KiB",
        flush=True,
    )
    rows = []
    for queued in args.queued:
        rows.append(startup(args, workdir, queued))
        shutil.rmtree(workdir / f"full{queued}", ignore_errors=True)
        print(startup_table(rows, base_daemon + base_writer), flush=True)


def startup_table(rows: list[Startup], base_kib: int) -> str:
    """The figures of every size side by side, one column per size."""

    def secs(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    def mib(kib: int) -> str:
        return f"{kib / 1024:.0f}" if kib else "-"

    def per_message(row: Startup) -> str:
        if not row.total_kib:
            return "-"
        return f"{(row.total_kib - base_kib) * 1024 / row.queued:.0f}"

    def growth(i: int) -> str:
        prev, row = (rows[i - 1] if i else None), rows[i]
        if prev is None or not (prev.total_kib and row.total_kib):
            return "-"
        return f"{(row.total_kib - prev.total_kib) * 1024 / (row.queued - prev.queued):.0f}"

    lines = [
        ("spool filled in, s", lambda r, i: f"{r.fill_s:.1f}"),
        ("start -> accepting (first 250), first start, s", lambda r, i: secs(r.first_s)),
        ("start -> accepting, restart, s", lambda r, i: secs(r.restart_s)),
        ("start -> accepting, delivery on, s", lambda r, i: secs(r.accepting_s)),
        ("start -> first delivery (local sink), s", lambda r, i: secs(r.first_delivery_s)),
        ("start -> accepting, shipped config (DNS unanswered), s", lambda r, i: secs(r.shipped_s)),
        (
            f"RSS daemon + children {DELIVERING_AT:.0f} s after the start, delivering, MiB",
            lambda r, i: mib(r.delivering_kib),
        ),
        (f"messages delivered in those {DELIVERING_AT:.0f} s", lambda r, i: f"{r.delivered:,}"),
        ("RSS daemon, MiB (restart, settled)", lambda r, i: mib(r.daemon_kib)),
        ("RSS children (writer, listener), MiB", lambda r, i: mib(r.writer_kib)),
        ("RSS daemon + children, MiB", lambda r, i: mib(r.total_kib)),
        ("peak daemon + children over the starts, MiB", lambda r, i: mib(r.peak_kib)),
        ("bytes per queued message (over the empty spool)", lambda r, i: per_message(r)),
        ("growth per message from the previous size, bytes", lambda r, i: growth(i)),
        ("failed", lambda r, i: r.failed or "-"),
    ]
    out = ["| | " + " | ".join(f"{r.queued:,}" for r in rows) + " |"]
    out.append("|---" * (len(rows) + 1) + "|")
    for title, get in lines:
        out.append(f"| {title} | " + " | ".join(get(r, i) for i, r in enumerate(rows)) + " |")
    return "\n".join(out)


def main() -> None:
    parser = load_parser(__doc__)
    parser.add_argument(
        "--queued", type=int, nargs="+", default=[100_000], help="queue sizes, in order"
    )
    parser.add_argument(
        "--rss-limit-mb",
        type=int,
        default=8000,
        help="kill the daemon when it and its writer pass this resident size (8000)",
    )
    parser.add_argument(
        "--start-timeout", type=float, default=600, help="seconds a start may take (600)"
    )
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument(
        "--dkim",
        nargs="+",
        default=[],
        choices=sorted(DKIM_SETUPS),
        help="also measure mtaqueue signing with these keys (both: one of each)",
    )
    args = parser.parse_args()
    with work_directory("mtaqueue-bench-") as workdir:
        if not args.skip_throughput:
            throughput(args, workdir)
        startup_and_memory(args, workdir)


if __name__ == "__main__":
    main()
