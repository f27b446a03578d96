"""Mail of our own: DSNs to senders and TLS reports, stored in the spool like any other.

    Notices(spool, hostname, cfg, tasks)
    .sign: (record, content) -> (record, content)   DKIM for our own mail, or None
    .notify(message, reports, kind, now) -> Future[bool]   a DSN; True once durable
    .queue_report(message, content) -> bool (async)        a TLS report's mail, tried once

Postfix's qmgr never writes a bounce itself; here too the queue manager only asks for
one. A DSN the spool refuses (a full disk, a writer restarting) is stored again every
DSN_RETRY seconds until it is durable.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .. import config
from ..dsn import DsnParams
from ..dsn import notice as dsn_notice
from ..logs import get_logger
from ..model import Message
from ..spool.errors import StorageError, StorageFull
from ..spool.message_file import CorruptMessageFile
from ..spool.store import Spool
from .tasks import Tasks

log = get_logger("delivery")

DSN_RETRY = 5.0  # seconds between tries to store a DSN the spool refused (a full disk)


class Notices:
    def __init__(self, spool: Spool, hostname: str, cfg: config.Config, tasks: Tasks) -> None:
        self.spool = spool
        self.hostname = hostname
        self.cfg = cfg  # replaced by a reload
        self.tasks = tasks
        self.sign: Callable[[Message, bytes], tuple[Message, bytes]] | None = None

    def notify(self, message: Message, reports: list, kind: str, now: float) -> asyncio.Future:
        """Queue a DSN to the sender (never for the null sender: wants_notice checked);
        the future says whether it is durable."""
        try:
            original = self.spool.content(message.id)
        except (OSError, CorruptMessageFile):
            original = b""
        dsn_id = self.spool.ids.next(now)
        params = DsnParams(self.hostname, now, self.cfg.dsn.max_return, dsn_id)
        notice, content = dsn_notice(
            message,
            reports,
            original,
            params,
            klass=self.cfg.dsn.klass,
            lifetime=self.cfg.dsn.lifetime,
        )
        stored, notice, content = self._accept_own(notice, content)  # now: a stop finds it
        fields = {"id": dsn_id, "kind": kind, "about": message.id, "to": message.sender}
        return self.tasks.spawn(self._store_notice(stored, notice, content, fields))

    def _accept_own(
        self, message: Message, content: bytes
    ) -> tuple[asyncio.Future, Message, bytes]:
        """Store mail of our own (a DSN, a TLS report), DKIM-signed if a key applies."""
        if self.sign is not None:
            message, content = self.sign(message, content)
        return self.spool.accept(message, content), message, content

    async def queue_report(self, message: Message, content: bytes) -> bool:
        """Queue a TLS report's mail: True once durable. Tried once: a report that could
        not be stored is tried again with the report's retries (tls_reports.py)."""
        stored, message, _ = self._accept_own(message, content)
        try:
            await stored
        except (StorageFull, StorageError) as exc:
            log.error("tls_report_mail_failed", id=message.id, error=str(exc))
            return False
        log.info("tls_report_queued", id=message.id, to=message.recipients[0].address)
        return True

    async def _store_notice(
        self, stored: asyncio.Future, notice: Message, content: bytes, fields: dict
    ) -> bool:
        """Wait for a DSN to be durable, storing it again every DSN_RETRY seconds while the
        spool refuses it (a full disk, a writer restarting): True once durable, False
        after a bug."""
        while True:
            try:
                await stored
            except (StorageFull, StorageError) as exc:
                log.error("dsn_failed", **fields, error=str(exc), retry_in=DSN_RETRY)
                await asyncio.sleep(DSN_RETRY)
                stored = self.spool.accept(notice, content)
                continue
            except Exception:
                log.exception("dsn_failed", **fields)
                return False
            log.info("dsn_queued", **fields)
            return True
