"""Preemption: SIGTERM / SIGUSR1 save a checkpoint and exit 75, and the same command, relaunched, continues exactly
where the run stopped (optimizer steps, model version, task order), past a save that was killed midway."""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import (GENERATIONS, POLICY, SCRIPT, TASKS, assert_all_slots_free, default_filter, free_port,
                      load_script, log_history, post_json, rollouts, run_main, run_script, script_env, train_args)
from safetensors.torch import load_file
from test_refusals import assert_refused

agh = load_script()

REQUEUE = 75


def run_until_signalled(args: list[str], cwd: Path, settled=lambda: True) -> tuple[int, str]:
    """Train until the first optimizer step is logged and `settled()` holds, then preempt as SLURM does: SIGTERM to
    every process of the job, then, while the trainer is stopping, a second notice (SIGUSR1)."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=cwd, env=script_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines: list[str] = []
    stepped, stopping = threading.Event(), threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("{'loss'"):
                stepped.set()
            if "stopping at the end of this optimizer step" in line:
                stopping.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert stepped.wait(600), "".join(lines)[-3000:]
        deadline = time.monotonic() + 300
        while not settled():
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGTERM)
        assert stopping.wait(60), "".join(lines)[-3000:]
        proc.send_signal(signal.SIGUSR1)
        code = proc.wait(timeout=300)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = "".join(lines)
    print(output[-20000:])
    return code, output


def jsonl(path: Path) -> list[dict]:
    """The records of a file the run appends to, but for a line still being written."""
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        with contextlib.suppress(ValueError):
            records.append(json.loads(line))
    return records


@pytest.fixture(scope="module")
def preempted_and_relaunched(rig, tmp_path_factory):
    work = tmp_path_factory.mktemp("preempt")
    out = work / "out"
    # Zero-variance groups kept out, as by default: TASKS hold one task every rollout solves and one none does.
    # --save-steps beyond the run: every checkpoint here is the preemption's own. --max-staleness 0 and an engine
    # that holds every request once the weights of step 1 are in: no sample can arrive after step 1 (those sampled
    # before are stale), so the SIGTERM lands while the trainer waits for rollouts, its usual state. Step 2's one
    # micro-batch was collated ahead, before step 1 trained: it is whole, so it still trains before the stop. An
    # agent timeout beyond the run: a held rollout never ends before the stop.
    command = default_filter(train_args(rig, out, "--max-steps", "3", "--save-steps", "100", "--max-staleness", "0",
                                        "--agent-timeout", "600", "--resume", "auto"))
    hold = rig.engine_stats()["weight_version"] + 2  # the cold sync, step 1
    trials = rig.workdir / "trials"
    earlier = set(trials.iterdir()) if trials.exists() else set()

    def settled() -> bool:
        """Nothing is left to settle before the stop: every rollout started is recorded or waits at the engine, and
        every group whose rollouts are all recorded has been scored."""
        recorded = collections.Counter(r["group"] for r in jsonl(out / "rollouts.jsonl"))
        started = len(set(trials.iterdir()) - earlier)
        whole = {g for g, n in recorded.items() if n == GENERATIONS}
        return (started == recorded.total() + rig.engine_stats()["held"]
                and whole <= {r["group"] for r in jsonl(out / "groups.jsonl")})

    post_json(f"{rig.engine_url}/stand_in/policy", {**POLICY, "hold_from_weight_version": hold})
    try:
        code, first = run_until_signalled(command, work, settled)
    finally:
        post_json(f"{rig.engine_url}/stand_in/policy", POLICY)
    first_groups = jsonl(out / "groups.jsonl")
    assert_all_slots_free(rig)
    saved = {p.name: (json.loads((p / "rollout_state.json").read_text()), log_history(out, int(p.name[11:])))
             for p in out.glob("checkpoint-*")}
    # What a save killed midway leaves: the next step's checkpoint, its weights cut short, and TRL's rollout_state.json
    # (written first) without the resume order the script writes last.
    partial = out / "checkpoint-3"
    shutil.copytree(out / "checkpoint-2", partial)
    weights = partial / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    state = json.loads((partial / "rollout_state.json").read_text())
    (partial / "rollout_state.json").write_text(json.dumps({k: state[k] for k in ("prompt_index", "model_version")}))
    relaunched = run_script(command, cwd=work)
    return code, first, saved, relaunched, out, (first_groups, jsonl(out / "groups.jsonl")[len(first_groups):])


def test_sigterm_saves_the_finished_step_and_asks_for_a_requeue(preempted_and_relaunched, rig):
    code, first, saved, _, out, _ = preempted_and_relaunched
    assert code == REQUEUE
    last = first.strip().splitlines()[-1]
    assert re.fullmatch(rf"\[harbor\] stopped by SIGTERM: checkpoint {re.escape(str(out))}/checkpoint-2 \(step 2\); "
                        r"a resume runs its \d+ untrained groups first, then tasks from position \d+; "
                        r"exit code 75 \(requeue\)\. Resume: uv run async_grpo_harbor\.py .* --resume auto", last), last
    assert "SIGUSR1 again: already stopping" in first
    assert "Traceback" not in first
    assert list(saved) == ["checkpoint-2"]
    assert [e["step"] for e in saved["checkpoint-2"][1]] == [1, 2]


def test_the_same_command_ignores_a_killed_save_and_continues_exactly(preempted_and_relaunched):
    _, first, saved, relaunched, out, _ = preempted_and_relaunched
    assert relaunched.returncode == 0, relaunched.stderr[-3000:]
    assert re.search(rf"PASS  resume\s+{re.escape(str(out))}/checkpoint-2\n", relaunched.stdout)
    # No optimizer step lost or repeated: the relaunch ran exactly step 3, on the optimizer state of step 2.
    assert [e["step"] for e in log_history(out, 3)] == [1, 2, 3]
    assert log_history(out, 3)[:2] == saved["checkpoint-2"][1]
    optimizer = torch.load(out / "checkpoint-3" / "optimizer.pt", weights_only=False)
    assert {int(s["step"]) for s in optimizer["state"].values()} == {3}
    # The model version counts on: one cold sync at launch and one per step, never reused.
    before, after = (saved["checkpoint-2"][0],
                     json.loads((out / "checkpoint-3" / "rollout_state.json").read_text()))
    assert after["model_version"] == before["model_version"] + 2
    # The task order continues: first the groups the stop left untrained, then the tasks after the last one taken.
    assert_resumed_order(before, relaunched.stdout)
    # The killed save was skipped, with a warning, and the relaunch's whole checkpoint of step 3 replaced it.
    assert f"warning: skipping {out}/checkpoint-3: a save cut short" in relaunched.stderr
    assert agh.checkpoint_problem(out / "checkpoint-3") is None
    assert load_file(out / "checkpoint-3" / "model.safetensors")


def test_a_resume_runs_every_planned_group_once_with_zero_variance_groups_kept_out(preempted_and_relaunched):
    # A checkpoint's rollout_state.json: the visits below prompt_index are settled, except the pending ones. Settled:
    # trained by a step of the checkpoint, or kept out for zero variance (or without a scorable rollout), which no
    # step ever trains: a resume that ran those again would repeat them, launch after launch.
    _, first, saved, _, out, (_, resumed_groups) = preempted_and_relaunched
    state, history = saved["checkpoint-2"]
    settled = set(range(state["prompt_index"])) - set(state["pending"])
    # As the first launch printed them (it started at visit 0: its group n is visit n), and what its steps trained.
    kept_out = {int(g) for g in re.findall(r"\[harbor\] group (\d+): zero variance, .*: kept out of training", first)}
    trained = sum(e["harbor/trained/groups"] for e in history)
    assert kept_out and trained, (first, history)
    assert kept_out <= settled and len(settled) == trained + len(kept_out), (state, kept_out, history)
    # The resumed launch runs no settled visit and no visit twice; whatever its checkpoint settles anew, it ran.
    ran = [r["visit"] for r in resumed_groups]
    assert ran and len(ran) == len(set(ran)) and not set(ran) & settled, (ran, state)
    final = json.loads((out / "checkpoint-3" / "rollout_state.json").read_text())
    settled_after = set(range(final["prompt_index"])) - set(final["pending"])
    assert settled <= settled_after and settled_after - settled <= set(ran), (state, final, ran)


def assert_resumed_order(saved: dict, stdout: str) -> None:
    tasks, pending, position = TASKS.split(","), saved["pending"], saved["prompt_index"]
    assert position > 0
    visits = [*pending, *range(position, position + 100)]
    groups = sorted({(group, name) for group, name, _ in rollouts(stdout)})
    assert groups and all(name == tasks[visits[group] % len(tasks)] for group, name in groups), (saved, groups)


def test_a_resume_runs_the_untrained_groups_first_then_continues_the_order():
    rows = ["a", "b", "c", "d"]
    # The checkpoint left visits 5 and 7 untrained and the order going on at visit 9 (visit v is row v % 4).
    order = agh.VisitOrder(rows, pending=[5, 7], start=9)
    assert [order.visit(group) for group in range(7)] == [5, 7, 9, 10, 11, 12, 13]
    assert list(order) == ["b", "d", "b", "c", "d"], "TRL's worker's first pass over the rows"
    assert list(order) == rows, "and every later one"
    # Stopped once groups 0-3 were taken, 0 and 3 trained: 1 and 2 run again, then visit 11 (group 4's) on.
    assert order.after(4, done={0, 3}) == ([7, 9], 11)
    # Stopped before taking every group the previous launch left: the rest stay first.
    assert order.after(1, done=set()) == ([5, 7], 9)


def test_a_resume_trains_at_the_learning_rate_it_is_given(preempted_and_relaunched, rig, tmp_path):
    # The optimizer and schedule a resume loads carry the checkpoint's rate: a run relaunched with a lower
    # --learning-rate (after a fall) must train at it, not quietly at the old one.
    out = tmp_path / "out"
    shutil.copytree(preempted_and_relaunched[4], out)
    relaunched = run_script(default_filter(train_args(rig, out, "--max-steps", "4", "--save-steps", "1",
                                                      "--resume", "auto", "--learning-rate", "2e-4")), cwd=tmp_path)
    assert relaunched.returncode == 0, relaunched.stderr[-3000:]
    history = log_history(out, 4)
    assert [(e["step"], e["learning_rate"]) for e in history] == [(1, 1e-3), (2, 1e-3), (3, 1e-3), (4, 2e-4)], history
    optimizer = torch.load(out / "checkpoint-4" / "optimizer.pt", weights_only=False)
    assert {group["lr"] for group in optimizer["param_groups"]} == {2e-4}, optimizer["param_groups"]


# The state files this script reads; a save killed midway lacks the resume order written last (the relaunch above).
@pytest.mark.parametrize("damage", ["cut trainer_state.json", "no rollout_state.json"])
def test_a_damaged_checkpoint_is_not_resumed_from(preempted_and_relaunched, tmp_path, damage):
    _, _, _, _, out, _ = preempted_and_relaunched
    run = tmp_path / "out"
    for step in (2, 3):
        shutil.copytree(out / f"checkpoint-{step}", run / f"checkpoint-{step}")
    file = run / "checkpoint-3" / damage.split()[1]
    if damage.startswith("no"):
        file.unlink()
    else:
        file.write_text(file.read_text()[:40])
    assert agh.resolve_resume(argparse.Namespace(resume="auto", output_dir=str(run))) == str(run / "checkpoint-2")


def test_resume_auto_refuses_a_run_name_that_changes_per_launch(tmp_path):
    proc = run_main(["--resume", "auto", "--vllm-url", f"http://127.0.0.1:{free_port()}"], cwd=tmp_path,
                    SLURM_JOB_ID="")
    assert_refused(proc, "--resume auto", "--run-name")


def test_resume_auto_starts_fresh_under_slurm(tmp_path):
    # The SLURM job id names the run, so a first launch with nothing to resume goes on to training set-up.
    url = f"http://127.0.0.1:{free_port()}"
    proc = run_main(["--resume", "auto", "--vllm-url", url], cwd=tmp_path, SLURM_JOB_ID="4242")
    assert_refused(proc, f"vLLM is not reachable at {url}")


def test_resume_auto_refuses_when_every_checkpoint_is_unusable(tmp_path):
    (tmp_path / "out" / "checkpoint-3").mkdir(parents=True)
    proc = run_main(["--resume", "auto", "--output-dir", str(tmp_path / "out")], cwd=tmp_path)
    assert proc.returncode == 2
    assert "warning: skipping" in proc.stderr and "checkpoint-3" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --resume: no usable checkpoint in")
