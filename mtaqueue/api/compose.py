"""An RFC 5322 message from the API's parts (subject, text, html, attachments), with the
standard library's `email` package. Pure; no I/O.

The result is 7-bit clean unless an address needs SMTPUTF8: non-ASCII text goes as
quoted-printable or base64 and header words as RFC 2047 encoded words, so that every
receiver takes it whether or not it offers 8BITMIME.
"""

from __future__ import annotations

import mimetypes
import re
from dataclasses import dataclass
from email.headerregistry import Address
from email.message import EmailMessage
from email.policy import SMTP, SMTPUTF8


@dataclass(frozen=True, slots=True)
class Part:
    """An attachment: inline (shown in the HTML by its Content-ID) if it has one."""

    filename: str
    data: bytes
    content_type: str = ""  # "" = guessed from the file name
    content_id: str = ""


def compose(
    sender: Address,
    to: list[Address],
    subject: str,
    text: str | None,
    html: str | None,
    parts: list[Part],
    utf8: bool,
) -> bytes:
    """The message (CRLF lines); Message-ID and Date are left to submission.prepare."""
    policy = (SMTPUTF8 if utf8 else SMTP).clone(cte_type="7bit")
    msg = EmailMessage(policy=policy)
    msg["From"] = sender
    msg["To"] = to
    msg["Subject"] = subject
    if text is not None:
        msg.set_content(text)
        if html is not None:
            msg.add_alternative(html, subtype="html")
    else:
        msg.set_content(html or "", subtype="html")
    for part in parts:
        kind = part.content_type or mimetypes.guess_type(part.filename)[0]
        maintype, _, subtype = (kind or "application/octet-stream").partition("/")
        msg.add_attachment(
            part.data,
            maintype=maintype,
            subtype=subtype,
            filename=part.filename,
            disposition="inline" if part.content_id else "attachment",
            cid=f"<{part.content_id.strip('<>')}>" if part.content_id else None,
        )
    for part in msg.walk():  # the package gives each part a MIME-Version of its own
        if part is not msg:
            del part["MIME-Version"]
    return msg.as_bytes(policy=policy)


def address(display_name: str, mailbox: str) -> Address:
    """An Address of a checked mailbox (local@domain), a UTF-8 local part included, which
    Address(addr_spec=...) refuses."""
    local, _, domain = mailbox.rpartition("@")
    if local.startswith('"') and local.endswith('"'):  # Address quotes it again as needed
        local = re.sub(r"\\(.)", r"\1", local[1:-1])
    return Address(display_name, username=local, domain=domain)
