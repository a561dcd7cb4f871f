"""It learns: the script, through the whole chain (the real Harbor server and capture proxy, mini-swe-agent, Harbor's
verifier, TRL's worker and trainer, weight pushes to the engine), raises a policy's solve rate on a task well beyond
chance. A sign error, a mask on the wrong turn, a push that lands elsewhere or a reward read from the wrong key
leaves it at chance, and this test fails.

What is sampled, and why it is the policy's own choice: the rig's engine lets the MODEL decide the `choose` task
(tests/rig/engine.py, `choices`). On the agent's first turn it scores four candidate completions, the same `bash`
tool call writing cat, dog, fox or tag to /app/answer.txt, by their sequence probabilities under the weights the
trainer last pushed, at the request's temperature; it samples one from those probabilities renormalised over the
four and returns its token ids with the model's real per-token logprobs. The verifier rewards `fox` only. The agent's
later turn (submit) stays scripted. Renormalising over candidates does not change GRPO's gradient: within a group
every rollout shares the prompt, so log q(c) = log p(c) - log Z differs from the model's log p(c) by a term common to
the group, and the group's advantages sum to zero, so that term drops out of sum_i A_i * grad log q(c_i).

The start is chance exactly: the four answer tokens are interchangeable in the initial weights (tests/rig/
tiny_model.py --interchangeable), so each candidate starts at probability 1/4 whatever the prompt (mini-swe-agent's
system prompt carries the machine's `uname`, which moves a random model's sequence logprobs by nats).

The model is first warmed to the engine's scripted action (tiny_model.py --warm: a supervised pass, the answers'
rows averaged after it), so the tokens the engine writes around the choice are ones the model itself would write: the
rollouts are on-policy, and the run's importance ratio starts at 1 (the unwarmed model's reached 1e4-1e9).

The run is the script's defaults except what a tiny model on two CPU cores needs: a high learning rate, few steps, one
group of 8 per optimizer step (--token-budget 0 --per-device-train-batch-size 8 --micro-batches-per-step 1), and
zero-variance groups trained rather than kept out (--max-zero-variance-groups 0): once the policy solves the task, a
group of 8 that fails once becomes rare, and kept out, the trainer waits for it (measured: 400 rollouts for the last
step). Groups of 8, not 4: at chance a group of 4 is all wrong a third of the time, and a step that trains one moves
the weights by AdamW's momentum alone; with groups of 4 at lr 5e-3, whether the probability of `fox` rose (to 0.98)
or wandered (0.37 -> 0.53 -> 0.43) hung on how many groups finished per step. Groups of 8 carry a signal in all but
10% of groups at chance and under 1% in between.

The verdict cannot hang on rollout timing or on a first group with no signal. The engine samples with seed
ENGINE_SEED, whose first 8 draws at chance hold no `fox`: in every run the first group is all wrong (a test checks
it), and the first step, having nothing else, trains it: no gradient, the weights stay (version 2 is still at 1/4).
Two assertions, each failing on a policy pushed the wrong way or not at all. The model's probability of `fox` under
the weights of the last push (read from the engine after the run, noise-free: the candidates' probabilities, not a
draw) must end above RISEN, 0.6, and above where it started. And the solve rate of the trained policy: after the run,
`--eval-only --eval-k MEASURED_K` measures it through the same Harbor server and verifier under the last push's weights,
a fixed n = 32 whatever the run's timing (the rollouts the last steps folded in are as many, and as old, as the
machine's load makes them); the test asserts at least k solves, the fewest a policy still at its starting rate of 1/4
reaches with probability < 1e-3 (`chance_bound(32)`: 17; a policy at 0.8 misses it with probability 1.4e-4). Measured in
three runs, two with the machine loaded (one of them with a core busy beside it): the probability of `fox` per version
0.25 -> 0.25 -> 0.42 -> 0.81 -> 0.88 -> 0.91 (twice) and 0.25 -> 0.25 -> 0.42 -> 0.70 -> 0.78 -> 0.96. The importance
ratio's max per step at most 300, at most 1.4% of tokens beyond --delta. At learning rate 0: 0.25 at every version,
6/32.

The control is in the suite too: the same run at --learning-rate 0, CONTROL_STEPS steps of groups of 4, with the
default zero-variance keep-out. Every weight version it pushes must leave the probability at exactly 1/4: a rise in the
learning run comes from the updates, nothing else (not the engine's sampling, not the pushes themselves).
AGH_LEARNING_RATE=0 runs the learning run itself at learning rate 0, which must fail both assertions.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import POLICY, RIG, SERVED_NAME, Rig, log_history, post_json, run_script

TASK = "choose"
ANSWERS = POLICY["choices"][TASK]
RIGHT = "fox"  # what tests/rig/tasks/choose/tests/test.sh rewards
LEARNING_RATE = os.environ.get("AGH_LEARNING_RATE", "7e-3")  # "0": the control, which must fail
STEPS = 5
MEASURED_K = 32  # rollouts of the trained policy, measured after the run by --eval-only: a fixed n
CONTROL_STEPS = 2
CONTROL_GROUP = 4  # what it shows (no push moves the probability) needs no larger groups
RISEN = 0.6  # where the right answer's probability must end: chance is 0.25
GROUP = 8
ENGINE_SEED = 4  # random.Random(4)'s first 8 draws among 4 equal candidates: none is the right one
CHANCE = 1 / len(ANSWERS)
TAIL = 1e-3


def chance_bound(n: int, p: float = CHANCE, tail: float = TAIL) -> int:
    """The fewest solves among n rollouts that a policy solving with probability p reaches with probability < tail."""
    def at_least(k: int) -> float:
        return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))
    return next(k for k in range(n + 1) if at_least(k) < tail)


def learning_args(rig: Rig, out: Path, lr: str = LEARNING_RATE, steps: int = STEPS,
                  keep_out: bool = False, group: int = GROUP) -> list[str]:
    """keep_out: zero-variance groups kept out of training, the script's default."""
    return [*rig.base_args(), "--tasks", TASK, "--num-generations", str(group), "--max-inflight", str(group),
            "--learning-rate", lr, "--max-steps", str(steps), "--save-steps", str(steps),
            "--token-budget", "0", "--per-device-train-batch-size", str(group), "--micro-batches-per-step", "1",
            *([] if keep_out else ["--max-zero-variance-groups", "0"]), "--output-dir", str(out)]


