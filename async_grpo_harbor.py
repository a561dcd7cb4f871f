# /// script
# requires-python = ">=3.12"
# dependencies = [
#     "trl==1.16.0",
#     "openenv[harbor]==0.10.0",
#     "vllm==0.29.0",
#     "transformers",
#     "torch",
#     "e2b",
#     "trackio",
# ]
# ///
"""RL-train a language model on any Harbor task suite, through a loop-owning agent harness, with TRL's AsyncGRPO.

The harness (default mini-swe-agent) runs inside a sandbox (default e2b) and drives itself; its model calls go
through OpenEnv's capture proxy to your vLLM server, which records exact token ids and logprobs. Harbor's verifier
scores the workspace. This script turns each rollout into a GRPO sample and trains the policy that vLLM serves.

Run it (see README.md for the full walk-through):

    # 1. the policy server (GPU 0)
    VLLM_SERVER_DEV_MODE=1 vllm serve Qwen/Qwen3-4B-Instruct-2507 --port 8000 --max-model-len 32768 \
        --enable-auto-tool-choice --tool-call-parser hermes \
        --logprobs-mode processed_logprobs --return-tokens-as-token-ids \
        --weight-transfer-config '{"backend":"nccl"}'

    # 2. train (GPU 1); starts its own Harbor server (`openenv harbor serve`) on 127.0.0.1 and stops it at exit
    E2B_API_KEY=... HF_TOKEN=... uv run async_grpo_harbor.py --model Qwen/Qwen3-4B-Instruct-2507 \
        --vllm-url http://localhost:8000 --harbor-expose cloudflare

    # check the whole set-up without training (one real rollout with --probe-rollout)
    uv run async_grpo_harbor.py ... --check --probe-rollout

    # resume the latest checkpoint of that run (same --run-name or --output-dir)
    uv run async_grpo_harbor.py ... --run-name <name printed at start> --resume
"""

from __future__ import annotations

import argparse
import difflib
import functools
import http.client
import itertools
import json
import multiprocessing
import os
import queue
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from openenv.core.harness import ResourceSession, ResourceSessionFactory, VerifyResult
from openenv.core.harness.training import TrainingTrace
from openenv.harbor.client import HarborEnv
from openenv.harbor.contract import to_training_trace
from openenv.harbor.models import HarborRolloutResult

DEFAULT_DATASET = "AdithyaSK/data_agent_rl_environment_train"
DEFAULT_TASKS = f"@{Path(__file__).with_name('tasks.txt')}"
# Prefix of the error the rollout child raises to stop training; main() finds it in TRL's wrapped exception.
ROLLOUTS_FAILING = "harbor rollouts failing:"


# ----------------------------------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="RL-train a model on a Harbor task suite through a loop-owning harness with TRL AsyncGRPO.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        # `--mod X` must not silently mean --model: the SLURM wrappers read flags from the same command line.
        allow_abbrev=False,
    )
    g = p.add_argument_group("policy and engine")
    g.add_argument("--model", default="Qwen/Qwen3-4B-Instruct-2507",
                   help="Model to train (hub id or local dir). Must be the model vLLM serves: its weights are "
                        "replaced in vLLM after every optimizer step.")
    g.add_argument("--vllm-url", default="http://localhost:8000",
                   help="Base URL of `vllm serve` (no /v1). The trainer pushes weights there over NCCL.")

    g = p.add_argument_group("harbor")
    g.add_argument("--harbor-url", default="",
                   help="Base URL of a running `openenv harbor serve` to use. Empty: this script starts its own on "
                        "127.0.0.1 for --dataset and --vllm-url, and stops it when it exits.")
    g.add_argument("--harbor-command", default=f"{sys.executable} -m openenv.cli harbor serve",
                   help="Without --harbor-url: the command that runs `openenv harbor serve` (its options are "
                        "appended), e.g. `uvx --python 3.12 --from openenv[harbor]==0.10.0 openenv harbor serve`.")
    g.add_argument("--harbor-expose", default="direct", choices=["direct", "cloudflare", "gradio"],
                   help="Without --harbor-url: how sandboxes reach the capture proxy. direct advertises 127.0.0.1, "
                        "for sandboxes on this host (docker); cloud sandboxes (e2b) need a tunnel: cloudflare "
                        "(needs cloudflared) or gradio. Tunnels admit only per-rollout session keys.")
    g.add_argument("--dataset", default=DEFAULT_DATASET,
                   help="Harbor dataset spec the server serves (HF repo, dir or name@version); selects the server "
                        "split. Default: 2,238 verified data-analysis tasks built for RL.")
    g.add_argument("--split", default="",
                   help="Server split name, when it differs from --dataset. Empty: the split named like --dataset "
                        "(or, for the default dataset, the server's only split).")
    g.add_argument("--tasks", default=DEFAULT_TASKS,
                   help="Tasks to train on, in this order: indices, ranges and task names (`0-49,57,hello-world`), "
                        "or `@file` with one entry per line (`#` comments). Every entry must exist on the server. "
                        "Default: the tasks.txt shipped beside this script, for the default dataset.")
    g.add_argument("--harness", default="mini-swe-agent",
                   help="Agent harness the server runs in the sandbox; it owns its own loop.")
    g.add_argument("--sandbox", default="e2b",
                   help="Harbor environment type the server starts per rollout (its credentials must be set on the "
                        "server, e.g. E2B_API_KEY for e2b).")
    g.add_argument("--reward-key", default="",
                   help="For tasks that emit several rewards: the key to train on, or a comma-separated preference "
                        "list. Empty: the task's `reward`.")
    g.add_argument("--agent-step-limit", type=int, default=30,
                   help="Model calls per rollout (a count, capped at the proxy). A memory guard: a rollout's packed "
                        "row grows by every turn (~1k tokens), and the tokens forwarded to vLLM with its square (each "
                        "turn re-sends the conversation). 30 is the longest whose row fits a 32k context at ~1k tokens "
                        "per turn (README: Capacity).")
    g.add_argument("--agent-timeout", type=float, default=600.0,
                   help="Seconds the agent may run per rollout; 0 uses the task's own timeout.")

    g = p.add_argument_group("GRPO")
    g.add_argument("--num-generations", type=int, default=8,
                   help="Rollouts per task per group; advantages compare rollouts of the same task (>= 2).")
    g.add_argument("--micro-batches-per-step", type=int, default=4,
                   help="Micro-batches per optimizer step. TRL packs each micro-batch with rollouts up to vLLM's "
                        "max_model_len tokens (its token budget: no rollout can be longer, so none is dropped), so "
                        "rollouts per step = this x how many fit in that budget.")
    g.add_argument("--max-inflight", type=int, default=16,
                   help="Rollouts running at once (= sandboxes alive at once). Size the Harbor server's "
                        "MAX_CONCURRENT_ENVS to at least twice this.")
    g.add_argument("--max-staleness", type=int, default=4,
                   help="Optimizer steps a rollout may lag the current policy before it is dropped. Never below 1 in "
                        "practice: accelerate prefetches one batch.")
    g.add_argument("--temperature", type=float, default=1.0,
                   help="Sampling temperature the proxy enforces on every agent call and the trainer scores at (> 0).")
    g.add_argument("--max-completion-length", type=int, default=1024,
                   help="Tokens per model call (an agent turn). The Harbor server this script starts caps every turn "
                        "there (its --max-output-tokens); a server of yours needs that flag set to match. An agent turn "
                        "is a thought and one command: 30 turns x 1024 fit a 32k context.")
    g.add_argument("--learning-rate", type=float, default=1e-6,
                   help="AdamW learning rate, constant: the number of rollouts per step varies with their length, "
                        "so a decay horizon in steps means little.")
    g.add_argument("--max-steps", type=int, default=500,
                   help="Optimizer steps to train; the run's only stop condition (tasks are cycled).")
    g.add_argument("--efficiency-weight", type=float, default=0.1,
                   help="Bonus for solving with fewer agent turns, as a fraction of the task reward (0 disables). "
                        "Only solved rollouts get it, so it never rewards giving up early.")
    g.add_argument("--max-consecutive-failures", type=int, default=32,
                   help="Stop training after this many unscorable rollouts in a row (sandbox down, bad credentials, "
                        "agent crash), instead of waiting forever for samples.")

    g = p.add_argument_group("run")
    g.add_argument("--output-dir", default="",
                   help="Checkpoints and logs. Empty: runs/<run name>.")
    g.add_argument("--run-name", default="",
                   help="Empty: <model>-<harness>-<sandbox>-<SLURM_JOB_ID, else UTC time + random suffix>, so "
                        "relaunches never write over each other while a requeued SLURM job keeps its name.")
    g.add_argument("--project", default="async-grpo-harbor",
                   help="trackio project, so runs on one suite compare side by side.")
    g.add_argument("--report-to", default="trackio",
                   help="Where metrics go: trackio (local, no account needed), none, or any HF integration.")
    g.add_argument("--save-steps", type=int, default=50,
                   help="Optimizer steps between checkpoints: what a crash or preemption can lose.")
    g.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="Resume trainer state and task position: bare `--resume` takes the latest checkpoint in the "
                        "output dir; or give a checkpoint path.")
    g.add_argument("--check", action="store_true",
                   help="Run the preflight checks (vLLM, Harbor server, sandbox, tasks, run dir), print their table "
                        "and exit: 0 when nothing FAILs. The same checks run before every training run.")
    g.add_argument("--probe-rollout", action="store_true",
                   help="With the checks: run one rollout of the first task, end to end, to confirm the sandbox, the "
                        "harness, the capture URL and the reward key.")
    return p


