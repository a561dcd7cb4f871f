"""Preemption: SIGTERM / SIGUSR1 save a checkpoint and exit 75, and the same command, relaunched, continues exactly
where the run stopped (optimizer steps, model version, task order), skipping a corrupt latest checkpoint."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import (SCRIPT, TASKS, assert_all_slots_free, free_port, load_script, log_history, rollouts, run_main,
                      run_script, script_env, train_args)
from safetensors.torch import load_file
from test_refusals import assert_refused

agh = load_script()

REQUEUE = 75


def run_until_signalled(args: list[str], cwd: Path) -> tuple[int, str]:
    """Train until the first optimizer step is logged, then preempt as SLURM does: SIGTERM to every process of the
    job, then, while the trainer is stopping, a second notice (SIGUSR1)."""
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


@pytest.fixture(scope="module")
def preempted_and_relaunched(rig, tmp_path_factory):
    work = tmp_path_factory.mktemp("preempt")
    out = work / "out"
    # --save-steps beyond the run: every checkpoint here is the preemption's own.
    command = train_args(rig, out, "--max-steps", "2", "--save-steps", "100", "--resume", "auto")
    code, first = run_until_signalled(command, work)
    assert_all_slots_free(rig)
    saved = {p.name: (json.loads((p / "rollout_state.json").read_text()), log_history(out, int(p.name[11:])))
             for p in out.glob("checkpoint-*")}
    # What a save killed midway would leave if it wrote in place: the next step's checkpoint, weights cut short.
    partial = out / "checkpoint-2"
    shutil.copytree(out / "checkpoint-1", partial)
    weights = partial / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    relaunched = run_script(command, cwd=work)
    return code, first, saved, relaunched, out


def test_sigterm_saves_the_finished_step_and_asks_for_a_requeue(preempted_and_relaunched, rig):
    code, first, saved, _, out = preempted_and_relaunched
    assert code == REQUEUE
    last = first.strip().splitlines()[-1]
    assert re.fullmatch(rf"\[harbor\] stopped by SIGTERM: checkpoint {re.escape(str(out))}/checkpoint-1 \(step 1\); "
                        r"exit code 75 \(requeue\)\. Resume: uv run async_grpo_harbor\.py .* --resume auto", last), last
    assert "SIGUSR1 again: already stopping" in first
    assert "Traceback" not in first
    assert list(saved) == ["checkpoint-1"]
    assert [e["step"] for e in saved["checkpoint-1"][1]] == [1]


def test_the_same_command_skips_the_partial_checkpoint_and_continues_exactly(preempted_and_relaunched):
    _, first, saved, relaunched, out = preempted_and_relaunched
    assert relaunched.returncode == 0, relaunched.stderr[-3000:]
    assert re.search(rf"warning: skipping {re.escape(str(out))}/checkpoint-2: model\.safetensors: .*incomplete",
                     relaunched.stderr), relaunched.stderr[-3000:]
    assert re.search(rf"resume from\s+{re.escape(str(out))}/checkpoint-1\n", relaunched.stdout)
    # No optimizer step lost or repeated: the relaunch ran exactly step 2, on the optimizer state of step 1.
    assert [e["step"] for e in log_history(out, 2)] == [1, 2]
    assert log_history(out, 2)[0] == saved["checkpoint-1"][1][0]
    optimizer = torch.load(out / "checkpoint-2" / "optimizer.pt", weights_only=False)
    assert {int(s["step"]) for s in optimizer["state"].values()} == {2}
    # The model version counts on: one cold sync at launch and one per step, never reused.
    before, after = (saved["checkpoint-1"][0],
                     json.loads((out / "checkpoint-2" / "rollout_state.json").read_text()))
    assert after["model_version"] == before["model_version"] + 2
    # The task order continues at the saved position: no task is revisited before the ones not yet visited.
    tasks, position = TASKS.split(","), before["prompt_index"]
    assert position > 0
    groups = sorted({(group, name) for group, name, _ in rollouts(relaunched.stdout)})
    assert groups and all(name == tasks[(position + group) % len(tasks)] for group, name in groups), groups
    # The partial checkpoint was replaced by a whole one.
    assert agh.checkpoint_problem(out / "checkpoint-2") is None
    assert load_file(out / "checkpoint-2" / "model.safetensors")


@pytest.mark.parametrize("damage", ["no optimizer.pt", "cut trainer_state.json", "no rollout_state.json"])
def test_a_damaged_checkpoint_is_not_resumed_from(preempted_and_relaunched, tmp_path, damage):
    _, _, _, _, out = preempted_and_relaunched
    run = tmp_path / "out"
    for step in (1, 2):
        shutil.copytree(out / f"checkpoint-{step}", run / f"checkpoint-{step}")
    file = run / "checkpoint-2" / damage.split()[1]
    if damage.startswith("no"):
        file.unlink()
    else:
        file.write_text(file.read_text()[:40])
    assert agh.latest_checkpoint(str(run)) == str(run / "checkpoint-1")


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
