"""What a server session asks of the I/O layer: `Action`, one of `Submit`, `Stream`,
`Write`, `Finish`, `CheckCredentials`, `StartTLS`.

Each says what to do and how to answer it with `ServerSession.resume()`. `Submit` and
`Stream` carry a transaction on to `submission`, so they live below it, in
`mtaqueue.transaction`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..transaction import Stream, Submit


@dataclass(frozen=True, slots=True)
class Write:
    """More content of the message begun with `Stream`; resume() as for it."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Finish:
    """The end of the message begun with `Stream`: its last content, then commit it, or
    drop what was stored if `refusal` says why it is refused. resume() with the reply."""

    data: bytes
    refusal: str | None


@dataclass(frozen=True, slots=True)
class CheckCredentials:
    """Verify a password; resume() with the user name, or None if it is wrong."""

    user: str
    password: str


@dataclass(frozen=True, slots=True)
class StartTLS:
    """Upgrade the connection; resume() once the handshake is done (or None if it failed)."""


Action = Submit | Stream | Write | Finish | CheckCredentials | StartTLS
