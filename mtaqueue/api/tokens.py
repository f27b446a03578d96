"""The API's bearer tokens: `api.tokens_file`, one `TOKEN [TENANT]` a line.

A token bound to a tenant submits as that tenant and sees only its mail; an unbound
token is the operator's and sees everything. Tokens are kept as SHA-256 digests (of one
length, whatever the token's) and a presented token is compared with every one of them
by `hmac.compare_digest`, without stopping at a match: the time taken tells nothing
about which token matched, or how much of one.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from dataclasses import dataclass

MIN_LENGTH = 16  # characters: a guessable token is refused at start


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request comes from."""

    tenant: str | None  # None: an unbound (operator's) token

    def sees(self, tenant: str | None) -> bool:
        return self.tenant is None or self.tenant == tenant


class Tokens:
    def __init__(self, entries: list[tuple[str, str | None]]) -> None:
        self._digests = [(_digest(token), tenant) for token, tenant in entries]

    def __len__(self) -> int:
        return len(self._digests)

    def caller(self, token: str) -> Caller | None:
        """The caller this token names, or None if it is no token of ours."""
        presented = _digest(token)
        found: Caller | None = None
        for digest, tenant in self._digests:  # no early exit: every token is compared
            if hmac.compare_digest(presented, digest):
                found = Caller(tenant)
        return found


def load_tokens(path: str) -> tuple[Tokens, list[str]]:
    """The tokens of a tokens file, and warnings about it; "" is no file (no tokens).
    Raises OSError, or ValueError naming the line."""
    if not path:
        return Tokens([]), []
    warnings = []
    with open(path, encoding="utf-8") as f:
        if stat.S_IMODE(os.fstat(f.fileno()).st_mode) & 0o077:
            warnings.append(f"{path} is readable by others than its owner (chmod 600)")
        lines = f.read().splitlines()
    entries: list[tuple[str, str | None]] = []
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        token, _, tenant = line.partition(" ")
        if len(token) < MIN_LENGTH:
            raise ValueError(f"line {number}: a token needs at least {MIN_LENGTH} characters")
        if not token.isascii() or not token.isprintable():
            raise ValueError(f"line {number}: a token is printable ASCII")
        entries.append((token, tenant.strip() or None))
    if len({token for token, _ in entries}) < len(entries):
        raise ValueError("the same token is on two lines")
    return Tokens(entries), warnings


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
