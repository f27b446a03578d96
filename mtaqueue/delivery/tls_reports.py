"""TLS-RPT I/O (RFC 8460): the counts in memory and in the state file, the `_smtp._tls`
TXT lookup through the daemon's resolver, the reports sent to each rua: POSTed to an
https: one, queued as our own mail to a mailto: one.

The counting and the report are policy/tls_report.py's. Sessions are counted as the
sender (delivery/sender.py) reports them; a sweep every CHECK_EVERY seconds saves the
counts when they changed and sends the reports that are due.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from email.utils import format_datetime, make_msgid
from pathlib import Path

import aiohttp
import msgspec

from .. import config
from ..logs import get_logger
from ..model import Message, Recipient
from ..policy.tls_report import (
    MEDIA_TYPE,
    Pending,
    Reporter,
    Session,
    TlsCounts,
    failed_try,
    filename,
    gzipped,
    parse_record,
    report,
)
from ..routing.resolver import Resolver
from ..spool import statefile
from .mta_sts import https_client

log = get_logger("delivery")

CHECK_EVERY = 300.0  # seconds between sweeps (saves and due reports)
POST_TIMEOUT = 60.0  # the whole HTTPS POST of a report

# Queues a message of our own (the report mail): True once it is durable.
QueueMail = Callable[[Message, bytes], Awaitable[bool]]


class TlsReports:
    def __init__(
        self,
        cfg: config.Config,
        context: ssl.SSLContext,
        resolver: Resolver,
        state: Path,
        hostname: str,
        queue_mail: QueueMail,
        new_id: Callable[[float], str],
    ) -> None:
        self.resolver = resolver
        self.hostname = hostname
        self._state = state
        self._queue_mail = queue_mail
        self._new_id = new_id
        self.counts = TlsCounts()
        self._saved = b""
        self._session: aiohttp.ClientSession | None = None
        self.context: ssl.SSLContext | None = None
        self._sending = asyncio.Lock()  # the sweep and `tls-report send` one at a time
        self.reconfigure(cfg, context)

    def reconfigure(self, cfg: config.Config, context: ssl.SSLContext) -> None:
        rpt = cfg.tls_rpt
        self.enabled = rpt.enabled
        self.sender = rpt.sender or f"postmaster@{self.hostname}"
        self.by = Reporter(
            rpt.organization or self.hostname, rpt.contact or self.sender, self.hostname
        )
        self.klass, self.lifetime = cfg.dsn.klass, cfg.dsn.lifetime  # mailed as DSNs are
        if context is not self.context and self._session is not None:  # trust the new CAs
            session, self._session = self._session, None
            asyncio.get_running_loop().create_task(session.close())
        self.context = context

    def record(self, session: Session) -> None:
        if self.enabled:
            self.counts.record(session, time.time())

    def load(self) -> None:
        try:
            data = statefile.read(self._state)
            if data:
                self.counts = TlsCounts.decode(data)
                self._saved = data
        except (OSError, msgspec.DecodeError) as exc:  # counting starts over
            log.warning("tls_reports_state_unreadable", error=str(exc))

    async def run(self) -> None:
        """The sweep, while the daemon runs."""
        while True:
            await asyncio.sleep(CHECK_EVERY)
            if self.enabled:
                await self.send_due(time.time())
            await self.save()

    async def close(self) -> None:
        await self.save()
        if self._session is not None:
            await self._session.close()

    async def save(self) -> None:
        data = self.counts.encode()
        self._saved = await statefile.save_changed(
            self._state,
            data,
            self._saved,
            lambda exc: log.warning("tls_reports_save_failed", error=str(exc)),
        )

    async def send_due(self, now: float, *, today: bool = False) -> list[dict]:
        """Send the reports due (`today`: every ended day's now, and today's so far);
        what came of each, as `mtaqueue-ctl tls-report send` shows it."""
        async with self._sending:
            results = [
                await self._send(day, domain, now)
                for day, domain in self.counts.due(now, self.hostname, today=today)
            ]
        await self.save()
        return results

    async def _send(self, day: str, domain: str, now: float) -> dict:
        entry = self.counts.get(day, domain)
        assert entry is not None  # due() named it
        fields = {"domain": domain, "day": day}
        name = f"_smtp._tls.{domain}"
        texts = await self.resolver.txt(name)
        ruas = parse_record(list(texts or ()))
        if texts is not None and not ruas:  # RFC 8460 3: no record, no report
            self.counts.remove(day, domain)
            log.info("tls_report_unwanted", **fields)
            return fields | {"result": "no _smtp._tls record"}
        pending = entry.report = entry.report or Pending(
            f"{day}.{uuid.uuid4().hex}@{self.hostname}"
        )
        pending.tries += 1
        errors = {}
        if texts is None:  # a temporary DNS failure: a failed try, not "no record"
            errors[name] = "the TXT lookup failed"
        document = report(entry, day, domain, pending.id, self.by)
        body = gzipped(document)
        for rua in ruas:
            if rua in pending.sent:
                continue
            error = await self._deliver(rua, body, document, domain)
            if error:
                errors[rua] = error
            else:
                pending.sent.append(rua)
        fields |= {"report_id": pending.id, "rua": ruas}
        if not errors:
            self.counts.remove(day, domain)
            log.info("tls_report_sent", **fields)
            return fields | {"result": "sent"}
        if failed_try(pending, now):
            log.warning("tls_report_failed", **fields, errors=errors, retry_at=pending.next_try)
            return fields | {"result": "failed, will retry", "errors": errors}
        self.counts.remove(day, domain)
        log.error("tls_report_dropped", **fields, errors=errors, tries=pending.tries)
        return fields | {"result": "failed, dropped", "errors": errors}

    async def _deliver(self, rua: str, body: bytes, document: dict, domain: str) -> str:
        """Send to one rua; "" once done, else why not."""
        try:
            if rua.startswith("https://"):
                await asyncio.wait_for(self._post(rua, body), POST_TIMEOUT)
            else:
                await self._mail(rua.removeprefix("mailto:"), body, document, domain)
        except TimeoutError:
            return f"no answer within {POST_TIMEOUT:g}s"
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            return str(exc) or type(exc).__name__
        return ""

    async def _post(self, url: str, body: bytes) -> None:
        if self._session is None:
            self._session = https_client(self.context, self.resolver)
        headers = {"Content-Type": MEDIA_TYPE}
        async with self._session.post(url, data=body, headers=headers, allow_redirects=False) as r:
            if not 200 <= r.status < 300:
                raise ValueError(f"HTTP {r.status}")

    async def _mail(self, address: str, body: bytes, document: dict, domain: str) -> None:
        address = address.split("?", 1)[0]  # a mailto: URI's headers are not ours to add
        if "@" not in address:
            raise ValueError(f"mailto:{address}: not an address")
        now = time.time()
        content = report_mail(self.sender, address, self.by, domain, document, body, now)
        message = Message(
            id=self._new_id(now),
            sender=self.sender,
            recipients=(Recipient(address),),
            created=now,
            size=len(content),
            klass=self.klass,
            expires=now + self.lifetime,
            client="",
            helo=self.hostname,
            tls_report=True,
        )
        if not await self._queue_mail(message, content):
            raise ValueError("the spool did not take the report mail")


def report_mail(
    sender: str, to: str, by: Reporter, domain: str, document: dict, body: bytes, now: float
) -> bytes:
    """The report as mail (RFC 8460 5.3): multipart/report, report-type "tlsrpt", a
    short text and the gzip'd JSON as an application/tlsrpt+gzip attachment. CRLF lines,
    7-bit (the attachment in base64)."""
    report_id = document["report-id"]
    name = filename(document, by.submitter, domain)
    boundary = f"tlsrpt-{uuid.uuid4().hex}"
    text = (
        f"This is a TLS report (RFC 8460) for {domain} from {by.organization},"
        f" {document['date-range']['start-datetime']} to"
        f" {document['date-range']['end-datetime']}."
    )
    encoded = base64.encodebytes(body).decode().replace("\n", "\r\n")
    lines = [
        f"From: {sender}",
        f"To: {to}",
        f"Subject: Report Domain: {domain} Submitter: {by.submitter} Report-ID: <{report_id}>",
        f"Date: {format_datetime(datetime.fromtimestamp(now, UTC))}",
        f"Message-ID: {make_msgid(domain=by.submitter)}",
        f"TLS-Report-Domain: {domain}",
        f"TLS-Report-Submitter: {by.submitter}",
        "MIME-Version: 1.0",
        f'Content-Type: multipart/report; report-type="tlsrpt"; boundary="{boundary}"',
        "",
        f"--{boundary}",
        "Content-Type: text/plain; charset=us-ascii",
        "",
        text,
        "",
        f"--{boundary}",
        f'Content-Type: {MEDIA_TYPE}; name="{name}"',
        "Content-Transfer-Encoding: base64",
        f'Content-Disposition: attachment; filename="{name}"',
        "",
        encoded.rstrip("\r\n"),
        "",
        f"--{boundary}--",
        "",
    ]
    return "\r\n".join(lines).encode("ascii", "replace")
