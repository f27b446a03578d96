"""schemathesis (an API fuzzer we did not write) against a running daemon: its requests
drawn from the served OpenAPI document, valid ones and invalid ones (--mode all), every
check on (--checks all). A valid request must not be refused with a 400, an invalid one
must not be taken, every answer must be one the document names, with its schema.

One setting departs from schemathesis's defaults, and only this one: a 422 answers a
valid request too. It is how the API refuses what the schema cannot know, as it depends
on the moment: a recipient on the suppression list (the stateful phase suppresses an
address, then submits to it) and an expires time already past (the document says both).
Strings are drawn from all of Unicode: the address patterns bound the octets themselves.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from api_client import TOKENS, TOKENS_FILE

ACCEPTED = ["2xx", "3xx", "401", "403", "404", "409", "422", "429", "5xx"]  # 422 added
EXAMPLES = 20  # per operation and phase: some 500 requests, well within a minute


def test_schemathesis_finds_no_request_the_server_and_its_document_disagree_on(
    start_daemon, tmp_path
):
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS_FILE)
    tokens.chmod(0o600)
    daemon = start_daemon("api.address=127.0.0.1:0", f"api.tokens_file={tokens}")
    (address,) = daemon.wait_event("api_listening")["address"]
    config = tmp_path / "schemathesis.toml"
    config.write_text(f"[checks.positive_data_acceptance]\nexpected-statuses = {ACCEPTED!r}\n")
    st = Path(sys.executable).with_name("st")
    run = subprocess.run(
        [
            str(st), "--config-file", str(config), "--no-color",
            "run", f"http://{address}/v1/openapi.json",
            "--checks", "all", "--mode", "all", "--workers", "1",
            "-H", f"Authorization: Bearer {TOKENS['operator']}",
            "--max-examples", str(EXAMPLES), "--generation-database", "none",
        ],
        cwd=tmp_path,  # its .hypothesis and .schemathesis directories
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    assert "Failures:" not in run.stdout, run.stdout  # (a warning, e.g. of 404s, may be)
