"""Benchmark (not a test): the CPU rig's learning run beside a gentler one and the control, as a picture and one line.

The runs are tests/test_learning.py's: the rig's engine lets the tiny model itself choose among four answers to the
`choose` task (one right), and the script trains it through the whole chain. `learning` is the test's run (--lr,
default the test's 5e-3); `gentle` the same run at a learning rate small enough that every trained token's
importance ratio stays within [0.5, 2] (--gentle-lr, over --gentle-steps steps), with --max-staleness 0: a sample
then trains one optimizer step after the weights that sampled it (the micro-batch TRL collates ahead), never more;
`control` the same run at --learning-rate 0. All three run at once, each on its own rig; the solve rate per optimizer step is read from each
run's rollouts.jsonl (the rollouts that finished since the previous step, as the step's `harbor/rollouts_total`
counts them), the model's probability of the right answer per weight version from the engine's record of its
choices, and per step what says how far one update moved the policy, from the checkpoint's log history: TRL's
importance ratio mean (`ratio`), the share of trained tokens clipped (`clip_ratio/region_mean`), its KL estimate
(`kl`), transformers' `grad_norm` (before clipping), and the ratio's extremes before the script's dual clip
(`harbor/ratio_max`, `harbor/ratio_min`, which the script logs). Each run also evaluates `choose` before its first step and after its
last (--eval-tasks, 4 rollouts each time), and the picture shows eval.csv's pass rates.

    bash bench/run.sh learning [--steps 6] [--lr 5e-3] [--gentle-lr 2e-4] [--gentle-steps 12] \
        [--out bench/results/2026-12-03-cpu-learning]

(bench/run.sh builds the rig's environments and matplotlib once). Writes OUT.png, OUT.json (every figure) and OUT.log
(the runs' output); the last line printed is `learn: solve_rate_first=<x> solve_rate_last=<y> control_last=<z>
gentle_last=<g> p_right=<learning>/<gentle>/<control> ratio=[<min>,<max>]/[<min>,<max>] steps=<n>/<m>`, where first
is step 1's solve rate (rollouts sampled before any update), last the one over the last LAST_STEPS steps and the
rollouts after them, p_right the model's probability of the right answer under the last weights each run pushed, and
ratio the importance ratio's range over every step of the learning and the gentle run.
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

from conftest import Rig, log_history, script_env  # noqa: E402
from test_learning import (ANSWERS, LEARNING_RATE, RIGHT, STEPS, build_choice_model,  # noqa: E402
                           chance_bound, learning_args, right_answer_probability,
                           solve_rates_per_step, solved)

SCRIPT = ROOT / "async_grpo_harbor.py"
LAST_STEPS = 2  # the window the report's last solve rate is taken over
# What each optimizer step logs about how far its update moved the policy: TRL's names, transformers' grad_norm, and
# the ratio's extremes that the script logs.
STEP_METRICS = ("ratio", "harbor/ratio_min", "harbor/ratio_max", "clip_ratio/region_mean", "kl", "grad_norm")
RATIO_BAND = (0.5, 2.0)


def one_run(name: str, model: Path, work: Path, lr: str, steps: int, flags: list[str], results: dict) -> None:
    started = time.monotonic()
    rig = Rig(work / name / "rig", model, [])
    try:
        out = work / name / "out"
        argv = learning_args(rig, out, lr=lr, steps=steps) + flags
        proc = subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=work / name, env=script_env(), text=True,
                              capture_output=True, timeout=7200)
        choices = [c for c in rig.engine_stats()["chat"] if c["choice"]]
    finally:
        rig.stop()
    per_step, after = solve_rates_per_step(out) if proc.returncode == 0 else ([], [])
    logged = log_history(out) if proc.returncode == 0 else []
    p_right = right_answer_probability(choices)
    last = [r for s in per_step[-LAST_STEPS:] for r in s] + after
    evals = []
    if (out / "eval.csv").is_file():
        evals = [{"step": int(r["step"]), "pass_rate": float(r["pass_rate"]) if r["pass_rate"] else None}
                 for r in csv.DictReader((out / "eval.csv").open())]
    results[name] = {
        "learning_rate": lr, "exit": proc.returncode, "wall_s": round(time.monotonic() - started, 1),
        "steps": [{"step": i + 1, "rollouts": len(s), "solved": solved(s),
                   **{k: logged[i].get(k) for k in STEP_METRICS if i < len(logged)}} for i, s in enumerate(per_step)],
        "after_last_step": {"rollouts": len(after), "solved": solved(after)},
        "last": {"rollouts": len(last), "solved": solved(last),
                 "chance_bound": chance_bound(len(last)) if last else None},
        "p_right_by_weight_version": {str(v): round(p, 4) for v, p in sorted(p_right.items())},
        "eval": evals, "rollouts": sum(len(s) for s in per_step) + len(after),
        "stdout": proc.stdout, "stderr": proc.stderr}


def ratio_range(run: dict) -> tuple[float | None, float | None]:
    lows = [s["harbor/ratio_min"] for s in run["steps"] if s.get("harbor/ratio_min") is not None]
    highs = [s["harbor/ratio_max"] for s in run["steps"] if s.get("harbor/ratio_max") is not None]
    return (min(lows) if lows else None), (max(highs) if highs else None)


def last_p_right(run: dict) -> float:
    return run["p_right_by_weight_version"][max(run["p_right_by_weight_version"], key=int)]


def rate(solved_count: int, n: int) -> float | None:
    return round(solved_count / n, 3) if n else None


def plot(results: dict, path: Path) -> None:
    # matplotlib lives beside the rig's environments (bench/run.sh), after them on the path: theirs win a conflict.
    if os.environ.get("AGH_BENCH_TOOLS"):
        sys.path.append(os.environ["AGH_BENCH_TOOLS"])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ratio_ax) = plt.subplots(2, 1, figsize=(8, 9), sharex=True, height_ratios=(3, 2))
    for name, style in (("learning", "-o"), ("gentle", "-D"), ("control", "--s")):
        r = results[name]
        xs = [s["step"] for s in r["steps"]]
        ax.plot(xs, [rate(s["solved"], s["rollouts"]) for s in r["steps"]], style,
                label=f"{name} (lr {r['learning_rate']}): solve rate of the step's rollouts")
        color = ax.lines[-1].get_color()
        # Weight version v is what the engine served after v - 1 optimizer steps (1: TRL's push of the initial weights).
        versions = sorted((int(v) - 1, p) for v, p in r["p_right_by_weight_version"].items())
        ax.plot([v for v, _ in versions], [p for _, p in versions], style[-1], color=color, alpha=0.5, lw=0.8,
                ls=":", label=f"{name}: the model's probability of {RIGHT!r} after the step")
        if r["eval"]:
            steps = sorted({e["step"] for e in r["eval"]})
            means = [sum(e["pass_rate"] or 0 for e in r["eval"] if e["step"] == s)
                     / len([e for e in r["eval"] if e["step"] == s]) for s in steps]
            ax.plot(steps, means, "^", color=color, alpha=0.6, label=f"{name}: held-out pass rate (eval.csv)")
        timed = [s for s in r["steps"] if s.get("harbor/ratio_max") is not None]
        if timed:
            ratio_ax.fill_between([s["step"] for s in timed], [s["harbor/ratio_min"] for s in timed],
                                  [s["harbor/ratio_max"] for s in timed], color=color, alpha=0.2)
            ratio_ax.plot([s["step"] for s in timed], [s["ratio"] for s in timed], style, color=color, ms=4,
                          label=f"{name}: importance ratio, mean (line) and range (band)")
    ax.axhline(1 / len(ANSWERS), color="grey", lw=0.8, ls=":", label="chance (1/4)")
    ax.set_ylabel("solve rate / probability")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("CPU rig: a tiny Qwen3 learns to choose the right answer of 4")
    ax.legend(fontsize=7, loc="lower right")
    ratio_ax.axhspan(*RATIO_BAND, color="green", alpha=0.08, label=f"[{RATIO_BAND[0]}, {RATIO_BAND[1]:g}]")
    ratio_ax.set_yscale("log")
    ratio_ax.set_xlabel("optimizer step")
    ratio_ax.set_ylabel("pi_new / pi_old per trained token")
    ratio_ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS, help="optimizer steps of the learning run and the control")
    parser.add_argument("--lr", default=LEARNING_RATE, help="learning rate of the learning run (the control's is 0)")
    parser.add_argument("--gentle-lr", default="2e-4", help="learning rate of the gentle run")
    parser.add_argument("--gentle-steps", type=int, default=12, help="optimizer steps of the gentle run")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu-learning"),
                        help="path prefix of the .png, .json and .log written")
    args = parser.parse_args()
    if not os.environ.get("AGH_SERVER_PYTHON"):
        print("error: set AGH_SERVER_PYTHON to the Harbor server environment's python (bash bench/run.sh learning "
              "does)", file=sys.stderr)
        return 2
    cache = Path(os.environ.get("AGH_CACHE_DIR") or Path.home() / ".cache" / "async_grpo_harbor")
    model = build_choice_model(cache)
    work = Path(tempfile.mkdtemp(prefix="learning-bench-"))
    variants = {"learning": (args.lr, args.steps, []),
                "gentle": (args.gentle_lr, args.gentle_steps, ["--max-staleness", "0"]),
                "control": ("0", args.steps, [])}
    results: dict = {}
    started = time.monotonic()
    # Held out before the first step and after the last: 4 rollouts of the task each time.
    runs = [threading.Thread(target=one_run, args=(
        name, model, work, lr, steps,
        [*flags, "--eval-tasks", "choose", "--eval-steps", str(steps), "--eval-k", "4"], results))
        for name, (lr, steps, flags) in variants.items()]
    for t in runs:
        t.start()
    for t in runs:
        t.join()
    wall = time.monotonic() - started
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".log"), "w") as log:
        for name in variants:
            log.write(f"===== {name}\n--- stdout\n{results[name].pop('stdout')}\n--- stderr\n"
                      f"{results[name].pop('stderr')}\n")
    for name, (_, steps, _) in variants.items():
        if results[name]["exit"] != 0 or len(results[name]["steps"]) != steps:
            print(f"error: the {name} run failed (exit {results[name]['exit']}); see {out.with_suffix('.log')}",
                  file=sys.stderr)
            return 1
    learning, gentle, control = results["learning"], results["gentle"], results["control"]
    first = learning["steps"][0]
    summary = {"solve_rate_first": rate(first["solved"], first["rollouts"]),
               "solve_rate_last": rate(learning["last"]["solved"], learning["last"]["rollouts"]),
               "control_last": rate(control["last"]["solved"], control["last"]["rollouts"]),
               "gentle_last": rate(gentle["last"]["solved"], gentle["last"]["rollouts"]),
               "p_right": "/".join(f"{last_p_right(r):.3f}" for r in (learning, gentle, control)),
               "ratio": "/".join("[{:.3g},{:.3g}]".format(*ratio_range(r)) for r in (learning, gentle)),
               "steps": f"{args.steps}/{args.gentle_steps}"}
    out.with_suffix(".json").write_text(json.dumps(
        {"summary": summary, "wall_s_all_at_once": round(wall, 1), "ratio_band": RATIO_BAND,
         "machine": {"cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()}, **results}, indent=1) + "\n")
    plot(results, out.with_suffix(".png"))
    print("learn: " + " ".join(f"{k}={v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
