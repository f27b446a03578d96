"""MTA-STS I/O (RFC 8461): the `_mta-sts` TXT lookup through the daemon's resolver, the
HTTPS fetch of the policy (aiohttp), the cache in memory and in the state file.

The decisions are policy/mta_sts.py's. Looked up when a recipient domain's MX route is
(placement.resolve), off the delivery hot path: once per domain while its policy is cached,
and one fetch shared by every delivery that needs it.

    Policies(cfg, context, resolver, state, clock)
    .applied(domain) -> Applied | None (async)   the policy a delivery goes by
    .load() / .close() (async) / .reconfigure(cfg, context)
    .prune(now)          expired policies and past failure marks go (the upkeep's sweep)
    .sizes() -> {name: entries}

In memory: each domain's policy until it expires (max_age, at most a year: RFC 8461
keeps an enforce policy that long), at most CACHE_KEPT of them (those fetched longest
ago go first); a failed fetch's mark for FETCH_RETRY.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import aiohttp.abc
import msgspec

from .. import config
from ..logs import get_logger
from ..policy.mta_sts import (
    NONE,
    POLICY_SIZE_LIMIT,
    WELL_KNOWN,
    Fetch,
    Policy,
    after_fetch,
    eligible,
    parse_policy,
    parse_record,
    plan,
)
from ..policy.tls_report import Session, fetch_result_type
from ..routing.resolver import Resolver, Route, RouteFailure
from ..routing.sts import Applied
from ..spool import statefile

log = get_logger("delivery")

# After a failed fetch, deliveries go by what is cached for this long before the next
# try: a policy host that is down is not asked again by every message.
FETCH_RETRY = 60.0
# Policies cached at most: a year of max_age over every domain ever mailed is too many.
CACHE_KEPT = 50_000

_STATE = msgspec.json.Decoder(dict[str, Policy])


def tls_context(cfg: config.MtaStsConfig) -> ssl.SSLContext:
    """What policy hosts' and enforced MX hosts' certificates must chain to (and name):
    mta_sts.ca_file, or the system's CA store. Raises ConfigError."""
    try:
        return ssl.create_default_context(cafile=cfg.ca_file or None)
    except (OSError, ssl.SSLError) as exc:
        raise config.ConfigError(f"mta_sts.ca_file: cannot load {cfg.ca_file}: {exc}") from None


