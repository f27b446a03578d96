"""The daemon's upkeep of its spool while it runs: the start-up sweep, free space, health.

    upkeep = SpoolUpkeep(spool, started)
    await upkeep.sweep(recovered)      # spool/sweep.py's verdict applied, and logged
    await upkeep.watch()               # a task: spool.disk_ok kept current, the spool's
                                       # expired keys and suppressions forgotten
    upkeep.stall_limit = seconds       # then upkeep.healthy() for the systemd watchdog

Its events are the daemon's (component `daemon`, docs/logging.md).
"""

from __future__ import annotations

import asyncio
import time

from . import heap
from .logs import get_logger
from .spool.expiring import prune_period
from .spool.store import RecoveryReport, Spool
from .spool.sweep import sweep

log = get_logger("daemon")

ADOPT_CHUNK = 1000  # messages re-adopted per batch of the sweep
DETAIL_MAX = 20  # ids and damage lines listed in spool_damaged (the counts are complete)


class SpoolUpkeep:
    def __init__(self, spool: Spool, started: float) -> None:
        self.spool = spool
        self.started = started  # epoch seconds: the sweep judges only files older
        self.stall_limit = 0.0  # seconds without a commit while work waits: unhealthy
        self._was_healthy = True

    async def sweep(self, recovered: RecoveryReport) -> None:
        loop = asyncio.get_running_loop()
        known = set(self.spool.messages)
        try:
            report = await loop.run_in_executor(
                None, sweep, self.spool.layout, known, recovered.deleted, self.started
            )
        except OSError as exc:  # the next start sweeps again
            log.error("spool_sweep_failed", error=str(exc))
            return
        changes = [
            self.spool.remove(queue_id, f"quarantined: {problem}")
            for queue_id, problem in report.quarantined
            if queue_id in self.spool.messages
        ]
        # (A message whose file waits is not missing: the journal holds its content.)
        missing = [
            queue_id
            for queue_id in report.missing
            if queue_id in self.spool.messages and not self.spool.fresh.waits(queue_id)
        ]
        changes += [self.spool.remove(queue_id, "message file missing") for queue_id in missing]
        adopted = 0
        for start in range(0, len(report.adopt), ADOPT_CHUNK):
            chunk = report.adopt[start : start + ADOPT_CHUNK]
            results = await asyncio.gather(*map(self.spool.adopt, chunk), return_exceptions=True)
            adopted += sum(not isinstance(result, BaseException) for result in results)
        await asyncio.gather(*changes, return_exceptions=True)
        log.info(
            "spool_swept",
            files=report.files,
            adopted=adopted,
            temp_removed=report.temp_removed,
            quarantined=len(report.quarantined),
            missing=len(missing),
        )
        if recovered.skipped_frames or report.adopt or report.quarantined or missing:
            # One event for the operator, with what was found and what became of it.
            log.error(
                "spool_damaged",
                frames_skipped=recovered.skipped_frames,
                bytes_skipped=recovered.skipped_bytes,
                journal_missing=recovered.journal_segments == 0
                and report.files > report.temp_removed,
                messages_readopted=adopted,
                readopt_failed=len(report.adopt) - adopted,
                files_quarantined=len(report.quarantined),
                files_missing=len(missing),
                damage=recovered.damage[:DETAIL_MAX],
                quarantined=[f"{i}: {problem}" for i, problem in report.quarantined][:DETAIL_MAX],
                missing=missing[:DETAIL_MAX],
            )

    async def watch(self) -> None:
        # Commits refresh the free space too; this catches a disk filled by someone else.
        prune_at = 0.0
        while True:
            await asyncio.sleep(2.0)
            if time.monotonic() >= prune_at:
                prune_at = time.monotonic() + prune_period(self.spool.dedupe_window)
                self.spool.prune(time.time())
                heap.trim()  # (what the prune and a minute's churn freed, back to the kernel)
            was_ok = self.spool.disk_ok
            self.spool.refresh_free_space()
            if was_ok != self.spool.disk_ok:
                event = "spool_space_ok" if self.spool.disk_ok else "spool_space_low"
                log.warning(event, free_bytes=self.spool.free_bytes)

    def healthy(self) -> bool:
        """For the systemd watchdog: false once the spool has made no progress for a
        whole WatchdogSec while work waits (a wedged or dead writer), so that systemd
        restarts us instead of a daemon that answers but never commits."""
        stalled = self.spool.stalled_for(time.monotonic())
        healthy = stalled < self.stall_limit
        if not healthy and self._was_healthy:
            log.error("spool_stalled", seconds=round(stalled, 1))
        self._was_healthy = healthy
        return healthy
