"""An RFC 5322 message from the API's parts (subject, text, html, attachments), with the
standard library's `email` package. Pure; no I/O.

The result is 7-bit clean unless an address needs SMTPUTF8: non-ASCII text goes as
quoted-printable or base64 and header words as RFC 2047 encoded words, so that every
receiver takes it whether or not it offers 8BITMIME.

From and To are written here, not by the package: it reads back what it writes, and
misreads mailboxes RFC 5321 allows, which the API has checked: a quoted local part with a
dot at either end or two together it writes bare (".b"@x as .b@x, no address) and then
fails on in a list (a TypeError), a no-break space or U+3000 in an atom it takes for
white space (a\u3000.b@x becomes another address).
"""

from __future__ import annotations

import mimetypes
import re
from dataclasses import dataclass
from email.header import Header
from email.message import EmailMessage
from email.policy import SMTP, SMTPUTF8


@dataclass(frozen=True, slots=True)
class Part:
    """An attachment: inline (shown in the HTML by its Content-ID) if it has one."""

    filename: str
    data: bytes
    content_type: str = ""  # "" = guessed from the file name
    content_id: str = ""


Mailbox = tuple[str, str]  # (display name, checked local-part@domain)


def compose(
    sender: Mailbox,
    to: list[Mailbox],
    subject: str,
    text: str | None,
    html: str | None,
    parts: list[Part],
    utf8: bool,
) -> bytes:
    """The message (CRLF lines); Message-ID and Date are left to submission.prepare."""
    policy = (SMTPUTF8 if utf8 else SMTP).clone(cte_type="7bit")
    msg = EmailMessage(policy=policy)
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
    return _field("From", [sender]) + _field("To", to) + msg.as_bytes(policy=policy)


_SPECIALS = re.compile(r'[][\\()<>@,:;".]')  # RFC 5322 specials


def _field(name: str, mailboxes: list[Mailbox]) -> bytes:
    """A From or To field: one mailbox a line."""
    return (f"{name}: " + ",\r\n ".join(_mailbox(*m) for m in mailboxes) + "\r\n").encode()


def _mailbox(display: str, mailbox: str) -> str:
    """`mailbox` as it is (checked: RFC 5321's syntax is RFC 5322's), after its name: as
    atoms, or quoted if it holds a special, or as RFC 2047 encoded words (folded) if it is
    not ASCII, is long or looks like an encoded word itself."""
    if not display:
        return mailbox
    if display.isascii() and len(display) <= 60 and "=?" not in display:
        quoted = display.replace("\\", "\\\\").replace('"', '\\"')
        phrase = f'"{quoted}"' if _SPECIALS.search(display) else display
    else:
        phrase = Header(display, "utf-8").encode(linesep="\r\n")
    return f"{phrase} <{mailbox}>"
