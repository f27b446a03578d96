"""What webhooks cost end-to-end throughput: the same load with and without an endpoint.

    python bench/webhook_bench.py [--messages 10000] [--sessions 20] [--size 2048] [--rounds 3]
    python bench/webhook_bench.py --dead 20000 100000

The second form measures a dead endpoint: for each N, N messages are delivered while the
endpoint answers 503, so 2N events wait in the log; printed: daemon + writer RSS before and
after (the backlog must stay on disk, not in memory), the log's size on disk, and how long
the endpoint takes to get the whole backlog once it answers again.

Each round: `smtp-source` submits to mtaqueue, which relays everything to one `smtp-sink`
(as in delivery_bench.py); in the webhook rounds a `[[webhooks]]` endpoint takes every event
(accepted and delivered: two per message; with `--events delivered`, one), an aiohttp server
in its own process that checks each signature and counts. The two kinds of round alternate.
Printed per round: mail throughput, the events' rate, and how long after the last delivery
the endpoint had every event; then the medians and the ratio (target: webhooks lower
throughput by at most 10%).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # postfix_instance
from accept_bench import Mtaqueue, Watch, settled_rss
from common import load_parser, stop_process, work_directory
from delivery_bench import MTAQUEUE_PORT, SINK, run_timed
from postfix_instance import SmtpSink, smtp_source

HOOK_PORT = 2780
SECRET = "bench-secret"
RECEIVER = f"""
import time
from aiohttp import web
from mtaqueue.events.signing import HEADER, verify
count = {{"events": 0, "bad": 0, "posts": 0, "status": 204}}
async def hook(request):
    body = await request.read()
    if count["status"] != 204:
        return web.Response(status=count["status"])
    if not verify({SECRET!r}, body, request.headers.get(HEADER, ""), time.time()):
        count["bad"] += 1
        return web.Response(status=401)
    count["events"] += body.count(b'"seq":')
    count["posts"] += 1
    return web.Response(status=204)
async def counts(request):
    return web.json_response(count)
async def set_status(request):
    count["status"] = int(request.query["status"])
    return web.json_response(count)
app = web.Application()
app.router.add_post("/hook", hook)
app.router.add_get("/count", counts)
app.router.add_get("/status", set_status)
web.run_app(app, host="127.0.0.1", port={HOOK_PORT}, print=None)
"""


def receiver_counts() -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{HOOK_PORT}/count", timeout=5) as r:
        return json.load(r)


def receiver_status(status: int) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{HOOK_PORT}/status?status={status}") as r:
        r.read()


def dead_endpoint(args, workdir: Path, sink: SmtpSink, n: int, webhook: bool = True) -> None:
    """N messages delivered while the endpoint fails; then it comes back. Without
    `webhook`: the same delivery with no endpoint, the memory's baseline."""
    host, port = SINK.split(":")
    workdir.mkdir(parents=True)
    config = workdir / "mtaqueue.toml"
    hook = f'[[webhooks]]\nurl = "http://127.0.0.1:{HOOK_PORT}/hook"\nsecret = "{SECRET}"\n'
    config.write_text(hook if webhook else "")
    os.environ["MTAQUEUE_CONFIG"] = str(config)
    receiver_status(503)
    mq = Mtaqueue(workdir / "spool", MTAQUEUE_PORT, f"delivery.relayhost=[{host}]:{port}")
    mq.start()
    watch = Watch(mq, 8 << 20)
    try:
        before = sum(settled_rss(watch, 10))
        base, events0 = sink.count(), receiver_counts()["events"]
        run_timed(
            lambda: smtp_source(f"127.0.0.1:{MTAQUEUE_PORT}", args.sessions, n, args.size),
            lambda: sink.count() - base >= n and mq.queued() == 0,
        )
        after = sum(settled_rss(watch, 20))
        if not webhook:
            print(
                f"no webhook, {n} messages: daemon+writer RSS {before / 1024:.0f} MiB before,"
                f" {after / 1024:.0f} MiB after ({(after - before) / 1024:+.0f} MiB)",
                flush=True,
            )
            return
        log_bytes = sum(p.stat().st_size for p in (workdir / "spool" / "events").glob("*.log"))
        receiver_status(204)
        back = time.monotonic()
        while receiver_counts()["events"] - events0 < 2 * n:
            if time.monotonic() - back > 600:
                raise RuntimeError(f"backlog not taken: {receiver_counts()}")
            time.sleep(0.1)
        took = time.monotonic() - back
        peak = watch.peak_total
    finally:
        watch.stop()
        mq.stop()
    print(
        f"dead endpoint, {n} messages ({2 * n} events waiting, {log_bytes / 2**20:.1f} MiB on"
        f" disk): daemon+writer RSS {before / 1024:.0f} MiB before, {after / 1024:.0f} MiB"
        f" after ({(after - before) / 1024:+.0f} MiB), peak {peak / 1024:.0f} MiB; the"
        f" endpoint back: every event taken in {took:.1f} s ({2 * n / took:.0f} events/s)",
        flush=True,
    )


