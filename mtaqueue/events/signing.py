"""The X-Mtaqueue-Signature header: t=<epoch>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>.

The time is inside the signed text so that a receiver can refuse a replayed request
(`verify`'s `tolerance`), as Stripe's and Svix's receivers do.
"""

from __future__ import annotations

import hashlib
import hmac

HEADER = "X-Mtaqueue-Signature"


def sign(secret: str, body: bytes, now: float) -> str:
    """The header's value for `body` sent at `now`."""
    t = int(now)
    mac = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256)
    return f"t={t},v1={mac.hexdigest()}"


def verify(secret: str, body: bytes, header: str, now: float, tolerance: float = 300.0) -> bool:
    """True if `header` signs `body` with `secret` and its time is within `tolerance` of now."""
    fields = dict(part.partition("=")[::2] for part in header.split(","))
    try:
        t = int(fields["t"])
    except (KeyError, ValueError):
        return False
    if abs(now - t) > tolerance:
        return False
    mac = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256)
    return hmac.compare_digest(mac.hexdigest(), fields.get("v1", ""))


def read_secret(secret: str, secret_file: str) -> str:
    """The key given inline, or the first line of `secret_file` (raises OSError)."""
    if secret or not secret_file:
        return secret
    with open(secret_file, encoding="utf-8") as f:
        return f.readline().strip()