class UsageError(Exception):
    """Bad input or an unusable setup: reported as one line, exit code 2."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    positive = {"num_generations": 2, "micro_batches_per_step": 1, "max_inflight": 1, "agent_step_limit": 1,
                "max_steps": 1, "save_steps": 1, "max_consecutive_failures": 1, "max_completion_length": 1}
    for name, low in positive.items():
        if getattr(args, name) < low:
            raise UsageError(f"--{name.replace('_', '-')} must be >= {low} (got {getattr(args, name)})")
    if args.max_inflight < args.num_generations:
        raise UsageError(f"--max-inflight ({args.max_inflight}) must be >= --num-generations "
                         f"({args.num_generations}): a group is only scored once all its rollouts finished")
    if not args.temperature > 0:
        raise UsageError(f"--temperature must be > 0 (got {args.temperature}): the proxy enforces a "
                         "full-vocabulary sampling policy")
    if args.max_staleness < 0 or args.agent_timeout < 0 or args.efficiency_weight < 0:
        raise UsageError("--max-staleness, --agent-timeout and --efficiency-weight must be >= 0")
    args.vllm_url = args.vllm_url.rstrip("/").removesuffix("/v1")
    args.harbor_url = args.harbor_url.rstrip("/")
    if args.probe_rollout and not args.check:
        raise UsageError("--probe-rollout is part of --check; add --check")
    if not args.run_name:
        stamp = (f"slurm{os.environ['SLURM_JOB_ID']}" if os.environ.get("SLURM_JOB_ID")
                 else f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}")
        model_short = Path(args.model.rstrip("/")).name
        args.run_name = f"{model_short}-{args.harness}-{args.sandbox}-{stamp}"
    args.output_dir = args.output_dir or os.path.join("runs", args.run_name)
    return args


def print_table(title: str, rows: dict[str, Any]) -> None:
    width = max(len(k) for k in rows)
    print(f"\n{title}\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows.items()) + "\n", flush=True)


# Shapes of the credentials our users carry (HF, OpenAI-style, E2B), for text that comes from the Harbor server,
# whose environment we cannot see.
SECRET_SHAPES = re.compile(r"\b(hf_|sk-|e2b_)[A-Za-z0-9_-]{8,}")


def redact(text: str) -> str:
    """Blank out secret-looking environment values and token shapes, so no message we print leaks a credential."""
    for name, value in os.environ.items():
        if len(value) >= 6 and re.search(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", name, re.I):
            text = text.replace(value, f"<{name}>")
    return SECRET_SHAPES.sub(lambda m: f"{m[1]}<redacted>", text)


# ----------------------------------------------------------------------------------------------------------------------
# Tasks
# ----------------------------------------------------------------------------------------------------------------------
def read_task_spec(spec: str) -> list[tuple[str, str]]:
    """`0-3,7,name` or `@file` -> [(entry, where it came from)], so errors can name the line."""
    if spec.startswith("@"):
        path = Path(spec[1:])
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise UsageError(f"--tasks {spec}: cannot read {path} ({exc.strerror}); give a file of task "
                             "indices, ranges or names, one per line") from None
        entries = []
        for number, line in enumerate(lines, 1):
            line = line.split("#", 1)[0].strip()
            entries += [(part.strip(), f"{path}:{number}") for part in line.split(",") if part.strip()]
        if not entries:
            raise UsageError(f"--tasks {spec}: {path} lists no tasks (only blank lines and # comments)")
        return entries
    entries = [(part.strip(), "--tasks") for part in spec.split(",") if part.strip()]
    if not entries:
        raise UsageError("--tasks is empty; give indices, ranges or names, e.g. 0-49,57,hello-world")
    return entries


def resolve_tasks(entries: list[tuple[str, str]], catalogue: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Map each entry to a catalogue task; any entry that names no task is an error, never silently skipped."""
    by_name = {}
    for task in catalogue:
        by_name.setdefault(task["task_name"], task)
        by_name.setdefault(task["task_id"], task)
    n = len(catalogue)
    chosen = []
    for entry, where in entries:
        if re.fullmatch(r"\d+", entry):
            indices = [int(entry)]
        elif m := re.fullmatch(r"(\d+)-(\d+)", entry):
            lo, hi = int(m[1]), int(m[2])
            if lo > hi:
                raise UsageError(f"{where}: range {entry!r} is backwards; write {hi}-{lo}")
            indices = list(range(lo, hi + 1))
        elif entry in by_name:
            chosen.append(by_name[entry])
            continue
        else:
            close = difflib.get_close_matches(entry, list(by_name), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UsageError(f"{where}: no task named {entry!r} in the served split ({n} tasks){hint}")
        bad = [i for i in indices if i >= n]
        if bad:
            raise UsageError(f"{where}: task index {bad[0]} is out of range: the served split has {n} tasks "
                             f"(0-{n - 1})")
        chosen += [catalogue[i] for i in indices]
    return chosen


def task_rows(tasks: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """One dataset row per task. The task's identity rides in the prompt message because that is all TRL hands the
    session factory: the `seed` it passes is a group counter that differs per epoch and restarts at 0 on resume."""
    return [
        {"prompt": [{"role": "user", "content": f"[{t['task_name']}] {t.get('instruction', '')[:2000]}",
                     "harbor_split": split, "harbor_task_index": int(t["index"]), "harbor_task_name": t["task_name"]}]}
        for t in tasks
    ]


# ----------------------------------------------------------------------------------------------------------------------
# Session factory: one Harbor rollout per TRL session
# ----------------------------------------------------------------------------------------------------------------------
class HarborServerSession:
    """One server session on `openenv harbor serve`, spoken over HTTP MCP (`POST /mcp`).

    Why not `HarborEnv`'s websocket: the server reads a websocket close only after the running tool returns, so a
    session stopped mid-rollout keeps its server slot until the trial ends (with no session timeout, the next run
    then fails with "Server at capacity"), and `HarborEnv.close()` blocks ~10 s on the handshake. An HTTP session is
    released at once by `openenv/session/close`, and shutting down our socket unblocks the waiting thread.
    """

    def __init__(self, base_url: str, timeout_s: float):
        url = urllib.parse.urlsplit(base_url)
        conn_cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        self._connect = functools.partial(conn_cls, url.hostname, url.port, timeout=timeout_s)
        self._prefix = url.path.rstrip("/")
        self._lock = threading.Lock()
        self._waiting: http.client.HTTPConnection | None = None
        self.session_id: str | None = None
        self.closed = False
        self.closed_event = threading.Event()

    def _open_connection(self, **overrides: Any) -> http.client.HTTPConnection:
        conn = self._connect(**overrides)
        conn.connect()
        # A rollout is one request that stays silent for minutes; without keepalive a NAT or load balancer on the
        # way drops it unseen and the thread waits out the whole timeout.
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6)):
            if hasattr(socket, option):
                conn.sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
        return conn

    def _post(self, conn: http.client.HTTPConnection, method: str, params: dict[str, Any]) -> Any:
        body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
        conn.request("POST", f"{self._prefix}/mcp", body, {"Content-Type": "application/json"})
        reply = json.loads(conn.getresponse().read() or b"{}")
        if reply.get("error"):
            raise RuntimeError(f"harbor server: {method}: {reply['error'].get('message', reply['error'])}")
        return reply.get("result")

    def _call_once(self, method: str, params: dict[str, Any], interruptible: bool) -> Any:
        # Connected before it is published, so close() always finds a socket it can shut down.
        conn = self._open_connection()
        try:
            with self._lock:
                if self.closed:
                    raise RuntimeError("session closed")
                if interruptible:
                    self._waiting = conn
            return self._post(conn, method, params)
        finally:
            with self._lock:
                self._waiting = None
            conn.close()

    def open(self) -> None:
        if self.session_id is not None:
            return
        session_id = self._call_once("openenv/session/create", {}, interruptible=False)["session_id"]
        with self._lock:
            self.session_id = session_id
            closed = self.closed
        if closed:  # close() ran while the slot was being created: it could not release what it did not know
            self._release()

    def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        self.open()
        return self._call_once("tools/call", {"name": name, "arguments": arguments, "session_id": self.session_id},
                               interruptible=True)

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            waiting = self._waiting.sock if self._waiting is not None else None
            session_id = self.session_id
        self.closed_event.set()
        if waiting is not None:
            try:
                waiting.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if session_id is not None:
            self._release()

    def _release(self) -> None:
        try:
            conn = self._open_connection(timeout=10)
        except OSError:
            return  # the server is gone: its slots went with it
        try:
            self._post(conn, "openenv/session/close", {"session_id": self.session_id})
        except (OSError, RuntimeError, ValueError):
            pass  # the server is gone (its slots went with it) or already dropped the session
        finally:
            conn.close()


