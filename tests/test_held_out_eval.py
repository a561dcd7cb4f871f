"""The held-out eval during training (--eval-tasks): a stop request cuts it short and the run saves at once; a resume
measures again only an eval that is not on record; Ctrl-C stops the run; the final eval runs once training rollouts
have stopped; a cut-short eval says what it measured and logs no pass rate over another task set; --eval-steps takes
transformers' fraction; the other ranks wait for rank 0's eval within a timeout sized for it.

Each run here holds the stand-in engine's replies at a chosen weight version (`hold_from_weight_version`), so an eval
is under way and cannot finish when the test signals the run: the moment is a state, not a sleep."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import (POLICY, SCRIPT, assert_all_slots_free, load_script, post_json, run_main, run_script, script_env,
                      train_args)
from test_preemption import jsonl
from test_refusals import assert_refused

agh = load_script()

EVAL_TASKS = ["echo-hello", "never"]  # held out: training runs on the coin tasks alone, so their trials tell apart
TRAIN_TASKS = "coin,coin2"
EVAL = ["--eval-tasks", ",".join(EVAL_TASKS), "--eval-k", "1", "--eval-steps", "1"]


def eval_trials(rig, earlier: set[Path]) -> int:
    """Held-out rollouts started since `earlier` (each Harbor trial is a dir named after its task)."""
    trials = rig.workdir / "trials"
    return sum(p.name.startswith(tuple(f"oe-{t}-" for t in EVAL_TASKS))
               for p in (set(trials.iterdir()) if trials.exists() else set()) - earlier)


def run_and_signal(args: list[str], cwd: Path, when, signum: int) -> tuple[int, str]:
    """Run the script in its own process group; once `when()` holds, send `signum` to the group (as a terminal's
    Ctrl-C or SLURM does), and wait for the exit."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=cwd, env=script_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 600
        while not when():
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.5)
        os.killpg(proc.pid, signum)
        code = proc.wait(timeout=300)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = "".join(lines)
    print(output[-20000:])
    return code, output


def eval_rows(out: Path) -> list[dict]:
    return list(csv.DictReader((out / "eval.csv").open()))


def eval_entries(out: Path, step: int) -> list[dict]:
    """The eval/* log entries a checkpoint holds."""
    history = json.loads((out / f"checkpoint-{step}" / "trainer_state.json").read_text())["log_history"]
    return [e for e in history if "eval/tasks" in e or "eval/pass_rate" in e]


@pytest.fixture(scope="module")
def evaluated_stopped_resumed(rig, tmp_path_factory):
    """One run in three launches of the same flags: one step (checkpoint-1, whose step-1 eval is whole); --max-steps 3
    resumed from it and stopped by SIGTERM while step 2's eval waits on the held engine; the same command again."""
    work = tmp_path_factory.mktemp("held-out")
    out = work / "out"

    def command(steps: int) -> list[str]:
        # --save-steps beyond the run: a checkpoint is the last step's or the stop's own.
        return train_args(rig, out, "--max-steps", str(steps), "--save-steps", "100", "--resume", "auto", *EVAL,
                          tasks=TRAIN_TASKS)

    first = run_script(command(1), cwd=work)
    first_records = (jsonl(out / "rollouts.jsonl"), jsonl(out / "eval_rollouts.jsonl"))
    trials = rig.workdir / "trials"
    earlier = set(trials.iterdir()) if trials.exists() else set()
    hold = rig.engine_stats()["weight_version"] + 2  # the resumed launch's cold sync, then step 2
    post_json(f"{rig.engine_url}/stand_in/policy", {**POLICY, "hold_from_weight_version": hold})
    try:
        # Step 2's eval has started both rollouts, which wait at the engine (step 1's is on record: not run again).
        code, stopped = run_and_signal(command(3), work, lambda: eval_trials(rig, earlier) >= len(EVAL_TASKS),
                                       signal.SIGTERM)
    finally:
        post_json(f"{rig.engine_url}/stand_in/policy", POLICY)
    assert_all_slots_free(rig)
    at_stop = (eval_rows(out), jsonl(out / "eval_rollouts.jsonl"))
    resumed = run_script(command(3), cwd=work)
    return out, first, first_records, (code, stopped, at_stop), resumed


def test_a_stop_during_the_held_out_eval_cuts_it_short_and_saves_the_step(evaluated_stopped_resumed):
    out, _, _, (code, stopped, (rows, records)), _ = evaluated_stopped_resumed
    assert code == 75, stopped[-3000:]
    last = stopped.strip().splitlines()[-1]
    assert re.fullmatch(rf"\[harbor\] stopped by SIGTERM: checkpoint {re.escape(str(out))}/checkpoint-2 \(step 2\); "
                        r".*exit code 75 \(requeue\)\. Resume: .*", last), last
    # Cut short, not waited for: no held-out rollout of step 2 finished, and the line says what was measured.
    assert "[harbor] eval at step 2 cut short: 0 of 2 held-out tasks measured in full" in stopped
    assert [r for r in records if r.get("step") == 2] == [] and not [r for r in rows if r["step"] == "2"]
    # Recorded as partial in the checkpoint: no pass rate over a task set other than the planned one.
    partial = [e for e in eval_entries(out, 2) if e["step"] == 2]
    assert partial == [{**partial[0], "eval/tasks": 2, "eval/tasks_measured": 0}] and "eval/pass_rate" not in partial[0]


