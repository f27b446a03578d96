"""The API's OpenAPI 3.1 document, served at /v1/openapi.json (no token needed: it holds
nothing but the API's shape). tests/test_api_e2e.py checks the server against it: every
route is documented, every documented operation answers with its documented schema.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import __version__
from ..smtp.addresses import MAX_PATH
from ..spool.finished import END_STATES, KEEP
from ..submission import MAX_KEY_LENGTH
from .rules import (
    ADDRESS_RULE,
    BARE_ADDRESS_PATTERN,
    DURATION_SCHEMA,
    KEY_PATTERN,
    SECONDS_SCHEMA,
    submission_schemas,
)

OPENAPI_PATH = "/v1/openapi.json"

_STRING = {"type": "string"}
_NULLABLE_STRING = {"type": ["string", "null"]}
_NUMBER = {"type": "number"}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _object(required: list[str], properties: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "required": required,
        "properties": properties,
        "additionalProperties": False,
        **more,
    }


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(status): {"$ref": f"#/components/responses/{status}"} for status in statuses}


_RECIPIENT_STATES = ["queued", "deferred", "delivered", "bounced", "expired", "held"]

_SCHEMAS: dict[str, Any] = {
    "Error": _object(["error"], {"error": _STRING}),
    "Ended": _object(
        ["error", "id", "state"],
        {
            "error": _STRING,
            "id": _STRING,
            "state": {
                "enum": list(END_STATES),
                "description": "how it left the queue: cancelled (by the application),"
                " deleted (by the operator), delivered, bounced or expired (every recipient),"
                " or finished (its recipients ended differently)",
            },
        },
    ),
    "Accepted": _object(
        ["id"],
        {"id": _STRING, "duplicate": {"const": True, "description": "only on a 200"}},
    ),
    "Attempt": _object(
        ["time", "reply", "mx", "outcome"],
        {"time": _NUMBER, "reply": _STRING, "mx": _NULLABLE_STRING, "outcome": _STRING},
    ),
    "Recipient": _object(
        ["address", "state", "attempts", "next_attempt", "last_reply", "history"],
        {
            "address": _STRING,
            "state": {"enum": _RECIPIENT_STATES},
            "attempts": {"type": "integer", "minimum": 0},
            "next_attempt": {"type": ["number", "null"]},
            "last_reply": _NULLABLE_STRING,
            "orcpt": _NULLABLE_STRING,
            "notify": _NULLABLE_STRING,
            "history": {"type": "array", "items": _ref("Attempt")},
        },
    ),
    "Message": _object(
        ["id", "class", "sender", "created", "size", "held", "recipients"],
        {
            "id": _STRING,
            "class": _STRING,
            "sender": _STRING,
            "created": {**_NUMBER, "description": "epoch seconds"},
            "size": {"type": "integer"},
            "held": {"type": "boolean"},
            "held_reason": {
                **_NULLABLE_STRING,
                "description": "why it is held: operator, expired, revalidation or error",
            },
            "held_at": {"type": ["number", "null"], "description": "epoch seconds"},
            "expires": {"type": ["number", "null"]},
            "tenant": _NULLABLE_STRING,
            "envid": _NULLABLE_STRING,
            "ret": _NULLABLE_STRING,
            "idempotency_key": _NULLABLE_STRING,
            "client": _STRING,
            "helo": _STRING,
            "body": {"enum": ["7BIT", "8BITMIME"]},
            "smtputf8": {"type": "boolean"},
            "recipients": {"type": "array", "items": _ref("Recipient")},
            "waiting": {
                "oneOf": [
                    {"type": "null"},
                    _object(
                        ["reason", "destination", "until"],
                        {"reason": {"enum": ["warmup"]}, "destination": _STRING, "until": _NUMBER},
                    ),
                ],
                "description": "what holds back mail whose recipients look ready: a warm-up"
                " allowance used up for the day, until `until` (epoch seconds); else null",
            },
        },
        description="As `mtaqueue-ctl list --json` prints it, with each recipient's history",
    ),
    "MessageList": _object(
        ["messages"],
        {"messages": {"type": "array", "items": _ref("Message"), "maxItems": 1}},
    ),
    "Cancelled": _object(
        ["id", "cancelled"],
        {
            "id": _STRING,
            "cancelled": {
                "type": "array",
                "items": _STRING,
                "description": "the recipients that were not delivered yet",
            },
        },
    ),
    "Suppression": _object(
        ["address", "until", "reason"],
        {
            "address": _STRING,
            "until": {**_NUMBER, "description": "epoch seconds"},
            "reason": _STRING,
        },
    ),
    "SuppressionList": _object(
        ["suppressions"], {"suppressions": {"type": "array", "items": _ref("Suppression")}}
    ),
    "SuppressionRequest": _object(
        [],
        {
            "reason": {**_NULLABLE_STRING, "description": 'null or "": "added by an operator"'},
            "for": {
                "anyOf": [SECONDS_SCHEMA, DURATION_SCHEMA, {"type": "null"}],
                "description": 'how long: "7d", or seconds; null: suppression.ttl',
            },
        },
    ),
    "Unsuppressed": _object(
        ["address", "removed"], {"address": _STRING, "removed": {"const": True}}
    ),
}

_RESPONSES: dict[str, Any] = {
    str(status): _json(_ref("Error"), description)
    for status, description in {
        400: "Invalid request; the error names the field",
        401: "No token, or not a valid one (WWW-Authenticate: Bearer)",
        403: "A token bound to a tenant asked for what is not its own",
        404: "Not found (or another tenant's)",
        413: "The body or the message is larger than allowed (listen.max_message_size)",
        415: "The body is not JSON",
        422: "Valid, but refused by what the schema cannot know, as it depends on the"
        " moment: a recipient is suppressed (hard bounce), or expires is a time already"
        " past; the error names it",
        503: "The spool cannot take mail now (writer restarting, write error): Retry-After",
        507: "The spool is full (spool.min_free): Retry-After",
    }.items()
} | {
    "409": _json(
        _ref("Ended"),
        "Nothing left to cancel: the message has left the queue (its state says how), or"
        f" every recipient is final. One that left it before the last {KEEP:,} ends, or"
        " before a restart, is no longer remembered: a 404, as if it never was.",
    )
}

_ID = {"name": "id", "in": "path", "required": True, "schema": _STRING}
_ADDRESS = {
    "name": "address",
    "in": "path",
    "required": True,
    "schema": {**_STRING, "maxLength": MAX_PATH, "pattern": BARE_ADDRESS_PATTERN},
    "description": f"local-part@domain: {ADDRESS_RULE}",
}
_KEY = {
    "name": "idempotency_key",
    "in": "query",
    "required": True,
    "schema": {**_STRING, "minLength": 1},  # empty: "idempotency_key: required" (400)
    "description": "as given in the Idempotency-Key header of the submission",
}
_TENANT = {
    "name": "tenant",
    "in": "query",
    "required": False,
    "schema": _STRING,
    "description": "whose key (unbound tokens; a bound token's tenant is its own)",
}


def _operation(
    operation_id: str,
    summary: str,
    answers: dict[int, tuple[str, str]],  # status -> the schema and what it is
    errors: tuple[int, ...],
    *,
    parameters: tuple[dict[str, Any], ...] = (),
    body: str | None = None,  # the request body's schema
    **more: Any,
) -> dict[str, Any]:
    responses = {str(status): _json(_ref(s), what) for status, (s, what) in answers.items()}
    operation = {
        "operationId": operation_id,
        "summary": summary,
        **({"parameters": list(parameters)} if parameters else {}),
        "responses": {**responses, **_errors(*errors)},
        **more,
    }
    if body is not None:
        content = {"application/json": {"schema": _ref(body)}}
        operation["requestBody"] = {"required": operation_id == "submit", "content": content}
    return operation


_IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "schema": {**_STRING, "minLength": 1, "maxLength": MAX_KEY_LENGTH, "pattern": KEY_PATTERN},
    "description": "as X-Mtaqueue-Idempotency-Key over SMTP. Given, it must hold a key: empty"
    " (or only spaces) is a 400, as is a control character or a space at either end.",
}

_PATHS: dict[str, Any] = {
    OPENAPI_PATH: {
        "get": {
            "operationId": "openapi",
            "summary": "This document",
            "security": [],
            "responses": {"200": _json({"type": "object"}, "The OpenAPI document")},
        }
    },
    "/v1/messages": {
        "post": _operation(
            "submit",
            "Submit a message",
            {
                202: ("Accepted", "Queued (durable)"),
                200: ("Accepted", "A duplicate: the first message's id"),
            },
            (400, 401, 413, 415, 422, 503, 507),
            parameters=(_IDEMPOTENCY_KEY,),
            body="Submission",
            description="202 once the message is as durable as an SMTP 250 (file and"
            " journal record synced). With an Idempotency-Key accepted within"
            " submission.dedupe_window (of the same tenant), 200 with the first message's id"
            " and nothing queued. The body may be up to listen.max_message_size x 4/3"
            " + 64 KiB.",
        ),
        "get": _operation(
            "findByKey",
            "The queued message holding an idempotency key (a list of 0 or 1)",
            {200: ("MessageList", "The message, if one is queued")},
            (400, 401, 403),
            parameters=(_KEY, _TENANT),
        ),
        "delete": _operation(
            "cancelByKey",
            "Cancel the queued message holding an idempotency key",
            {200: ("Cancelled", "Cancelled (durable)")},
            (400, 401, 403, 404, 409),
            parameters=(_KEY, _TENANT),
            description="409 (with its state) if the key's message has left the queue, while"
            " the dedupe index holds the key (submission.dedupe_window); 404 if no message"
            " of the caller's holds it.",
        ),
    },
    "/v1/messages/{id}": {
        "get": _operation(
            "getMessage",
            "A queued message, with its attempt history",
            {200: ("Message", "The message")},
            (401, 404),
            parameters=(_ID,),
            description="Only queued mail: once every recipient is delivered, bounced or"
            " expired the message leaves the queue (its events tell the outcome).",
        ),
        "delete": _operation(
            "cancelMessage",
            "Cancel what is not delivered yet (no DSN; event cancelled)",
            {200: ("Cancelled", "Cancelled (durable)")},
            (401, 404, 409),
            parameters=(_ID,),
            description="A recipient in the middle of an attempt may still receive it. 409"
            " (with its state) if the message has left the queue: cancelled, delivered, ...;"
            " 404 if it was never queued, is no longer remembered, or is another tenant's.",
        ),
    },
    "/v1/suppressions": {
        "get": _operation(
            "listSuppressions",
            "The suppression list (unbound tokens only: it is every tenant's)",
            {200: ("SuppressionList", "The suppressions in force")},
            (401, 403),
        )
    },
    "/v1/suppressions/{address}": {
        "put": _operation(
            "suppress",
            "Suppress an address (RCPT refused, API 422) for a while",
            {200: ("Suppression", "Suppressed (durable)")},
            (400, 401, 403),
            parameters=(_ADDRESS,),
            body="SuppressionRequest",
        ),
        "delete": _operation(
            "unsuppress",
            "Lift an address's suppression",
            {200: ("Unsuppressed", "Lifted (durable)")},
            (400, 401, 403, 404),
            parameters=(_ADDRESS,),
        ),
    },
}


def document(
    classes: Sequence[str] | None = None, max_recipients: int | None = None
) -> dict[str, Any]:
    """The document; `classes` and `max_recipients` as the daemon's configuration has
    them (None: left open)."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "mtaqueue HTTP API",
            "version": __version__,
            "description": "Submit mail to the queue, follow it, cancel it; the suppression"
            ' list. Errors are {"error": "..."}.',
        },
        "security": [{"bearer": []}],
        "paths": _PATHS,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": _SCHEMAS | submission_schemas(classes, max_recipients),
            "responses": _RESPONSES,
        },
    }
