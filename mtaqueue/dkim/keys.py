"""The signing keys of the `[dkim."DOMAIN"]` tables, read from their PEM files, and the DNS
TXT record (`SELECTOR._domainkey.DOMAIN`) that publishes each one's public key.

Read by the daemon at start and at SIGHUP, and by `mtaqueue-ctl dkim check`; not by
config.load(), which also finds the control socket for users who cannot read the keys.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

from ..config import DKIM_HEADERS, ConfigError, DkimKeyConfig, dkim_path

MIN_RSA_BITS = 1024  # RFC 8301 3.2: verifiers refuse smaller keys

PrivateKey = rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey


@dataclass(frozen=True, slots=True)
class SigningKey:
    domain: str  # d=, lower case
    selector: str  # s=
    algorithm: str  # a=: "rsa-sha256" or "ed25519-sha256"
    private: PrivateKey
    headers: tuple[bytes, ...]  # lower-case names of the fields to sign
    key_file: str
    pem: bytes  # as read: what the spool writer is given to sign with (service.py)

    @property
    def key_id(self) -> str:
        """Names the key to the spool writer: a reload that changes the file changes it."""
        return hashlib.sha256(self.pem).hexdigest()[:16]

    @property
    def signature_size(self) -> int:
        """Octets of its signatures: an RSA key's modulus, an Ed25519 signature's 64."""
        if isinstance(self.private, rsa.RSAPrivateKey):
            return (self.private.key_size + 7) // 8
        return 64

    @property
    def record_name(self) -> str:
        return f"{self.selector}._domainkey.{self.domain}"

    @property
    def key_type(self) -> str:
        """k= of the DNS record."""
        return "rsa" if self.algorithm == "rsa-sha256" else "ed25519"

    def public_key(self) -> bytes:
        """p= of the DNS record, decoded: an RSA key's SubjectPublicKeyInfo (DER), as
        RFC 6376 3.6.1 publishes it; an Ed25519 key's 32 octets (RFC 8463 4.2)."""
        public = self.private.public_key()
        if isinstance(public, ed25519.Ed25519PublicKey):
            return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return public.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def record(self) -> str:
        """The TXT record's text, before it is cut into strings of 255 octets."""
        p = base64.b64encode(self.public_key()).decode()
        return f"v=DKIM1; k={self.key_type}; p={p}"


def load_keys(tables: dict[str, list[DkimKeyConfig]]) -> dict[str, tuple[SigningKey, ...]]:
    """Each (lower-case) domain's keys, in the order configured; ConfigError naming the
    key that cannot be read or does not fit its algorithm."""
    keys: dict[str, tuple[SigningKey, ...]] = {}
    for domain, entries in tables.items():
        loaded = []
        for i, entry in enumerate(entries):
            path = dkim_path(domain, i if len(entries) > 1 else None)
            private, pem = _read_key(f"{path}.key_file", entry.key_file)
            _check_algorithm(path, entry.algorithm, private)
            headers = [name.lower() for name in entry.headers or DKIM_HEADERS]
            loaded.append(
                SigningKey(
                    domain=domain.lower().rstrip("."),
                    selector=entry.selector,
                    algorithm=entry.algorithm,
                    private=private,
                    headers=tuple(dict.fromkeys(name.encode() for name in headers)),
                    key_file=entry.key_file,
                    pem=pem,
                )
            )
        keys[domain.lower().rstrip(".")] = tuple(loaded)
    return keys


def _read_key(path: str, key_file: str) -> tuple[PrivateKey, bytes]:
    try:
        with open(key_file, "rb") as f:
            pem = f.read()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read {key_file}: {exc.strerror or exc}") from None
    try:
        private = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:  # TypeError: the key is encrypted
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{path}: {key_file} is not an unencrypted PEM key: {reason}") from None
    if not isinstance(private, PrivateKey):
        kind = type(private).__name__.removeprefix("_")
        raise ConfigError(f"{path}: {key_file} holds a {kind}, not an RSA or Ed25519 key")
    return private, pem


def load_private(pem: bytes) -> PrivateKey:
    """A key the daemon read and checked (load_keys), in the spool writer."""
    private = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(private, PrivateKey):
        raise ValueError(f"not an RSA or Ed25519 key: {type(private).__name__}")
    return private


def _check_algorithm(path: str, algorithm: str, private: PrivateKey) -> None:
    if algorithm == "rsa-sha256" and not isinstance(private, rsa.RSAPrivateKey):
        raise ConfigError(f"{path}.key_file: an Ed25519 key, but algorithm is rsa-sha256")
    if algorithm == "ed25519-sha256" and not isinstance(private, ed25519.Ed25519PrivateKey):
        raise ConfigError(f"{path}.key_file: an RSA key, but algorithm is ed25519-sha256")
    if isinstance(private, rsa.RSAPrivateKey) and private.key_size < MIN_RSA_BITS:
        raise ConfigError(
            f"{path}.key_file: a {private.key_size}-bit RSA key; verifiers refuse fewer than"
            f" {MIN_RSA_BITS} bits (RFC 8301), 2048 is usual"
        )
