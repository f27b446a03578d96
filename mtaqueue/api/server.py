"""The HTTP API: aiohttp routes over the daemon's spool and delivery manager.

Every route but the OpenAPI document needs a bearer token (tokens.py). A token bound to
a tenant submits as that tenant and sees and cancels that tenant's mail only: anyone
else's is a 404, as if it did not exist. The suppression list is shared by every tenant,
so only unbound (operator's) tokens may read or change it.

A cancel of mail that has left the queue (cancelled, delivered, ...) is a 409 naming its
state while the spool remembers its end (spool/finished.py), a 404 after that.

A submission is answered 202 only once it is as durable as an SMTP 250 (file and journal
record synced); one whose Idempotency-Key was accepted within the dedupe window is
answered 200 with the first message's id. Large bodies are decoded, checked and built
in a thread, so the event loop never waits for them.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web

from ..control import suppression
from ..control.views import message_json
from ..delivery.manager import DeliveryManager
from ..dkim.service import Signed, SigningError, SigningService
from ..logs import get_logger
from ..model import FINAL_STATES, Message
from ..smtp.listener import ListenerSettings
from ..spool.errors import DISK_LOW, StorageError, StorageFull
from ..spool.finished import recipients_state
from ..spool.store import Spool
from ..submission import Received, accepted_fields
from .errors import ApiError
from .openapi import OPENAPI_PATH, document
from .rules import ADDRESS_RULE, BARE_ADDRESS_PATTERN, seconds
from .submit import build, check, decode, refuse_now
from .tokens import Caller, Tokens

log = get_logger("api")

CALLER = "mtaqueue.caller"  # the request's Caller
IN_THREAD = 256 << 10  # bodies larger than this are decoded and built in a thread
JSON_OVERHEAD = 64 << 10  # a body may exceed the base64 of the largest message by this
RETRY_AFTER = "30"  # seconds, when the spool cannot take mail
CANCELLED = "cancelled"  # the journaled reason, which makes "cancelled" events
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class ApiDeps:
    """What the API reads and acts on; the callables give the current (reloaded) values."""

    spool: Spool
    signing: SigningService
    delivery: DeliveryManager
    settings: Callable[[], ListenerSettings]  # the listener's limits and submission settings
    rcpt_check: Callable[[str], str | None]  # the listener's RCPT refusal (suppressed)
    suppression_ttl: Callable[[], float]


def body_limit(max_message_size: int) -> int:
    """The largest request body: the largest message, base64-encoded, and some JSON."""
    return max_message_size * 4 // 3 + JSON_OVERHEAD


class Api:
    def __init__(self, deps: ApiDeps, tokens: Tokens) -> None:
        self.deps = deps
        self.tokens = tokens  # replaced on reload

    def app(self) -> web.Application:
        # Bodies are read by _read, with the limit of the moment (it changes on reload).
        app = web.Application(middlewares=[self._middleware], client_max_size=1 << 62)
        app.router.add_get(OPENAPI_PATH, self._openapi)
        app.router.add_post("/v1/messages", self._submit)
        app.router.add_get("/v1/messages", self._find)
        app.router.add_delete("/v1/messages", self._cancel_by_key)
        app.router.add_get("/v1/messages/{id}", self._show)
        app.router.add_delete("/v1/messages/{id}", self._cancel)
        app.router.add_get("/v1/suppressions", self._suppressions)
        app.router.add_put("/v1/suppressions/{address}", self._suppress)
        app.router.add_delete("/v1/suppressions/{address}", self._unsuppress)
        return app

    # -- every request ---------------------------------------------------------------

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        caller = None
        try:
            if request.path != OPENAPI_PATH:
                caller = request[CALLER] = self._authenticate(request)
            response = await handler(request)
        except web.HTTPMethodNotAllowed as exc:
            allowed = ", ".join(sorted(exc.allowed_methods))
            message = f"{request.method} is not allowed here (allowed: {allowed})"
            response = _refused(request, caller, ApiError(405, message, {"Allow": allowed}))
        except web.HTTPNotFound:
            response = _refused(request, caller, ApiError(404, f"no such endpoint: {request.path}"))
        except ApiError as exc:
            response = _refused(request, caller, exc)
        except web.HTTPException as exc:  # aiohttp's own refusals (a malformed request)
            response = _refused(request, caller, ApiError(exc.status, exc.reason))
        except Exception:  # a bug must cost one request a clear answer, not a text page
            log.exception("api_failed", method=request.method, path=request.path)
            response = _refused(request, caller, ApiError(500, "internal error"))
        else:
            tenant = caller.tenant if caller else None
            log.debug("api_request", method=request.method, path=request.path, tenant=tenant)
        return response

    def _authenticate(self, request: web.Request) -> Caller:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "a bearer token is needed", {"WWW-Authenticate": _CHALLENGE})
        caller = self.tokens.caller(token.strip())
        if caller is None:
            challenge = f'{_CHALLENGE}, error="invalid_token"'
            raise ApiError(401, "the token is not valid", {"WWW-Authenticate": challenge})
        return caller

    async def _openapi(self, request: web.Request) -> web.Response:
        settings = self.deps.settings()  # classes and max_recipients, as now configured
        return web.json_response(
            document(settings.submission.classes, settings.session.max_recipients)
        )

    # -- messages --------------------------------------------------------------------

    async def _submit(self, request: web.Request) -> web.Response:
        caller = request[CALLER]
        if request.content_type != "application/json":
            raise ApiError(415, "the body must be JSON (Content-Type: application/json)")
        spool = self.deps.spool
        refusal = spool.refusal  # before reading a body that could not be stored anyway
        if refusal is not None:
            raise _storage_error(full=refusal == DISK_LOW)
        settings = self.deps.settings()
        body = await _read(request, body_limit(settings.session.max_message_size))
        offload = len(body) > IN_THREAD
        sub = await _run(offload, decode, body)
        now, client = time.time(), request.remote or ""
        key = request.headers.get("Idempotency-Key")
        checked = await _run(offload, check, sub, key, settings.session, settings.submission, now)
        refuse_now(checked, self.deps.rcpt_check)
        received = Received(spool.ids.next(now), now, client, False, "HTTP")
        message, content = await _run(
            offload, build, checked, caller.tenant, received, settings.session, settings.submission
        )
        try:
            signing = self.deps.signing.sign(message, content)
            # DKIM: signed once, before it is stored (the values as the writer stores it)
            signed = Signed(message, content, []) if signing is None else await signing
            message = signed.message
            queue_id = await self._store(signed, settings.session.stream_threshold)
        except StorageFull as exc:
            log.error("spool_full", error=str(exc), client=client)
            raise _storage_error(full=True) from None
        except (StorageError, SigningError) as exc:  # a write failed, the writer restarts...
            log.error("spool_write_failed", error=str(exc), client=client)
            raise _storage_error(full=False) from None
        if queue_id != message.id:
            key = message.idempotency_key
            log.info("duplicate_submission", id=queue_id, idempotency_key=key, via="http")
            return web.json_response({"id": queue_id, "duplicate": True}, status=200)
        log.info("accepted", **accepted_fields(message, client), via="http")
        return web.json_response({"id": queue_id}, status=202)

    async def _store(self, signed: Signed, threshold: int | None) -> str:
        """The id the spool answers once the message is durable. As the listener stores:
        a message past spool.stream_threshold is written to its file by the spool's
        threads (its signatures made first), a smaller one goes to the writer with its
        record (which makes them)."""
        spool = self.deps.spool
        message, content, pending = signed
        first = spool.duplicate_of(message)
        if first is not None:  # no file to write (and remove)
            return first
        if threshold is None or len(content) <= threshold:
            return await spool.accept(message, content, pending)
        if pending:
            content = await asyncio.to_thread(self.deps.signing.fill, signed)
        return await spool.incoming(message).commit(content)

    async def _show(self, request: web.Request) -> web.Response:
        return web.json_response(self._json(self._message(request)))

    async def _find(self, request: web.Request) -> web.Response:
        found = self._by_key(request)
        return web.json_response({"messages": [] if found is None else [self._json(found)]})

    def _json(self, message: Message) -> dict:
        return message_json(message, self.deps.delivery.waiting_for(message.id))

    async def _cancel(self, request: web.Request) -> web.Response:
        queue_id = request.match_info["id"]
        message = self.deps.spool.messages.get(queue_id)
        if message is None:
            self._refuse_ended(request, queue_id)
        if message is None or not request[CALLER].sees(message.tenant):
            raise ApiError(404, f"no message {queue_id} in the queue")
        return await self._cancelled(message)

    async def _cancel_by_key(self, request: web.Request) -> web.Response:
        queue_id = self._key_holder(request)
        found = None if queue_id is None else self.deps.spool.messages.get(queue_id)
        if found is None:
            if queue_id is not None:
                self._refuse_ended(request, queue_id)
            raise ApiError(404, "no queued message has this idempotency_key")
        return await self._cancelled(found)

    def _refuse_ended(self, request: web.Request, queue_id: str) -> None:
        """409 with its state if `queue_id` is the caller's and has left the queue."""
        ended = self.deps.spool.finished.get(queue_id)
        if ended is not None and request[CALLER].sees(ended.tenant):
            raise _nothing_to_cancel(queue_id, ended.state)

    async def _cancelled(self, message: Message) -> web.Response:
        pending = [r.address for r in message.recipients if r.state not in FINAL_STATES]
        if not pending:  # finished, still queued until its DSN is durable
            raise _nothing_to_cancel(message.id, recipients_state(message.recipients))
        self.deps.delivery.cancel([message], CANCELLED)
        await self.deps.spool.committed()  # the removal is durable: it will not come back
        return web.json_response({"id": message.id, "cancelled": pending})

    def _message(self, request: web.Request) -> Message:
        queue_id = request.match_info["id"]
        message = self.deps.spool.messages.get(queue_id)
        if message is None or not request[CALLER].sees(message.tenant):
            raise ApiError(404, f"no message {queue_id} in the queue")
        return message

    def _by_key(self, request: web.Request) -> Message | None:
        queue_id = self._key_holder(request)
        return None if queue_id is None else self.deps.spool.messages.get(queue_id)

    def _key_holder(self, request: web.Request) -> str | None:
        """The id of the message holding ?idempotency_key= (of the caller's tenant, or for
        an unbound token of ?tenant=, else of no tenant), queued or not, while the dedupe
        index has the key."""
        caller = request[CALLER]
        key = request.query.get("idempotency_key")
        if not key:
            raise ApiError(400, "idempotency_key: required")
        tenant = request.query.get("tenant") or None
        if caller.tenant is not None:
            if tenant not in (None, caller.tenant):
                raise ApiError(403, "tenant: this token is bound to another tenant")
            tenant = caller.tenant
        return self.deps.spool.key_holder(key, tenant)

    # -- suppressions ----------------------------------------------------------------

    async def _suppressions(self, request: web.Request) -> web.Response:
        _operator(request)
        return web.json_response({"suppressions": suppression.active(self.deps.spool, time.time())})

    async def _suppress(self, request: web.Request) -> web.Response:
        _operator(request)
        address = suppression_address(request.match_info["address"])
        body = await _read(request, JSON_OVERHEAD)
        fields = _json_object(body) if body else {}  # no body: no fields; blanks are no JSON
        reason, ttl = suppression_fields(fields, self.deps.suppression_ttl())
        return web.json_response(await suppression.add(self.deps.spool, address, ttl, reason))

    async def _unsuppress(self, request: web.Request) -> web.Response:
        _operator(request)
        address = suppression_address(request.match_info["address"])
        removed = await suppression.remove(self.deps.spool, address)
        if removed is None:
            raise ApiError(404, f"{address} is not suppressed")
        return web.json_response(removed)


