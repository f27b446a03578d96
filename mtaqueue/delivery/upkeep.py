"""Upkeep: the sweep for expired mail and quiet destinations, and the state files.

    Upkeep(driver, registry, placement, outcomes, intake, active, egress, spool)
    .load()                      learned.json and egress.json, at start
    .run() (async)               every EXPIRY_CHECK seconds until the stop
    .expire(now) (async)         expire mail whose lifetime has passed
    .prune(now)                  forget what expired in the rooms' maps (each sweep)
    .save(now)                   both state files, at the stop

A state file that cannot be read starts its state over (nothing is lost: learning and
blocklist holds come back); one that cannot be written is kept in memory and tried again
at the next sweep.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from ..logs import get_logger
from ..policy import rate_learner
from ..policy.egress import EgressState
from ..policy.settle import expire_due
from ..scheduler.active import ActiveWindow
from ..spool import statefile
from ..spool.store import Spool
from ..spool.walk import chunks
from .driver import Driver
from .intake import Intake
from .outcomes import Outcomes
from .placement import Placement
from .registry import Registry

log = get_logger("delivery")

EXPIRY_CHECK = 30.0  # seconds between sweeps for mail whose lifetime has passed


class Upkeep:
    def __init__(
        self,
        driver: Driver,
        registry: Registry,
        placement: Placement,
        outcomes: Outcomes,
        intake: Intake,
        active: ActiveWindow,
        egress: EgressState,
        spool: Spool,
    ) -> None:
        self.driver = driver
        self.registry = registry
        self.placement = placement
        self.outcomes = outcomes
        self.intake = intake
        self.active = active
        self.egress = egress
        self.layout = spool.layout
        self.spool = spool  # its `messages` is replaced by the recovery: read it each time
        self._learned_saved = b""
        self._egress_saved = b""

    def load(self) -> None:
        try:
            data = statefile.read(self.layout.learned)
            if data:
                self.registry.learned, lockstep = rate_learner.decode(data)
                self.registry.out_of_step.restore(lockstep)
        except (OSError, ValueError) as exc:  # learning starts over: nothing is lost
            log.warning("learned_unreadable", error=str(exc))
        try:
            data = statefile.read(self.layout.egress)
            if data:
                self.egress.restore(data)
                self._egress_saved = data
        except (OSError, ValueError) as exc:  # sources come back early: nothing is lost
            log.warning("egress_unreadable", error=str(exc))

    async def run(self) -> None:
        driver = self.driver
        while not driver.closing:
            await asyncio.sleep(EXPIRY_CHECK)
            await self.expire(driver.now())
            # Destinations whose last waiting mail went without a connection (deleted,
            # bounced, expired) or whose stats window passed are forgotten here.
            now = driver.now()
            for destination in list(self.registry.destinations.values()):
                self.registry.tidy(destination)
                self.registry.retire(destination, now)
            self.prune(now)
            data = self.registry.learned_data(now)
            if data != self._learned_saved:
                await asyncio.to_thread(self.save_learned, data)
            now = driver.now()
            egress = self.egress.encode(now)
            if egress != self._egress_saved:
                await asyncio.to_thread(self.save_egress, egress)

    async def expire(self, now: float) -> None:
        """Expire mail whose lifetime has passed, whatever it waits for (pacing included).
        The queue is read a chunk at a time, as at start."""
        settings = self.outcomes.settings
        due: set[str] = set()
        for chunk in chunks(list(self.spool.messages)):
            for message_id in chunk:
                m = self.intake.read(message_id)
                if m is not None and expire_due(m, now, settings(m.klass)) is not None:
                    due.add(message_id)
            await asyncio.sleep(0)
        if not due:
            return
        self.outcomes.unqueue(lambda item: item.message_id in due, now)
        for message_id in due:
            message = self.spool.messages.get(message_id)
            if message is None or self.active.busy.get(message_id):
                continue  # in transit: the next sweep
            settlement = expire_due(message, now, settings(message.klass))
            if settlement is not None:
                self.driver.perform(self.outcomes.apply(settlement, now))

    def prune(self, now: float) -> None:
        """Forget what has expired in the maps of the rooms below (docs/architecture.md,
        "What is kept in memory"); learned.json's and egress.json's are pruned as they
        are encoded."""
        self.registry.prune(now)
        self.registry.core.admission.prune(now)
        self.active.prune(self.spool.messages)
        self.placement.warm.prune(now)
        self.placement.policies.prune(now)
        self.placement.sender.hosts.prune(now)

    def save(self, now: float) -> None:
        self.save_learned(self.registry.learned_data(now))
        self.save_egress(self.egress.encode(now))

    def save_learned(self, data: bytes) -> None:
        if _write_state(self.layout.learned, data, "learned"):
            self._learned_saved = data

    def save_egress(self, data: bytes) -> None:
        if _write_state(self.layout.egress, data, "egress"):
            self._egress_saved = data


def _write_state(path: Path, data: bytes, what: str) -> bool:
    """Replace a state file; False (logged `<what>_save_failed`) if it could not be: the
    state is kept in memory, and the next sweep tries again."""
    try:
        statefile.write_atomic(path, data)
    except OSError as exc:
        log.warning(f"{what}_save_failed", error=str(exc))
        return False
    return True
