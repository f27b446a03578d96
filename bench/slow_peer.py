"""A synthetic provider that only slows down, never refuses: silent throttling (issue 29).

    python bench/slow_peer.py --listen 127.0.0.2:0 --listen 127.0.0.3:0 \\
        --comfort-sessions 3 --comfort-rate 20 --rate-window 3 --session-factor 0.2 \\
        --rate-factor 2 --max-delay 8 --dot-delay 0.25 [--dot-only] [--sample-every 1] \\
        [any option of synthetic_peer.py: --greylist 300 --time-scale 0.01 --report FILE ...]

In-process (tests):

    with SlowPeer(["127.0.0.2:0"], comfort_sessions=3, dot_delay=0.1) as peer:
        ...  # smtplib / aiosmtplib against peer.host, peer.port
        comfort = peer.report()["comfort"]  # records, past, delays, max_sessions, samples

SlowPeer is synthetic_peer.SyntheticPeer (same options, same report, e.g. greylisting),
plus two comfort levels per client IP that it never announces and never answers 4xx or
5xx for. Each is optional:

- sessions: while more than `comfort_sessions` (S) sessions of the IP are open;
- rate: while the IP's MAIL commands of the last `rate_window` seconds (3), divided by
  the window, exceed `comfort_rate` (R, messages per second);

then the banner and the reply to the final dot of DATA wait

    min(max_delay, session_factor * (sessions - S) + rate_factor * (rate / R - 1))

(each term only when positive: 0.2 s a session over S, 2 s per 100% over R, 8 s at most
by default). With `dot_only` the banner is never delayed (connections open fast): only
the reply after the final dot carries the signal. Independently, `dot_delay` delays the
reply to every final dot by a fixed time at any load: the provider's own processing time
(a slow-at-any-load host with `dot_delay=1` and no comfort level is slow, not
throttling). Delays are real seconds: `time_scale` scales the policy windows of
synthetic_peer (greylisting), not these. Other replies (EHLO, MAIL, RCPT) are never
delayed.

The report (`report()`, or the CLI's JSON) adds "comfort":

- "settings"; "accepted" (messages accepted), "past" (accepted while the client was past
  a comfort level at the final dot: sessions > S or rate > R), "past_sessions",
  "past_rate";
- "delay_s": {"banner", "dot_throttle", "dot_fixed", "max"}: seconds of delay imposed
  (the throttling part at the banner and after the dot, the fixed `dot_delay` part, and
  the longest single delay), "banner_delays" (banners delayed);
- "max_sessions" (the most sessions one IP had open), "connections" (opened);
- "records": one per accepted message, `records_fields` = dot (epoch seconds the final
  dot was read), reply (epoch seconds the 250 was sent, after the delay: the acceptance
  time), message_id, client, sessions and rate (at the dot), past, delay;
- "samples": every `sample_every` seconds (1) per client IP with sessions open or MAILs in
  the window: time, client, sessions, rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from aiosmtpd.smtp import Envelope
from synthetic_peer import (
    SyntheticPeer,
    _Client,
    _Session,
    build_parser,
    message_id,
    peer_options,
    serve_cli,
)

RECORD_FIELDS = ["dot", "reply", "message_id", "client", "sessions", "rate", "past", "delay"]
SAMPLE_FIELDS = ["time", "client", "sessions", "rate"]
MAX_RECORDS = 2_000_000
MAX_SAMPLES = 200_000


class _SlowSession(_Session):
    """Delays the banner and the reply to the final dot as the provider says."""

    def __init__(self, peer: SlowPeer) -> None:
        super().__init__(peer)
        self._greeted = False
        self._dot: list | None = None  # the record of the message whose 250 is due

    async def push(self, status: str | bytes) -> None:
        peer = self._peer
        assert isinstance(peer, SlowPeer)
        open_ = self.transport is not None and not self.transport.is_closing()
        if not self._greeted:
            self._greeted = True
            if open_ and self._admitted and self._client is not None:
                delay = peer._banner_delay(self._client)
                if delay > 0:
                    await asyncio.sleep(delay)
        elif self._dot is not None:  # the reply to the final dot
            record, self._dot = self._dot, None
            if open_ and record[-1] > 0:
                await asyncio.sleep(record[-1])
            open_ = self.transport is not None and not self.transport.is_closing()
            record[1] = time.time() if open_ else None  # None: the client left first
            peer._record(record)
        await super().push(status)


class SlowPeer(SyntheticPeer):
    """A provider that slows past its undisclosed comfort levels (see the module)."""

    session_class = _SlowSession

    def __init__(
        self,
        listen: str | tuple[str, int] | Iterable[str | tuple[str, int]] = ("127.0.0.2:0",),
        *,
        comfort_sessions: int | None = None,
        comfort_rate: float | None = None,
        rate_window: float = 3.0,
        session_factor: float = 0.2,
        rate_factor: float = 2.0,
        max_delay: float = 8.0,
        dot_delay: float = 0.0,
        dot_only: bool = False,
        sample_every: float = 1.0,
        **options: Any,
    ) -> None:
        if comfort_sessions is not None and comfort_sessions < 0:
            raise ValueError("comfort_sessions must be >= 0")
        if comfort_rate is not None and comfort_rate <= 0:
            raise ValueError("comfort_rate must be > 0")
        if rate_window <= 0 or sample_every <= 0:
            raise ValueError("rate_window and sample_every must be > 0")
        if min(session_factor, rate_factor, max_delay, dot_delay) < 0:
            raise ValueError("factors and delays must be >= 0")
        self.comfort_sessions = comfort_sessions
        self.comfort_rate = comfort_rate
        self.rate_window = float(rate_window)
        self.session_factor = float(session_factor)
        self.rate_factor = float(rate_factor)
        self.max_delay = float(max_delay)
        self.dot_delay = float(dot_delay)
        self.dot_only = dot_only
        self.sample_every = float(sample_every)
        self._sampler: asyncio.Task[None] | None = None
        super().__init__(listen, **options)

    def _reset_state(self) -> None:
        super()._reset_state()
        self._mails: dict[str, deque[float]] = {}  # MAIL times (monotonic) in the window
        self._records: list[list] = []
        self._samples: list[tuple] = []
        self.records_dropped = 0
        self.past = self.past_sessions = self.past_rate = 0
        self.banner_delays = 0
        self.delay_banner = self.delay_dot_throttle = self.delay_dot_fixed = 0.0
        self.delay_longest = 0.0

    # -- the comfort levels (loop thread) --

    def _rate(self, ip: str, now: float) -> float:
        """MAILs per second of `ip` over the last rate_window seconds."""
        mails = self._mails.get(ip)
        if not mails:
            return 0.0
        horizon = now - self.rate_window
        while mails and mails[0] <= horizon:
            mails.popleft()
        return len(mails) / self.rate_window

    def _pressure(self, client: _Client) -> tuple[int, float, bool, bool, float]:
        """(sessions, rate, past sessions, past rate, throttling delay) now."""
        sessions = client.active
        rate = self._rate(client.ip, time.monotonic())
        over_sessions = over_rate = 0.0
        if self.comfort_sessions is not None:
            over_sessions = max(0, sessions - self.comfort_sessions)
        if self.comfort_rate is not None:
            over_rate = max(0.0, rate / self.comfort_rate - 1)
        delay = self.session_factor * over_sessions + self.rate_factor * over_rate
        return sessions, rate, over_sessions > 0, over_rate > 0, min(self.max_delay, delay)

    def _banner_delay(self, client: _Client) -> float:
        if self.dot_only:
            return 0.0
        delay = self._pressure(client)[-1]
        if delay > 0:
            self.banner_delays += 1
            self.delay_banner += delay
            self.delay_longest = max(self.delay_longest, delay)
        return delay

    def _on_mail(self, client: _Client) -> str | None:
        mails = self._mails.get(client.ip)
        if mails is None:
            mails = self._mails[client.ip] = deque()
        mails.append(time.monotonic())
        return super()._on_mail(client)

    def _on_data(self, session: _Session, envelope: Envelope) -> str:
        reply = super()._on_data(session, envelope)
        sessions, rate, past_sessions, past_rate, throttle = self._pressure(session._client)
        delay = self.dot_delay + throttle
        self.past_sessions += past_sessions
        self.past_rate += past_rate
        self.past += past_sessions or past_rate
        self.delay_dot_throttle += throttle
        self.delay_dot_fixed += self.dot_delay
        self.delay_longest = max(self.delay_longest, delay)
        mid = message_id(envelope.original_content or b"")
        past = past_sessions or past_rate
        assert isinstance(session, _SlowSession)
        session._dot = [time.time(), None, mid, session._client.ip, sessions, rate, past, delay]
        return reply

    def _record(self, record: list) -> None:
        if len(self._records) < MAX_RECORDS:
            self._records.append(record)
        else:
            self.records_dropped += 1

    # -- life: a sampler beside the listeners --

    async def _listen(self) -> None:
        await super()._listen()
        self._sampler = asyncio.create_task(self._sample())

    async def _shutdown(self) -> None:
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        await super()._shutdown()

    async def _sample(self) -> None:
        while True:
            await asyncio.sleep(self.sample_every)
            now, wall = time.monotonic(), time.time()
            for ip, client in self._clients.items():
                rate = self._rate(ip, now)
                if (client.active or rate) and len(self._samples) < MAX_SAMPLES:
                    self._samples.append((round(wall, 3), ip, client.active, round(rate, 3)))

    # -- the report --

    def _build_report(self, reason: str) -> dict[str, Any]:
        report = super()._build_report(reason)
        report["comfort"] = {
            "settings": {
                "comfort_sessions": self.comfort_sessions,
                "comfort_rate": self.comfort_rate,
                "rate_window_s": self.rate_window,
                "session_factor_s": self.session_factor,
                "rate_factor_s": self.rate_factor,
                "max_delay_s": self.max_delay,
                "dot_delay_s": self.dot_delay,
                "dot_only": self.dot_only,
            },
            "accepted": len(self._records) + self.records_dropped,
            "past": self.past,
            "past_sessions": self.past_sessions,
            "past_rate": self.past_rate,
            "banner_delays": self.banner_delays,
            "delay_s": {
                "banner": round(self.delay_banner, 6),
                "dot_throttle": round(self.delay_dot_throttle, 6),
                "dot_fixed": round(self.delay_dot_fixed, 6),
                "max": round(self.delay_longest, 6),
            },
            "max_sessions": max((c.peak for c in self._clients.values()), default=0),
            "connections": self.connections,
            "records_dropped": self.records_dropped,
            "records_fields": RECORD_FIELDS,
            "records": [_rounded(r) for r in self._records],
            "samples_fields": SAMPLE_FIELDS,
            "samples": [list(s) for s in self._samples],
        }
        return report


def _rounded(record: list) -> list:
    dot, reply, mid, client, sessions, rate, past, delay = record
    reply = None if reply is None else round(reply, 6)
    return [round(dot, 6), reply, mid, client, sessions, round(rate, 3), past, round(delay, 6)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    parser.description = "A synthetic provider that only slows down past comfort levels."
    add = parser.add_argument_group("slowing (never refusing)").add_argument
    add("--comfort-sessions", type=int, metavar="S", help="slow while more than S sessions")
    add("--comfort-rate", type=float, metavar="R", help="slow while over R MAILs per second")
    add("--rate-window", type=float, default=3.0, metavar="SECONDS", help="rate window (3)")
    add("--session-factor", type=float, default=0.2, metavar="SECONDS", help="per session over S")
    add("--rate-factor", type=float, default=2.0, metavar="SECONDS", help="per 100%% over R")
    add("--max-delay", type=float, default=8.0, metavar="SECONDS", help="throttling cap (8)")
    add("--dot-delay", type=float, default=0.0, metavar="SECONDS", help="after every final dot")
    add("--dot-only", action="store_true", help="never delay the banner")
    add("--sample-every", type=float, default=1.0, metavar="SECONDS", help="sessions samples")
    args = parser.parse_args(argv)
    options = peer_options(parser, args)
    try:
        peer = SlowPeer(
            comfort_sessions=args.comfort_sessions,
            comfort_rate=args.comfort_rate,
            rate_window=args.rate_window,
            session_factor=args.session_factor,
            rate_factor=args.rate_factor,
            max_delay=args.max_delay,
            dot_delay=args.dot_delay,
            dot_only=args.dot_only,
            sample_every=args.sample_every,
            **options,
        )
    except (ValueError, OSError) as error:
        parser.error(str(error))
    status = serve_cli(peer, args)
    c = peer.report()["comfort"]
    print(
        f"slow_peer: {c['past']} of {c['accepted']} accepted past comfort; delay "
        f"{sum(v for k, v in c['delay_s'].items() if k != 'max'):.1f} s; max sessions "
        f"{c['max_sessions']}",
        file=sys.stderr,
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
