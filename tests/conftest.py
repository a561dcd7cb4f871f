"""The CPU rig: a stand-in engine and the REAL Harbor server, started for the tests, and a way to run the script.

`tests/run.sh` provides the two interpreters: this process (the trainer's Python 3.11 with CPU torch) and
$AGH_SERVER_PYTHON (Python 3.12 with openenv[harbor] and mini-swe-agent).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import io
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import traceback
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import pytest

# Nothing here reaches the hub. huggingface_hub reads this once, at its first import, which the collection of a test
# module can trigger: without it an in-process preflight of a hub model id waits ~23 s on the network.
os.environ["HF_HUB_OFFLINE"] = "1"
# A shell starts a background job (`cmd &`, as a CI runner may) with SIGINT ignored, and every process started under
# it inherits that: the script would never see the Ctrl-C its tests send (seen: a fresh-clone run's Ctrl-C test waited
# out its 300 s). They send it as a terminal does to its foreground job, whose SIGINT is the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = Path(__file__).resolve().parents[1]
RIG = ROOT / "tests" / "rig"
SCRIPT = ROOT / "async_grpo_harbor.py"
SERVED_NAME = "tiny-qwen3"
# Solve rates of the stand-in engine's scripted policy: one task always solved, one never, two in exactly half of
# their rollouts (tests/rig/engine.py), so every group of a coin task varies.
POLICY = {"tasks": {"echo-hello": 1.0, "never": 0.0, "coin": 0.5, "coin2": 0.5}, "answers": {"echo-hello": "hello"},
          "choices": {"choose": ["cat", "dog", "fox", "tag"]}}
# Credentials users hold; the trainer and the Harbor server get them, and nothing the run prints or writes may
# show them.
SECRETS = {"E2B_API_KEY": "e2b_fake4f2a9c1d77", "HF_TOKEN": "hf_fake8812bb0c3e", "OPENAI_API_KEY": "sk-fake19e0aa77"}
# A rollout here is ~1.2k tokens, mostly the shared system prompt; TRL packs samples by unique tokens up to
# max_model_len, so a small context closes a micro-batch every few samples.
MAX_MODEL_LEN = 1600
# What one agent turn may generate: the first prompt (~1.1k) plus this must fit MAX_MODEL_LEN, or the engine refuses
# every call, as vLLM does.
MAX_OUTPUT_TOKENS = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read())


def post_json(url: str, body: dict, timeout: float = 30.0):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


class Service:
    """A child process with its log in a file; its log tail is shown when it fails to come up."""

    def __init__(self, name: str, cmd: list[str], log: Path, ready_url: str, env: dict | None = None,
                 cwd: Path | None = None):
        self.name, self.log, self.ready_url = name, log, ready_url
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=cwd,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                get_json(self.ready_url, timeout=5)
                return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} did not come up:\n" + self.log.read_text()[-3000:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class Rig:
    """One stand-in engine plus one Harbor server pointed at it."""

    def __init__(self, workdir: Path, model_dir: Path, engine_flags: list[str], max_concurrent_envs: int = 8,
                 harbor: bool = True, engine_env: dict[str, str] | None = None, seed: int | None = None):
        """seed: the engine's sampling of the model's choices (POLICY's `seed` unless given)."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir, self.model_dir = workdir, model_dir
        self.max_concurrent_envs = max_concurrent_envs
        policy = workdir / "policy.json"
        policy.write_text(json.dumps(POLICY if seed is None else {**POLICY, "seed": seed}))
        engine_port, harbor_port = free_port(), free_port()
        self.engine_url = f"http://127.0.0.1:{engine_port}"
        self.harbor_url = f"http://127.0.0.1:{harbor_port}"
        # Served in float32 (`vllm serve --dtype float32`, the trainer's default precision), so a first step's
        # importance ratio is exactly 1; the engine's own default, bfloat16 like vLLM's, is for the dtype checks.
        self.engine = Service(
            "engine", [sys.executable, str(RIG / "engine.py"), "--model-dir", str(model_dir), "--port",
                       str(engine_port), "--served-name", SERVED_NAME, "--policy", str(policy),
                       "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32", *engine_flags],
            workdir / "engine.log", f"{self.engine_url}/health", env=engine_env)
        self.harbor = None
        # The Harbor server imports while the engine loads, and serves once the engine answers (its start probes it).
        starting = self.start_harbor(successor=True) if harbor else None
        try:
            self.engine.wait_ready()
        except RuntimeError:
            if starting:
                starting.stop()
            raise
        if not harbor:
            self.harbor_url, self.split = "", str(RIG / "tasks")
            return
        starting.wait_ready()
        self.harbor = starting
        self.split = get_json(f"{self.harbor_url}/harbor_env/splits")[0]["name"]

    def start_harbor(self, successor: bool = False) -> Service:
        """Start the Harbor server on the rig's port, serving once the engine answers. successor: a new one that
        serves once the running one (if any) is gone from the port, for a restart (`serve_when_port_free` in
        rig/harbor_server.py); not yet waited for."""
        log = self.workdir / (f"harbor.{self.harbor.proc.pid}.log" if self.harbor else "harbor.log")
        service = Service(
            "harbor server", [os.environ["AGH_SERVER_PYTHON"], str(RIG / "harbor_server.py"),
                              "--dataset", str(RIG / "tasks"), "--llm-url", f"{self.engine_url}/v1",
                              "--host", "127.0.0.1", "--port", self.harbor_url.rsplit(":", 1)[1],
                              "--capture-port", str(free_port()), "--expose", "direct",
                              "--max-output-tokens", str(MAX_OUTPUT_TOKENS)],
            log, f"{self.harbor_url}/harbor_env/splits",
            env={**SECRETS, "MAX_CONCURRENT_ENVS": str(self.max_concurrent_envs),
                 "RIG_SANDBOX_DIR": str(self.workdir / "sandboxes"), "RIG_WAIT_FOR_ENGINE": "1",
                 "OPENENV_HARBOR_TRIALS_DIR": str(self.workdir / "trials"),
                 **({"RIG_SERVE_WHEN_PORT_FREE": "1"} if successor else {})},
            cwd=self.workdir)
        if not successor:
            service.wait_ready()
            self.harbor = service
        return service

    def restart_harbor(self) -> None:
        self.harbor.stop()
        self.start_harbor()

    def engine_stats(self) -> dict:
        return get_json(f"{self.engine_url}/stand_in/stats")

    def base_args(self) -> list[str]:
        return ["--model", str(self.model_dir), "--vllm-url", self.engine_url, "--harbor-url", self.harbor_url,
                "--dataset", self.split, "--harness", "mini-swe-agent", "--sandbox", "local",
                "--num-generations", "4", "--max-inflight", "4", "--max-completion-length", str(MAX_OUTPUT_TOKENS),
                "--reward-key", "correct,reward", "--report-to", "none"]

    def stop(self) -> None:
        for service in (self.harbor, self.engine):
            if service is not None:
                service.stop()


def script_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(RIG / "sitecustomize"), "AGH_CPU_RIG": "1", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **extra}


