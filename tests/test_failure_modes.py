"""What a two-day run meets: a sandbox backend that goes down, a SIGTERM, an engine that scores differently."""

from __future__ import annotations

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
from conftest import SCRIPT, Rig, assert_all_slots_free, log_history, rollouts, run_script, script_env, train_args


def test_all_failing_rollouts_stop_training_with_the_reason(rig, tmp_path):
    proc = run_script(train_args(rig, tmp_path / "out", "--sandbox", "local-down", "--max-steps", "3",
                                 "--max-consecutive-failures", "6"), cwd=tmp_path, timeout=600)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    # Rollouts in flight when the sixth failed may be counted too.
    assert re.match(r"error: training stopped: ([6-9]|\d\d) consecutive rollouts were unscorable", last), last
    assert "sandbox backend unreachable" in last and "--resume" in last
    assert all(reward is None for _, _, reward in rollouts(proc.stdout))
    assert_all_slots_free(rig)


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("whole_group", [False, True], ids=["trainer-only", "process-group"])
def test_sigterm_mid_rollout_leaves_no_child_and_no_session(rig, tmp_path, whole_group):
    # trainer-only: `kill <pid>`, which used to orphan the rollout child (it went on starting rollouts).
    # process-group: what SLURM and Ctrl-C do; the child must not die before it released its server sessions.
    args = train_args(rig, tmp_path / "out", "--max-steps", "50")
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=tmp_path, env=script_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines: list[str] = []
    started = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[harbor] group"):
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert started.wait(300), "".join(lines)[-3000:]
        time.sleep(2)  # the next rollouts are now in flight
        family = descendants(proc.pid)
        assert family, "no rollout child"
        if whole_group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        # Before the first optimizer step there is nothing to save, but a requeue still starts the run.
        assert proc.wait(timeout=120) == 75
        reader.join(timeout=10)
        assert "[harbor] stopped by SIGTERM: no optimizer step yet, nothing to save; exit code 75" in "".join(lines)
        # multiprocessing's resource tracker ignores SIGTERM by design and leaves once its last user has gone.
        deadline = time.monotonic() + 15
        while (survivors := [pid for pid in family if alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not survivors, [Path(f"/proc/{pid}/cmdline").read_bytes()[:200] for pid in survivors]
        assert "Traceback" not in "".join(lines)
        assert_all_slots_free(rig)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def skewed_run(tmp_path_factory, tiny_model):
    """One run read by two tests: an engine that samples at T but reports logprobs at T + 0.3, and a task list whose
    first task never scores."""
    work = tmp_path_factory.mktemp("skewed")
    skewed = Rig(work / "rig", tiny_model, ["--score-temperature-offset", "0.3"])
    try:
        proc = run_script(train_args(skewed, work / "out", "--tasks", "broken,coin,coin2,echo-hello", "--max-steps",
                                     "2", "--save-steps", "2"), cwd=work)
    finally:
        skewed.stop()
    return proc, work / "out"


def test_an_engine_scoring_at_another_temperature_moves_ratio_and_kl(skewed_run):
    # The control for the exact ratio of 1 in the training test: the same run against an engine that samples at
    # T but reports logprobs at T + 0.3 must show it.
    proc, out = skewed_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = log_history(out)[0]
    assert abs(first["ratio"] - 1.0) > 1e-3 or first["kl"] > 1e-4, first


def test_a_task_that_never_scores_does_not_pin_the_resume_position(skewed_run):
    # TRL resumes at the first task group that was never trained; a group whose rollouts all failed never is, so
    # every later resume would restart at the broken task and replay all the tasks after it.
    proc, out = skewed_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    broken = [r for _, name, r in rollouts(proc.stdout) if name == "broken"]
    assert broken and all(r is None for r in broken)
    assert json.loads((out / "checkpoint-2" / "rollout_state.json").read_text())["prompt_index"] >= 2
