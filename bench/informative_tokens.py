"""Benchmark (not a test): how much of what reaches the loss carries signal, with zero-variance groups trained (TRL's
behaviour) and kept out (the script's default).

On the CPU rig (the stand-in engine's scripted policy solves echo-hello always, never never, coin and coin2 in exactly
half of their rollouts, alternating), train the same short run twice, side by side on one rig,
`--max-zero-variance-groups 0` (off) and the default (on), and read each optimizer step's `batch/trained_tokens_per_step`
(loss tokens, TRL's own count) and `harbor/trained/informative_token_frac` (the share of them with a non-zero
advantage). A zero-variance group's tokens carry advantage 0 but still count in the loss's token mean, so with the
filter off the informative share is about the share of tokens from mixed groups (with G=4: coin and coin2 mix every
group, the others never: ~0.5; the two runs share the engine's per-task count, so a group whose first calls
interleave with the other run's may not mix), and it moves from step to step with whichever groups happen to fill
it. With the filter on it should be 1.0 every step.

    AGH_SERVER_PYTHON=$(ls -d ~/.cache/async_grpo_harbor/server-*)/bin/python \\
        $(ls -d ~/.cache/async_grpo_harbor/trainer-*)/bin/python bench/informative_tokens.py [--steps 3]

(the two environments `bash tests/run.sh` builds). The last line printed is
`signal: informative_token_frac_off=<x> informative_token_frac_on=<y>`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import RIG, SCRIPT, TASKS, Rig, default_filter, log_history, script_env, train_args  # noqa: E402

# The groups this benchmark reports on (the tests run groups of 2: conftest.GENERATIONS); the last flag wins.
G4 = ["--num-generations", "4", "--max-inflight", "4"]


def measure(out: Path) -> dict:
    steps = log_history(out)
    tokens = [e["batch/trained_tokens_per_step"] for e in steps]
    fracs = [e.get("harbor/trained/informative_token_frac", 0.0) for e in steps]
    return {"steps": len(steps), "tokens": sum(tokens),
            "informative_token_frac": sum(f * t for f, t in zip(fracs, tokens)) / sum(tokens),
            "per_step": [round(f, 3) for f in fracs], "min": min(fracs), "max": max(fracs),
            "stdev": statistics.pstdev(fracs), "groups_trained": sum(e["harbor/trained/groups"] for e in steps),
            "zero_variance_groups": int(sum(e.get("harbor/zero_variance_groups_total", 0) for e in steps)),
            "groups_scored": int(sum(e.get("harbor/groups_total", 0) for e in steps))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per training run")
    args = parser.parse_args()
    if not os.environ.get("AGH_SERVER_PYTHON"):
        print("error: set AGH_SERVER_PYTHON to the Harbor server environment's python (see this file's docstring)",
              file=sys.stderr)
        return 2
    cache = Path(os.environ.get("AGH_CACHE_DIR") or Path.home() / ".cache" / "async_grpo_harbor")
    model = cache / f"tiny-qwen3-{hashlib.sha256((RIG / 'tiny_model.py').read_bytes()).hexdigest()[:16]}"
    subprocess.run([sys.executable, str(RIG / "tiny_model.py"), str(model)], check=True)
    work = Path(tempfile.mkdtemp(prefix="signal-bench-"))
    # Room for both runs' rollouts and their preflights' capacity probes at once.
    rig = Rig(work / "rig", model, [], max_concurrent_envs=12)
    runs, results = {}, {}
    try:
        t0 = time.monotonic()
        for name in ("off", "on"):  # side by side, so both meet the same machine load
            # A rollout is ~5 s on an idle rig; the long agent timeout keeps a loaded machine from failing them.
            # train_args trains zero-variance groups: the filter "off"
            argv = train_args(rig, work / name, "--max-steps", str(args.steps), "--save-steps", str(args.steps),
                              "--run-name", f"signal-{name}", "--agent-timeout", "600", *G4)
            log = (work / f"{name}.log").open("w")
            runs[name] = subprocess.Popen([sys.executable, str(SCRIPT), *(argv if name == "off" else
                                                                          default_filter(argv))],
                                          cwd=work, env=script_env(), text=True, stdout=log, stderr=subprocess.STDOUT)
        while len(results) < len(runs):
            for name, proc in runs.items():
                if name in results or proc.poll() is None:
                    continue
                if proc.returncode != 0:
                    print((work / f"{name}.log").read_text()[-3000:], file=sys.stderr)
                    print(f"error: the run with the filter {name} failed (exit {proc.returncode})", file=sys.stderr)
                    return 1
                results[name] = measure(work / name) | {"wall_s": round(time.monotonic() - t0)}
            time.sleep(1)
        results = {name: results[name] for name in runs}
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                proc.kill()
        rig.stop()
    print(f"\ntasks {TASKS}, G=4, {args.steps} optimizer steps per run")
    print("| zero-variance groups | steps | loss tokens | informative token frac | per step | min | max | stdev "
          "| groups trained | zero-variance / scored groups | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {'trained (off)' if name == 'off' else 'kept out (on)'} | {r['steps']} | {r['tokens']:.0f} "
              f"| **{r['informative_token_frac']:.3f}** | {', '.join(f'{f:.2f}' for f in r['per_step'])} "
              f"| {r['min']:.2f} | {r['max']:.2f} | {r['stdev']:.3f} | {r['groups_trained']:.0f} "
              f"| {r['zero_variance_groups']} / {r['groups_scored']} | {r['wall_s']} |")
    print(json.dumps({"results": results, "steps": args.steps, "workdir": str(work)}))
    print(f"signal: informative_token_frac_off={results['off']['informative_token_frac']:.3f} "
          f"informative_token_frac_on={results['on']['informative_token_frac']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