class HarborRolloutClient:
    """`HarborEnv.run_rollout` (its exact wire contract) with its MCP calls riding a `HarborServerSession`.

    Not a `HarborEnv` instance: its constructor builds an httpx client that a rollout never uses, and that costs
    ~20 ms of CPU per rollout (TLS context) on the rollout child's thread pool.
    """

    run_rollout = HarborEnv.run_rollout

    def __init__(self, base_url: str, timeout_s: float):
        self.server_session = HarborServerSession(base_url, timeout_s)

    def _call(self, name: str, **kwargs: Any) -> Any:
        result = self.server_session.call_tool(name, kwargs)
        if isinstance(result, dict) and result.get("isError"):
            raise RuntimeError(f"tool {name!r} failed: {json.dumps(result.get('content'))[:300]}")
        return result

    def close(self) -> None:
        self.server_session.close()


class HarborSession(ResourceSession):
    """One rollout: the harness runs on the server, we only wait for its result.

    Satisfies OpenEnv's `TrainableSession`: `wait_for_completion()` runs the rollout, `fetch_training_trace()` hands
    TRL the validated token capture, `verify()` forwards the verifier's reward. A failed rollout is unscorable
    (reward None), never fatal; only a run of them stops training, through the one channel TRL offers: a ValueError
    out of `fetch_training_trace()`.
    """

    def __init__(self, factory: HarborSessionFactory, prompt: list[dict[str, Any]], group: int | None):
        self._factory = factory
        self._prompt = prompt
        self._split = prompt[0]["harbor_split"]
        self._task_index = int(prompt[0]["harbor_task_index"])
        self.label = f"group {group} task {self._task_index} ({prompt[0]['harbor_task_name']})"
        self._client = HarborRolloutClient(factory.harbor_url, factory.request_timeout_s)
        self.result: HarborRolloutResult | None = None
        self.failure: str | None = None

    def initial_messages(self) -> list[dict[str, Any]]:
        return list(self._prompt)

    def list_tools(self) -> list:
        return []

    def call_tool(self, name: str, arguments: dict[str, Any]):
        raise NotImplementedError("the harness owns its loop; tools run inside the sandbox")

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        f = self._factory
        # A Harbor server restart or a full server must not burn through --max-consecutive-failures in a second:
        # transport failures are retried for a while before this rollout counts as failed.
        deadline = time.monotonic() + f.transport_retry_s
        for attempt in itertools.count():
            try:
                self.result = self._client.run_rollout(
                    split=self._split, task_index=self._task_index, harness=f.harness, sandbox=f.sandbox,
                    reward_key=f.reward_key, agent_timeout_sec=f.agent_timeout_s,
                    agent_step_limit=f.agent_step_limit, sampling=f.sampling,
                )
                break
            except Exception as exc:  # noqa: BLE001 - any transport failure is this rollout's failure, judged below
                self.failure = f"harbor server call failed: {type(exc).__name__}: {exc}"
                if "capacity" in str(exc):
                    self.failure += " (raise MAX_CONCURRENT_ENVS on the Harbor server to >= 2 x --max-inflight)"
                retryable = isinstance(exc, OSError) or "capacity" in str(exc)
                if not retryable or self._client.server_session.closed or time.monotonic() > deadline:
                    return 1
                self._client.server_session.closed_event.wait(min(2.0 ** attempt, 30.0))
        self.failure = None
        r = self.result
        fatal = next((x for x in r.findings if "[FATAL" in x), None)
        if not r.ok:
            self.failure = f"{r.exception_type or 'error'}: {r.error}"
        elif r.rollout_type != "train":
            self.failure = ("the engine returned no token ids / processed logprobs (eval tier): restart vLLM with "
                            "--return-tokens-as-token-ids --logprobs-mode processed_logprobs")
        elif fatal:
            self.failure = f"capture finding {fatal}"
        elif r.reward is None:
            self.failure = "the verifier produced no reward"
        return 0 if self.failure is None else 1

    def fetch_training_trace(self) -> TrainingTrace:
        if self._client.server_session.closed:
            return TrainingTrace(turns=[])  # abandoned at stop: neither a sample nor a failure
        if self.failure is None:
            try:
                trace = to_training_trace(self.result)
            except (ValueError, TypeError, KeyError) as exc:
                # One malformed capture is this rollout's problem, not the run's: TRL stops its worker on any of these.
                self.failure = f"capture rejected: {exc}"
        self._factory.record_outcome(self)
        return TrainingTrace(turns=[]) if self.failure is not None else trace

    def verify(self, transcript: list[dict[str, Any]], final_state: Any | None = None) -> VerifyResult:
        if self.failure is not None or self.result is None:
            return VerifyResult(env_reward=None, done=True, metrics={"failure": self.failure})
        r = self.result
        return VerifyResult(env_reward=r.reward, done=True,
                            metrics={"wall_s": r.wall_s, "turns": r.n_turns, **r.phase_timings})

    def close(self) -> None:
        self._factory.live_sessions.discard(self)
        self._client.close()


