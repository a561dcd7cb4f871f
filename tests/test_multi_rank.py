"""Several trainer ranks, launched as the SLURM wrappers launch them (`accelerate launch --num_processes N`): a stop
while rank 0 waits for rollouts reaches every rank, every rank writes its part of the checkpoint and exits 75, and the
same command resumes from that checkpoint, the task order continuing (and stops again, before its first step).

On CPU the ranks run DDP over gloo: accelerate runs FSDP only on GPUs. What the GPU path adds (FSDP2's parameter
gathers in the weight sync and the checkpoint save, NCCL) is not exercised here; the checkpoint files FSDP writes are
covered in test_preemption.py with accelerate's own save functions.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import GENERATIONS, POLICY, SCRIPT, free_port, log_history, post_json, rollouts, script_env, train_args
from test_preemption import agh, assert_resumed_order

REQUEUE = 75
RANKS = 2
EVAL_TASKS = ["echo-hello", "never"]


def launch(args: list[str], cwd: Path, stop_when) -> tuple[int, str]:
    """Run the script on RANKS processes with accelerate's launcher, as the SLURM wrappers do; once `stop_when(output
    so far)` holds, SIGTERM every process of the job, as SLURM does."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(RANKS),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), str(SCRIPT), *args]
    # The launcher SIGKILLs ranks this long after forwarding a SIGTERM (the wrappers set it from their grace period).
    proc = subprocess.Popen(command, cwd=cwd, env=script_env(TORCH_ELASTIC_SHUTDOWN_TIMEOUT="600"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines: list[str] = []
    reached, ended = threading.Event(), threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if not reached.is_set() and stop_when("".join(lines)):
                reached.set()
                ended.set()
        ended.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code = None
    try:
        ended.wait(900)
        if reached.is_set():
            os.killpg(proc.pid, signal.SIGTERM)
            code = proc.wait(timeout=900)
            reader.join(timeout=60)  # the ranks may still be writing their last lines when the launcher returns
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        output = "".join(lines)
        print(f"$ accelerate launch --num_processes {RANKS} async_grpo_harbor.py {' '.join(args)}\n{output[-30000:]}")
    assert reached.is_set(), "the run ended, or never got to the point to stop it at"
    return code, output


@pytest.fixture(scope="module")
def stopped_and_resumed(rig, tmp_path_factory):
    work = tmp_path_factory.mktemp("ranks")
    out = work / "out"
    # Two micro-batches per step, --max-staleness 0 and an engine that holds every request once the weights of step 1
    # are in: after step 1 no sample can arrive (those sampled before are stale), so step 2 waits for its second
    # micro-batch, rank 0 in the rollout queue and rank 1 in accelerate's batch broadcast, when the SIGTERM lands.
    # --save-steps beyond the run: the checkpoint is the stop's own. A held-out eval before each launch's first step
    # (step 0, then step 1 in the resumed one), which rank 0 runs while rank 1 waits for it.
    command = train_args(rig, out, "--max-steps", "3", "--micro-batches-per-step", "2", "--save-steps", "100",
                         "--max-staleness", "0", "--resume", "auto", "--eval-tasks", ",".join(EVAL_TASKS),
                         "--eval-k", "1", "--eval-steps", "0")
    hold = rig.engine_stats()["weight_version"] + 2  # the cold sync, step 1
    post_json(f"{rig.engine_url}/stand_in/policy", {**POLICY, "hold_from_weight_version": hold})
    try:
        code, first = launch(command, work, lambda output: "{'loss'" in output)
    finally:
        post_json(f"{rig.engine_url}/stand_in/policy", POLICY)
    saved = json.loads((out / "checkpoint-1" / "rollout_state.json").read_text())
    files = sorted(p.name for p in (out / "checkpoint-1").iterdir())
    # The same command resumes; stopped again once it has run the untrained groups and one more, long before a
    # step's two micro-batches are in: a stop before the first batch of a launch.
    groups = set(range(len(saved["pending"]) + 1))
    resumed_code, resumed = launch(command, work, lambda output: {g for g, *_ in rollouts(output)} >= groups)
    return code, first, saved, files, resumed_code, resumed, out


def test_a_stop_while_waiting_for_rollouts_checkpoints_every_rank(stopped_and_resumed):
    code, first, saved, files, _, _, out = stopped_and_resumed
    assert code != 0  # the launcher reports its ranks' 75 as a failure; the SLURM wrappers requeue on it
    assert_stopped_every_rank(first, out, saved)
    # The step under way was dropped, its collated micro-batch with it: those groups run again first.
    assert saved["pending"]
    # Each rank wrote its own RNG state into the one checkpoint, which is whole.
    assert {f"rng_state_{rank}.pth" for rank in range(RANKS)} <= set(files), files
    assert agh.checkpoint_problem(out / "checkpoint-1") is None
    assert [e["step"] for e in log_history(out, 1)] == [1]


def assert_stopped_every_rank(output: str, out: Path, saved: dict) -> None:
    assert re.search(rf"\[harbor\] stopped by SIGTERM: checkpoint {re.escape(str(out))}/checkpoint-1 \(step 1, all "
                     rf"{RANKS} ranks\); a resume runs its {len(saved['pending'])} untrained groups first, then tasks "
                     rf"from position {saved['prompt_index']}; exit code 75 \(requeue\)\. Resume: uv run "
                     r"async_grpo_harbor\.py .* --resume auto\n", output), output[-5000:]
    assert "[harbor] rank 1: stopped with rank 0 by SIGTERM; exit code 75" in output
    assert output.count("[harbor] SIGTERM: stopping") == 1, "rank 0 alone speaks"
    assert 'async_grpo_harbor.py", line' not in output, "no rank failed"


def test_the_other_ranks_wait_for_rank_0s_held_out_eval(stopped_and_resumed):
    """Rank 0 alone runs the eval, before the launch's first step, while rank 1 waits for it in a group of its own,
    outside training's collectives; then every rank trains on, and stops together."""
    _, first, _, _, _, resumed, out = stopped_and_resumed
    for step, output in ((0, first), (1, resumed)):
        assert len(re.findall(rf"\[harbor\] eval at step {step}: pass rate [\d.]+ \(\d/2\) on 2 held-out tasks",
                              output)) == 1, output[-5000:]
        assert "[harbor] rank 1: stopped with rank 0 by SIGTERM" in output  # it got past the eval, into training
    assert sorted((r["step"], r["task"]) for r in csv.DictReader((out / "eval.csv").open())) == \
        [(str(step), task) for step in (0, 1) for task in sorted(EVAL_TASKS)]


def test_the_process_group_timeout_is_sized_from_the_rollout_budget(stopped_and_resumed):
    # --num-generations x (60 s agent timeout + 1800 s margin), as the hyper-parameter table reports it.
    _, first, *_ = stopped_and_resumed
    timeout = timedelta(seconds=GENERATIONS * (60 + 1800))
    assert re.search(rf"ranks\s+{RANKS} ranks \(gloo\), collective timeout {timeout}\n", first), first[:5000]


def test_the_same_command_resumes_every_rank_with_the_task_order_continuing(stopped_and_resumed):
    _, _, saved, files, code, resumed, out = stopped_and_resumed
    assert re.search(rf"PASS  resume\s+{re.escape(str(out))}/checkpoint-1\n", resumed)
    # First the groups the stop left untrained, then the tasks after the last one taken.
    assert_resumed_order(saved, resumed)
    # Stopped again before any step: every rank exits 75, and the checkpoint still holds everything.
    assert code != 0
    assert_stopped_every_rank(resumed, out, saved)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    assert json.loads((out / "checkpoint-1" / "rollout_state.json").read_text()) == saved
