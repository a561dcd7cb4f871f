"""Benchmark (not a test): how much of a short run's signal does --curate recover?

On the CPU rig (the stand-in engine's scripted policy solves echo-hello always, never never, coin and coin2 in exactly
half of their rollouts, alternating), measure pass rates with --eval-only --curate, then train the same short run
twice on the same rig, once on the full task list and once on the curated one, and compare the fraction of GRPO
groups whose rewards were all equal (they teach nothing). Expected with G=4: full ~ (1 + 1 + 0 + 0) / 4 = 0.5,
curated ~ 0 (with the random engine this replaced, whose coin groups were flat 2 times in 16: 0.56 and 0.125).

    AGH_SERVER_PYTHON=$(ls -d ~/.cache/async_grpo_harbor/server-*)/bin/python \
        $(ls -d ~/.cache/async_grpo_harbor/trainer-*)/bin/python bench/curate_signal.py [--steps 4] [--eval-k 12]

(the two environments `bash tests/run.sh` builds). The last line printed is
`curate: zero_var_full=<x> zero_var_curated=<y>`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import RIG, SCRIPT, TASKS, Rig, log_history, script_env, train_args  # noqa: E402

# The groups this benchmark reports on (the tests run groups of 2: conftest.GENERATIONS); the last flag wins.
G4 = ["--num-generations", "4", "--max-inflight", "4"]


def run_script(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=cwd, env=script_env(), text=True,
                          capture_output=True, timeout=1800)
    if proc.returncode != 0:
        print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
    return proc


def zero_variance(out: Path) -> tuple[float, int]:
    steps = log_history(out)
    groups = sum(e.get("harbor/groups_total", 0) for e in steps)
    return sum(e.get("harbor/zero_variance_groups_total", 0) for e in steps) / groups, int(groups)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per training run")
    parser.add_argument("--eval-k", type=int, default=12, help="rollouts per task when measuring pass rates")
    args = parser.parse_args()
    if not os.environ.get("AGH_SERVER_PYTHON"):
        print("error: set AGH_SERVER_PYTHON to the Harbor server environment's python (see this file's docstring)",
              file=sys.stderr)
        return 2
    cache = Path(os.environ.get("AGH_CACHE_DIR") or Path.home() / ".cache" / "async_grpo_harbor")
    model = cache / "tiny-qwen3"
    subprocess.run([sys.executable, str(RIG / "tiny_model.py"), str(model)], check=True)
    work = Path(tempfile.mkdtemp(prefix="curate-bench-"))
    rig = Rig(work / "rig", model, [])
    try:
        measured = run_script([*rig.base_args(), "--tasks", TASKS, "--eval-only", "--curate", "--eval-k",
                               str(args.eval_k), "--temperature", "0.7", "--agent-step-limit", "6",
                               "--agent-timeout", "60", "--output-dir", str(work / "eval")], cwd=work)
        if measured.returncode != 0:
            print(f"error: --eval-only --curate failed (exit {measured.returncode})", file=sys.stderr)
            return 1
        curated = work / "eval" / "curated_tasks.txt"
        results = {}
        for name, tasks in (("full", TASKS), ("curated", f"@{curated}")):
            out = work / name
            argv = train_args(rig, out, "--max-steps", str(args.steps), "--save-steps", str(args.steps),
                              "--run-name", f"bench-{name}", *G4)
            argv[argv.index("--tasks") + 1] = tasks
            proc = run_script(argv, cwd=work)
            if proc.returncode != 0:
                print(f"error: training on the {name} list failed (exit {proc.returncode})", file=sys.stderr)
                return 1
            results[name] = zero_variance(out)
    finally:
        rig.stop()
    listed = [line for line in curated.read_text().splitlines() if line and not line.startswith("#")]
    print(f"\ncurated list: {', '.join(listed)} (from {TASKS})")
    print(f"{'list':<10} {'groups':>7} {'zero-variance fraction':>24}")
    for name, (frac, groups) in results.items():
        print(f"{name:<10} {groups:>7} {frac:>24.3f}")
    full, cur = results["full"][0], results["curated"][0]
    print(json.dumps({"zero_var_full": full, "zero_var_curated": cur, "steps": args.steps, "workdir": str(work)}))
    print(f"curate: zero_var_full={full:.3f} zero_var_curated={cur:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
