"""Fixtures for every test file.

    start_daemon("section.key=value", ..., config=, workdir=, env=) -> DaemonProcess
    daemon -> a DaemonProcess started with the test defaults
    postfix_installed (session): root and Debian's postfix package (installed if
        missing: tests/install_postfix.sh), or the test fails
    exim_available (session) -> EximBinary: Debian's Exim unpacked (fetched if missing),
        or the test fails

Subprocesses import this tree (PYTHONPATH), and hypothesis has no deadline.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from daemon_process import DaemonProcess
from exim_fetch import EximBinary, EximUnavailable, ensure_exim
from hypothesis import settings
from postfix_tools import POSTFIX_TOOLS

from mtaqueue.spool.layout import SpoolLayout

# Properties check behaviour, not speed: hypothesis' per-example deadline (200 ms) would
# turn a loaded CI machine into failures. Speed belongs in bench/.
settings.register_profile("mtaqueue", deadline=None)
settings.load_profile("mtaqueue")

# Every subprocess a test starts (`python -m mtaqueue.daemon`, the writer, the ctl) imports
# this tree, never an installed copy: after `pip install .` the tests still test the work tree.
TREE = str(Path(__file__).resolve().parent.parent)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [TREE, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
)


@pytest.fixture(scope="session")
def postfix_installed() -> None:
    """For tests that run a private Postfix (tests/postfix_instance.py): root and Debian's
    `postfix` package, installed here if missing (tests/install_postfix.sh, as .ci/run
    does; one worker at a time), or the test fails saying why. Never a skip: a run
    without Postfix must not pass them silently."""
    if os.geteuid() != 0:
        pytest.fail(
            "a private Postfix instance needs root (its master runs as root)", pytrace=False
        )
    _install("postfix", _missing_postfix)


@pytest.fixture(scope="session")
def unbound_installed() -> None:
    """For tests that run a private Unbound (bench/unbound_instance.py): Debian's `unbound`
    package, installed here if missing, as `postfix_installed` does."""
    _install("unbound", lambda: [] if shutil.which("unbound") else ["unbound"])


def _install(package: str, missing: Callable[[], list[str]]) -> None:
    """tests/install_postfix.sh, if `missing()` names anything; fails the test if it
    still does."""
    output = ""
    if missing():
        with open(Path(tempfile.gettempdir()) / "mtaqueue-install-postfix.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if missing():
                script = Path(__file__).parent / "install_postfix.sh"
                done = subprocess.run(["bash", str(script)], capture_output=True, text=True)
                output = (done.stdout + done.stderr)[-2000:]
    gone = missing()
    if gone:
        pytest.fail(
            f"{', '.join(gone)} missing, and tests/install_postfix.sh could not install "
            f"Debian's `{package}` package:\n{output}",
            pytrace=False,
        )


def _missing_postfix() -> list[str]:
    return [tool for tool in POSTFIX_TOOLS if not os.access(tool, os.X_OK)]


@pytest.fixture(scope="session")
def exim_available() -> EximBinary:
    """For tests that run a private Exim (tests/exim_instance.py): root, and Debian's
    exim4-daemon-light unpacked in tests/exim_fetch.py's cache, fetched with apt-get
    download and unpacked now if it is not there yet (never installed: it would remove
    Postfix). The test fails, saying why, where that cannot be done; never a skip."""
    if os.geteuid() != 0:
        pytest.fail("a private Exim daemon needs root (it binds, then drops)", pytrace=False)
    try:
        return ensure_exim()
    except EximUnavailable as exc:
        pytest.fail(
            f"Debian's Exim cannot be had here: {exc}\n(tests/exim_fetch.py fetches it with "
            "apt-get download as root; .ci/run does it before the tests)",
            pytrace=False,
        )


@pytest.fixture
def start_daemon(tmp_path):
    """Factory: start_daemon("section.key=value", ..., config="toml", env={...}) -> running
    DaemonProcess (`env`: added to its environment)."""
    started: list[DaemonProcess] = []

    def start(
        *overrides: str, config: str | None = None, workdir=None, env: dict | None = None
    ) -> DaemonProcess:
        daemon = DaemonProcess(workdir or tmp_path, *overrides, config=config)
        daemon.env.update(env or {})
        started.append(daemon)
        return daemon.start()

    yield start
    for daemon in started:
        daemon.kill()


@pytest.fixture
def daemon(start_daemon) -> DaemonProcess:
    return start_daemon()


@pytest.fixture
def layout(tmp_path) -> SpoolLayout:
    """A spool's directories, made (no daemon)."""
    layout = SpoolLayout(tmp_path / "spool")
    layout.create()
    return layout