_CHALLENGE = 'Bearer realm="mtaqueue"'
_BARE_ADDRESS = re.compile(BARE_ADDRESS_PATTERN)


def _refused(request: web.Request, caller: Caller | None, error: ApiError) -> web.Response:
    fields = {"method": request.method, "path": request.path, "status": error.status}
    if error.status == 401:
        log.warning("api_auth_failed", client=request.remote, error=error.message, **fields)
    else:
        tenant = caller.tenant if caller else None
        log.info("api_refused", tenant=tenant, error=error.message, **fields)
    return web.json_response(error.body(), status=error.status, headers=error.headers)


def _nothing_to_cancel(queue_id: str, state: str) -> ApiError:
    message = f"message {queue_id} is {state}: nothing left to cancel"
    return ApiError(409, message, fields={"id": queue_id, "state": state})


def _storage_error(full: bool) -> ApiError:
    """SMTP's 452 4.3.1 (full) and 451 4.3.0 (a write failed, the writer restarting)."""
    if full:
        return ApiError(507, "insufficient system storage", {"Retry-After": RETRY_AFTER})
    return ApiError(503, "temporary storage failure, try again later", {"Retry-After": RETRY_AFTER})


def _operator(request: web.Request) -> None:
    tenant = request[CALLER].tenant
    if tenant is not None:
        raise ApiError(403, f"the suppression list is every tenant's; this token is {tenant}'s")


