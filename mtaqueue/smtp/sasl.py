"""The AUTH exchange, PLAIN (RFC 4616) and LOGIN, sans-IO: `SaslExchange`.

`start(arg)` takes AUTH's argument (the mechanism, maybe an initial response), then
`answer(line)` each line the client sends while `waiting`. Each returns
`CheckCredentials` (the user name and password to verify) or a reply: a 334 challenge
while `waiting`, else a refusal. Whether AUTH may be used at all is the session's to say.
"""

from __future__ import annotations

import base64

from .actions import CheckCredentials

# What the client's next line answers.
_PLAIN, _USER, _PASSWORD = range(3)


class SaslExchange:
    def __init__(self) -> None:
        self._step: int | None = None
        self._user = ""

    @property
    def waiting(self) -> bool:
        """A challenge is out: the client's next line answers it."""
        return self._step is not None

    def start(self, arg: str) -> CheckCredentials | str:
        mechanism, _, initial = arg.partition(" ")
        mechanism = mechanism.upper()
        if mechanism == "PLAIN":
            if initial:
                return _plain(initial)
            self._step = _PLAIN
            return "334 "
        if mechanism == "LOGIN":
            if initial:
                return self._login_user(initial)
            self._step = _USER
            return "334 VXNlcm5hbWU6"  # "Username:"
        return "504 5.5.4 Error: unsupported authentication mechanism"

    def answer(self, line: str) -> CheckCredentials | str:
        step, self._step = self._step, None
        if line.strip() == "*":
            return "501 5.7.0 Error: authentication cancelled"
        if step == _PLAIN:
            return _plain(line)
        if step == _USER:
            return self._login_user(line)
        password = _b64(line)
        if password is None:
            return "501 5.5.2 Error: invalid base64 data"
        return CheckCredentials(self._user, password)

    def _login_user(self, line: str) -> str:
        user = _b64(line)
        if user is None:
            return "501 5.5.2 Error: invalid base64 data"
        self._user = user
        self._step = _PASSWORD
        return "334 UGFzc3dvcmQ6"  # "Password:"


def _plain(line: str) -> CheckCredentials | str:
    decoded = _b64(line)
    parts = decoded.split("\0") if decoded is not None else []
    if len(parts) != 3 or not parts[1]:
        return "501 5.5.2 Error: invalid PLAIN credentials"
    return CheckCredentials(parts[1], parts[2])


def _b64(text: str) -> str | None:
    try:
        return base64.b64decode(text.strip(), validate=True).decode("utf-8")
    except ValueError:  # not base64 (binascii.Error), not ASCII, or not UTF-8
        return None