class HarborSessionFactory(ResourceSessionFactory):
    """Creates one `HarborSession` per rollout. Built inside TRL's rollout child as `factory(sampling=...)`.

    `sampling` is the trainer's own policy (temperature), forwarded to every `run_rollout` so the proxy samples at
    the temperature the trainer scores at.
    """

    def __init__(self, *, harbor_url: str, harness: str, sandbox: str, reward_key: str, agent_step_limit: int,
                 agent_timeout_s: float, max_consecutive_failures: int, sampling: dict[str, Any] | None = None):
        self.harbor_url = harbor_url
        self.harness = harness
        self.sandbox = sandbox
        self.reward_key = reward_key
        self.agent_step_limit = agent_step_limit
        self.agent_timeout_s = agent_timeout_s
        # A rollout is bounded by the agent timeout plus sandbox setup and verification.
        self.request_timeout_s = (agent_timeout_s or 3600.0) + 1800.0
        self.transport_retry_s = 300.0
        self.max_consecutive_failures = max_consecutive_failures
        self.sampling = dict(sampling or {})
        self._lock = threading.Lock()
        self._consecutive_failures = 0
        self.live_sessions: set[HarborSession] = set()
        if multiprocessing.parent_process() is not None and threading.current_thread() is threading.main_thread():
            self._guard_rollout_child()

    def _guard_rollout_child(self) -> None:
        """Make TRL's rollout child leave only through the trainer, or release its server sessions on the way out.

        Ctrl-C and SLURM signal the whole process group: a child dying on them strands its server sessions (slots that
        the next run needs) while the trainer is still winding down. A child whose trainer was killed outright would
        otherwise go on starting paid sandboxes with nobody to train on them.
        """
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda signum, frame: self._abandon(128 + signum))
        parent = os.getppid()

        def watch_parent():
            while os.getppid() == parent:
                time.sleep(1.0)
            self._abandon(1)

        threading.Thread(target=watch_parent, daemon=True, name="harbor-parent-watch").start()

    def _abandon(self, exit_code: int) -> None:
        for session in list(self.live_sessions):
            session.close()
        os._exit(exit_code)

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> HarborSession:
        # `seed` is TRL's group counter: only a label here, the task itself comes from the prompt.
        session = HarborSession(self, list(task), seed)
        self.live_sessions.add(session)
        return session

    def record_outcome(self, session: HarborSession) -> None:
        failure, r = session.failure, session.result
        with self._lock:
            self._consecutive_failures = 0 if failure is None else self._consecutive_failures + 1
            count = self._consecutive_failures
        if failure is None:
            print(f"[harbor] {session.label}: reward {r.reward:g} in {r.n_turns} turns, {r.wall_s:.1f}s", flush=True)
            return
        print(redact(f"[harbor] {session.label}: unscorable: {failure[:300]}"), flush=True)
        if count >= self.max_consecutive_failures:
            raise ValueError(redact(
                f"{ROLLOUTS_FAILING} {count} consecutive rollouts were unscorable; the last: {failure[:300]}"))


# ----------------------------------------------------------------------------------------------------------------------
# Reward
# ----------------------------------------------------------------------------------------------------------------------
def harbor_reward(outcome: Any, *, step_limit: int, efficiency_weight: float) -> float | None:
    """The verifier's reward, plus a bonus for solving in fewer agent turns.

    reward = r + w * r * (1 - turns / step_limit)   when r > 0, else r
    r is Harbor's verifier reward; w is --efficiency-weight. The bonus lies in [0, w * r]: it never turns a failure
    into a success, never pays for giving up early (unsolved rollouts get none), and cannot exceed a fraction w of
    the task reward. `None` (the rollout could not be scored) stays `None`, so it is left out of the group baseline.
    """
    r = outcome.env_reward
    if r is None:
        return None
    if r <= 0:
        return float(r)
    turns = len(outcome.trace) or outcome.tool_call_count
    return float(r + efficiency_weight * r * max(0.0, 1.0 - turns / step_limit))


# ----------------------------------------------------------------------------------------------------------------------
# The Harbor server: the user's (--harbor-url), or one this script starts and owns
# ----------------------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # The kernel stops the server if this process is killed outright (SIGKILL, OOM), when no cleanup of ours runs.
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EmbeddedHarborServer:
    """`openenv harbor serve` as a child of this process, so one command runs everything after `vllm serve`.

    Bound to 127.0.0.1, with `--expose direct` unless --harbor-expose says otherwise: OpenEnv's default (gradio)
    opens a public tunnel nobody asked for. Its session slots are sized from --max-inflight, its per-turn cap is
    --max-completion-length, its log goes to the output dir, and it is stopped on every way out of `main`.
    """

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.log_path = Path(args.output_dir) / "harbor_server.log"
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, served_model: str, timeout_s: float = 1800.0) -> float:
        """Start the server and wait until its Task API answers; returns the seconds that took."""
        a = self.args
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = shlex.split(a.harbor_command) + [
            "--dataset", a.dataset, "--llm-url", f"{a.vllm_url}/v1", "--host", "127.0.0.1", "--port", str(port),
            "--capture-port", str(free_port()), "--expose", a.harbor_expose,
            "--max-output-tokens", str(a.max_completion_length)]
        if served_model:
            cmd += ["--model", served_model]
        slots = max(2 * a.max_inflight, int(os.environ.get("MAX_CONCURRENT_ENVS", "0") or 0))
        t0 = time.monotonic()
        with self.log_path.open("a") as log:
            log.write(f"\n===== {datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S} UTC: {shlex.join(cmd)}\n")
            log.flush()
            try:
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env={**os.environ, "MAX_CONCURRENT_ENVS": str(slots)},
                                             start_new_session=True, preexec_fn=_die_with_parent)
            except OSError as exc:
                raise UsageError(f"cannot start the Harbor server `{shlex.join(cmd[:4])}` ({exc.strerror}); "
                                 "install openenv[harbor] (Python >= 3.12) or set --harbor-command") from None
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise UsageError(f"the Harbor server exited with code {self.proc.returncode} while starting (log: "
                                 f"{self.log_path})")
            try:
                http_json(f"{self.url}/harbor_env/splits", timeout=5)
                return time.monotonic() - t0
            except (OSError, ValueError):
                time.sleep(0.5)
        self.stop()
        raise UsageError(f"the Harbor server did not answer within {timeout_s:.0f}s; see {self.log_path}")

    def log_tail(self, lines: int = 15) -> str:
        try:
            tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return redact("\n".join(f"    {line}" for line in tail))

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ----------------------------------------------------------------------------------------------------------------------
# Preflight (`--check`, and before every run): refuse a setup that would train on nothing, before loading any weights
# ----------------------------------------------------------------------------------------------------------------------
PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
# Harbor backends whose sandboxes run off this host: they cannot reach a capture proxy advertised as 127.0.0.1.
OFF_HOST_SANDBOXES = {"e2b", "modal", "daytona", "runloop", "langsmith", "ec2", "gke", "ack", "openshift", "novita",
                      "islo", "tensorlake", "cwsandbox", "use-computer", "cua-cloud", "blaxel", "beam", "skypilot",
                      "hf-sandbox", "hyperbrowser", "vercel", "prime", "mosaic", "sail", "kernel"}