async def _read(request: web.Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to pass `limit` (by its
    Content-Length before anything is read)."""
    too_large = ApiError(413, f"the request body is larger than {limit} octets")
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _run(in_thread: bool, call: Callable[..., _T], *args: Any) -> _T:
    return await asyncio.to_thread(call, *args) if in_thread else call(*args)


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise ApiError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ApiError(400, "the body must be a JSON object")
    return value


def suppression_fields(fields: dict[str, Any], default_ttl: float) -> tuple[str, float]:
    """The reason and the seconds of a suppression's body (SuppressionRequest), null or
    left out their defaults; ApiError 400 if it is not one."""
    unknown = fields.keys() - {"reason", "for"}
    if unknown:
        raise ApiError(400, f"{min(unknown)}: unknown field (known: reason, for)")
    reason = fields.get("reason")
    if reason is not None and not isinstance(reason, str):
        raise ApiError(400, "reason: must be a string")
    _utf8("reason", reason or "")
    ttl = default_ttl if fields.get("for") is None else seconds(fields["for"])
    if ttl is None:
        raise ApiError(400, f"for: {fields['for']!r} is no duration (7d) or seconds")
    return reason or suppression.DEFAULT_REASON, ttl


def suppression_address(address: str) -> str:
    """The {address} of a suppression: as the listener checks an address (the octets
    included), and as rules.BARE_ADDRESS_PATTERN bounds its characters."""
    address = _checked(suppression.checked_address, address)
    if not _BARE_ADDRESS.fullmatch(address):
        raise ApiError(
            400, f"invalid address {address!r}: longer than the API takes ({ADDRESS_RULE})"
        )
    return address


def _utf8(field: str, text: str) -> None:
    try:
        text.encode()
    except UnicodeEncodeError:  # JSON may escape a lone surrogate
        raise ApiError(400, f"{field}: not valid UTF-8 (a lone surrogate)") from None


def _checked(check: Callable[..., _T], *args: Any) -> _T:
    try:
        return check(*args)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
