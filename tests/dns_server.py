"""A real, authoritative-only DNS server on loopback (UDP and TCP) serving zone data set from
Python, for tests. It answers only from its own data and never forwards anything.

    with DnsServer() as dns:
        dns.add("example.org", "MX", "10 mx1.example.org", ttl=300)
        dns.add("mx1.example.org", "A", "127.0.0.2")
        dns.servfail("broken.test")  # SERVFAIL for any type
        dns.refuse("refused.test")  # REFUSED for any type
        dns.drop("slow.test")  # no answer at all: the client times out
        resolver_nameservers = [("127.0.0.1", dns.port)]  # or the config form: dns.address
        assert ("example.org", "MX") in dns.queries

    DnsServer(port=53, host="127.0.53.1")  # where a resolv.conf can point (Postfix's smtpd)

Any other name is NXDOMAIN; a known name without the asked type is NODATA. Negative answers
carry an SOA whose TTL and minimum are `soa_ttl`, so clients derive their negative TTL from it.
CNAMEs are followed within the data, as an authoritative server does for in-zone targets.
Records go out in the order they were added (real servers often rotate them).
Names are case-insensitive; the data may change while the server runs.
"""

from __future__ import annotations

import socket
import socketserver
import struct
import threading

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdata
import dns.rdataclass
import dns.rdatatype
import dns.rrset

_IN = dns.rdataclass.IN
_MAX_CHAIN = 8


def _name(text: str) -> dns.name.Name:
    return dns.name.from_text(text)  # absolute; Name compares and hashes case-insensitively


class DnsServer:
    def __init__(self, port: int = 0, host: str = "127.0.0.1") -> None:
        self.host = host
        self.soa_ttl = 60
        self.queries: list[tuple[str, str]] = []  # (lower-case name, type) in arrival order
        self._requested_port = port
        self._records: dict[dns.name.Name, dict[int, list[tuple[int, dns.rdata.Rdata]]]] = {}
        self._rcodes: dict[dns.name.Name, dns.rcode.Rcode] = {}
        self._dropped: set[dns.name.Name] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()  # set by stop(); releases held TCP queries
        self._servers: list[socketserver.BaseServer] = []

    # -- zone data ---------------------------------------------------------------------

    def add(self, name: str, rdtype: str, rdata: str, ttl: int = 300) -> None:
        """Add one record; relative names in `rdata` are taken as absolute ("mx1.example.org")."""
        rd = dns.rdata.from_text(_IN, rdtype, rdata, origin=dns.name.root, relativize=False)
        with self._lock:
            self._records.setdefault(_name(name), {}).setdefault(rd.rdtype, []).append((ttl, rd))

    def remove(self, name: str, rdtype: str | None = None) -> None:
        """Remove the name's records of one type, or everything about it, servfail() and drop()
        included (the name becomes NXDOMAIN)."""
        with self._lock:
            if rdtype is None:
                self._records.pop(_name(name), None)
                self._rcodes.pop(_name(name), None)
                self._dropped.discard(_name(name))
            else:
                self._records.get(_name(name), {}).pop(dns.rdatatype.from_text(rdtype), None)

    def servfail(self, name: str) -> None:
        self._rcodes[_name(name)] = dns.rcode.SERVFAIL

    def refuse(self, name: str) -> None:
        self._rcodes[_name(name)] = dns.rcode.REFUSED

    def drop(self, name: str) -> None:
        self._dropped.add(_name(name))

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._servers[0].server_address[1]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> DnsServer:
        self._servers = list(self._bind())
        for server in self._servers:
            threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        for server in self._servers:
            server.shutdown()
            server.server_close()

    def __enter__(self) -> DnsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _bind(self) -> tuple[_UdpServer, _TcpServer]:
        # UDP and TCP on the same port; with an ephemeral port, TCP may find it taken.
        for _ in range(20):
            udp = _UdpServer((self.host, self._requested_port), self)
            try:
                tcp = _TcpServer((self.host, udp.server_address[1]), self)
            except OSError:
                udp.server_close()
                if self._requested_port:
                    raise
                continue
            return udp, tcp
        raise OSError("no port free for both UDP and TCP")

    # -- answering ---------------------------------------------------------------------

    def answer(self, wire: bytes) -> bytes | None:
        """The response to one query in wire format, or None to stay silent."""
        try:
            query = dns.message.from_wire(wire)
            question = query.question[0]
        except (dns.exception.DNSException, IndexError):
            return None
        qname, qtype = question.name, question.rdtype
        self.queries.append(
            (qname.to_text(omit_final_dot=True).lower(), dns.rdatatype.to_text(qtype))
        )
        if qname in self._dropped:
            return None
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        with self._lock:
            self._resolve(response, qname, qtype)
        return response.to_wire(want_shuffle=False)  # in the order added: tests can rely on it

    def _resolve(self, response: dns.message.Message, qname: dns.name.Name, qtype: int) -> None:
        name = qname
        for _ in range(_MAX_CHAIN):
            if name in self._rcodes:
                response.set_rcode(self._rcodes[name])
                return
            node = self._records.get(name)
            if node is None:
                response.set_rcode(dns.rcode.NXDOMAIN)
                break
            if qtype in node:
                response.answer.append(_rrset(name, qtype, node[qtype]))
                return
            cname = node.get(dns.rdatatype.CNAME)
            if cname is None:
                break  # NODATA
            response.answer.append(_rrset(name, dns.rdatatype.CNAME, cname))
            name = cname[0][1].target
        response.authority.append(self._soa())

    def _soa(self) -> dns.rrset.RRset:
        # At the root, so it is a superdomain of every name (clients look for one).
        text = f"ns.test. hostmaster.test. 1 3600 600 86400 {self.soa_ttl}"
        return dns.rrset.from_text(dns.name.root, self.soa_ttl, _IN, "SOA", text)


def _rrset(
    name: dns.name.Name, rdtype: int, records: list[tuple[int, dns.rdata.Rdata]]
) -> dns.rrset.RRset:
    rrset = dns.rrset.RRset(name, _IN, rdtype)
    for ttl, rd in records:
        rrset.add(rd, ttl)  # an RRset has one TTL: the lowest wins
    return rrset


class _UdpServer(socketserver.UDPServer):
    def __init__(self, address: tuple[str, int], dns: DnsServer) -> None:
        self.dns = dns
        super().__init__(address, _UdpHandler)


class _UdpHandler(socketserver.BaseRequestHandler):
    server: _UdpServer

    def handle(self) -> None:
        data, sock = self.request
        response = self.server.dns.answer(data)
        if response is not None:
            sock.sendto(response, self.client_address)


class _TcpServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True

    def __init__(self, address: tuple[str, int], dns: DnsServer) -> None:
        self.dns = dns
        super().__init__(address, _TcpHandler)


class _TcpHandler(socketserver.BaseRequestHandler):
    server: _TcpServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        while (length := _recv_exactly(sock, 2)) is not None:
            wire = _recv_exactly(sock, struct.unpack("!H", length)[0])
            if wire is None:
                return
            response = self.server.dns.answer(wire)
            if response is None:
                self.server.dns._stopping.wait()  # hold the connection: the client times out
                return
            sock.sendall(struct.pack("!H", len(response)) + response)


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data
