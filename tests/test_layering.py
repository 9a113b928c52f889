"""Import contracts: ``lint-imports`` checks the ``[tool.importlinter]`` contracts of pyproject.toml.

kvflow.schemas imports nothing else of kvflow, kvflow.router and
kvflow.workers do not import each other, and the subpackages are layered.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def lint_imports_executable() -> str:
    """The ``lint-imports`` script of this interpreter's environment (import-linter, the ``test`` extra)."""
    candidate = Path(sys.executable).parent / "lint-imports"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("lint-imports")
    if found is None:
        pytest.fail("lint-imports not found: install the test extra (pip install -e '.[test]')")
    return found


def test_contracts_are_declared():
    """The contracts this suite relies on are still in pyproject.toml."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert config["root_package"] == "kvflow"
    ids = {contract["id"] for contract in config["contracts"]}
    assert {"schemas-standalone", "router-workers-independent", "layers"} <= ids
    # They hold without exceptions: no import is ignored.
    assert [c["id"] for c in config["contracts"] if c.get("ignore_imports")] == []


def test_import_contracts_hold():
    """``lint-imports`` keeps every contract; on failure the report names the broken one and its imports."""
    result = subprocess.run(
        [lint_imports_executable(), "--no-cache"],  # reads pyproject.toml in cwd
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    report = result.stdout + result.stderr
    if result.returncode != 0:
        broken = [line for line in report.splitlines() if " BROKEN" in line]
        pytest.fail("import contracts broken:\n  " + "\n  ".join(broken or ["(see report)"])
                    + "\n\nlint-imports report:\n" + report[report.find("Contracts"):], pytrace=False)
