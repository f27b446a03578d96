"""What an SMTP session may take and offer: `SessionSettings` (made from the listen.*
and spool.* settings), and `content_limits`, the limits of a message's content that
follow from them (`smtp.content`), which the HTTP API applies too.
"""

from __future__ import annotations

from dataclasses import dataclass

from .content import Limits


@dataclass(frozen=True, slots=True)
class SessionSettings:
    hostname: str
    max_message_size: int
    max_recipients: int
    bare_newline: str = "normalize"  # or "reject"
    max_line_length: int = 1 << 20  # listen.max_line_length, octets without the CRLF
    stream_threshold: int | None = None  # spool.stream_threshold; None: hold every message
    # The header must end within this many octets of data; an LF-only client is known by
    # its first this many (see content.py).
    max_header_size: int = 1 << 20
    tls_available: bool = False
    auth_available: bool = False
    auth_required: bool = False


def content_limits(settings: SessionSettings) -> Limits:
    """What a message's content may be: the listener's limits, the HTTP API's too."""
    return Limits(
        settings.max_message_size,
        settings.max_line_length,
        settings.max_header_size,
        settings.bare_newline == "reject",
    )
