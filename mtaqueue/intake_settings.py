"""What the daemon's intake (the SMTP listener and the HTTP API) takes from a config.

    listener_settings(cfg, hostname) -> ListenerSettings   # sessions, limits, submission
    tls_context(cfg) -> ssl.SSLContext | None              # listen.tls_cert / tls_key
    credentials(cfg) -> Credentials | None                 # listen.auth_file
    api_tokens(cfg) -> (Tokens | None, warnings)           # api.tokens_file

Built before any I/O, at start and (but the TLS context and credentials) at each SIGHUP;
a file that cannot be read raises config.ConfigError naming its key.
"""

from __future__ import annotations

import ipaddress
import ssl

from . import config
from .api.tokens import Tokens, load_tokens
from .policy.fairness import class_order
from .smtp.auth import Credentials, load_auth_file
from .smtp.listener import ListenerSettings
from .smtp.session_settings import SessionSettings
from .submission import SubmissionSettings


def listener_settings(cfg: config.Config, hostname: str) -> ListenerSettings:
    host, port = config.split_host_port(cfg.listen.address, min_port=0)
    exceptions = [
        n
        for entry in cfg.listen.client_limit_exceptions
        for n in (cfg.listen.mynetworks if entry == "mynetworks" else [entry])
    ]
    return ListenerSettings(
        host=host,
        port=port,
        mynetworks=tuple(ipaddress.ip_network(n, strict=False) for n in cfg.listen.mynetworks),
        max_connections=cfg.listen.max_connections,
        max_connections_per_client=cfg.listen.max_connections_per_client,
        client_limit_exceptions=tuple(ipaddress.ip_network(n, strict=False) for n in exceptions),
        command_timeout=cfg.listen.command_timeout,
        stress_command_timeout=cfg.listen.stress_command_timeout,
        data_timeout=cfg.listen.data_timeout,
        stress_data_timeout=cfg.listen.stress_data_timeout,
        min_data_rate=cfg.listen.min_data_rate,
        session=SessionSettings(
            hostname=hostname,
            max_message_size=cfg.listen.max_message_size,
            max_recipients=cfg.listen.max_recipients,
            bare_newline=cfg.listen.bare_newline,
            max_line_length=cfg.listen.max_line_length,
            stream_threshold=cfg.spool.stream_threshold,
            tls_available=bool(cfg.listen.tls_cert),
            auth_available=bool(cfg.listen.auth_file),
            auth_required=cfg.listen.auth_required,
        ),
        submission=SubmissionSettings(
            hostname=hostname,
            classes=tuple(class_order({n: c.priority for n, c in cfg.classes.items()})),
            default_class=cfg.submission.default_class,
            tenant_header=cfg.submission.tenant_header.lower().encode(),
        ),
    )


def tls_context(cfg: config.Config) -> ssl.SSLContext | None:
    if not cfg.listen.tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cfg.listen.tls_cert, cfg.listen.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise config.ConfigError(f"listen.tls_cert: cannot load certificate/key: {exc}") from None
    return context


def api_tokens(cfg: config.Config) -> tuple[Tokens | None, list[str]]:
    """The API's tokens and warnings about their file; None while the API is off."""
    if not cfg.api.address:
        return None, []
    try:
        return load_tokens(cfg.api.tokens_file)
    except (OSError, ValueError) as exc:
        raise config.ConfigError(f"api.tokens_file: {exc}") from None


def credentials(cfg: config.Config) -> Credentials | None:
    if not cfg.listen.auth_file:
        return None
    try:
        return Credentials(load_auth_file(cfg.listen.auth_file))
    except (OSError, ValueError) as exc:
        raise config.ConfigError(f"listen.auth_file: {exc}") from None
