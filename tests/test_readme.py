"""The README opens with the two commands a newcomer needs, and CI runs the second."""

from __future__ import annotations

import re
from pathlib import Path

TREE = Path(__file__).resolve().parent.parent


def test_readme_opens_with_run_and_test_commands_that_ci_runs():
    readme = (TREE / "README.md").read_text()
    opening = readme[: readme.index("\n## ")]
    run, test = re.findall(r"```sh\n(.*?)\n```", opening, re.DOTALL)
    venv = "python3 -m venv .venv && . .venv/bin/activate && "  # PEP 668: never outside one
    assert run == venv + "pip install . && mtaqueue -c conf/mtaqueue.toml"
    assert test == venv + "pip install -e '.[test]' && python -m pytest -q"
    assert test in (TREE / ".ci" / "run").read_text().splitlines()
