"""SMTP AUTH credentials: a file of `user:hash` lines, PBKDF2-SHA256 hashes.

Create a hash with `mtaqueue --hash-password` (reads the password from stdin).
Verification is deliberately slow (many iterations), so the listener runs it
in a worker thread.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

SCHEME = "pbkdf2_sha256"
ITERATIONS = 200_000


class AuthFileError(ValueError):
    pass


def hash_password(password: str, iterations: int = ITERATIONS) -> str:
    salt = os.urandom(16)
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    return f"{SCHEME}${iterations}${salt.hex()}${digest.hex()}"


def verify_password(stored: str, password: str) -> bool:
    _scheme, iterations, salt, digest = stored.split("$")
    computed = hashlib.pbkdf2_hmac(
        "sha256", password.encode(), bytes.fromhex(salt), int(iterations)
    )
    return hmac.compare_digest(computed.hex(), digest)


def load_auth_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """Read `user:hash` lines (blank lines and # comments ignored)."""
    users: dict[str, str] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, stored = line.partition(":")
        parts = stored.split("$")
        if not sep or not user or len(parts) != 4 or parts[0] != SCHEME or not parts[1].isdigit():
            raise AuthFileError(f"{path}:{number}: expected user:{SCHEME}$iterations$salt$hash")
        users[user] = stored
    return users


class Credentials:
    def __init__(self, users: dict[str, str]) -> None:
        self._users = users

    def check(self, user: str, password: str) -> str | None:
        """The user name if the password is right (blocking)."""
        stored = self._users.get(user)
        if stored is None:
            # Same cost as a real check, so timing does not reveal valid users.
            verify_password(f"{SCHEME}${ITERATIONS}${'00' * 16}${'00' * 32}", password)
            return None
        return user if verify_password(stored, password) else None
