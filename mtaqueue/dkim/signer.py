"""Which keys sign a message, and the signing: the keys of its From domain or, failing
that, of the nearest parent domain that has any (d= is then that parent).

A message is signed once, at acceptance, after our steering fields are gone and before it
is stored: every attempt sends the same signed octets. Content the delivery side would
have to convert for some hop (8-bit text, lines over 998 octets) is converted first, as
RFC 6376 5.3 asks of signers, so no hop changes what was signed. A message written to
disk as it arrives (past spool.stream_threshold) is signed as it came: its body was
stored before it was complete.
"""

from __future__ import annotations

import email.utils
import re
from typing import NamedTuple

from ..conversion import Prepared, prepare
from ..header_fields import header_end, split_fields
from .canonical import RelaxedBody
from .keys import SigningKey
from .signature import PendingSignature, fill, placeholder, signature_field, unsigned_field


class Presigned(NamedTuple):
    """A message signed but for the signature values (signature.py's two steps)."""

    fields: bytes  # the signature fields, a placeholder where each value goes
    content: bytes  # what they sign (converted if some hop would have changed it)
    pending: list[PendingSignature]  # offsets in `fields`, so also in fields + content


class Signer:
    def __init__(self, keys: dict[str, tuple[SigningKey, ...]]) -> None:
        self.keys = keys  # lower-case domain -> its keys
        self.by_id = {key.key_id: key for domain in keys.values() for key in domain}
        self.private = {key_id: key.private for key_id, key in self.by_id.items()}

    def keys_for(self, fields: list[tuple[bytes, bytes]]) -> tuple[SigningKey, ...]:
        """The keys that sign a message with these header fields (none: unsigned)."""
        domain = from_domain(fields)
        while domain:
            if domain in self.keys:
                return self.keys[domain]
            domain = domain.partition(".")[2]
        return ()

    def keys_for_content(self, content: bytes) -> tuple[SigningKey, ...]:
        """The keys that sign this message (cheap: the daemon asks first)."""
        if not self.keys:
            return ()
        return self.keys_for(split_fields(content[: header_end(content)]))

    def sign(self, content: bytes, now: float) -> tuple[bytes, bytes] | None:
        """The signature fields and the content they sign (converted if some hop would
        have changed it), to be stored one after the other; None if no key signs it."""
        presigned = self.prepare(content, now)
        if presigned is None:
            return None
        return fill(presigned.fields, presigned.pending, self.private), presigned.content

    def prepare(self, content: bytes, now: float) -> Presigned | None:
        """As sign(), but the signature values left to make (all the rest is done)."""
        end = header_end(content)
        fields = split_fields(content[:end])
        keys = self.keys_for(fields)
        if not keys:
            return None
        safe = _seven_bit_safe(content)
        if safe is not content:
            content, end = safe, header_end(safe)
            fields = split_fields(content[:end])
        body = RelaxedBody()
        body.feed(content[end + 2 :])  # after the blank line ("" when there is none)
        digest = body.digest()
        out: list[bytes] = []
        pending: list[PendingSignature] = []
        at = 0
        for key in keys:
            unsigned = unsigned_field(key, fields, digest, int(now))
            at += len(unsigned.field)
            pending.append(PendingSignature(key.key_id, unsigned.digest, at))
            value = placeholder(unsigned.size)
            out += [unsigned.field, value]
            at += len(value)
        return Presigned(b"".join(out), content, pending)

    def stream(self, header: bytes, now: float) -> StreamSigning | None:
        """For a message whose `header` (as stored, up to the blank line) is stored before
        its body has arrived: what signs it once the body has been fed; None: unsigned."""
        fields = split_fields(header)
        keys = self.keys_for(fields)
        return StreamSigning(keys, fields, len(header), int(now)) if keys else None


class StreamSigning:
    """Fed the content as it is written, header first (which it skips: it signs the
    fields it was given), then the signature fields to put before it."""

    def __init__(
        self, keys: tuple[SigningKey, ...], fields: list[tuple[bytes, bytes]], skip: int, t: int
    ) -> None:
        self._keys, self._fields, self._timestamp = keys, fields, t
        self._skip = skip + 2  # the header and the blank line after it
        self._body = RelaxedBody()

    def feed(self, data: bytes) -> None:
        if self._skip:
            taken = min(self._skip, len(data))
            self._skip -= taken
            data = data[taken:]
        if data:
            self._body.feed(data)

    def fields(self) -> bytes:
        digest = self._body.digest()
        return b"".join(
            signature_field(key, self._fields, digest, self._timestamp) for key in self._keys
        )


# The usual forms, "Name <user@domain>" and "user@domain", without the email package's
# parser (ten times slower): a quote or a comment could hide a "<" or an "@".
_SIMPLE_FROM = re.compile(
    rb"[^\"()]*?<[^<>@]*@([^<>@\s]+)>\s*|\s*[^\s<>@\"()]+@([^\s<>@\"(),;]+)\s*"
)


def from_domain(fields: list[tuple[bytes, bytes]]) -> str:
    """The lower-case domain of the first From address, "" if there is none."""
    raw = next((raw for name, raw in fields if name == b"from"), None)
    if raw is None:
        return ""
    value = raw.partition(b":")[2].replace(b"\r\n", b"")
    simple = _SIMPLE_FROM.fullmatch(value)
    if simple is not None:
        domain = (simple[1] or simple[2]).decode("utf-8", "replace")
        return domain.lower().rstrip(".")
    for _, address in email.utils.getaddresses([value.decode("utf-8", "replace")]):
        if "@" in address:
            return address.rpartition("@")[2].strip().lower().rstrip(".")
    return ""


def _seven_bit_safe(content: bytes) -> bytes:
    """The content as any hop takes it unchanged; if a header needs 8 bits (SMTPUTF8
    mail, which only reaches 8-bit hops), as 8-bit hops do; else as it is."""
    for eightbitmime in (False, True):
        prepared = prepare(content, eightbitmime=eightbitmime)
        if isinstance(prepared, Prepared):
            return prepared.content
    return content
