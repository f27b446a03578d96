"""The arguments of MAIL and RCPT, parsed (pure): `mail_from`, `rcpt_to`, `ArgumentError`.

`mail_from(arg, esmtp=, max_size=)` gives the `Envelope` that MAIL FROM opens,
`rcpt_to(arg, esmtp=, smtputf8=)` the `Recipient` that RCPT TO adds; what either refuses
raises `ArgumentError`, whose message is the whole reply. The path is checked as in
addresses.py; the parameters are SIZE (RFC 1870), BODY (RFC 6152), SMTPUTF8 (RFC 6531),
RET and ENVID, NOTIFY and ORCPT (RFC 3461), and AUTH (RFC 4954, ignored).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ..model import Recipient
from ..transaction import Envelope
from .addresses import ATOM, AddressError, check_mailbox, split_path, xtext_decode

_NOTIFY_VALUES = frozenset({"SUCCESS", "FAILURE", "DELAY"})
_T = TypeVar("_T")


class ArgumentError(Exception):
    """A MAIL/RCPT argument is refused; the message is the full reply."""


def mail_from(arg: str, *, esmtp: bool, max_size: int) -> Envelope:
    """MAIL's argument ("FROM:<path> params") as the envelope it opens."""

    def parse(sender: str, params: str) -> Envelope:
        envelope = Envelope(sender=sender)
        _mail_params(envelope, params, esmtp, max_size)
        if sender:
            check_mailbox(sender, utf8=envelope.smtputf8)
        return envelope

    return _path(arg, "FROM:", "MAIL FROM:<address>", "501 5.1.7 Bad sender", parse)


def rcpt_to(arg: str, *, esmtp: bool, smtputf8: bool) -> Recipient:
    """RCPT's argument ("TO:<path> params") as a recipient of an envelope with `smtputf8`."""

    def parse(address: str, params: str) -> Recipient:
        check_mailbox(address, utf8=smtputf8)
        notify, orcpt = _rcpt_params(params, esmtp)
        return Recipient(address, orcpt=orcpt, notify=notify)

    return _path(arg, "TO:", "RCPT TO:<address>", "501 5.1.3 Bad recipient", parse)


def _path(arg: str, keyword: str, syntax: str, bad: str, parse: Callable[[str, str], _T]) -> _T:
    """MAIL's or RCPT's path and parameters, as `parse` takes them."""
    if arg[: len(keyword)].upper() != keyword:
        raise ArgumentError(f"501 5.5.4 Syntax: {syntax}")
    try:
        return parse(*split_path(arg[len(keyword) :]))
    except AddressError as exc:
        raise ArgumentError(f"{bad} address syntax: {exc}") from None


def _mail_params(envelope: Envelope, params: str, esmtp: bool, max_size: int) -> None:
    if params and not esmtp:
        raise ArgumentError("555 5.5.4 Error: parameters need EHLO")
    for key, value in _params(params):
        if key == "SIZE":
            if not (value.isascii() and value.isdigit()):  # not "²", which int() refuses
                raise ArgumentError("501 5.5.4 Error: bad SIZE value")
            if int(value) > max_size:
                raise ArgumentError("552 5.3.4 Error: message size exceeds fixed limit")
        elif key == "BODY":
            body = value.upper()
            if body not in ("7BIT", "8BITMIME"):
                raise ArgumentError("501 5.5.4 Error: BODY must be 7BIT or 8BITMIME")
            envelope.body = body
        elif key == "SMTPUTF8":
            if value:
                raise ArgumentError("501 5.5.4 Error: SMTPUTF8 takes no value")
            envelope.smtputf8 = True
        elif key == "RET":
            if value.upper() not in ("FULL", "HDRS"):
                raise ArgumentError("501 5.5.4 Error: RET must be FULL or HDRS")
            envelope.ret = value.upper()
        elif key == "ENVID":
            if not value:
                raise ArgumentError("501 5.5.4 Error: ENVID needs a value")
            try:
                envid = xtext_decode(value)
            except AddressError as exc:
                raise ArgumentError(f"501 5.5.4 Error: ENVID is not valid xtext: {exc}") from None
            if len(envid) > 100:
                raise ArgumentError("501 5.5.4 Error: ENVID longer than 100 characters")
            envelope.envid = envid  # RFC 3461 4.4: kept exactly, case included
        elif key == "AUTH":
            pass  # RFC 4954 5: we may ignore it
        else:
            raise ArgumentError(f"555 5.5.4 Error: unsupported MAIL parameter {key}")


def _rcpt_params(params: str, esmtp: bool) -> tuple[str | None, str | None]:
    if params and not esmtp:
        raise ArgumentError("555 5.5.4 Error: parameters need EHLO")
    notify = orcpt = None
    for key, value in _params(params):
        if key == "NOTIFY":
            words = value.upper().split(",")
            if words != ["NEVER"] and not (words and set(words) <= _NOTIFY_VALUES):
                raise ArgumentError(
                    "501 5.5.4 Error: NOTIFY must be NEVER or SUCCESS,FAILURE,DELAY"
                )
            notify = ",".join(words)
        elif key == "ORCPT":
            addr_type, semi, xtext = value.partition(";")
            if not semi or not ATOM.match(addr_type) or not xtext:
                raise ArgumentError("501 5.5.4 Error: ORCPT must be addr-type;address")
            try:
                orcpt = f"{addr_type};{xtext_decode(xtext)}"
            except AddressError as exc:
                raise ArgumentError(f"501 5.5.4 Error: ORCPT is not valid xtext: {exc}") from None
            if len(value) > 500:
                raise ArgumentError("501 5.5.4 Error: ORCPT longer than 500 characters")
        else:
            raise ArgumentError(f"555 5.5.4 Error: unsupported RCPT parameter {key}")
    return notify, orcpt


def _params(text: str):
    for word in text.split():
        key, _, value = word.partition("=")
        yield key.upper(), value
