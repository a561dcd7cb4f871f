"""Benchmark (not a test): the CPU rig's learning run beside its control, as a picture and one line.

The run is tests/test_learning.py's: the rig's engine lets the tiny model itself choose among four answers to the
`choose` task (one right), and the script trains it through the whole chain. The control is the same run with
--learning-rate 0. Both run at once, each on its own rig; the solve rate per optimizer step is read from each run's
rollouts.jsonl (the rollouts that finished since the previous step, as the step's `harbor/rollouts_total` counts them).
When the script has held-out eval (--eval-tasks in its --help), both runs also evaluate `choose` every --eval-steps
and the picture shows eval.csv's pass rate per step.

    bash bench/run.sh learning [--steps 6] [--lr 5e-3] [--out bench/results/2026-12-02-cpu-learning]

(bench/run.sh builds the rig's environments and matplotlib once). Writes OUT.png, OUT.json (every figure) and OUT.log
(both runs' output); the last line printed is
`learn: solve_rate_first=<x> solve_rate_last=<y> control_last=<z> steps=<n>`, where first is step 1's solve rate
(rollouts sampled before any update), and last the one over the last LAST_STEPS steps and the rollouts after them.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import SCRIPT, Rig, script_env  # noqa: E402
from test_learning import (ANSWERS, LAST_STEPS, LEARNING_RATE, RIGHT, STEPS, build_choice_model,  # noqa: E402
                           chance_bound, learning_args, solve_rates_per_step, solved)


def has_eval_tasks() -> bool:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, env=script_env())
    return "--eval-tasks" in proc.stdout


def one_run(name: str, model: Path, work: Path, lr: str, steps: int, eval_flags: list[str], results: dict) -> None:
    started = time.monotonic()
    rig = Rig(work / name / "rig", model, [])
    try:
        out = work / name / "out"
        argv = learning_args(rig, out, lr=lr, steps=steps) + eval_flags
        proc = subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=work / name, env=script_env(), text=True,
                              capture_output=True, timeout=3600)
        choices = [c for c in rig.engine_stats()["chat"] if c["choice"]]
    finally:
        rig.stop()
    per_step, after = solve_rates_per_step(out) if proc.returncode == 0 else ([], [])
    right = ANSWERS.index(RIGHT)
    p_right: dict[int, float] = {}
    for c in choices:
        p_right.setdefault(c["weight_version"], c["choice"]["probs"][right])
    last = [r for s in per_step[-LAST_STEPS:] for r in s] + after
    evals = []
    if (out / "eval.csv").is_file():
        evals = [{"step": int(r["step"]), "pass_rate": float(r["pass_rate"]) if r["pass_rate"] else None}
                 for r in csv.DictReader((out / "eval.csv").open())]
    results[name] = {
        "learning_rate": lr, "exit": proc.returncode, "wall_s": round(time.monotonic() - started, 1),
        "steps": [{"step": i + 1, "rollouts": len(s), "solved": solved(s)} for i, s in enumerate(per_step)],
        "after_last_step": {"rollouts": len(after), "solved": solved(after)},
        "last": {"rollouts": len(last), "solved": solved(last),
                 "chance_bound": chance_bound(len(last)) if last else None},
        "p_right_by_weight_version": {str(v): round(p, 4) for v, p in sorted(p_right.items())},
        "eval": evals, "rollouts": sum(len(s) for s in per_step) + len(after),
        "stdout": proc.stdout, "stderr": proc.stderr}


def rate(solved_count: int, n: int) -> float | None:
    return round(solved_count / n, 3) if n else None


def plot(results: dict, path: Path) -> None:
    # matplotlib lives beside the rig's environments (bench/run.sh), after them on the path: theirs win a conflict.
    if os.environ.get("AGH_BENCH_TOOLS"):
        sys.path.append(os.environ["AGH_BENCH_TOOLS"])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for name, style in (("learning", "-o"), ("control", "--s")):
        r = results[name]
        xs = [s["step"] for s in r["steps"]]
        ax.plot(xs, [rate(s["solved"], s["rollouts"]) for s in r["steps"]], style,
                label=f"{name} (lr {r['learning_rate']}): solve rate of the step's rollouts")
        # Weight version v is what the engine served after v - 1 optimizer steps (1: TRL's push of the initial weights).
        versions = sorted((int(v) - 1, p) for v, p in r["p_right_by_weight_version"].items())
        ax.plot([v for v, _ in versions], [p for _, p in versions], style[-1], color=ax.lines[-1].get_color(),
                alpha=0.5, lw=0.8, ls=":", label=f"{name}: the model's probability of {RIGHT!r} after the step")
        if r["eval"]:
            steps = sorted({e["step"] for e in r["eval"]})
            means = [sum(e["pass_rate"] or 0 for e in r["eval"] if e["step"] == s)
                     / len([e for e in r["eval"] if e["step"] == s]) for s in steps]
            ax.plot(steps, means, style[:-1] + "^", alpha=0.6, label=f"{name}: held-out pass rate (eval.csv)")
    ax.axhline(1 / len(ANSWERS), color="grey", lw=0.8, ls=":", label="chance (1/4)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("solve rate")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("CPU rig: a tiny Qwen3 learns to choose the right answer of 4")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS, help="optimizer steps per run")
    parser.add_argument("--lr", default=LEARNING_RATE, help="learning rate of the learning run (the control's is 0)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu-learning"),
                        help="path prefix of the .png, .json and .log written")
    args = parser.parse_args()
    if not os.environ.get("AGH_SERVER_PYTHON"):
        print("error: set AGH_SERVER_PYTHON to the Harbor server environment's python (bash bench/run.sh learning "
              "does)", file=sys.stderr)
        return 2
    cache = Path(os.environ.get("AGH_CACHE_DIR") or Path.home() / ".cache" / "async_grpo_harbor")
    model = build_choice_model(cache)
    eval_flags = ["--eval-tasks", "choose", "--eval-steps", "2", "--eval-k", "4"] if has_eval_tasks() else []
    work = Path(tempfile.mkdtemp(prefix="learning-bench-"))
    results: dict = {}
    started = time.monotonic()
    runs = [threading.Thread(target=one_run, args=(name, model, work, lr, args.steps, eval_flags, results))
            for name, lr in (("learning", args.lr), ("control", "0"))]
    for t in runs:
        t.start()
    for t in runs:
        t.join()
    wall = time.monotonic() - started
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".log"), "w") as log:
        for name in ("learning", "control"):
            log.write(f"===== {name}\n--- stdout\n{results[name].pop('stdout')}\n--- stderr\n"
                      f"{results[name].pop('stderr')}\n")
    for name in ("learning", "control"):
        if results[name]["exit"] != 0 or len(results[name]["steps"]) != args.steps:
            print(f"error: the {name} run failed (exit {results[name]['exit']}); see {out.with_suffix('.log')}",
                  file=sys.stderr)
            return 1
    learning, control = results["learning"], results["control"]
    first = learning["steps"][0]
    summary = {"solve_rate_first": rate(first["solved"], first["rollouts"]),
               "solve_rate_last": rate(learning["last"]["solved"], learning["last"]["rollouts"]),
               "control_last": rate(control["last"]["solved"], control["last"]["rollouts"]), "steps": args.steps}
    out.with_suffix(".json").write_text(json.dumps(
        {"summary": summary, "wall_s_both_at_once": round(wall, 1), "eval_flags": eval_flags,
         "machine": {"cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()}, **results}, indent=1) + "\n")
    plot(results, out.with_suffix(".png"))
    print(" ".join(f"{k}={v}" for k, v in [("learn: solve_rate_first", summary["solve_rate_first"]),
                                          ("solve_rate_last", summary["solve_rate_last"]),
                                          ("control_last", summary["control_last"]), ("steps", args.steps)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