# What each cloud backend reads from the environment of the process that starts it (the Harbor server).
SANDBOX_CREDENTIALS = {"e2b": "E2B_API_KEY", "daytona": "DAYTONA_API_KEY", "runloop": "RUNLOOP_API_KEY"}


class Preflight:
    """One row per check: PASS, WARN (trains, but read this), FAIL (will not train; the fix is on the row) or SKIP."""

    def __init__(self):
        self.rows: list[tuple[str, str, str, str]] = []

    def add(self, check: str, status: str, detail: str, fix: str = "") -> bool:
        self.rows.append((check, status, redact(detail), fix))
        return status != FAIL

    @property
    def failures(self) -> list[tuple[str, str, str, str]]:
        return [row for row in self.rows if row[1] == FAIL]

    def print(self) -> None:
        width = max(len(row[0]) for row in self.rows)
        lines = []
        for check, status, detail, fix in self.rows:
            first, *more = detail.splitlines() or [""]
            lines.append(f"  {status}  {check:<{width}}  {first}")
            lines += [f"        {'':<{width}}  {line}" for line in more]
            if fix and status in (WARN, FAIL):
                lines.append(f"        {'':<{width}}  fix: {fix}")
        print("\npreflight\n" + "\n".join(lines) + "\n", flush=True)

    def error_line(self) -> str:
        _, _, detail, fix = self.failures[0]
        more = len(self.failures) - 1
        return (f"error: {detail.splitlines()[0]}" + (f"; {fix}" if fix else "")
                + (f" (and {more} more failed check{'s' * (more > 1)} above)" if more else ""))


def closest_first(name: str, choices: Any) -> list[str]:
    return difflib.get_close_matches(name, list(choices), n=len(choices), cutoff=0)


def harbor_environment_types() -> set[str]:
    """Sandbox types Harbor itself knows; the server advertises (and credential-checks) only a few of them."""
    try:
        from harbor.models.environment_type import EnvironmentType
    except ImportError:
        return OFF_HOST_SANDBOXES | {"docker", "podman"}
    return {t.value for t in EnvironmentType}


def endpoint(url: str) -> tuple[str | None, int | None]:
    parts = urllib.parse.urlsplit(url)
    return {"localhost": "127.0.0.1"}.get(parts.hostname, parts.hostname), parts.port


def http_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read())


