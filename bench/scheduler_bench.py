"""The scheduler core's cost per event with many destinations (pure: no sockets, a fake clock).

    python bench/scheduler_bench.py [--destinations 100 10000 100000] [--seconds 3]

A queue spread over D destinations (two messages each, more arriving), the shipped default
pacing and 100 connections in all (delivery.max_connections), so that with many
destinations most of them wait for a global slot. A driver completes the core's actions at
once: every Connect is `connected`, every Send is `done` (delivered) in turn, and a new
message is queued to a random destination after each; the clock moves 1 ms an event. Events
per second is the core's calls (enqueue, connected, done, tick) over the wall time, after
the set-up. Run it in an older tree to compare (it imports the mtaqueue beside it).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mtaqueue import config
from mtaqueue.config import DEFAULT_CLASSES
from mtaqueue.policy.classify import classify
from mtaqueue.policy.replies import Reply
from mtaqueue.policy.shaper import DestinationShaper
from mtaqueue.scheduler.actions import Connect, Send
from mtaqueue.scheduler.core import Scheduler

OK = Reply("data_end", 250, "2.0.0", "ok")
CLASSES = {name: (c.priority, c.weight) for name, c in DEFAULT_CLASSES.items()}
T0 = 1_000_000.0
STEP = 0.001  # fake seconds per event


def run(destinations: int, seconds: float, rng: random.Random) -> dict:
    shaping = config.ShapingConfig()
    pacing = shaping.default
    core: Scheduler[str] = Scheduler(CLASSES, max_connections=100, connection_idle=5.0)
    keys = [f"d{i}.example" for i in range(destinations)]
    ids = iter(range(10**12))
    now = T0
    for key in keys:
        core.add_destination(key, DestinationShaper(pacing, shaping, now), pacing)
        for _ in range(2):
            klass = "p0" if rng.random() < 0.02 else "p2"
            core.enqueue(now, key, f"m{next(ids)}", klass, run=False)
    sending: deque[int] = deque()
    pending = deque(core.tick(now))
    events = delivered = 0

    def settle() -> None:
        nonlocal events
        while pending:
            action = pending.popleft()
            if isinstance(action, Connect):
                events += 1
                pending.extend(core.connected(now, action.conn))
            elif isinstance(action, Send):
                sending.append(action.conn)

    settle()
    events = 0
    started = time.perf_counter()
    verdict = classify(OK, ())
    while time.perf_counter() - started < seconds:
        now += STEP
        if sending:
            conn = sending.popleft()
            pending.extend(core.done(now, conn, reusable=True, replies=[(OK, verdict)]))
            delivered += 1
        else:
            pending.extend(core.tick(now))
        klass = "p0" if rng.random() < 0.02 else "p2"
        pending.extend(core.enqueue(now, rng.choice(keys), f"m{next(ids)}", klass))
        events += 2
        settle()
    wall = time.perf_counter() - started
    return {"destinations": destinations, "events": events, "delivered": delivered, "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--destinations", type=int, nargs="+", default=[100, 10000, 100000])
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    print("| destinations | events | events/s | µs/event | deliveries |")
    print("|---|---|---|---|---|")
    for count in args.destinations:
        r = run(count, args.seconds, random.Random(1))
        rate = r["events"] / r["wall"]
        cells = [f"{count:,}", f"{r['events']:,}", f"{rate:,.0f}", f"{1e6 / rate:,.1f}"]
        print("| " + " | ".join([*cells, f"{r['delivered']:,}"]) + " |")


if __name__ == "__main__":
    main()
