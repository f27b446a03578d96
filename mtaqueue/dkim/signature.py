"""One DKIM-Signature field (RFC 6376 3.5, 3.7; RFC 8463): relaxed/relaxed, SHA-256.

Both algorithms sign the SHA-256 of the canonical header data: RSA as PKCS #1 v1.5 of that
digest, Ed25519 (PureEdDSA) over the 32 octets of the digest itself (RFC 8463 3). Both are
deterministic, so a field is a pure function of its inputs.

A field can be made in two steps: all of it but the signature value, whose length the key
alone sets (so the message's size is known at once), with a placeholder of that length;
then the value, by whoever holds the key (the spool writer, on its own threads: service.py).
"""

from __future__ import annotations

import base64
import hashlib
from typing import NamedTuple

import msgspec
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ed25519, padding, utils

from .canonical import relaxed_field
from .keys import PrivateKey, SigningKey

_LINE = 76  # folded lines of at most this many octets, for readers (any length verifies)


class PendingSignature(msgspec.Struct, array_like=True, frozen=True):
    """A signature value still to make: with the key `key_id` (SigningKey.key_id), of
    `digest`, in place of the placeholder at `offset` of the content it is part of."""

    key_id: str
    digest: bytes
    offset: int


class Unsigned(NamedTuple):
    field: bytes  # up to and including "b="
    digest: bytes  # what the signature signs
    size: int  # octets of the signature


def signature_field(
    key: SigningKey, fields: list[tuple[bytes, bytes]], body_hash: bytes, timestamp: int
) -> bytes:
    """The field, CRLF included, signing the header `fields` (lower-case name, raw field,
    in the header's order) and a body whose relaxed SHA-256 is `body_hash`."""
    unsigned = unsigned_field(key, fields, body_hash, timestamp)
    return unsigned.field + b_value(sign_digest(key.private, unsigned.digest))


def unsigned_field(
    key: SigningKey, fields: list[tuple[bytes, bytes]], body_hash: bytes, timestamp: int
) -> Unsigned:
    """The field as signature_field() makes it, up to its b= value."""
    names, signed = select(key.headers, fields)
    stamp = f"\tt={timestamp}; h="
    field = (
        f"DKIM-Signature: v=1; a={key.algorithm}; c=relaxed/relaxed; d={key.domain};"
        f" s={key.selector};\r\n{stamp}{_fold(names, len(stamp))};\r\n"
        f"\tbh={base64.b64encode(body_hash).decode()};\r\n\tb="
    ).encode()
    # The field itself is hashed last, its b= empty and without its CRLF (RFC 6376 3.7).
    data = b"".join(map(relaxed_field, signed)) + relaxed_field(field)[:-2]
    return Unsigned(field, hashlib.sha256(data).digest(), key.signature_size)


def b_value(signature: bytes) -> bytes:
    """The field's end: the signature in folded base64, then CRLF. Its length depends on
    the signature's only, so placeholder(n) is as long as any n-octet signature's."""
    return _fold_b64(base64.b64encode(signature).decode(), len(" b=")).encode() + b"\r\n"


def placeholder(size: int) -> bytes:
    return b_value(bytes(size))


def fill(content: bytes, pending: list[PendingSignature], keys: dict[str, PrivateKey]) -> bytes:
    """`content` with each pending signature made in place of its placeholder. KeyError:
    a key that is not in `keys`; ValueError: no placeholder of that size at that offset
    (a bug, which must not store a broken signature)."""
    out, at = [], 0
    for item in sorted(pending, key=lambda p: p.offset):
        signature = sign_digest(keys[item.key_id], item.digest)
        value = b_value(signature)
        end = item.offset + len(value)
        if item.offset < at or content[item.offset : end] != placeholder(len(signature)):
            raise ValueError(f"no signature placeholder at offset {item.offset}")
        out += [content[at : item.offset], value]
        at = end
    out.append(content[at:])
    return b"".join(out)


def select(
    wanted: tuple[bytes, ...], fields: list[tuple[bytes, bytes]]
) -> tuple[list[str], list[bytes]]:
    """h= and the fields it signs, in order. Each wanted name is listed once per field of
    that name, the fields taken from the bottom up (RFC 6376 5.4.2); From once more, which
    signs its absence, so that no second From can be added (as OpenDKIM's OversignHeaders)."""
    by_name: dict[bytes, list[bytes]] = {}
    for lower, raw in fields:
        by_name.setdefault(lower, []).append(raw)
    names: list[str] = []
    signed: list[bytes] = []
    for name in wanted:
        present = by_name.get(name)
        if present is not None:
            names += [name.decode()] * len(present)
            signed += reversed(present)
        if name == b"from":
            names.append("from")
    return names, signed


def sign_digest(private: PrivateKey, digest: bytes) -> bytes:
    """The signature (b=) of the SHA-256 `digest` of the canonical header data."""
    if isinstance(private, ed25519.Ed25519PrivateKey):
        return private.sign(digest)
    return private.sign(digest, padding.PKCS1v15(), utils.Prehashed(hashes.SHA256()))


def _fold(names: list[str], used: int) -> str:
    """h='s names joined by colons, a line break after a colon where a line would pass
    _LINE (FWS is allowed around the colons)."""
    out, width = "", used
    for i, name in enumerate(names):
        piece = name if i == 0 else ":" + name
        if width + len(piece) > _LINE and i:
            out += ":\r\n\t" + name
            width = 1 + len(name)
        else:
            out += piece
            width += len(piece)
    return out


def _fold_b64(text: str, used: int) -> str:
    """Base64 in lines of _LINE (FWS may separate its characters: RFC 6376 2.4)."""
    first = _LINE - used - 1
    rest = [text[i : i + _LINE - 1] for i in range(first, len(text), _LINE - 1)]
    return "\r\n\t".join([text[:first], *rest])