def check_run_dir(args: argparse.Namespace, pf: Preflight) -> tuple[bool, str | None]:
    out = Path(args.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        pf.add("output dir", FAIL, f"cannot write to {out} ({exc.strerror})",
               "give a writable --output-dir (checkpoints and logs go there)")
        return False, None
    pf.add("output dir", PASS, str(out))
    try:
        resume = resolve_resume(args)
    except UsageError as exc:
        pf.add("resume", FAIL, str(exc))
        return True, None
    pf.add("resume", PASS, resume or "fresh start")
    return True, resume


def check_engine(args: argparse.Namespace, pf: Preflight) -> dict[str, Any] | None:
    """vLLM as the trainer needs it: the right model, trainable captures, tool calls, weight sync, enough context."""
    from openenv.core.harness.capture.validate_llm import validate_llm

    serve_hint = "start it first (the `vllm serve` command in this script's docstring) or fix --vllm-url"
    try:
        served = http_json(f"{args.vllm_url}/v1/models")["data"][0]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        pf.add("vLLM reachable", FAIL, f"vLLM is not reachable at {args.vllm_url} ({exc})", serve_hint)
        return None
    pf.add("vLLM reachable", PASS, f"{args.vllm_url} serves {served['id']}")

    names = {served["id"], served.get("root") or ""}
    if args.model in names or Path(args.model.rstrip("/")).name in {Path(n.rstrip("/")).name for n in names if n}:
        pf.add("served model", PASS, f"--model {args.model} is what vLLM serves")
    else:
        pf.add("served model", FAIL, f"vLLM serves {served.get('root') or served['id']} but --model is {args.model}: "
               "the trainer would push its weights into another model", "serve --model with vLLM, or fix --model")

    report = validate_llm(args.vllm_url, served["id"], timeout=60.0)
    flags = {"text": "--return-tokens-as-token-ids --logprobs-mode processed_logprobs",
             "logprobs": "--return-tokens-as-token-ids"}
    if report.logprobs_mode == "raw":
        pf.add("capture tier", FAIL, "the engine returns raw (pre-temperature) logprobs: every importance ratio would "
               "be wrong, so the proxy grades its rollouts eval tier", "restart vLLM with --logprobs-mode "
               "processed_logprobs")
    elif report.capture_level != "tokens":
        pf.add("capture tier", FAIL, f"the engine's rollouts would be eval tier ({report.capture_level or 'nothing'} "
               "captured, no token ids): nothing to train on",
               f"restart vLLM with {flags.get(report.capture_level, flags['text'])}")
    elif report.logprobs_mode != "processed":
        pf.add("capture tier", WARN, "train: token ids + logprobs, but whether they are processed (temperature-"
               "scaled) could not be measured", "make sure vLLM runs with --logprobs-mode processed_logprobs")
    else:
        pf.add("capture tier", PASS, "train: token ids + processed logprobs")
    tools = {"ok": (PASS, "a tool call round-trips"),
             "rejected": (FAIL, "vLLM refuses tool calls, which every agent harness makes"),
             "no-tool-call": (WARN, "the model answered a tool request in prose"),
             "unknown": (WARN, "could not tell whether tool calls work")}
    status, detail = tools.get(report.tool_support, (WARN, "not probed"))
    pf.add("tool calls", status, detail,
           "serve with --enable-auto-tool-choice --tool-call-parser <the parser of your model family, hermes for Qwen3>")

    try:
        config = http_json(f"{args.vllm_url}/server_info?config_format=json")["vllm_config"]
    except (OSError, ValueError, KeyError):
        pf.add("weight transfer", FAIL, "vLLM's dev endpoints are off: the trainer cannot push weights after a step",
               "restart vLLM with VLLM_SERVER_DEV_MODE=1 in its environment")
        config = None
    if config is not None:
        transfer = config.get("weight_transfer_config")
        if transfer:
            pf.add("weight transfer", PASS, f"enabled ({transfer.get('backend', '?')})")
        else:
            pf.add("weight transfer", FAIL, "vLLM has no weight transfer engine: the trainer cannot push weights",
                   "restart vLLM with --weight-transfer-config '{\"backend\":\"nccl\"}'")
        check_dtype(args, pf, str((config.get("model_config") or {}).get("dtype", "")).removeprefix("torch."))

    max_len = served.get("max_model_len") or (config or {}).get("model_config", {}).get("max_model_len")
    worst = args.agent_step_limit * args.max_completion_length
    if not max_len:
        pf.add("context", WARN, "vLLM did not report its max_model_len")
    elif worst > max_len:
        pf.add("context", WARN, f"{args.agent_step_limit} turns x {args.max_completion_length} tokens = {worst:,} > "
               f"vLLM's max_model_len {max_len:,}: a rollout that uses its whole budget ends at the context limit",
               "lower --agent-step-limit or --max-completion-length, or raise vLLM's --max-model-len")
    else:
        pf.add("context", PASS, f"{args.agent_step_limit} turns x {args.max_completion_length} tokens = {worst:,} "
               f"fit max_model_len {max_len:,}, with {max_len - worst:,} left for the prompt and command output")
    served["max_model_len"] = max_len
    return served


def check_dtype(args: argparse.Namespace, pf: Preflight, served_dtype: str) -> None:
    import torch

    # TRL keeps float32 master weights (its default dtype) and, on GPUs, scores under bfloat16 autocast.
    trains_at = "bfloat16" if torch.cuda.is_available() else "float32"
    if not served_dtype:
        pf.add("dtype", WARN, "vLLM did not report its dtype")
    elif served_dtype == trains_at:
        pf.add("dtype", PASS, f"vLLM serves {served_dtype}, the trainer scores at {trains_at}")
    else:
        pf.add("dtype", WARN, f"vLLM serves {served_dtype}, the trainer scores at {trains_at} (TRL warns about this "
               "too): the precision gap shows up as importance-ratio noise, clipped, not as a bias",
               f"for the closest match serve with --dtype {trains_at}")


def check_sandbox_reach(args: argparse.Namespace, pf: Preflight) -> bool:
    """Before starting our own server: what only this process can see (its environment, its PATH)."""
    var = SANDBOX_CREDENTIALS.get(args.sandbox)
    if var and not os.environ.get(var):
        return pf.add("credentials", FAIL, f"{var} is not set: every {args.sandbox} sandbox would fail to start",
                      f"export {var} before launching (the Harbor server this script starts inherits it)")
    if args.dataset == DEFAULT_DATASET and not os.environ.get("HF_TOKEN"):
        pf.add("credentials", WARN, "HF_TOKEN is not set: the default suite's tasks fetch their data with it",
               "export HF_TOKEN")
    else:
        pf.add("credentials", PASS, f"{var} set" if var else f"{args.sandbox} needs none that this script knows of")
    if args.harbor_expose == "direct" and args.sandbox in OFF_HOST_SANDBOXES:
        return pf.add("capture URL", FAIL, f"{args.sandbox} sandboxes run off this host and cannot reach the capture "
                      "proxy at 127.0.0.1 (--harbor-expose direct)",
                      "--harbor-expose cloudflare (a tunnel that admits only per-rollout session keys)")
    if args.harbor_expose == "cloudflare" and not shutil.which("cloudflared"):
        return pf.add("capture URL", FAIL, "--harbor-expose cloudflare needs `cloudflared` on PATH",
                      "install cloudflared, or use --harbor-expose gradio")
    pf.add("capture URL", PASS, f"--expose {args.harbor_expose}")
    return True


def check_harbor(args: argparse.Namespace, pf: Preflight, served: dict[str, Any],
                 server: EmbeddedHarborServer | None) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
    """The server's splits and its engine report, once harness, sandbox and session slots are known to work."""
    if server is not None:
        try:
            seconds = server.start(served["id"])
        except UsageError as exc:
            pf.add("Harbor server", FAIL, f"{exc}\n{server.log_tail()}", "fix what its log says, or pass --harbor-url")
            return None
        args.harbor_url = server.url
        pf.add("Harbor server", PASS, f"started {server.url} in {seconds:.0f}s (log: {server.log_path})")
    client = HarborEnv(base_url=args.harbor_url)
    try:
        splits = client.splits()
        caps = client.capabilities()
    except Exception as exc:  # noqa: BLE001 - any failure here means the same thing to the user
        pf.add("Harbor server", FAIL, f"Harbor server not reachable at {args.harbor_url} ({type(exc).__name__}: "
               f"{exc})", "start `openenv harbor serve ... --expose direct`, fix --harbor-url, or drop --harbor-url "
               "to let this script start one")
        return None
    finally:
        client.close()
    if server is None:
        pf.add("Harbor server", PASS, f"{args.harbor_url} (yours)")

    harnesses = {h["name"]: h for h in caps.get("harnesses", [])}
    harness = harnesses.get(args.harness)
    if harness is None and ":" not in args.harness:  # `module:Class` is a custom harness the server imports
        pf.add("harness", FAIL, f"unknown harness {args.harness!r}; this server has: "
               f"{', '.join(closest_first(args.harness, harnesses))}")
    elif harness and harness.get("status", "").split(":")[0] in ("blocked", "unsupported"):
        pf.add("harness", FAIL, f"harness {args.harness!r} cannot run on this server: {harness['status']}",
               "pick a validated harness")
    else:
        pf.add("harness", PASS, f"{args.harness} ({harness.get('status', '?') if harness else 'custom import'})")

    sandboxes = {s["name"]: s for s in caps.get("sandboxes", [])}
    box = sandboxes.get(args.sandbox)
    if box is None and args.sandbox in harbor_environment_types():
        pf.add("sandbox", WARN, f"the Harbor server does not advertise {args.sandbox!r}, so its credentials were "
               "not checked", "run `openenv harbor info` on the server")
    elif box is None:
        pf.add("sandbox", FAIL, f"unknown sandbox {args.sandbox!r}; this server has: "
               f"{', '.join(closest_first(args.sandbox, sandboxes))}")
    elif not box.get("available"):
        pf.add("sandbox", FAIL, f"sandbox {args.sandbox!r} is not usable on the Harbor server: {box.get('detail', '')}",
               "set its credentials in the Harbor server's environment")
    else:
        pf.add("sandbox", PASS, f"{args.sandbox} ({box.get('detail') or 'available'})")

    llm = caps.get("llm") or {}
    if llm.get("capture_level") != "tokens" or not llm.get("ok", True):
        pf.add("server's engine", FAIL, f"the Harbor server's engine {llm.get('url', '?')} cannot be trained on "
               f"(capture level {llm.get('capture_level') or 'unknown'}): vLLM must run with "
               "--return-tokens-as-token-ids and --logprobs-mode processed_logprobs",
               "restart vLLM with those flags, then the Harbor server")
    elif endpoint(llm.get("url", "")) != endpoint(args.vllm_url):
        pf.add("server's engine", WARN, f"the Harbor server samples from {llm.get('url')} but weights go to "
               f"{args.vllm_url}: if they are not the same server, training is off-policy",
               "point both at the same vLLM")
    else:
        pf.add("server's engine", PASS, f"{llm.get('url')}: tokens, the vLLM the trainer updates")

    try:
        check_session_capacity(args.harbor_url, args.max_inflight)
        pf.add("session slots", PASS, f">= {args.max_inflight} free (--max-inflight)")
    except UsageError as exc:
        pf.add("session slots", FAIL, str(exc))
    return splits, caps.get("llm") or {}


def check_tasks(args: argparse.Namespace, pf: Preflight,
                splits: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]] | None:
    names = [s["name"] for s in splits]
    if args.split:
        split = args.split
    elif args.dataset in names:
        split = args.dataset
    else:
        # A server started on a local copy of the default suite names its split by path.
        split = names[0] if len(names) == 1 and args.dataset == DEFAULT_DATASET else ""
    if split not in names:
        pf.add("dataset", FAIL, f"the Harbor server does not serve {args.split or args.dataset!r}; it serves: "
               f"{', '.join(names) or 'nothing'}",
               f"start it with --dataset {args.dataset}, pass --split, or drop --harbor-url")
        return None
    split_info = next(s for s in splits if s["name"] == split)
    if split_info.get("error"):
        pf.add("dataset", FAIL, f"the Harbor server could not load {split!r}: {split_info['error']}")
        return None
    pf.add("dataset", PASS, f"{split} ({split_info.get('num_tasks', '?')} tasks)")
    if args.tasks == DEFAULT_TASKS and split != DEFAULT_DATASET and args.dataset != DEFAULT_DATASET:
        pf.add("tasks", FAIL, f"--tasks: the default task list is for {DEFAULT_DATASET}",
               f"give the tasks of {split!r} (e.g. --tasks 0-99)")
        return None
    try:
        tasks = resolve_tasks(read_task_spec(args.tasks), fetch_catalogue(args.harbor_url, split))
    except UsageError as exc:
        pf.add("tasks", FAIL, str(exc))
        return None
    pf.add("tasks", PASS, f"{len(tasks)}: {', '.join(t['task_name'] for t in tasks[:5])}"
           f"{', ...' if len(tasks) > 5 else ''}")
    return split, tasks


