"""The script installs as its PEP 723 header says: pins that exist on the registry and resolve together."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from conftest import SCRIPT

# Imported on the GPU path by what the script runs, but not by this script's configuration (none since --use-peft).
NOT_ON_OUR_PATH: set[str] = set()


def trainer_imports() -> set[str]:
    """Top-level modules that TRL's AsyncGRPO package and the script import anywhere, lazily or behind an
    availability guard included: the GPU path imports what the CPU rig skips (`kernels` for tree attention, vLLM's
    NCCL helpers for the weight push)."""
    import trl

    files = [*(Path(trl.__file__).parent / "experimental" / "async_grpo").glob("*.py"), SCRIPT]
    names = set()
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"__future__"} - NOT_ON_OUR_PATH


def test_header_dependencies_resolve_together(tmp_path):
    script = tmp_path / SCRIPT.name
    shutil.copy(SCRIPT, script)
    # The header asks for Python >= 3.12; uv must not try to download one, so it is handed the rig's 3.12. Its
    # cache outlives the run, so a rerun resolves from cached metadata in seconds.
    cache = Path(os.environ.get("AGH_CACHE_DIR") or tmp_path) / "uv"
    proc = subprocess.run([sys.executable, "-m", "uv", "lock", "--script", str(script), "--python",
                           os.environ["AGH_SERVER_PYTHON"]], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "UV_PYTHON_DOWNLOADS": "never", "UV_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lock = tomllib.loads(script.with_name(script.name + ".lock").read_text())
    versions = {p["name"]: p["version"] for p in lock["package"]}
    assert versions["trl"] == "1.16.0"
    assert versions["openenv"] == "0.10.0"
    assert versions["vllm"] == "0.29.0"
    assert {"harbor", "e2b", "trackio", "torch", "transformers"} <= set(versions)
    assert not [p["name"] for p in lock["package"] if "git" in p.get("source", {})], "git dependency"
    # Every module the trainer imports, on the GPU path too, comes from a locked distribution (a module not
    # installed here is assumed to be its distribution's name, as kernels and vllm are).
    installed = importlib.metadata.packages_distributions()
    needed = {module: [canonical(d) for d in installed.get(module, [module])] for module in trainer_imports()}
    assert {"kernels", "vllm", "torch", "transformers"} <= set(needed), needed
    missing = {module: dists for module, dists in needed.items() if not set(dists) & set(versions)}
    assert not missing, f"imported but not locked: {missing}"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_help_documents_every_flag():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    flags = set(re.findall(r"^  (--[\w-]+)", proc.stdout, re.M))
    for flag in ("--model", "--vllm-url", "--harbor-url", "--dataset", "--split", "--tasks", "--harness",
                 "--sandbox", "--reward-key", "--num-generations", "--max-inflight", "--max-staleness",
                 "--temperature", "--max-completion-length", "--agent-step-limit", "--agent-timeout",
                 "--learning-rate", "--max-steps", "--save-steps", "--output-dir", "--run-name", "--project",
                 "--resume", "--dtype", "--save-total-limit", "--harbor-expose", "--use-peft", "--lora-r",
                 "--lora-alpha", "--lora-dropout", "--lora-target-modules", "--use-rslora"):
        assert flag in flags, flag
