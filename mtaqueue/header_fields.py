"""The header section of a stored message (CRLF lines): where it ends, and its fields.

Shared by the submission (which removes our steering fields) and the DKIM signer (which
signs some of the rest), so that both see the same fields.
"""

from __future__ import annotations


def header_end(content: bytes) -> int:
    """Offset of the blank line that ends the header (content is CRLF-normalized); the
    content's length when there is none."""
    if content.startswith(b"\r\n"):
        return 0
    end = content.find(b"\r\n\r\n")
    return len(content) if end < 0 else end + 2


def split_fields(header: bytes) -> list[tuple[bytes, bytes]]:
    """Header fields as (lower-case name, raw field with folding, no final CRLF)."""
    fields: list[tuple[bytes, bytes]] = []
    for line in header.split(b"\r\n"):
        if not line:
            continue
        if line[:1] in (b" ", b"\t") and fields:
            name, raw = fields[-1]
            fields[-1] = (name, raw + b"\r\n" + line)
        else:
            fields.append((line.split(b":", 1)[0].strip().lower(), line))
    return fields