def check_reward(args: argparse.Namespace, pf: Preflight, split: str, task: dict[str, Any]) -> None:
    """One real rollout, scored by the verifier: proves sandbox, harness, capture URL and reward key end to end."""
    key = args.reward_key or "reward"
    if not args.probe_rollout:
        pf.add("reward key", SKIP, f"{key!r}: not probed (`--check --probe-rollout` runs one rollout to confirm it)")
        return
    client = HarborRolloutClient(args.harbor_url, (args.agent_timeout or 3600.0) + 1800.0)
    t0 = time.monotonic()
    try:
        r = client.run_rollout(split=split, task_index=int(task["index"]), harness=args.harness, sandbox=args.sandbox,
                               reward_key=args.reward_key, agent_timeout_sec=args.agent_timeout,
                               agent_step_limit=args.agent_step_limit, sampling={"temperature": args.temperature})
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the rest of the table still matters
        pf.add("probe rollout", FAIL, f"{task['task_name']}: {type(exc).__name__}: {exc}")
        return
    finally:
        client.close()
    emitted = ", ".join(sorted(r.rewards)) or "none"
    where = f"{task['task_name']} in {time.monotonic() - t0:.0f}s, {r.n_turns} turns"
    if r.reward is None and r.rewards:
        pf.add("reward key", FAIL, f"--reward-key {key!r} is not emitted by {task['task_name']}; it emits: {emitted}",
               "pass one of those to --reward-key (a comma-separated list is tried in order)")
    elif not r.ok or r.reward is None:
        pf.add("probe rollout", FAIL, f"{where}: {r.exception_type or 'error'}: {(r.error or 'no reward')[:300]}",
               f"read the agent log tail: {r.agent_log_tail[-200:]!r}" if r.agent_log_tail else "")
    else:
        pf.add("reward key", PASS, f"{key!r} = {r.reward:g} ({emitted} emitted)")
        pf.add("probe rollout", PASS if r.rollout_type == "train" else FAIL,
               f"{where}, {r.rollout_type} tier, {r.n_trainable_tokens} trainable tokens")


def preflight(args: argparse.Namespace, pf: Preflight, server: EmbeddedHarborServer | None) -> dict[str, Any]:
    """Every check, cheapest first: the local ones, vLLM, the Harbor server, the tasks, a rollout. A failure that
    makes the later checks meaningless ends the table there; otherwise every row is filled, so one run shows all
    that is wrong."""
    plan: dict[str, Any] = {}
    writable, plan["resume"] = check_run_dir(args, pf)
    pf.add("GRPO", PASS, f"{args.num_generations} generations per group, {args.max_inflight} rollouts in flight")
    served = check_engine(args, pf)
    if served is None:
        return plan
    plan["max_model_len"] = served["max_model_len"]
    if server is not None and not (writable and check_sandbox_reach(args, pf)):
        return plan
    found = check_harbor(args, pf, served, server)
    if found is None:
        return plan
    splits, plan["llm"] = found
    chosen = check_tasks(args, pf, splits)
    if chosen is None:
        return plan
    plan["split"], plan["tasks"] = chosen
    check_reward(args, pf, plan["split"], plan["tasks"][0])
    return plan


def check_session_capacity(harbor_url: str, needed: int) -> None:
    """Take and release as many server sessions as rollouts will run at once: a short server fails every rollout."""
    sessions = [HarborServerSession(harbor_url, timeout_s=30) for _ in range(needed)]
    try:
        for opened, session in enumerate(sessions):
            session.open()
    except (OSError, RuntimeError) as exc:
        raise UsageError(f"the Harbor server has only {opened} free session slots of the {needed} that "
                         f"--max-inflight needs ({exc}); restart it with MAX_CONCURRENT_ENVS={2 * needed} (twice "
                         "--max-inflight leaves room for a previous run's sessions)") from None
    finally:
        for session in sessions:
            session.close()


def fetch_catalogue(harbor_url: str, split: str, page: int = 500) -> list[dict[str, Any]]:
    client = HarborEnv(base_url=harbor_url)
    try:
        total = client.num_tasks(split)
        return [t.model_dump() for start in range(0, total, page)
                for t in client.get_task_range(split, start, min(start + page, total))]
    finally:
        client.close()


def latest_checkpoint(output_dir: str) -> str | None:
    steps = [(int(m[1]), p) for p in Path(output_dir).glob("checkpoint-*")
             if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)) and (p / "trainer_state.json").is_file()]
    return str(max(steps)[1]) if steps else None


def resolve_resume(args: argparse.Namespace) -> str | None:
    if args.resume is None:
        if latest_checkpoint(args.output_dir):
            raise UsageError(f"{args.output_dir} already holds checkpoints of another run; pass --resume to "
                             "continue it, or a new --run-name / --output-dir")
        return None
    if args.resume == "latest":
        path = latest_checkpoint(args.output_dir)
        if path is None:
            raise UsageError(f"--resume: no checkpoint-N/trainer_state.json in {args.output_dir}; pass the run's "
                             "--run-name or --output-dir, or a checkpoint path")
        return path
    if not (Path(args.resume) / "trainer_state.json").is_file():
        raise UsageError(f"--resume {args.resume}: not a checkpoint (no trainer_state.json there)")
    return args.resume


# ----------------------------------------------------------------------------------------------------------------------
# Trainer
# ----------------------------------------------------------------------------------------------------------------------
def stop_rollout_worker(worker: Any, timeout_s: float = 10.0) -> None:
    """Stop TRL's rollout child promptly and boundedly.

    TRL 1.16's `stop()` joins the child for 15 s and terminates it: the child cannot exit while items it put on
    `rollout_buffer` / `metrics_queue` are unread (mp.Queue flushes its pipe at exit), so we drain both while it
    winds down. If the child died holding the stop Event's lock, `Event.set()` blocks forever: it gets its own
    thread and a deadline.
    """
    proc = worker._process
    if proc is None:
        return
    t0 = time.monotonic()
    if proc.is_alive():
        setter = threading.Thread(target=worker._stop_event_mp.set, daemon=True)
        setter.start()
        setter.join(timeout=5.0)
    while proc.is_alive() and time.monotonic() - t0 < timeout_s:
        for q in (worker.rollout_buffer, worker.metrics_queue):
            try:
                while True:
                    q.get_nowait()
            except (queue.Empty, OSError, EOFError, ValueError):
                pass
        proc.join(timeout=0.05)
    if proc.is_alive():
        print(f"[harbor] rollout worker did not exit within {timeout_s:.0f}s; killing it", flush=True)
        proc.kill()
        proc.join(timeout=5)
    else:
        print(f"[harbor] rollout worker exited on its own in {time.monotonic() - t0:.1f}s (exit code "
              f"{proc.exitcode})", flush=True)
    worker._process = None


