"""The learned rate against fixed-window limiters, on a fake clock: seconds, not an hour.

    python bench/learner_windows.py [--offsets 0,0.33,0.41] [--burst 5] [--messages N]

The pure policy code alone (mtaqueue/policy/rate_learner.py, and the shaper's message
bucket: a token bucket of `--burst` at the learned rate, one message at a time after a
pause): a backlog of N messages, each needing two MAILs (a greylisted first attempt and its
retry, as at postfix_provider.py's provider), sent to a limiter that allows `limit` MAILs
per `unit` seconds in fixed windows, each starting at the first MAIL after the last one
ended (Postfix's anvil), refused MAILs counting in their window. Every limiter runs at
several phases of its windows (`--offsets`, shares of a unit already gone at the first
MAIL). Per limiter: refused MAILs per 1,000 messages and drain / T_min (T_min =
(ceil(2N / limit) - 1) x unit); then the mean over all.

This is the learner in isolation: one sender, no connections, no reply latency, sends
evenly spaced. A real provider's figures (postfix_provider.py) differ by how replies
bunch; use this to compare two versions of the learner quickly (run it in each tree), and
the real provider to confirm.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtaqueue.policy.buckets import TokenBucket
from mtaqueue.policy.rate_learner import RateLearner

# (MAILs allowed, window in seconds): anvil's default unit is 60 s; 10 s is the bench's.
LIMITERS = [
    (20, 10.0),
    (30, 10.0),
    (60, 10.0),
    (120, 10.0),
    (1000, 10.0),
    (6, 1.0),
    (100, 60.0),
    (200, 60.0),
    (300, 60.0),
    (600, 60.0),
    (1200, 60.0),
    (3000, 60.0),
]
GAP = 0.002  # seconds between two sends at the least (a transaction's turn)


class Window:
    """`limit` MAILs per `unit` seconds, the window opening at the first MAIL after the last
    one closed; `gone` of a unit already past at t = 0."""

    def __init__(self, limit: int, unit: float, gone: float) -> None:
        self.limit, self.unit = limit, unit
        self.start, self.count = -gone * unit, 0

    def take(self, now: float) -> bool:
        if now - self.start >= self.unit:
            self.start, self.count = now, 0
        self.count += 1
        return self.count <= self.limit


def drain(limit: int, unit: float, messages: int, gone: float, burst: int) -> tuple[int, float]:
    """(refused MAILs, drain / T_min) for `messages` sent to one limiter."""
    learner, provider = RateLearner(0.0), Window(limit, unit, gone)
    bucket = TokenBucket(learner.limit(0.0), burst, 0.0)
    now, refused, taken, paused = 0.0, 0, 0, 0.0
    while taken < 2 * messages:
        bucket.set_rate(learner.limit(0.0), now)
        if learner.paused_until != paused:  # the shaper's resume: no burst after a pause
            paused = learner.paused_until
            bucket.resume_at(paused)
        wait = max(bucket.wait(now), learner.wait(now))
        if wait:
            now += wait
            continue
        bucket.take(now)
        learner.sent(now)
        if provider.take(now):
            learner.delivered(now, 0.0)
            taken += 1
        else:
            learner.throttled(now, "450 4.7.1 Error: too much mail from 192.0.2.1")
            refused += 1
        now += GAP
    t_min = max(1, math.ceil(2 * messages / limit) - 1) * unit
    return refused, now / t_min


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--offsets", default="0,0.33,0.41", help="shares of a window gone")
    parser.add_argument("--burst", type=int, default=5, help="the message bucket's (5)")
    parser.add_argument(
        "--messages", type=int, help="per limiter (default: 10 x its limit, at least 1,000)"
    )
    args = parser.parse_args()
    offsets = [float(x) for x in args.offsets.split(",")]
    print("| limiter | messages | refused MAILs / 1,000 | drain / T_min at each offset |")
    print("| --- | --- | --- | --- |")
    refused_all = messages_all = 0
    ratios = []
    for limit, unit in LIMITERS:
        messages = args.messages or max(1000, 10 * limit)
        runs = [drain(limit, unit, messages, gone, args.burst) for gone in offsets]
        refused = sum(r for r, _ in runs)
        refused_all += refused
        messages_all += messages * len(runs)
        ratios += [d for _, d in runs]
        drains = " ".join(f"{d:.3f}" for _, d in runs)
        per = 1000 * refused / (messages * len(runs))
        print(f"| {limit} per {unit:.0f} s | {messages} | {per:.1f} | {drains} |")
    print(
        f"\nall: {1000 * refused_all / messages_all:.2f} refused MAILs per 1,000 messages; "
        f"drain / T_min mean {sum(ratios) / len(ratios):.3f}, max {max(ratios):.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
