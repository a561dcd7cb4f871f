"""The script passes its linters: ruff (ruff.toml: pycodestyle, pyflakes, lines <= 120) and tests/lint.py (no class
inside a function; no control flow reads an exception's message)."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT, SCRIPT


def test_the_script_passes_ruff_and_the_guides_own_lint():
    runs = [subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300) for command in (
        [sys.executable, "-m", "ruff", "check", "--no-cache", str(SCRIPT)],
        [sys.executable, str(ROOT / "tests" / "lint.py"), str(SCRIPT)])]
    assert [run.returncode for run in runs] == [0, 0], "\n".join(run.stdout + run.stderr for run in runs)
