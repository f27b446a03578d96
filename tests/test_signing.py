"""The webhook signature: what a receiver checks."""

import hashlib
import hmac

from hypothesis import given
from hypothesis import strategies as st

from mtaqueue.events.signing import sign, verify


def test_the_header_is_hmac_sha256_of_time_dot_body() -> None:
    header = sign("k", b'{"a":1}', 1700000000.7)
    expected = hmac.new(b"k", b'1700000000.{"a":1}', hashlib.sha256).hexdigest()
    assert header == f"t=1700000000,v1={expected}"


@given(st.text(min_size=1), st.binary(), st.text(min_size=1))
def test_verify_accepts_only_the_right_key_and_body(secret: str, body: bytes, other: str) -> None:
    header = sign(secret, body, 1000.0)
    assert verify(secret, body, header, 1000.0)
    assert not verify(secret, body + b"x", header, 1000.0)
    # HMAC pads a short key with zero bytes (RFC 2104): "0" and "0\x00" are one key.
    if other.encode().rstrip(b"\0") != secret.encode().rstrip(b"\0"):
        assert not verify(other, body, header, 1000.0)


def test_an_old_or_malformed_header_is_refused() -> None:
    header = sign("k", b"x", 1000.0)
    assert not verify("k", b"x", header, 1000.0 + 301)
    assert not verify("k", b"x", "v1=abc", 1000.0)
    assert not verify("k", b"x", "t=zz,v1=abc", 1000.0)
