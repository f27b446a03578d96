"""An API request refused: the status and the one-line message of `{"error": ...}`, and
any more fields of that body (`fields`: a 409's id and state)."""

from __future__ import annotations

import re
from typing import Any

_SMTP_CODES = re.compile(r"\d{3}[ -](\d\.\d{1,3}\.\d{1,3} )?(Error: )?")


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        headers: dict[str, str] | None = None,
        fields: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}
        self.fields = fields or {}

    def body(self) -> dict[str, Any]:
        return {"error": self.message, **self.fields}


def reply_text(reply: str) -> str:
    """An SMTP reply's text without its codes: the SMTP side's words for the same refusal
    ("550 5.1.1 <a@b>: suppressed ..." -> "<a@b>: suppressed ...")."""
    match = _SMTP_CODES.match(reply)
    return reply[match.end() :] if match else reply
