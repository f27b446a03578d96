"""Helpers the benchmark programs share: a work directory, the load options, stopping a child.

The programs import it from this directory (`sys.path` holds bench/ when one of them runs).
`stop_process` is the tests' (tests/postfix_tools.py), which the benchmarks use anyway.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from postfix_tools import stop_process as stop_process  # re-exported: the benchmarks' too

REPO = Path(__file__).resolve().parent.parent


def byte_compiled(package: Path = REPO / "mtaqueue") -> None:
    """Compile the tree's modules, as installing it does (pip writes each module's .pyc):
    a daemon started from a checkout with PYTHONDONTWRITEBYTECODE set would compile its
    ~200 modules at every start, 0.2 s that an installed daemon never spends."""
    compileall.compile_dir(package, quiet=1)


@contextlib.contextmanager
def work_directory(prefix: str, keep: bool = False) -> Iterator[Path]:
    """A new directory under $BENCH_DIR (default: the system's temp directory), removed on
    leaving the block unless `keep` (then its path is printed). It is made 0755 (mkdtemp()
    makes 0700): Postfix's own user must reach a queue inside it. The tree is byte-compiled
    first (`byte_compiled`): every daemon a bench starts runs as an installed one."""
    byte_compiled()
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=os.environ.get("BENCH_DIR")))
    path.chmod(0o755)
    try:
        yield path
    finally:
        if keep:
            print(f"work directory kept: {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


def load_parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by the first line of `doc`, with the options of the throughput
    benchmarks: smtp-source's load (-m, -s, -l) and how many alternating rounds to run."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--messages", type=int, default=10000)
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    return parser


def tree_pids(root: int) -> list[int]:
    """`root` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])  # after "(comm)", which may hold spaces
        children.setdefault(ppid, []).append(int(entry))
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo += children.get(pid, [])
    return pids


MTAQUEUE_CHILDREN = {"writer": b"mtaqueue.spool.writer", "listener": b"mtaqueue.listener_main"}


def mtaqueue_children(daemon: int) -> dict[str, int]:
    """The daemon's child processes by role ("writer", "listener"), from their command lines."""
    found = {}
    for pid in tree_pids(daemon)[1:]:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        found |= {role: pid for role, module in MTAQUEUE_CHILDREN.items() if module in cmdline}
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now. Benchmarks of other work may run on the same
    machine at the same time: a fixed port could be theirs (and their mail ours)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """True when something already accepts connections on host:port (IPv4 or IPv6)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(1)
        return sock.connect_ex((host, port)) == 0


def dkim_key(workdir: Path, algorithm: str) -> Path:
    """A private key file (PEM) in `workdir`, made on first use: RSA 2048 bits for
    "rsa-sha256", else Ed25519."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

    path = workdir / f"dkim-{algorithm}.pem"
    if not path.exists():
        if algorithm == "rsa-sha256":
            key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        else:
            key = ed25519.Ed25519PrivateKey.generate()
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        path.write_bytes(pem)
        path.chmod(0o600)
    return path


def print_checks(columns: list[str], rows: list[tuple[str, list[str], bool]]) -> int:
    """A Markdown table of checks (number, cells, ok), then the verdict; the exit status:
    1 if a check failed, else 0."""
    print("\n| # | " + " | ".join(columns) + " | |")
    print("| --- " * (len(columns) + 2) + "|")
    for number, cells, ok in rows:
        row = [number, *cells, "ok" if ok else "FAIL"]
        print("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
    failed = [number for number, _, ok in rows if not ok]
    print("all checks pass" if not failed else f"FAILED: {', '.join(failed)}", flush=True)
    return 1 if failed else 0
