"""The script installs as its PEP 723 header says: pins that exist on the registry and resolve together."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib

from conftest import SCRIPT


def test_header_dependencies_resolve_together(tmp_path):
    script = tmp_path / SCRIPT.name
    shutil.copy(SCRIPT, script)
    # The header asks for Python >= 3.12; uv must not try to download one, so it is handed the rig's 3.12.
    proc = subprocess.run([sys.executable, "-m", "uv", "lock", "--script", str(script), "--python",
                           os.environ["AGH_SERVER_PYTHON"]], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "UV_PYTHON_DOWNLOADS": "never", "UV_CACHE_DIR": str(tmp_path / "uv")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lock = tomllib.loads(script.with_name(script.name + ".lock").read_text())
    versions = {p["name"]: p["version"] for p in lock["package"]}
    assert versions["trl"] == "1.16.0"
    assert versions["openenv"] == "0.10.0"
    assert versions["vllm"] == "0.29.0"
    assert {"harbor", "e2b", "trackio", "torch", "transformers"} <= set(versions)
    assert not [p["name"] for p in lock["package"] if "git" in p.get("source", {})], "git dependency"


def test_help_documents_every_flag():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    flags = set(re.findall(r"^  (--[\w-]+)", proc.stdout, re.M))
    for flag in ("--model", "--vllm-url", "--harbor-url", "--dataset", "--split", "--tasks", "--harness",
                 "--sandbox", "--reward-key", "--num-generations", "--max-inflight", "--max-staleness",
                 "--temperature", "--max-completion-length", "--agent-step-limit", "--agent-timeout",
                 "--learning-rate", "--max-steps", "--save-steps", "--output-dir", "--run-name", "--project",
                 "--resume"):
        assert flag in flags, flag
