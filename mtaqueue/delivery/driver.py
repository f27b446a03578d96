"""The asyncio driver: the one clock and timer, and the only room that performs actions.

    Driver(core, active, intake, placement, connections, outcomes, registry, tasks, clock, rng)
    .now() -> float                      the clock every room is given
    .perform(actions)                    do what the core (and the rooms) decided
    .route_due(message_ids)              route due mail now (a revalidation's go-ahead)
    await .watch_lag()                   how late the event loop runs, for the core
    .close(grace)                        stop: no new connection; attempts may finish
    .closing

The core decides when each message is due, which connection opens and which message
goes on it; the rooms below return its actions and their own (`Retire`). This driver
arms the timer for the last `Wake`, spawns connects, sends and route lookups, and feeds
what each returns back in here. A bug in one of them must not strand a slot or an item:
the slot ends, the item is retried later (uncharged once).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable

from ..logs import get_logger
from ..process_stats import cpu_waited
from ..routing.nexthop import NextHop
from ..routing.relays import Relay
from ..scheduler.actions import Close, Connect, Dispatch, GiveUp, Release, Send, Wake
from ..scheduler.active import ActiveWindow
from ..scheduler.core import RELEASE, Scheduler
from .connections import Connections, Retire, Step
from .destination import WorkItem
from .intake import Intake
from .outcomes import Outcomes
from .placement import Placement, Work
from .registry import Registry
from .tasks import Tasks

log = get_logger("delivery")

LAG_TICK = 0.1  # seconds between looks at how late the event loop runs


class Driver:
    def __init__(
        self,
        core: Scheduler,
        active: ActiveWindow,
        intake: Intake,
        placement: Placement,
        connections: Connections,
        outcomes: Outcomes,
        registry: Registry,
        tasks: Tasks,
        clock: Callable[[], float],
        rng: random.Random,
    ) -> None:
        self.core = core
        self.active = active
        self.intake = intake
        self.placement = placement
        self.connections = connections
        self.outcomes = outcomes
        self.registry = registry
        self.tasks = tasks
        self.now = clock
        self.rng = rng  # a circuit's release spread
        self.closing = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0  # the Wake it was armed for
        self._drain: asyncio.Future | None = None

    def perform(self, actions: list[Step]) -> None:
        """Do what was decided (and what is decided meanwhile, after: the last Wake is the
        one that holds)."""
        actions = list(actions)
        for action in actions:
            if isinstance(action, Wake):
                if self._timer is not None and action.at == self._timer_at:
                    continue  # armed for it already (most events leave the next wake as it was)
                if self._timer is not None:
                    self._timer.cancel()
                self._timer_at = action.at
                if not self.closing:
                    delay = max(0.0, action.at - self.now())
                    self._timer = asyncio.get_running_loop().call_later(delay, self._tick)
            elif isinstance(action, Dispatch):
                self._dispatch_due(action.message_ids)
            elif isinstance(action, Connect | Send) and self.closing:
                continue  # no new connection or message while stopping
            elif isinstance(action, Connect):
                self._attempt(action.conn, action.item, self.connections.open(action))
            elif isinstance(action, Send):
                work = self.connections.send(action.conn, action.item)
                self._attempt(action.conn, action.item, work)
            elif isinstance(action, Close):
                self.connections.close(action.conn)
            elif isinstance(action, GiveUp):
                actions += self.connections.give_up(action.conn)
            elif isinstance(action, Release):
                actions += self._release(action)
            elif isinstance(action, Retire):
                self.registry.retire(action.destination, self.now())

    async def watch_lag(self) -> None:
        """Tell the core how late the event loop runs: a reply that a busy loop read late
        was not sent late by its destination (policy/latency.py, our own load). How late
        is the timer's lateness or, if more, what the loop's thread waited for a CPU over
        the tick (each wake-up on a loaded machine waits, not only the timer's)."""
        loop = asyncio.get_running_loop()
        while not self.closing:
            planned, waited = loop.time() + LAG_TICK, cpu_waited()
            await asyncio.sleep(LAG_TICK)
            late = max(loop.time() - planned, cpu_waited() - waited)
            self.core.load.lag(self.now(), max(0.0, late))

    def _tick(self) -> None:
        self._timer = None
        self.perform(self.core.tick(self.now()))

    def _attempt(self, conn: int, item: WorkItem, work: Awaitable[list[Step]]) -> None:
        self.tasks.spawn(self._guard(conn, item, work))

    async def _guard(self, conn: int, item: WorkItem, work: Awaitable[list[Step]]) -> None:
        try:
            self.perform(await work)
        except Exception as exc:
            log.exception("attempt_failed", id=item.message_id)
            self.connections.abort(conn)
            now = self.now()
            actions: list[Step] = []
            with contextlib.suppress(KeyError):  # the slot may have ended already
                actions += self.core.abandon(now, conn)
            actions += self.outcomes.retry_later(item.message_id, item.indexes, exc, now)
            self.perform(actions)

    def _release(self, action: Release) -> list[Step]:
        """The probe went through and the circuit closed: the mail that waited while it was
        open is let go spread over shaping.release_spread, most urgent first (the queue
        gives it in class order), not as a herd. Not an attempt: due times stay."""
        now = self.now()
        shaper = self.registry.destinations[action.destination].shaper
        starts = shaper.released(now, len(action.items), self.rng)
        actions: list[Step] = []
        for item, start in zip(action.items, starts, strict=True):
            self.active.free(item.message_id, item.indexes)
            actions += self.outcomes.schedule(item.message_id, start, now, RELEASE)
        return actions

    # -- due mail ------------------------------------------------------------------------

    def _dispatch_due(self, message_ids: tuple[str, ...]) -> None:
        route_now, lined_up = self.intake.admit(message_ids)
        if route_now:
            self.route_due(route_now)
        if lined_up and (self._drain is None or self._drain.done()):
            self._drain = self.tasks.spawn(self._let_through())

    async def _let_through(self) -> None:
        async for chunk in self.intake.let_through():
            self.route_due(chunk)

    def route_due(self, message_ids: list[str]) -> None:
        batch, actions = self.placement.group(message_ids, self.now())
        for (hop, relay), work in batch.items():
            self.tasks.spawn(self._route(hop, relay, work))
        self.perform(actions)

    async def _route(self, hop: NextHop, relay: Relay | None, work: Work) -> None:
        resolved = await self.placement.resolve(hop, relay, work)
        self.perform(self.placement.queue(hop, relay, work, resolved, self.now()))

    async def read_queue(self, message_ids: list[str]) -> None:
        async for actions in self.intake.read_queue(message_ids, self.now()):
            self.perform(actions)

    # -- a stop ------------------------------------------------------------------------

    async def close(self, grace: float) -> None:
        """Stop dispatching; let attempts in progress finish for up to `grace` seconds."""
        self.closing = self.intake.closing = self.placement.closing = True
        if self._timer is not None:
            self._timer.cancel()
        self.connections.quit_idle()  # idle connections go now
        deadline = asyncio.get_running_loop().time() + grace
        while self.connections.in_transit() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        await self.tasks.cancel_all()