class Policies:
    """Each recipient domain's MTA-STS policy, as deliveries go by it."""

    def __init__(
        self,
        cfg: config.MtaStsConfig,
        context: ssl.SSLContext,
        resolver: Resolver,
        state: Path | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.resolver = resolver
        self._state = state  # None: kept in memory only
        self._clock = clock
        self._cache: dict[str, Policy] = {}
        self._failed: dict[str, float] = {}  # domain -> no fetch before
        self._in_flight: dict[str, asyncio.Task[Policy | None]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._saved = b""
        # A failed fetch that leaves the domain without a policy (TLS-RPT counts it)
        self.on_failure: Callable[[Session], None] | None = None
        self.reconfigure(cfg, context)

    def reconfigure(self, cfg: config.MtaStsConfig, context: ssl.SSLContext) -> None:
        """`context`: tls_context(cfg), made by the caller before it changes anything."""
        self.cfg, self.context = cfg, context
        if self._session is not None:  # the next fetch trusts the new CAs
            session, self._session = self._session, None
            asyncio.get_running_loop().create_task(session.close())

    def load(self) -> None:
        """The policies cached before a restart (an enforce policy must survive one)."""
        if self._state is None:
            return
        try:
            data = statefile.read(self._state)
            self._cache = _STATE.decode(data) if data else {}
        except (OSError, msgspec.DecodeError) as exc:  # refetched when next needed
            log.warning("mta_sts_state_unreadable", error=str(exc))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def applied(self, domain: str) -> Applied | None:
        """The policy a delivery to `domain`'s MX hosts goes by; None: none (not
        published, mode none, not fetched and none cached, or mta_sts.enabled false)."""
        if not self.cfg.enabled:
            return None
        texts = await self.resolver.txt(f"_mta-sts.{domain}")
        record_id = parse_record(list(texts)) if texts else None
        now = self._clock()
        cached = self._cache.get(domain)
        decided = plan(cached, record_id, now)
        if isinstance(decided, Fetch):
            if self._failed.get(domain, 0.0) > now:
                decided = after_fetch(cached, None, now)
            else:
                decided = await self._shared_fetch(domain, decided.id)
        if decided is None or decided.mode == NONE:
            return None
        return Applied(domain, decided.mode, decided.mx, decided.id, decided.max_age)

    def prune(self, now: float) -> None:
        self._failed = {d: t for d, t in self._failed.items() if t > now}
        cache = [(d, p) for d, p in self._cache.items() if not p.expired(now)]
        if len(cache) > CACHE_KEPT:
            cache = sorted(cache, key=lambda entry: entry[1].fetched)[-CACHE_KEPT:]
        self._cache = dict(cache)

    def sizes(self) -> dict[str, int]:
        return {"mta_sts_policies": len(self._cache), "mta_sts_failures": len(self._failed)}

    async def _shared_fetch(self, domain: str, ident: str) -> Policy | None:
        task = self._in_flight.get(domain)
        if task is None:
            task = self._in_flight[domain] = asyncio.create_task(self._refresh(domain, ident))
            task.add_done_callback(lambda _: self._in_flight.pop(domain, None))
        # Shielded: a cancelled delivery must not cancel the fetch others wait for.
        return await asyncio.shield(task)

    async def _refresh(self, domain: str, ident: str) -> Policy | None:
        fetched = await self._fetch(domain, ident)
        now = self._clock()
        cached = self._cache.get(domain)
        kept = after_fetch(cached, fetched, now)
        if fetched is None:
            self._failed[domain] = now + FETCH_RETRY
        else:
            self._failed.pop(domain, None)
            log.info(
                "mta_sts_policy",
                domain=domain,
                id=fetched.id,
                mode=fetched.mode,
                mx=list(fetched.mx),
                max_age=fetched.max_age,
            )
        if kept is None:
            self._cache.pop(domain, None)
        else:
            self._cache[domain] = kept
        await self._save(now)
        return kept

    async def _fetch(self, domain: str, ident: str) -> Policy | None:
        """GET https://mta-sts.<domain>/.well-known/mta-sts.txt: no redirects (RFC 8461
        3.3), 200 and text/plain only, at most 64 KiB; None (logged) when it fails."""
        port = self.cfg.https_port
        authority = f"mta-sts.{domain}" + ("" if port == 443 else f":{port}")
        url = f"https://{authority}{WELL_KNOWN}"
        invalid = False
        try:
            text = await asyncio.wait_for(self._get(url), self.cfg.fetch_timeout)
            policy = parse_policy(text, ident, self._clock())
            invalid = isinstance(policy, str)
        except TimeoutError:
            policy = f"no answer within {self.cfg.fetch_timeout:g}s"
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            policy = str(exc) or type(exc).__name__
        if isinstance(policy, str):
            kept = domain in self._cache and not self._cache[domain].expired(self._clock())
            log.warning("mta_sts_fetch_failed", domain=domain, url=url, error=policy, kept=kept)
            if not kept and self.on_failure is not None:
                kind = fetch_result_type(policy, invalid)
                self.on_failure(Session(domain, None, "", "", kind, policy[:300]))
            return None
        return policy

    async def _get(self, url: str) -> str:
        async with self._client().get(url, allow_redirects=False) as response:
            if response.status != 200:
                raise ValueError(f"HTTP {response.status} (only 200 is a policy)")
            if response.content_type != "text/plain":
                raise ValueError(f"Content-Type {response.content_type}, not text/plain")
            body = b""
            async for chunk in response.content.iter_chunked(16384):
                body += chunk
                if len(body) > POLICY_SIZE_LIMIT:
                    raise ValueError(f"larger than {POLICY_SIZE_LIMIT} bytes")
        return body.decode("utf-8")  # a UnicodeDecodeError is a ValueError

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = https_client(self.context, self.resolver)
        return self._session

    async def _save(self, now: float) -> None:
        if self._state is None:
            return
        self._cache = {d: p for d, p in self._cache.items() if not p.expired(now)}
        data = msgspec.json.encode(self._cache)
        self._saved = await statefile.save_changed(
            self._state,
            data,
            self._saved,
            lambda exc: log.warning("mta_sts_state_save_failed", error=str(exc)),
        )


def https_client(context: ssl.SSLContext, resolver: Resolver) -> aiohttp.ClientSession:
    """An HTTPS client that trusts `context` and resolves names through the daemon's
    resolver (policy hosts here, TLS-RPT collectors in tls_reports.py)."""
    connector = aiohttp.TCPConnector(ssl=context, resolver=_PolicyHostResolver(resolver))
    return aiohttp.ClientSession(connector=connector)


def restricted(route: Route | RouteFailure, sts: Applied | None) -> Route | RouteFailure:
    """The route with the domain's MTA-STS policy: in enforce mode only the MX hosts it
    lists (none: deferred, never a host it does not list); unlisted hosts are logged."""
    if sts is None or isinstance(route, RouteFailure):
        return route
    names, unlisted = eligible(sts, [h.name for h in route.hosts])
    for host in unlisted:
        action = "delivered as usual" if host in names else "host skipped"
        violation(sts, host, "MX host not listed in the policy", action)
    hosts = tuple(h for h in route.hosts if h.name in names)
    if not hosts:
        listed = " ".join(sts.mx)
        text = f"{sts.domain}: no MX host matches its MTA-STS policy (mx: {listed}); deferred"
        return RouteFailure(False, "4.7.5", text, network="tls")
    return msgspec.structs.replace(route, hosts=hosts, sts=sts)


def violation(sts: Applied, host: str, reason: str, action: str, ip: str | None = None) -> None:
    """Log what enforce mode refuses (`action`: what came of it)."""
    log.warning(
        "mta_sts_violation",
        domain=sts.domain,
        mode=sts.mode,
        policy_id=sts.id,
        host=host,
        ip=ip,
        reason=reason,
        action=action,
    )


class _PolicyHostResolver(aiohttp.abc.AbstractResolver):
    """aiohttp resolves mta-sts.<domain> (and TLS-RPT collectors) through the daemon's
    resolver (dns.nameservers), as the MX hosts are."""

    def __init__(self, resolver: Resolver) -> None:
        self._resolver = resolver

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[aiohttp.abc.ResolveResult]:
        addresses = await self._resolver.addresses(host)
        if not addresses:
            raise OSError(f"{host}: no address")
        return [
            aiohttp.abc.ResolveResult(
                hostname=host,
                host=address,
                port=port,
                family=socket.AF_INET6 if ":" in address else socket.AF_INET,
                proto=0,
                flags=socket.AI_NUMERICHOST,
            )
            for address in addresses
        ]

    async def close(self) -> None:
        pass
