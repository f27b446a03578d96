"""Debian's Exim 4, fetched and unpacked for the tests, never installed.

    ensure_exim(cache=CACHE) -> EximBinary     fetch and unpack it once, then reuse it
    find_exim(cache=CACHE) -> EximBinary | None
    EximBinary(path, libraries, version)       .env(): the environment to run it with
    EximUnavailable                            why it cannot be had here
    python3 tests/exim_fetch.py                the same from a shell (.ci/run)

Debian's ``exim4-daemon-*`` packages conflict with ``postfix`` (both provide
mail-transport-agent), and a private Postfix runs in other tests: installing Exim would
remove it. So ``apt-get download`` fetches ``exim4-daemon-light`` and those of its
``lib*`` dependencies that are not installed (on bookworm: ``libidn12``), without
installing anything, and ``dpkg-deb -x`` unpacks them into ``CACHE/root`` (by default
``/var/cache/mtaqueue-tests/exim4``, or ``$MTAQUEUE_EXIM_CACHE``: a place the unprivileged
user Exim runs as can reach, which a clone under /root is not). ``apt-get update`` runs
first when the package lists do not have it (a fresh machine). Needs root.

Two changes are made to the unpacked binary, and to nothing else:

- the setuid bit is removed: it is only ever run by root (the tests) or by itself;
- its compiled-in user and group, ``Debian-exim`` (``EXIM_USER=ref:Debian-exim``, looked
  up when it starts, before any configuration is read), which exists only where the
  ``exim4-base`` package created it, becomes ``daemon`` (present in every Debian, user
  and group). The configuration then names the user it really runs as (``exim_user``,
  tests/exim_instance.py). That string is the only byte changed, NUL-padded in place;
  the SMTP code is Debian's as shipped.

Nothing under /etc, /var/spool or /var/log is read for configuration or written: the
configuration, spool and logs are each instance's own (``-C``, tests/exim_instance.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("MTAQUEUE_EXIM_CACHE", "/var/cache/mtaqueue-tests/exim4"))
PACKAGE = "exim4-daemon-light"
BINARY = "usr/sbin/exim4"
COMPILED_USER = b"\0Debian-exim\0"  # EXIM_USER and EXIM_GROUP share the string
RUN_USER = b"daemon"  # a user and a group of that name exist in every Debian
DONE = ".complete"


class EximUnavailable(RuntimeError):
    """Exim cannot be fetched or run here; the text says why."""


@dataclass(frozen=True)
class EximBinary:
    path: Path  # the unpacked exim4
    libraries: tuple[Path, ...]  # directories of the unpacked libraries it needs
    version: str  # the Debian package's version, e.g. 4.96-15+deb12u11

    def env(self) -> dict[str, str]:
        """An environment to run it in: this one, with the unpacked libraries found.
        (The configuration must keep LD_LIBRARY_PATH, ``keep_environment``: Exim clears
        its environment and re-executes itself.)"""
        env = dict(os.environ)
        if self.libraries:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(map(str, self.libraries))
        return env


def find_exim(cache: Path = CACHE) -> EximBinary | None:
    """The unpacked Exim in cache, if a complete one is there."""
    root = cache / "root"
    binary = root / BINARY
    if not (root / DONE).is_file() or not os.access(binary, os.X_OK):
        return None
    return EximBinary(binary, _library_dirs(root), (root / DONE).read_text().strip())


def ensure_exim(cache: Path = CACHE) -> EximBinary:
    """The unpacked Exim, fetched and unpacked first if missing (one process at a time:
    xdist workers wait on a lock). Raises EximUnavailable saying why it cannot be had."""
    found = find_exim(cache)
    if found is not None:
        return found
    if os.geteuid() != 0:
        raise EximUnavailable(f"no unpacked Exim in {cache}, and fetching it needs root")
    missing = [tool for tool in ("apt-get", "dpkg-deb", "dpkg-query") if not shutil.which(tool)]
    if missing:
        raise EximUnavailable(f"no unpacked Exim in {cache}, and {', '.join(missing)} missing")
    cache.mkdir(parents=True, exist_ok=True)
    cache.chmod(0o755)  # the user Exim runs as executes it again
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = find_exim(cache)  # another process may have done it meanwhile
        if found is None:
            _fetch(cache)
            found = find_exim(cache)
    if found is None:
        raise EximUnavailable(f"unpacking Exim into {cache} left no usable binary")
    return found


def _fetch(cache: Path) -> None:
    with tempfile.TemporaryDirectory(dir=cache, prefix="fetch-") as tmp:
        debs, root = Path(tmp) / "debs", Path(tmp) / "root"
        debs.mkdir()
        with contextlib.suppress(KeyError):  # apt drops to _apt to download: let it write
            os.chown(debs, pwd.getpwnam("_apt").pw_uid, -1)
        (deb,) = _download([PACKAGE], debs)
        version = _run(["dpkg-deb", "-f", str(deb), "Version"]).strip()
        libraries = _missing_libraries(_run(["dpkg-deb", "-f", str(deb), "Depends"]))
        extra = _download(libraries, debs) if libraries else []
        for package in (deb, *extra):
            _run(["dpkg-deb", "-x", str(package), str(root)])
        binary = root / BINARY
        binary.chmod(0o755)  # not setuid
        _patch_user(binary)
        _check_links(binary, _library_dirs(root))
        root.chmod(0o755)
        (root / DONE).write_text(f"{version}\n")
        shutil.rmtree(cache / "root", ignore_errors=True)  # an incomplete earlier attempt
        root.rename(cache / "root")


def _download(packages: list[str], directory: Path) -> list[Path]:
    """``apt-get download`` the packages into directory; ``apt-get update`` first if the
    package lists lack them (a fresh machine) or name files no longer there."""
    command = ["apt-get", "download", "-q", *packages]
    try:
        _run(command, cwd=directory)
    except EximUnavailable:
        _run(["apt-get", "update", "-q"])
        _run(command, cwd=directory)
    found = [next(directory.glob(f"{name}_*.deb"), None) for name in packages]
    if None in found:
        raise EximUnavailable(f"apt-get download left no .deb for {packages} in {directory}")
    return found  # type: ignore[return-value]


def _missing_libraries(depends: str) -> list[str]:
    """The lib* packages among Depends (first of each alternative) not installed here."""
    names = [re.split(r"[\s(:]", alt.split("|")[0].strip())[0] for alt in depends.split(",")]
    missing = []
    for name in names:
        if not name.startswith("lib"):
            continue  # exim4-base, debconf: not needed to run the binary
        status = subprocess.run(
            ["dpkg-query", "-W", "-f=${db:Status-Status}", name],
            capture_output=True,
            text=True,
            check=False,
        )
        if status.stdout.strip() != "installed":
            missing.append(name)
    return missing


def _patch_user(binary: Path) -> None:
    data = binary.read_bytes()
    if data.count(COMPILED_USER) != 1:
        raise EximUnavailable(
            f"{binary}: expected the compiled-in user {COMPILED_USER!r} exactly once, found "
            f"{data.count(COMPILED_USER)}: another build of Exim, look at its EXIM_USER"
        )
    padded = b"\0" + RUN_USER + b"\0" * (len(COMPILED_USER) - len(RUN_USER) - 1)
    binary.write_bytes(data.replace(COMPILED_USER, padded))


def _library_dirs(root: Path) -> tuple[Path, ...]:
    return tuple(sorted({p.parent for p in root.glob("usr/lib/**/*.so*")}))


def _check_links(binary: Path, libraries: tuple[Path, ...]) -> None:
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(map(str, libraries)))
    output = _run(["ldd", str(binary)], env=env)
    if "not found" in output:
        raise EximUnavailable(f"{binary} still lacks libraries after unpacking:\n{output}")


def _run(command: list[str], **kwargs) -> str:
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=300,
            check=False,
            **kwargs,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EximUnavailable(f"{' '.join(command)}: {exc}") from exc
    if done.returncode != 0:
        raise EximUnavailable(
            f"{' '.join(command)} failed (exit {done.returncode}):\n{done.stderr.strip()}"
        )
    return done.stdout


if __name__ == "__main__":
    try:
        exim = ensure_exim()
    except EximUnavailable as exc:
        sys.exit(f"exim_fetch: {exc}")
    print(f"Exim {exim.version}: {exim.path}")