def a_round(args, workdir: Path, sink: SmtpSink, webhook: bool) -> tuple[float, float, float]:
    host, port = SINK.split(":")
    config = workdir / "mtaqueue.toml"
    workdir.mkdir(parents=True)
    hook = f'[[webhooks]]\nurl = "http://127.0.0.1:{HOOK_PORT}/hook"\nsecret = "{SECRET}"\n'
    if args.events:
        hook += f"events = {json.dumps(args.events)}\n"
    config.write_text(hook if webhook else "")
    os.environ["MTAQUEUE_CONFIG"] = str(config)
    mq = Mtaqueue(workdir / "spool", MTAQUEUE_PORT, f"delivery.relayhost=[{host}]:{port}")
    mq.start()
    per_message = len(args.events) if args.events else 2
    base, events0 = sink.count(), receiver_counts()["events"] if webhook else 0
    try:
        seconds = run_timed(
            lambda: smtp_source(
                f"127.0.0.1:{MTAQUEUE_PORT}", args.sessions, args.messages, args.size
            ),
            lambda: sink.count() - base >= args.messages and mq.queued() == 0,
        )
        lag = 0.0
        if webhook:
            done = time.monotonic()
            while receiver_counts()["events"] - events0 < per_message * args.messages:
                if time.monotonic() - done > 120:
                    raise RuntimeError(f"events missing: {receiver_counts()}")
                time.sleep(0.05)
            lag = time.monotonic() - done
    finally:
        mq.stop()
    rate = args.messages / seconds
    return rate, (per_message * args.messages / (seconds + lag)) if webhook else 0.0, lag


def main() -> None:
    parser = load_parser(__doc__)
    parser.add_argument("--dead", type=int, nargs="*", default=None, metavar="N")
    parser.add_argument(
        "--events",
        nargs="*",
        choices=("accepted", "delivered"),
        default=None,
        help="the webhook's event types (default: every type: accepted and delivered here)",
    )
    args = parser.parse_args()
    plain, hooked = [], []
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER])
    try:
        for _ in range(100):
            try:
                receiver_counts()
                break
            except OSError:
                time.sleep(0.1)
        with work_directory("mtaqueue-webhook-bench-") as workdir, SmtpSink(SINK) as sink:
            if args.dead:
                for n in args.dead:
                    dead_endpoint(args, workdir / f"plain{n}", sink, n, webhook=False)
                    dead_endpoint(args, workdir / f"dead{n}", sink, n)
                return
            for n in range(args.rounds):
                rate, _, _ = a_round(args, workdir / f"plain{n}", sink, webhook=False)
                plain.append(rate)
                print(f"round {n}: no webhook  {rate:7.0f} msgs/s", flush=True)
                rate, events, lag = a_round(args, workdir / f"hook{n}", sink, webhook=True)
                hooked.append(rate)
                print(
                    f"round {n}: webhook     {rate:7.0f} msgs/s, {events:6.0f} events/s,"
                    f" every event taken {lag:.2f} s after the last delivery",
                    flush=True,
                )
        counts = receiver_counts()
    finally:
        stop_process(receiver, 5)
    p, h = sorted(plain)[len(plain) // 2], sorted(hooked)[len(hooked) // 2]
    print(f"median: no webhook {p:.0f} msgs/s, webhook {h:.0f} msgs/s, ratio {h / p:.2f}")
    print(f"receiver: {counts['events']} events in {counts['posts']} POSTs, {counts['bad']} bad")


if __name__ == "__main__":
    main()
