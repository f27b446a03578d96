"""MTA-STS test fixtures: a test CA (cryptography) and an HTTPS policy server on loopback.

`TestCa` issues server certificates for any names; the daemon trusts it through
mta_sts.ca_file. `PolicyServer` is an aiohttp server with its own event loop in a thread (as
the SMTP peers are), serving /.well-known/mta-sts.txt for each "mta-sts.<domain>" by its
Host header from `policies`, counting the fetches in `requests`; it is a TLS-RPT
collector too: what is POSTed to /tlsrpt goes in `reports` (Content-Type, body).
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import threading
from pathlib import Path

from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


class TestCa:
    __test__ = False  # not a pytest class

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(_name("mtaqueue test CA"))
            .issuer_name(_name("mtaqueue test CA"))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.path = directory / "ca.pem"
        self.path.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def server_context(self, *names: str) -> ssl.SSLContext:
        """A server-side TLS context with a certificate for `names` signed by this CA."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*self.issue(*names))
        return context

    def issue(self, *names: str) -> tuple[Path, Path]:
        """PEM files (certificate, key) for `names` (and 127.0.0.1) signed by this CA, in
        its directory: for servers that read files (Postfix, openssl s_server)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        sans: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
        sans.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(names[0]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        cert_path = self.directory / f"{names[0]}.crt"
        key_path = self.directory / f"{names[0]}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(_pem_key(key))
        return cert_path, key_path


def policy_text(mode: str, *mx: str, max_age: int = 86400) -> str:
    lines = ["version: STSv1", f"mode: {mode}", *(f"mx: {m}" for m in mx), f"max_age: {max_age}"]
    return "\r\n".join(lines) + "\r\n"


class PolicyServer:
    def __init__(self, host: str, context: ssl.SSLContext) -> None:
        self.host = host
        self.context = context
        self.policies: dict[str, str] = {}  # domain -> policy file
        self.requests: list[str] = []  # the domain of each fetch
        self.reports: list[tuple[str, bytes]] = []  # TLS-RPT POSTs: (Content-Type, body)
        self.report_status = 201  # another: the POST is refused (not kept in `reports`)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def start(self) -> PolicyServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/.well-known/mta-sts.txt", self._policy)
        app.router.add_post("/tlsrpt", self._report)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0, ssl_context=self.context)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _policy(self, request: web.Request) -> web.Response:
        domain = request.host.partition(":")[0].removeprefix("mta-sts.")
        self.requests.append(domain)
        text = self.policies.get(domain)
        if text is None:
            return web.Response(status=404)
        return web.Response(text=text, content_type="text/plain")

    async def _report(self, request: web.Request) -> web.Response:
        body = await request.read()
        if self.report_status < 300:
            self.reports.append((request.headers.get("Content-Type", ""), body))
        return web.Response(status=self.report_status)