def run_script(args: list[str], cwd: Path, timeout: float = 900.0, **env: str) -> subprocess.CompletedProcess:
    """Run the training script as a user would; its output is echoed so a failing test shows it."""
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=script_env(**env), text=True,
                          capture_output=True, timeout=timeout)
    print(f"$ async_grpo_harbor.py {' '.join(args)}\n--- stdout\n{proc.stdout[-20000:]}\n--- stderr\n"
          f"{proc.stderr[-20000:]}")
    return proc


@functools.cache
def load_script():
    """The training script as a module of this process, for tests of its functions and of `main()` in-process."""
    spec = importlib.util.spec_from_file_location("async_grpo_harbor", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: dataclasses resolve the script's annotations through it
    spec.loader.exec_module(module)
    return module


def trainer_without_rollouts(model: Path, out: Path, worker, **config):
    """The script's HarborGRPOTrainer on `model`, its rollout worker a stand-in that never starts: a test puts samples
    on the worker's queue, or builds a batch, and drives TRL's loss and training step itself."""
    script = load_script()
    args = script.HarborGRPOConfig(output_dir=str(out), report_to="none", vllm_url="http://127.0.0.1:9", **config)
    trainer = script.HarborGRPOTrainer(model=str(model), args=args,
                                       processing_class=script.AutoTokenizer.from_pretrained(model),
                                       train_dataset=script.Dataset.from_list([{"prompt": "x"}]),
                                       rollout_worker=worker, weight_transfer=object())
    trainer.current_gradient_accumulation_steps = 1  # what transformers' training loop sets before a step
    trainer.model.train()
    return trainer


def run_main(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """`main(args)` in this process, seen as `run_script` sees the script: exit code, stdout, stderr (an uncaught
    exception is a traceback on stderr and code 1, as Python prints it). For what ends before training: no
    interpreter start, and the libraries a preflight imports load once per session. Python warnings and log records
    go to pytest's own capture here; test_refusals runs one refusal as a process too."""
    script = load_script()
    # The rig's stand-ins, as the script's own process gets them (AGH_CPU_RIG): its preflight asks them of a CPU
    # trainer (NCCL, CUDA IPC), whichever test modules this run collected.
    if str(RIG) not in sys.path:
        sys.path.insert(0, str(RIG))
    import cpu_trainer

    cpu_trainer.install()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    stdout, stderr = io.StringIO(), io.StringIO()
    os.environ.update({k: v for k, v in script_env(**env).items() if k != "PYTHONPATH"})
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = script.main([str(a) for a in args])
            except SystemExit as exc:  # argparse: --help, a malformed value
                code = exc.code
                if not isinstance(code, int):
                    print(code or "", file=sys.stderr, end="\n" if code else "")
                    code = 0 if code is None else 1
            except Exception:  # noqa: BLE001 - what the interpreter would print and exit with
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    proc = subprocess.CompletedProcess(["main", *args], int(code), stdout.getvalue(), stderr.getvalue())
    print(f"$ main({' '.join(map(str, args))})\n--- stdout\n{proc.stdout[-20000:]}\n--- stderr\n{proc.stderr[-20000:]}")
    return proc


# Modules by wall time, longest first (their shared training runs). tests/run.sh deals whole modules to its workers
# (`--dist loadfile`) in collection order, so the long ones start at once and the short ones fill in beside them:
# started last, one long module alone would set the suite's time. A module not listed runs after these.
LONGEST_FIRST = ["test_preemption.py", "test_held_out_eval.py", "test_failure_modes.py", "test_learning.py",
                 "test_multi_rank.py", "test_e2b.py", "test_train_e2e.py", "test_check.py", "test_lora.py",
                 "test_refusals.py", "test_eval_curate.py", "test_ipc.py", "test_trainer_memory.py", "test_slurm.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module keeps its own order


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    # Keyed by the recipe, so checkouts with different recipes sharing one cache never rebuild over each other.
    recipe = hashlib.sha256((RIG / "tiny_model.py").read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("AGH_CACHE_DIR") or tmp_path_factory.mktemp("cache")) / f"tiny-qwen3-{recipe}"
    subprocess.run([sys.executable, str(RIG / "tiny_model.py"), str(cache)], check=True)
    return cache


@pytest.fixture(scope="session")
def rig(tmp_path_factory, tiny_model):
    rig = Rig(tmp_path_factory.mktemp("rig"), tiny_model, [])
    yield rig
    rig.stop()


@pytest.fixture(scope="session")
def eval_tier_rig(tmp_path_factory, tiny_model):
    """A rig whose engine returns no token ids (a plain OpenAI server, as a hosted model): OpenEnv's `eval` tier."""
    rig = Rig(tmp_path_factory.mktemp("eval-rig"), tiny_model, ["--no-token-ids"])
    yield rig
    rig.stop()


@pytest.fixture
def make_rig(tmp_path, tiny_model):
    """A private rig with extra engine flags, e.g. an engine without token ids."""
    rigs = []

    def make(*engine_flags: str, harbor: bool = True, engine_env: dict[str, str] | None = None) -> Rig:
        rigs.append(Rig(tmp_path / f"rig{len(rigs)}", tiny_model, list(engine_flags), harbor=harbor,
                        engine_env=engine_env))
        return rigs[-1]

    yield make
    for r in rigs:
        r.stop()


# ---- what a training run printed and wrote
TASKS = "echo-hello,coin,coin2,never"
E2E_TASKS = "echo-hello,coin,coin2,coin"
ROLLOUT = re.compile(r"\[harbor\] group (\d+) task (\d+) \(([\w-]+)\): (?:reward ([-\d.e]+)|unscorable)")


def rollouts(stdout: str) -> list[tuple[int, str, float | None]]:
    return [(int(g), name, float(r) if r else None) for g, _, name, r in ROLLOUT.findall(stdout)]


# Zero-variance groups are trained (TRL's behaviour) in the launches that test something else: kept out, as by
# default, two of TASKS never give a sample and a run waits for about twice the rollouts. The training test
# (`default_filter`) runs the default.
TRAIN_ZERO_VARIANCE = ["--max-zero-variance-groups", "0"]


# Generations per group in every training launch, and as many rollouts in flight (TRL starts the next group's as slots
# free). A rollout's CPU is mostly its harness starting (mini-swe-agent imports litellm: ~6 s), so a launch's time is
# about its rollouts times this; under the exact-rate engine a group of two of a coin task varies as one of four
# does, unless another rollout's first call of that task lands between its two.
GENERATIONS = 2


def train_args(rig: Rig, out: Path, *extra: str, tasks: str = TASKS) -> list[str]:
    return [*rig.base_args(), "--tasks", tasks, "--num-generations", str(GENERATIONS),
            "--max-inflight", str(GENERATIONS), "--micro-batches-per-step", "1", "--max-staleness", "2",
            "--learning-rate", "1e-3", "--temperature", "0.7", "--agent-step-limit", "6", "--agent-timeout", "60",
            "--output-dir", str(out), "--run-name", "e2e", *TRAIN_ZERO_VARIANCE, *extra]


def default_filter(args: list[str]) -> list[str]:
    """`train_args` with zero-variance groups kept out of training, as a user's run does."""
    i = args.index(TRAIN_ZERO_VARIANCE[0])
    return args[:i] + args[i + 2:]


def embedded(args: list[str], work: Path) -> tuple[list[str], dict[str, str]]:
    """Arguments and environment for the one-command path: no --harbor-url, so the script starts the Harbor server
    itself; the rig's wrapper of `openenv harbor serve` stands in for the installed one."""
    if "--harbor-url" in args:
        i = args.index("--harbor-url")
        args = args[:i] + args[i + 2:]
    command = shlex.join([os.environ["AGH_SERVER_PYTHON"], str(RIG / "harbor_server.py")])
    env = {"RIG_SANDBOX_DIR": str(work / "sandboxes"), "OPENENV_HARBOR_TRIALS_DIR": str(work / "trials")}
    return [*args, "--harbor-command", command], env


# The rig's second harness is mini-swe-agent again under another name (tests/rig/harbor_server.py): every other
# harness installs itself from the network.
HARNESSES = ["mini-swe-agent", "mini-swe-agent-twin"]
EVAL_TASKS = ["echo-hello", "never"]
EVAL_ARGS = ["--eval-tasks", ",".join(EVAL_TASKS), "--eval-k", "1", "--eval-steps", "3"]


@pytest.fixture(scope="session")
def trained(rig, tmp_path_factory):
    """The README's one command (no --harbor-url, so the script runs its own Harbor server): 3 steps, a checkpoint
    each, trackio, harnesses rotated per group. One run, read by test_train_e2e."""
    work = tmp_path_factory.mktemp("train")
    chats, started = len(rig.engine_stats()["chat"]), datetime.now(timezone.utc)
    # One task whose groups never vary, kept out by the default filter, and three whose groups always do: a step's
    # micro-batch closes only when the next varied group arrives (one more is collated ahead), so each flat group
    # in the list delays the run by a group's rollouts.
    # Held out: one task always solved, one never (an exact pass rate of 0.5), measured before training and at step 3
    # (--eval-steps), which is also the last.
    args, env = embedded(default_filter(train_args(rig, work / "out", "--max-steps", "3", "--save-steps", "1",
                                                   "--report-to", "trackio", "--project", "e2e", "--harness",
                                                   ",".join(HARNESSES), *EVAL_ARGS, tasks=E2E_TASKS)), work)
    proc = run_script(args, cwd=work, HF_HOME=str(work / "hf"), TRACKIO_DIR=str(work / "trackio"), **SECRETS, **env)
    # What the engine was asked during this run alone: later tests share the engine.
    return proc, work / "out", rig, (rig.engine_stats()["chat"][chats:], started)


def log_history(out: Path, step: int | None = None) -> list[dict]:
    """Per-optimizer-step metrics, as saved with the checkpoint of `step` (default: the latest)."""
    checkpoint = out / f"checkpoint-{step}" if step else max(out.glob("checkpoint-*"),
                                                               key=lambda p: int(p.name.split("-")[1]))
    return [e for e in json.loads((checkpoint / "trainer_state.json").read_text())["log_history"] if "loss" in e]




def assert_all_slots_free(rig: Rig) -> None:
    """Every session slot of the Harbor server can be taken: no run left one attached."""
    def rpc(method, **params):
        return post_json(f"{rig.harbor_url}/mcp", {"jsonrpc": "2.0", "id": 1, "method": method, "params": params})

    sessions = [rpc("openenv/session/create") for _ in range(rig.max_concurrent_envs)]
    try:
        assert all("result" in s for s in sessions), sessions
    finally:
        for s in sessions:
            if "result" in s:
                rpc("openenv/session/close", session_id=s["result"]["session_id"])


@pytest.fixture(autouse=True)
def no_session_left_attached(request):
    """Every test that used the shared rig leaves all of its Harbor server's session slots free: a slot left attached
    fails the test that left it, not a later one counting free slots."""
    yield
    if "rig" in request.fixturenames:
        rig = request.getfixturevalue("rig")
        try:
            assert_all_slots_free(rig)
        except AssertionError:
            rig.restart_harbor()  # a fresh server, all slots free: the slots left would fail every later test too
            raise
