"""Revalidation's edge: ask the application (revalidate.url) whether late mail may still go.

The decisions are policy/revalidate.py's; this module does the HTTP. Placement
(delivery/placement.py) asks it about a message due for an attempt (`wanted`, then `ask`)
before routing it, so a message being checked holds no connection slot and waits for
nothing but its own answer:
the checks run beside delivery, at most MAX_IN_FLIGHT at once (the endpoint is the
application's, often a small web service; the rest wait in line, oldest request first),
each bounded by revalidate.timeout. The answer goes back as a decision (`on_decided`,
delivery/operations.py's `revalidated`), which sends, cancels or holds the message.

The request is a POST of JSON {message_id, idempotency_key, class, tenant, age}, signed as
the webhooks are (X-Mtaqueue-Signature, events/signing.py) when a secret is set.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

import aiohttp
import msgspec

from .. import __version__, config
from ..events import signing
from ..logs import get_logger
from ..model import Message
from ..policy.revalidate import SEND, Answer, decide, needs_check, pass_stale, request_body

log = get_logger("delivery")

MAX_IN_FLIGHT = 16  # requests to the endpoint at once
_PRUNE_AT = 1024  # remembered go-aheads before the stale ones are looked for

# (message id, the recipients set aside for it, the decision)
Decided = Callable[[str, list[int], str], None]


class Revalidation:
    def __init__(self, cfg: config.Config, on_decided: Decided) -> None:
        self._on_decided = on_decided
        # message id -> when an answer let it go (it holds for PASS_VALID)
        self._passed: dict[str, float] = {}
        self._prune_at = _PRUNE_AT
        self._waiting: deque[tuple[Message, list[int]]] = deque()
        self._workers: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        self.reconfigure(cfg)

    def __len__(self) -> int:
        """Go-aheads remembered (stale ones go once they double, see `_pass`)."""
        return len(self._passed)

    def reconfigure(self, cfg: config.Config) -> None:
        """Take new settings (start, or a reload); raises ConfigError, changing nothing, when
        the secret file cannot be read."""
        r = cfg.revalidate
        try:
            secret = signing.read_secret(r.secret, r.secret_file)
        except OSError as exc:
            raise config.ConfigError(
                f"revalidate.secret_file: cannot read {r.secret_file}: {exc.strerror or exc}"
            ) from None
        self._cfg, self._secret = cfg, secret

    def wanted(self, message: Message, now: float) -> bool:
        """Whether `message` must be checked before it is attempted now."""
        classes = self._cfg.classes
        # A class removed by a reload: its mail follows the default class (as in delivery).
        klass = classes.get(message.klass) or classes[self._cfg.submission.default_class]
        return needs_check(message, now, klass.revalidate_after, self._passed.get(message.id))

    def ask(self, message: Message, indexes: list[int]) -> None:
        """Check `message`, whose recipients `indexes` the caller set aside for it: the
        decision comes back through `on_decided` with them."""
        self._waiting.append((message, indexes))
        if len(self._workers) < MAX_IN_FLIGHT:
            task = asyncio.get_running_loop().create_task(self._work())
            self._workers.add(task)
            task.add_done_callback(self._workers.discard)

    async def close(self) -> None:
        """Stop checking (a stop): the messages waiting stay queued, as they were."""
        self._waiting.clear()
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _work(self) -> None:
        while self._waiting:
            message, indexes = self._waiting.popleft()
            started = time.monotonic()
            answer = await self._post(message)
            decision = decide(answer, self._cfg.revalidate.on_error)
            fields = {
                "id": message.id,
                "class": message.klass,
                "status": answer.status,
                "decision": decision,
                "seconds": round(time.monotonic() - started, 3),
            }
            if answer.failed:
                log.warning("revalidation_failed", **fields, error=answer.error or None)
            else:
                log.info("revalidated", **fields)
            if decision == SEND:
                self._pass(message.id, time.time())
            try:
                self._on_decided(message.id, indexes, decision)
            except Exception:  # the manager's to recover; the next check goes on
                log.exception("revalidation_apply_failed", id=message.id)

    async def _post(self, message: Message) -> Answer:
        r = self._cfg.revalidate
        now = time.time()
        body = msgspec.json.encode(request_body(message, now))
        headers = {"Content-Type": "application/json"}
        if self._secret:
            headers[signing.HEADER] = signing.sign(self._secret, body, now)
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=MAX_IN_FLIGHT)
            # Named as the webhooks are: the application's access log says who asked.
            self._session = aiohttp.ClientSession(
                connector=connector, headers={"User-Agent": f"mtaqueue/{__version__}"}
            )
        timeout = aiohttp.ClientTimeout(total=r.timeout)
        try:
            # A redirect is not followed: a POST turned GET elsewhere would not be the
            # question asked; it counts as an error (on_error).
            async with self._session.post(
                r.url, data=body, headers=headers, timeout=timeout, allow_redirects=False
            ) as response:
                await response.read()  # to the end, so that the connection is kept
                return Answer(response.status)
        except TimeoutError:
            return Answer(error=f"no answer within {r.timeout:g}s")
        except aiohttp.ClientError as exc:
            return Answer(error=f"{type(exc).__name__}: {exc}")
        except OSError as exc:
            return Answer(error=str(exc))

    def _pass(self, message_id: str, now: float) -> None:
        self._passed[message_id] = now
        if len(self._passed) >= self._prune_at:
            # Go-aheads no longer valid, of mail delivered or removed since, would stay.
            self._passed = {i: t for i, t in self._passed.items() if not pass_stale(t, now)}
            self._prune_at = max(_PRUNE_AT, 2 * len(self._passed))
