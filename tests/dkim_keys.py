"""DKIM test keys (made once per test session: RSA keys take a while) and their PEM files,
records and verification with dkimpy, the third-party verifier of the tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import dkim
import dns.nameserver
import dns.resolver
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

from mtaqueue.config import DKIM_HEADERS
from mtaqueue.dkim.keys import PrivateKey, SigningKey
from mtaqueue.dkim.published import txt_strings

DnsFunc = Callable[..., bytes]


_KEYS: dict[tuple[str, int], PrivateKey] = {}


def private_key(algorithm: str, n: int = 0) -> PrivateKey:
    """The `n`th test key of an algorithm (RSA: 2048 bits)."""
    if (algorithm, n) not in _KEYS:
        if algorithm == "ed25519-sha256":
            _KEYS[algorithm, n] = ed25519.Ed25519PrivateKey.generate()
        else:
            _KEYS[algorithm, n] = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return _KEYS[algorithm, n]


def pem(key: PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def write_key(directory: Path, algorithm: str, n: int = 0) -> Path:
    path = directory / f"{algorithm}-{n}.pem"
    path.write_bytes(pem(private_key(algorithm, n=n)))
    path.chmod(0o600)
    return path


def signing_key(
    domain: str = "example.com", selector: str = "s1", algorithm: str = "rsa-sha256", n: int = 0
) -> SigningKey:
    headers = tuple(name.encode() for name in DKIM_HEADERS)
    key = private_key(algorithm, n=n)
    return SigningKey(domain, selector, algorithm, key, headers, "", pem(key))


def verify_all(message: bytes, records: dict[str, str] | DnsFunc) -> list[bool]:
    """dkimpy's verdict on each DKIM-Signature of `message` (top first), the TXT records
    given by name ("s1._domainkey.example.com") or looked up by a dnsfunc (`dns_txt`)."""

    def from_records(name: bytes, timeout: float = 5) -> bytes:
        assert isinstance(records, dict)
        return records.get(name.decode().rstrip("."), "").encode()

    dnsfunc = from_records if isinstance(records, dict) else records
    verifier = dkim.DKIM(message)
    count = message.count(b"\nDKIM-Signature:") + message.startswith(b"DKIM-Signature:")
    return [_verify(verifier, i, dnsfunc) for i in range(count)]


def dns_txt(port: int) -> DnsFunc:
    """dkimpy's DNS lookup, through dnspython, at a test DNS server on 127.0.0.1."""

    def dnsfunc(name: bytes, timeout: float = 5) -> bytes:
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers = [dns.nameserver.Do53Nameserver("127.0.0.1", port)]
        try:
            answer = resolver.resolve(name.decode(), "TXT", lifetime=timeout)
        except dns.resolver.NXDOMAIN:
            return b""
        return b"".join(answer[0].strings)

    return dnsfunc


def publish(server, key: SigningKey) -> None:
    """The key's TXT record on a test DNS server (`dns_server.DnsServer`), in strings of
    255 octets as a zone file holds it."""
    strings = " ".join(f'"{s}"' for s in txt_strings(key.record()))
    server.add(key.record_name, "TXT", strings)


def _verify(verifier: dkim.DKIM, index: int, dnsfunc) -> bool:
    try:
        return verifier.verify(idx=index, dnsfunc=dnsfunc)
    except dkim.DKIMException:  # e.g. "body hash mismatch": not valid
        return False