def right_answer_probability(choices: list[dict]) -> dict[int, float]:
    """weight version -> the model's probability of the right answer, as the engine computed it under that version
    (every choice under one version has the same candidates' probabilities: one prompt, one set of weights)."""
    right = ANSWERS.index(RIGHT)
    by_version: dict[int, float] = {}
    for c in choices:
        by_version.setdefault(c["weight_version"], c["choice"]["probs"][right])
    return by_version


BASH_TOOL = {"type": "function", "function": {
    "name": "bash", "description": "Run a command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


def choice_under_the_served_weights(rig: Rig) -> dict:
    """The engine's choice record for one greedy first turn of the task, under the weights it serves now (the last
    push): the candidates' probabilities whether or not a rollout of the run sampled after that push."""
    post_json(f"{rig.engine_url}/v1/chat/completions", {
        "model": SERVED_NAME, "messages": [{"role": "user", "content": f"rig-task: {TASK}"}], "tools": [BASH_TOOL],
        "temperature": 0.0}, timeout=120)
    return rig.engine_stats()["chat"][-1]


def build_choice_model(cache: Path) -> Path:
    """The rig's tiny model with the four answers interchangeable and warmed to the engine's scripted action (its
    format near-certain, so the rollouts are on-policy), built once per recipe under `cache`."""
    recipe = hashlib.sha256((RIG / "tiny_model.py").read_bytes() + ",".join(ANSWERS).encode()).hexdigest()[:16]
    model = cache / f"tiny-qwen3-choice-warm-{recipe}"
    subprocess.run([sys.executable, str(RIG / "tiny_model.py"), str(model), "--interchangeable", ",".join(ANSWERS),
                    "--warm"], check=True)
    return model


def solve_rates_per_step(out: Path) -> tuple[list[list[dict]], list[dict]]:
    """rollouts.jsonl split by optimizer step: the rollouts each step folded in (those that finished since the
    previous step, `harbor/rollouts_total` in its log), and those that finished after the last step."""
    records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines() if line.strip()]
    steps, start = [], 0
    for entry in log_history(out):
        n = int(entry.get("harbor/rollouts_total", 0))
        steps.append(records[start:start + n])
        start += n
    return steps, records[start:]


def solved(records: list[dict]) -> int:
    return sum(r["error"] is None and r["reward"] > 0 for r in records)


@pytest.fixture(scope="module")
def choice_model(tmp_path_factory) -> Path:
    return build_choice_model(Path(os.environ.get("AGH_CACHE_DIR") or tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def learning_run(choice_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("learning")
    rig = Rig(work / "rig", choice_model, [], seed=ENGINE_SEED)
    try:
        proc = run_script(learning_args(rig, work / "out"), cwd=work)
        choices = [c for c in rig.engine_stats()["chat"] if c["choice"]]
        measured = None
        if proc.returncode == 0:
            choices.append(choice_under_the_served_weights(rig))
            # The trained policy's solve rate, the way a user measures one (--eval-only, through the same Harbor
            # server and verifier), under the weights of the last push: MEASURED_K draws whatever the run's timing.
            measured = run_script([*rig.base_args(), "--tasks", TASK, "--eval-only", "--eval-k", str(MEASURED_K),
                                   "--output-dir", str(work / "measured")], cwd=work)
    finally:
        rig.stop()
    return proc, work / "out", choices, measured


@pytest.fixture(scope="module")
def control_run(choice_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("control")
    rig = Rig(work / "rig", choice_model, [])
    try:
        proc = run_script(learning_args(rig, work / "out", lr="0", steps=CONTROL_STEPS, keep_out=True,
                                         group=CONTROL_GROUP), cwd=work)
        choices = [c for c in rig.engine_stats()["chat"] if c["choice"]]
        if proc.returncode == 0:
            choices.append(choice_under_the_served_weights(rig))
    finally:
        rig.stop()
    return proc, work / "out", choices


def test_the_policys_choice_starts_at_chance(learning_run):
    _, _, choices, _ = learning_run
    first = min(c["weight_version"] for c in choices)
    assert first <= 1, "no choice was made under the initial weights"  # 1: TRL's push at start, the same weights
    initial = [c["choice"]["probs"] for c in choices if c["weight_version"] == first]
    assert initial and all(p == pytest.approx([CHANCE] * len(ANSWERS), abs=1e-6) for p in initial), initial[0]
    assert {c["choice"]["answers"] == ANSWERS for c in choices} == {True}


def test_the_right_answer_grows_likelier(learning_run):
    proc, _, choices, _ = learning_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    by_version = right_answer_probability(choices)
    print(f"the model's probability of {RIGHT!r} per weight version:",
          {v: round(p, 3) for v, p in sorted(by_version.items())})
    # The last version is the last push's, read after the run: what the run's training left, not a draw.
    first, last = by_version[min(by_version)], by_version[max(by_version)]
    assert max(by_version) > min(by_version), "every choice was made under one weight version: no push landed"
    assert last > RISEN and last > first, (f"the probability of {RIGHT!r} went {first:.3f} -> {last:.3f} (weight "
                                           f"versions {min(by_version)} -> {max(by_version)}); it must end above "
                                           f"{RISEN} and above where it started")


def test_at_learning_rate_0_no_push_moves_the_right_answers_probability(control_run):
    proc, out, choices = control_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [e["step"] for e in log_history(out)] == list(range(1, CONTROL_STEPS + 1))
    versions = sorted({c["weight_version"] for c in choices})
    # The first rollouts' version and the last push's (read after the run, by the same engine): each push landed.
    assert len(versions) >= 2, versions
    moved = [(c["weight_version"], c["choice"]["probs"]) for c in choices
             if c["choice"]["probs"] != pytest.approx([CHANCE] * len(ANSWERS), abs=1e-6)]
    assert not moved, moved
    # The default keep-out was on: every zero-variance group was kept out, none trained.
    logged = log_history(out)
    assert sum(e.get("harbor/not_trained/zero_variance_groups_total", 0) for e in logged) == \
        sum(e.get("harbor/zero_variance_groups_total", 0) for e in logged)
    assert re.search(r"zero-variance groups\s+kept out", proc.stdout), "the hyper-parameter table's row"


def test_the_first_group_had_no_signal(learning_run):
    """The condition the verdict must survive held: the first group was all wrong (no gradient)."""
    proc, out, _, _ = learning_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines() if line.strip()]
    first = [r for r in records if r["group"] == min(r["group"] for r in records)]
    assert len(first) == GROUP and solved(first) == 0, [r["reward"] for r in first]


def test_solve_rate_rises_well_beyond_chance(learning_run):
    proc, out, _, measured = learning_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps, after = solve_rates_per_step(out)
    assert len(steps) == STEPS
    print("solve rate per step:", " ".join(f"{solved(s)}/{len(s)}" for s in steps), f"after: {solved(after)}/"
          f"{len(after)}")
    assert measured is not None and measured.returncode == 0, measured and measured.stderr[-3000:]
    [row] = list(csv.DictReader((out.parent / "measured" / "pass_rates.csv").open()))
    k = chance_bound(MEASURED_K)
    print(f"the trained policy, measured after the run: {row['solved']}/{row['k']} solved (bound {k})")
    assert (int(row["k"]), int(row["errors"])) == (MEASURED_K, 0), row
    assert int(row["solved"]) >= k, (f"{row['solved']}/{MEASURED_K} solved by the trained policy; a policy still at "
                                     f"chance ({CHANCE}) reaches {k} with probability < {TAIL}")
