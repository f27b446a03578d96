"""The client side of each relay (routing/relays.py): its password and its TLS context.

Read at start and at each reload, so that a wrong path or an unreadable file stops the start
(or is refused by the reload) with the key's name, rather than deferring mail for hours.
The password is kept in memory only, and never logged.
"""

from __future__ import annotations

import ssl

from ..config import ConfigError
from ..routing.relays import Relay, Relays
from ..smtp.client import Smarthost


def load(relays: Relays) -> dict[str, Smarthost]:
    """The Smarthost of each relay, by destination key. Raises ConfigError."""
    contexts: dict[str, ssl.SSLContext] = {}  # by CA file: each loaded once
    smarthosts = {}
    for key, relay in relays.by_key().items():
        context = None
        if relay.tls:
            if relay.ca_file not in contexts:
                contexts[relay.ca_file] = _context(relay)
            context = contexts[relay.ca_file]
        password = _password(relay) if relay.user else ""
        smarthosts[key] = Smarthost(relay.tls, context, relay.user, password, relay.ca_file)
    return smarthosts


def _password(relay: Relay) -> str:
    path = relay.password_file
    where = f"{relay.source}.relay_password_file"
    try:
        with open(path, encoding="utf-8") as f:
            password = f.readline().rstrip("\r\n")
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: {path} is not UTF-8") from None
    if not password:
        raise ConfigError(f"{where}: the first line of {path} is empty")
    return password


def _context(relay: Relay) -> ssl.SSLContext:
    """Verifies the smarthost's certificate chain and name (a named host, and often a
    password behind it): against the system's CA store, or only the CAs of relay_tls_ca."""
    try:
        return ssl.create_default_context(cafile=relay.ca_file or None)
    except (OSError, ssl.SSLError) as exc:
        where = f"{relay.source}.relay_tls_ca"
        raise ConfigError(f"{where}: cannot load {relay.ca_file}: {exc}") from None
