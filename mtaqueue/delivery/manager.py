"""The delivery side's face: the rooms wired together, and the one small interface that
the daemon, mtaqueue-ctl and the API use.

    DeliveryManager(cfg, spool, resolver, hostname, rng=None)
    .reconfigure(cfg)            start or reload (may raise ConfigError, changing nothing)
    .start() / .close(grace)     schedule the queue and run / stop
    .on_accepted(message)        a new message is durable: due now
    .hold .release .flush .requeue .delete .cancel .bounce    (messages) -> count
    .limit .backoff .forget_learned                           (destination name) -> count
    .unsuspend(host=, domain=) / .suspended_hosts()           host suspensions lifted, shown
    .warmups(address) / .move_warmup(address, name, to_first)
    .domains() / .view() / .waiting_for(message_id) / .relay_of(message)
    .scheduled() -> {reason: count}                          schedules by reason (metrics)
    .memory_sizes() -> {map: entries}                       in-memory maps' sizes (metrics)
    .on_delivery / .on_connect / .sign_notice                 hooks: metrics, DKIM
    .tls_reports

The rooms, top down (docs/architecture.md): operations, ramps and upkeep ask the driver
(driver.py: the clock, the timer, the only room that performs actions) to do what the
core (scheduler/core.py) and the rooms below decide: intake (the start-up read, the
active window's line), connections (the pool), placement (routing and sources),
outcomes (settlements and the journal), registry (live destinations), notices (DSNs).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from .. import config
from ..logs import get_logger
from ..model import Message
from ..policy.buckets import TokenBucket
from ..policy.classify import compile_rules
from ..policy.egress import EgressState
from ..policy.fairness import class_order
from ..policy.hosts import HostSuspensions
from ..routing.pools import Pools
from ..routing.relays import relays
from ..routing.resolver import Resolver
from ..scheduler.active import ActiveWindow
from ..scheduler.core import ACCEPTED, Scheduler
from ..smtp.client import ClientSettings
from ..spool.store import Spool
from ..spool.walk import WALK_CHUNK, walk
from . import smarthosts
from .connections import Connections
from .destination import DestinationsView
from .driver import Driver
from .intake import Intake
from .mta_sts import Policies, tls_context
from .notices import Notices
from .operations import Operations
from .outcomes import Outcomes
from .placement import Placement
from .ramps import Ramps
from .registry import Registry
from .revalidation import Revalidation
from .sender import Sender
from .tasks import Tasks
from .tls_reports import TlsReports
from .upkeep import Upkeep

log = get_logger("delivery")


class DeliveryManager:
    def __init__(
        self,
        cfg: config.Config,
        spool: Spool,
        resolver: Resolver,
        hostname: str,
        rng: random.Random | None = None,
    ) -> None:
        self.spool = spool
        self.resolver = resolver
        self.hostname = hostname
        rng = rng or random.Random()
        d = cfg.delivery
        self.hosts = HostSuspensions(d.host_suspend, d.host_suspend_max)
        self.egress = EgressState()  # sources out by destination, IPv4-only destinations
        clock = time.time  # the one clock: the driver's, given to the rooms that await
        self.tasks = tasks = Tasks()
        self.active = active = ActiveWindow(WALK_CHUNK)  # a walk's chunk at a time
        self.core = core = Scheduler(
            _classes(cfg), max_connections=d.max_connections, connection_idle=d.connection_idle
        )
        self.registry = registry = Registry(core, spool)
        self.notices = Notices(spool, hostname, cfg, tasks)
        self.outcomes = outcomes = Outcomes(spool, active, core, registry, self.notices, tasks, rng)
        self.revalidation = Revalidation(cfg, self._revalidated)
        self.placement = placement = Placement(
            spool, active, registry, outcomes, core, resolver, self.egress, self.revalidation, rng
        )
        self.intake = Intake(spool, active, outcomes, rng, clock)
        self.connections = Connections(
            registry, placement, outcomes, core, active, spool, tasks, clock
        )
        self.driver = driver = Driver(
            core,
            active,
            self.intake,
            placement,
            self.connections,
            outcomes,
            registry,
            tasks,
            clock,
            rng,
        )
        self.upkeep = Upkeep(
            driver, registry, placement, outcomes, self.intake, active, self.egress, spool
        )
        self.operations = ops = Operations(
            driver, outcomes, registry, active, spool, resolver, self.hosts
        )
        self.ramps = Ramps(driver, placement, outcomes, registry, self.upkeep)
        self.hold, self.release, self.flush, self.requeue = (
            ops.hold,
            ops.release,
            ops.flush,
            ops.requeue,
        )
        self.delete, self.cancel, self.bounce = ops.delete, ops.cancel, ops.bounce
        self.limit, self.backoff, self.forget_learned = ops.limit, ops.backoff, ops.forget_learned
        self.unsuspend, self.suspended_hosts = ops.unsuspend, ops.suspended
        self.warmups = self.ramps.show
        self.policies: Policies | None = None  # MTA-STS, made by reconfigure
        self.tls_reports: TlsReports | None = None  # TLS-RPT, made by reconfigure
        self.reconfigure(cfg)

    def reconfigure(self, cfg: config.Config) -> None:
        """Take new settings (start, or a reload): may raise ConfigError before changing
        anything. Destinations keep their state unless their pacing changed."""
        d = cfg.delivery
        rules = compile_rules(d.rules)
        self.revalidation.reconfigure(cfg)
        routes = relays(cfg)
        secrets = smarthosts.load(routes)  # passwords and CA files, read again at each reload
        sts_context = tls_context(cfg.mta_sts)
        now = self.driver.now()
        client = ClientSettings(d.helo_name or self.hostname, d.timeouts, d.tls)
        sts_tls = sts_context if cfg.mta_sts.enabled else None
        sender = Sender(client, rules, self.hosts, d, sts_tls, self.registry.out_of_step)
        if self.policies is None:
            self.policies = Policies(
                cfg.mta_sts, sts_context, self.resolver, self.spool.layout.mta_sts
            )
        else:
            self.policies.reconfigure(cfg.mta_sts, sts_context)
        if self.tls_reports is None:
            self.tls_reports = TlsReports(
                cfg,
                sts_context,
                self.resolver,
                self.spool.layout.tls_reports,
                self.hostname,
                self.notices.queue_report,
                self.spool.ids.next,
            )
        else:
            self.tls_reports.reconfigure(cfg, sts_context)
        sender.on_tls = self.policies.on_failure = self.tls_reports.record
        rate = TokenBucket(config.parse_rate(d.max_rate), 1, now) if d.max_rate else None
        tenant_rate = cfg.shaping.tenant_rate
        self.core.configure(
            max_connections=d.max_connections,
            connection_idle=d.connection_idle,
            rate=rate,
            tenant_rate=config.parse_rate(tenant_rate) if tenant_rate else 0.0,
        )
        classes = _classes(cfg)
        if self.core.classes != classes:
            self.core.reclassify(classes)
        self.cfg, self.relays, self.sender = cfg, routes, sender
        self.notices.cfg = cfg
        order = class_order({n: c.priority for n, c in cfg.classes.items()})
        self.outcomes.configure(cfg, sender, order[0])
        self.placement.configure(cfg, sender, self.policies, Pools(cfg), routes, order)
        self.intake.configure(cfg, order[0])
        self.connections.configure(sender)
        self.operations.configure(cfg)
        for key in self.registry.configure(cfg, routes.by_key(), secrets, now):
            log.info("relay_reconfigured", destination=key)
        if (
            self.outcomes.started
        ):  # a reload: what new pacing (or a fresh smarthost) allows goes now
            self.driver.perform(self.core.tick(now))

    # -- life ------------------------------------------------------------------------

    def start(self) -> None:
        """Schedule the queue and run. Due times survive restarts; mail that became due
        meanwhile is let in as the active window has room, the first class (p0) first,
        and spread over retry.restart_spread, except the first class."""
        self.upkeep.load()
        self._sts.load()
        self._reports.load()
        self.outcomes.started = True  # (delivery.enabled = false: never; nothing to save)
        self.tasks.spawn(self.driver.read_queue(list(self.spool.messages)))
        self.tasks.spawn(self.upkeep.run())
        self.tasks.spawn(self.driver.watch_lag())
        self.tasks.spawn(self._reports.run())

    async def close(self, grace: float) -> None:
        """Stop dispatching; let attempts in progress finish for up to `grace` seconds."""
        await self.driver.close(grace)
        await self.revalidation.close()
        await self._sts.close()
        if self.outcomes.started:
            await self._reports.close()
            self.upkeep.save(self.driver.now())

    def on_accepted(self, message: Message) -> None:
        """A new message is durable: due now."""
        now = self.driver.now()
        self.driver.perform(self.outcomes.schedule(message.id, now, now, ACCEPTED))

    def _revalidated(self, message_id: str, indexes: list[int], decision: str) -> None:
        self.operations.revalidated(message_id, indexes, decision)

    # -- views -------------------------------------------------------------------------

    def waiting_for(self, message_id: str) -> dict[str, Any] | None:
        """Why a message its record shows as ready waits, for `mtaqueue-ctl list/show`:
        over a source's warm-up allowance of the day (no attempt is charged for it)."""
        return self.placement.warm.waiting_for(message_id, self.driver.now())

    def domains(self) -> list[dict]:
        """The live destinations' state (for metrics; `view` adds the waiting mail)."""
        return self.registry.domains(self.driver.now(), self.sender, self.egress)

    async def view(self) -> list[dict]:
        """`mtaqueue-ctl domains`: every destination with waiting mail or state to show."""
        live = self.domains()
        view = DestinationsView(live, self.active.busy, self.relay_of)
        async for message in walk(self.spool.messages):
            view.add(message)
        return sorted(view.entries() + self.ramps.unrouted(live), key=lambda d: d["destination"])

    def scheduled(self) -> dict[str, int]:
        """How often a message went (back) into the scheduled queue, by reason."""
        return dict(self.core.inserted)

    def memory_sizes(self) -> dict[str, int]:
        """Entries of each in-memory map that could grow with destinations, hosts, tenants
        or messages, by a stable name (docs/architecture.md, "What is kept in memory")."""
        tallies = self._reports.counts.days.values()
        return {
            **self.registry.sizes(),
            **self.core.admission.sizes(),
            **self.active.sizes(),
            **self._sts.sizes(),
            **self.egress.sizes(),
            "host_suspensions": len(self.hosts),
            "tls_report_tallies": sum(len(domains) for domains in tallies),
            "warm_waits": len(self.placement.warm),
            "revalidation_passes": len(self.revalidation),
            "latency_rounds": len(self.core.load),
        }

    def relay_of(self, message: Message) -> str | None:
        """The smarthost (destination key) all of a message goes to, or None."""
        relay = self.relays.for_message(message.klass, message.tenant)
        return relay.key if relay is not None else None

    async def move_warmup(self, address: str, name: str | None, to_first: bool) -> list[dict]:
        return await self.ramps.move(address, name, to_first, self.outcomes.started)

    # -- hooks -------------------------------------------------------------------------

    @property
    def on_delivery(self) -> Callable[[dict], None] | None:
        return self.outcomes.on_delivery

    @on_delivery.setter
    def on_delivery(self, hook: Callable[[dict], None] | None) -> None:
        self.outcomes.on_delivery = hook

    @property
    def on_connect(self) -> Callable[[str, float], None] | None:
        return self.connections.on_connect

    @on_connect.setter
    def on_connect(self, hook: Callable[[str, float], None] | None) -> None:
        self.connections.on_connect = hook

    @property
    def sign_notice(self) -> Callable[[Message, bytes], tuple[Message, bytes]] | None:
        return self.notices.sign

    @sign_notice.setter
    def sign_notice(self, hook: Callable[[Message, bytes], tuple[Message, bytes]] | None) -> None:
        self.notices.sign = hook

    @property
    def _sts(self) -> Policies:
        assert self.policies is not None  # made by reconfigure in __init__
        return self.policies

    @property
    def _reports(self) -> TlsReports:
        assert self.tls_reports is not None  # made by reconfigure in __init__
        return self.tls_reports


def _classes(cfg: config.Config) -> dict[str, tuple[int, int]]:
    return {name: (c.priority, c.weight) for name, c in cfg.classes.items()}