def test_a_resume_does_not_measure_again_the_eval_on_record(evaluated_stopped_resumed):
    out, _, _, (_, stopped, _), resumed = evaluated_stopped_resumed
    # Step 1's eval is whole in checkpoint-1: the launch resumed from it did not run it again.
    assert "[harbor] eval at step 1: on record in the resumed checkpoint, not measured again" in stopped
    steps = [int(r["step"]) for r in eval_rows(out)]
    assert steps.count(1) == len(EVAL_TASKS), steps
    assert [r["step"] for r in jsonl(out / "eval_rollouts.jsonl")].count(1) == len(EVAL_TASKS)
    assert [e["step"] for e in eval_entries(out, 3)].count(1) == 1
    # Step 2's eval, cut short by the stop, is measured again by the next resume; then step 3's, once.
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert steps.count(2) == len(EVAL_TASKS) and steps.count(3) == len(EVAL_TASKS), steps
    assert [e["step"] for e in eval_entries(out, 3) if agh.whole_eval(e)] == [0, 1, 2, 3]


def test_every_held_out_rollout_record_names_its_step(evaluated_stopped_resumed):
    out, *_ = evaluated_stopped_resumed
    records = jsonl(out / "eval_rollouts.jsonl")
    assert sorted(r["step"] for r in records) == sorted([0, 1, 2, 3] * len(EVAL_TASKS)), records
    assert {(r["step"], r["task"]) for r in records} == {(s, t) for s in range(4) for t in EVAL_TASKS}


def test_the_final_eval_runs_once_training_rollouts_have_stopped(evaluated_stopped_resumed):
    _, first, (train_records, eval_records), _, _ = evaluated_stopped_resumed
    assert first.returncode == 0, first.stdout[-3000:]
    lines = first.stdout.splitlines()
    stopped = lines.index("[harbor] rollout worker stopped: no training rollout runs beside the final eval")
    final = next(i for i, line in enumerate(lines) if line.startswith("[harbor] eval at step 1: pass rate"))
    assert stopped < final
    # Every training rollout of the launch started before the final eval's first one.
    assert max(r["started"] for r in train_records) < min(r["started"] for r in eval_records if r["step"] == 1)


def test_ctrl_c_during_the_held_out_eval_stops_the_run(rig, tmp_path):
    out = tmp_path / "out"
    trials = rig.workdir / "trials"
    earlier = set(trials.iterdir()) if trials.exists() else set()
    # Every reply held from the cold sync on, until the run has exited: the eval before the first step waits at the
    # engine when Ctrl-C lands, and nothing but the interrupt can end it.
    post_json(f"{rig.engine_url}/stand_in/policy",
              {**POLICY, "hold_from_weight_version": rig.engine_stats()["weight_version"] + 1})
    try:
        code, output = run_and_signal(train_args(rig, out, "--max-steps", "1", *EVAL, tasks=TRAIN_TASKS), tmp_path,
                                      lambda: eval_trials(rig, earlier) >= len(EVAL_TASKS), signal.SIGINT)
    finally:
        post_json(f"{rig.engine_url}/stand_in/policy", POLICY)
    assert code == 130, output[-3000:]
    assert f"[harbor] interrupted; checkpoints so far are in {out}" in output
    assert "Traceback" not in output and not list(out.glob("checkpoint-*"))
    assert_all_slots_free(rig)


def test_eval_steps_below_one_is_a_fraction_of_max_steps_as_in_transformers():
    assert agh.parse_args(["--max-steps", "20", "--eval-steps", "0.1"]).eval_steps == 2
    assert agh.parse_args(["--max-steps", "25", "--eval-steps", "0.1"]).eval_steps == 3  # rounded up
    assert agh.parse_args(["--eval-steps", "0"]).eval_steps == 0


def test_eval_steps_above_one_must_be_whole(tmp_path):
    assert_refused(run_main(["--eval-steps", "2.5"], cwd=tmp_path),
                   "--eval-steps 2.5: give a whole number of steps, or a fraction of --max-steps below 1")


def test_the_other_ranks_wait_for_the_eval_within_a_timeout_sized_for_it():
    # 40 held-out tasks x k=8 at 16 in flight: 20 waves of rollouts, each up to its rollout budget (agent timeout +
    # 30 min) after up to --harbor-retry-window for a full server. The process group's timeout covers one group of 8.
    args = agh.parse_args(["--num-generations", "8", "--max-inflight", "16", "--eval-k", "8", "--agent-timeout", "600",
                           "--harbor-retry-window", "300"])
    budget = agh.eval_budget_s(args, 40)
    assert budget == 20 * (600 + 1800 + 300)
    assert budget > args.ddp_timeout == 8 * (600 + 1800)
    # Two harnesses: every task is measured under each.
    args.harnesses = ["mini-swe-agent", "opencode"]
    assert agh.eval_budget_s(args, 40) == 2 * budget