def build_trainer(args: argparse.Namespace, split: str, tasks: list[dict[str, Any]]):
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, GenerationConfig
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo.openenv_harness import HarnessRolloutWorker

    class HarborRolloutWorker(HarnessRolloutWorker):
        stop = stop_rollout_worker

    class HarborGRPOTrainer(AsyncGRPOTrainer):
        def _save_checkpoint(self, model, trial):
            super()._save_checkpoint(model, trial)
            # TRL resumes at the first group it never trained. A group that yields no sample (every rollout of a
            # broken task failed) is never trained, so each later resume would restart there and replay everything
            # after it; resume after the last trained group instead.
            state_file = (Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
                          / "rollout_state.json")
            if self.accelerator.is_main_process and state_file.is_file() and self._trained_groups:
                state = json.loads(state_file.read_text())
                start = self.rollout_worker._loop_kwargs["dataset_start_index"]
                state["prompt_index"] = start + max(self._trained_groups) + 1
                state_file.write_text(json.dumps(state))

    config = AsyncGRPOConfig(
        output_dir=args.output_dir, run_name=args.run_name, project=args.project, report_to=args.report_to,
        learning_rate=args.learning_rate, max_steps=args.max_steps, save_steps=args.save_steps,
        save_strategy="steps", logging_steps=1, gradient_accumulation_steps=args.micro_batches_per_step,
        # bf16 autocast exists only on GPUs; elsewhere it would score at another precision than the engine.
        bf16=torch.cuda.is_available(),
        num_generations=args.num_generations, max_inflight_tasks=args.max_inflight,
        max_staleness=args.max_staleness, temperature=args.temperature,
        max_completion_length=args.max_completion_length, vllm_server_base_url=args.vllm_url,
        request_timeout=int(args.agent_timeout or 3600) + 1800,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    try:
        eos = GenerationConfig.from_pretrained(args.model).eos_token_id
    except OSError:
        eos = None
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    eos_ids = [tokenizer.eos_token_id, *[i for i in eos_ids if i != tokenizer.eos_token_id]]
    dataset = Dataset.from_list(task_rows(tasks, split))
    worker = HarborRolloutWorker(
        model_name=args.model, dataset=dataset, reward_funcs=[],
        processing_class=tokenizer, eos_token_ids=eos_ids, num_generations=args.num_generations,
        max_inflight_tasks=args.max_inflight, queue_maxsize=config.queue_maxsize,
        vllm_server_url=args.vllm_url, max_tokens=args.max_completion_length, temperature=args.temperature,
        request_timeout=config.request_timeout,
        harness_session_factory=functools.partial(
            HarborSessionFactory, harbor_url=args.harbor_url, harness=args.harness, sandbox=args.sandbox,
            reward_key=args.reward_key, agent_step_limit=args.agent_step_limit,
            agent_timeout_s=args.agent_timeout, max_consecutive_failures=args.max_consecutive_failures),
        rollout_reward_fn=functools.partial(harbor_reward, step_limit=args.agent_step_limit,
                                            efficiency_weight=args.efficiency_weight),
    )
    return HarborGRPOTrainer(model=args.model, args=config, train_dataset=dataset, processing_class=tokenizer,
                             rollout_worker=worker)


# ----------------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------------
def _raise_on_sigterm(signum, frame):
    # Unwinding runs every cleanup on the way out: TRL's (without it the rollout child is orphaned and keeps starting
    # sandboxes) and ours (server sessions held by the preflight).
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        args = parse_args(argv)
    except UsageError as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 2
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    share = join_ranks() if world > 1 else None
    server = None if args.harbor_url or rank else EmbeddedHarborServer(args)
    try:
        code, plan = None, {}
        if rank == 0:
            pf = Preflight()
            plan = preflight(args, pf, server)
            pf.print()
            if pf.failures:
                print(pf.error_line(), file=sys.stderr)
                code = 2
            elif args.check:
                print(f"preflight: no failures ({sum(r[1] == WARN for r in pf.rows)} warnings)", flush=True)
                code = 0
        if share is not None:
            code, plan, args.run_name, args.output_dir, args.harbor_url = share(
                (code, plan, args.run_name, args.output_dir, args.harbor_url))
        return code if code is not None else train(args, plan, server)
    except KeyboardInterrupt:
        print(f"\n[harbor] interrupted; checkpoints so far are in {args.output_dir}", file=sys.stderr)
        return 130
    finally:
        if server is not None:
            server.stop()


def join_ranks():
    """Under `accelerate launch` / torchrun: rank 0 alone runs the preflight and the Harbor server (TRL runs rollouts on
    the main process only); the others take its plan and run name, so N processes start one server and write one run.

    Over a gloo group with a long timeout: rank 0's preflight can take minutes (a first dataset download), longer than
    NCCL's default collective timeout.
    """
    from datetime import timedelta

    import torch.distributed as dist
    from accelerate import PartialState

    PartialState()  # the process group the trainer will use
    group = dist.new_group(backend="gloo", timeout=timedelta(hours=2))

    def share(payload):
        box = [payload]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    return share


def train(args: argparse.Namespace, plan: dict[str, Any], server: EmbeddedHarborServer | None) -> int:
    llm, tasks = plan["llm"], plan["tasks"]
    print_table("async_grpo_harbor" if int(os.environ.get("RANK", "0")) == 0 else "", {
        "run name": args.run_name, "output dir": args.output_dir, "resume from": plan["resume"] or "-",
        "model": args.model, "vllm": args.vllm_url,
        "harbor": f"{args.harbor_url}" + (f" (started here, log {server.log_path})" if server else ""),
        "engine (server side)": f"{llm.get('url', '?')} capture={llm.get('capture_level', '?')}",
        "tokens per micro-batch": f"{plan['max_model_len']} (vLLM max_model_len: TRL's token budget)",
        "split": plan["split"], "tasks": f"{len(tasks)} ({', '.join(t['task_name'] for t in tasks[:5])}"
                                         f"{', ...' if len(tasks) > 5 else ''})",
        "harness / sandbox": f"{args.harness} / {args.sandbox}", "reward key": args.reward_key or "reward",
        "generations / micro-batches per step": f"{args.num_generations} / {args.micro_batches_per_step}",
        "max inflight": args.max_inflight, "max staleness": args.max_staleness, "temperature": args.temperature,
        "agent step limit / timeout": f"{args.agent_step_limit} calls / {args.agent_timeout:g} s",
        "max completion length": args.max_completion_length, "learning rate": args.learning_rate,
        "max steps / save steps": f"{args.max_steps} / {args.save_steps}",
        "efficiency weight": args.efficiency_weight, "stop after failures": args.max_consecutive_failures,
        "report to": f"{args.report_to} (project {args.project})",
    })
    trainer = build_trainer(args, plan["split"], tasks)
    try:
        trainer.train(resume_from_checkpoint=plan["resume"])
    except RuntimeError as exc:
        cause = str(exc.__cause__ or exc)
        if ROLLOUTS_FAILING in cause:
            reason = cause.split(ROLLOUTS_FAILING, 1)[1].splitlines()[0].strip()
            print(f"error: training stopped: {reason}. Fix the cause, then relaunch with --output-dir "
                  f"{args.output_dir} --resume", file=sys.stderr)
            return 1
        raise
    trainer.save_model(args.output_dir)
    print(f"[harbor] done: {trainer.state.global_step} steps, model saved to {args.output_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
