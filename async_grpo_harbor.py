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

    # preemptible (SLURM requeue): one command for the first launch and every requeue; SIGTERM / SIGUSR1 save a
    # checkpoint and exit 75
    uv run async_grpo_harbor.py ... --run-name my-run --resume auto
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
from typing import TYPE_CHECKING, Any

# Nothing heavy at module level: `--help` and a refused argument answer at once, and TRL's spawned rollout child, which
# imports this file, pays only for what it runs. Each path imports what it needs where it needs it.
if TYPE_CHECKING:
    from openenv.core.harness import TrainingTrace, VerifyResult
    from openenv.harbor.models import HarborRolloutResult

# openenv 0.10 imports gradio (its web UI, ~2.5 s) with anything from `openenv.core`, here and again in TRL's rollout
# child. Neither serves a UI, and openenv leaves the UI out when gradio cannot be imported.
sys.modules.setdefault("gradio", None)

DEFAULT_DATASET = "AdithyaSK/data_agent_rl_environment_train"
DEFAULT_TASKS = f"@{Path(__file__).with_name('tasks.txt')}"
# Prefix of the error the rollout child raises to stop training; main() finds it in TRL's wrapped exception.
ROLLOUTS_FAILING = "harbor rollouts failing:"
# EX_TEMPFAIL: "stopped on request, a checkpoint holds everything; relaunch me". SLURM wrappers requeue on it.
REQUEUE_EXIT_CODE = 75


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
                        "there (its --max-output-tokens); a server of yours needs that flag set to match. An agent "
                        "turn is a thought and one command: 30 turns x 1024 fit a 32k context.")
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
                   help="Empty: the --output-dir's name if given, else <model>-<harness>-<sandbox>-<SLURM_JOB_ID, "
                        "else UTC time + random suffix>, so relaunches never write over each other while a requeued "
                        "SLURM job keeps its name.")
    g.add_argument("--project", default="async-grpo-harbor",
                   help="trackio project, so runs on one suite compare side by side.")
    g.add_argument("--report-to", default="trackio",
                   help="Where metrics go: trackio (local, no account needed), none, or any HF integration.")
    g.add_argument("--save-steps", type=int, default=50,
                   help="Optimizer steps between checkpoints: what a crash or preemption can lose.")
    g.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="Resume trainer state and task position: bare `--resume` takes the latest checkpoint in the "
                        "output dir; `auto` the same if there is one, else starts fresh (one command for the first "
                        "launch and every requeue; needs --run-name, --output-dir or SLURM_JOB_ID); or give a "
                        "checkpoint path. A corrupt or partial checkpoint is skipped for the one before it.")
    g.add_argument("--check", action="store_true",
                   help="Run the preflight checks (vLLM, Harbor server, sandbox, tasks, run dir), print their table "
                        "and exit: 0 when nothing FAILs. The same checks run before every training run.")
    g.add_argument("--probe-rollout", action="store_true",
                   help="With the checks: run one rollout of the first task, end to end, to confirm the sandbox, the "
                        "harness, the capture URL and the reward key.")

    g = p.add_argument_group("measure and curate (no trainer, no weights)")
    g.add_argument("--eval-only", action="store_true",
                   help="Measure instead of training: --eval-k rollouts per task (and per harness) at --temperature, "
                        "through the same Harbor server, then write pass_rates.csv to the output dir. Needs no token "
                        "ids from the engine, so a hosted model served by the Harbor server can be measured too.")
    g.add_argument("--eval-k", type=int, default=8,
                   help="Rollouts per task for --eval-only. The pass rate's standard error is sqrt(p(1-p)/k).")
    g.add_argument("--curate", nargs="?", const="", default=None, metavar="PASS_RATES_CSV",
                   help="Write a --tasks file of the learnable tasks (pass rate inside --band) from a pass_rates.csv; "
                        "bare --curate measures first (as --eval-only). Prints how many tasks fall below, inside "
                        "and above the band, and the fraction of GRPO groups expected to carry signal.")
    g.add_argument("--band", default="0.1,0.9",
                   help="LOW,HIGH: pass rates kept by --curate, inclusive. Outside it most groups of --num-generations "
                        "rollouts score identically and teach nothing.")
    g.add_argument("--curated-tasks", default="",
                   help="Where --curate writes the task file. Empty: <output dir>/curated_tasks.txt.")
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
    args.measure = args.eval_only or args.curate == ""
    if args.eval_k < 1:
        raise UsageError(f"--eval-k must be >= 1 (got {args.eval_k})")
    args.band = parse_band(args.band)
    if args.max_inflight < args.num_generations and not args.measure:
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
    if args.resume == "auto" and not (args.run_name or args.output_dir or os.environ.get("SLURM_JOB_ID")):
        raise UsageError("--resume auto needs a run name that survives a relaunch: pass --run-name (or --output-dir); "
                         "under SLURM the job id names the run")
    if not args.run_name and args.output_dir:
        # A relaunch into the same dir is the same run, so it keeps its name in the tracker.
        args.run_name = Path(args.output_dir.rstrip("/")).name
    if not args.run_name:
        stamp = (f"slurm{os.environ['SLURM_JOB_ID']}" if os.environ.get("SLURM_JOB_ID")
                 else f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}")
        model_short = Path(args.model.rstrip("/")).name
        args.run_name = f"{model_short}-{args.harness.replace(',', '+')}-{args.sandbox}-{stamp}"
    args.output_dir = args.output_dir or os.path.join("runs", args.run_name)
    return args


def parse_band(text: str) -> tuple[float, float]:
    try:
        low, high = (float(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"--band {text!r}: give two pass rates LOW,HIGH, e.g. 0.1,0.9") from None
    if not 0 <= low <= high <= 1:
        raise UsageError(f"--band {text!r}: need 0 <= LOW <= HIGH <= 1")
    return low, high


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


def harness_names(spec: str) -> list[str]:
    return [name.strip() for name in spec.split(",") if name.strip()]


def rotate_harnesses(rows: list[dict[str, Any]], harnesses: list[str]) -> list[dict[str, Any]]:
    """Every task once per harness per pass over the rows, the harness changing from one row to the next.

    A row is a GRPO group (TRL repeats it for all its generations), so a group never mixes harnesses and its
    advantages compare like with like; shifting the assignment each pass keeps a task from always meeting the same
    harness when the task count is a multiple of the harness count.
    """
    return [{"prompt": [{**row["prompt"][0], "harbor_harness": harnesses[(i + shift) % len(harnesses)]}]}
            for shift in range(len(harnesses)) for i, row in enumerate(rows)]


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

    def __init__(self, base_url: str, timeout_s: float):
        self.server_session = HarborServerSession(base_url, timeout_s)

    def run_rollout(self, **kwargs: Any) -> HarborRolloutResult:
        from openenv.harbor.client import HarborEnv

        return HarborEnv.run_rollout(self, **kwargs)

    def _call(self, name: str, **kwargs: Any) -> Any:
        result = self.server_session.call_tool(name, kwargs)
        if isinstance(result, dict) and result.get("isError"):
            raise RuntimeError(f"tool {name!r} failed: {json.dumps(result.get('content'))[:300]}")
        return result

    def close(self) -> None:
        self.server_session.close()


# OpenEnv's `ResourceSession` and `ResourceSessionFactory` by shape, not by inheritance: they live in `openenv.core`,
# seconds to import, and TRL checks only the `TrainableSession` protocol (tests/test_sessions.py holds us to all three).
class HarborSession:
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
        self.task_name = prompt[0]["harbor_task_name"]
        self.harness = prompt[0].get("harbor_harness") or factory.harness
        self.group = group
        self.label = f"group {group} task {self._task_index} ({self.task_name})"
        self.train_reward: float | None = None
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
        # The proxy accepts a training policy only from an engine it captures tokens from; any engine takes an eval one.
        policy = {"purpose": "eval", "eval_sampling": f.eval_sampling} if f.eval_sampling else {"sampling": f.sampling}
        for attempt in itertools.count():
            try:
                self.result = self._client.run_rollout(
                    split=self._split, task_index=self._task_index, harness=self.harness, sandbox=f.sandbox,
                    reward_key=f.reward_key, agent_timeout_sec=f.agent_timeout_s,
                    agent_step_limit=f.agent_step_limit, **policy,
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
        elif r.rollout_type != "train" and f.require_tokens:
            self.failure = ("the engine returned no token ids / processed logprobs (eval tier): restart vLLM with "
                            "--return-tokens-as-token-ids --logprobs-mode processed_logprobs")
        elif fatal:
            self.failure = f"capture finding {fatal}"
        elif r.reward is None:
            self.failure = "the verifier produced no reward"
        return 0 if self.failure is None else 1

    def fetch_training_trace(self) -> TrainingTrace:
        from openenv.core.harness import TrainingTrace
        from openenv.harbor.contract import to_training_trace

        if self._client.server_session.closed:
            return TrainingTrace(turns=[])  # abandoned at stop: neither a sample nor a failure
        if self.failure is None:
            try:
                trace = to_training_trace(self.result)
            except (ValueError, TypeError, KeyError) as exc:
                # One malformed capture is this rollout's problem, not the run's: TRL stops its worker on any of these.
                self.failure = f"capture rejected: {exc}"
            else:
                if self._factory.reward_fn is not None:
                    # What TRL's rollout reward will be, so the group accounting sees the rewards it trains on.
                    self.train_reward = self._factory.reward_fn(
                        RewardInputs(env_reward=self.result.reward, trace=trace.turns, tool_call_count=0))
        self._factory.record_outcome(self)
        return TrainingTrace(turns=[]) if self.failure is not None else trace

    def verify(self, transcript: list[dict[str, Any]], final_state: Any | None = None) -> VerifyResult:
        from openenv.core.harness import VerifyResult

        if self.failure is not None or self.result is None:
            return VerifyResult(env_reward=None, done=True, metrics={"failure": self.failure})
        r = self.result
        return VerifyResult(env_reward=r.reward, done=True,
                            metrics={"wall_s": r.wall_s, "turns": r.n_turns, **r.phase_timings})

    def close(self) -> None:
        self._factory.live_sessions.discard(self)
        self._client.close()


class HarborSessionFactory:
    """Creates one `HarborSession` per rollout. Built inside TRL's rollout child as `factory(sampling=...)`.

    `sampling` is the trainer's own policy (temperature), forwarded to every `run_rollout` so the proxy samples at
    the temperature the trainer scores at.
    """

    def __init__(self, *, harbor_url: str, harness: str, sandbox: str, reward_key: str, agent_step_limit: int,
                 agent_timeout_s: float, max_consecutive_failures: int, sampling: dict[str, Any] | None = None,
                 require_tokens: bool = True, record_path: str = "", reward_fn: Any = None,
                 eval_sampling: dict[str, Any] | None = None):
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
        # False for --eval-only: a rollout of an engine without token ids is measurable, just not trainable.
        self.require_tokens = require_tokens
        self.eval_sampling = dict(eval_sampling or {})
        # One JSON line per finished rollout, for the trainer's accounting and for the user to read.
        self.record_path = record_path
        self.reward_fn = reward_fn
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
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the trainer's stop request; it stops us when it is ready
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
        self._write_record(session)
        if failure is None:
            phases = "".join(f", {name} {seconds:.1f}s" for name, seconds in r.phase_timings.items())
            stops = f", {r.budget_stop_count} budget stops" if r.budget_stop_count else ""
            line = (f"[harbor] {session.label}: reward {r.reward:g} in {r.n_turns} turns, {r.wall_s:.1f}s, harness "
                    f"{session.harness}{phases}{stops}")
        else:
            line = redact(f"[harbor] {session.label}: unscorable: {failure[:300]} (harness {session.harness})")
        # One locked write per line: rollouts finish on several threads at once, and print() writes the text and its
        # newline separately, so two lines ran into one (seen in a test run) and log parsers missed a rollout.
        with self._lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
        if failure is not None and count >= self.max_consecutive_failures:
            raise ValueError(redact(
                f"{ROLLOUTS_FAILING} {count} consecutive rollouts were unscorable; the last: {failure[:300]}"))

    def _write_record(self, session: HarborSession) -> None:
        if not self.record_path:
            return
        r, failure = session.result, session.failure
        record = {
            "time": time.time(), "group": session.group, "task": session.task_name,
            "index": session._task_index, "harness": session.harness, "sandbox": self.sandbox,
            "reward": r.reward if r is not None and failure is None else None,
            "train_reward": session.train_reward if failure is None else None,
            "turns": r.n_turns if r is not None else 0, "wall_s": r.wall_s if r is not None else 0.0,
            "budget_stops": r.budget_stop_count if r is not None else 0,
            "phases": dict(r.phase_timings) if r is not None else {},
            "error": failure_kind(failure), "failure": redact(failure[:300]) if failure else None,
        }
        with self._lock, open(self.record_path, "a") as f:
            f.write(json.dumps(record) + "\n")


class RewardInputs:
    """The fields of TRL's `HarnessRolloutOutcome` that `harbor_reward` reads, for computing it outside TRL."""

    def __init__(self, env_reward: float | None, trace: list, tool_call_count: int):
        self.env_reward, self.trace, self.tool_call_count = env_reward, trace, tool_call_count


def failure_kind(failure: str | None) -> str | None:
    """A short, countable name for why a rollout was unscorable."""
    if failure is None:
        return None
    for prefix, kind in (("harbor server call failed", "transport"), ("the engine returned no token ids", "eval_tier"),
                         ("capture", "capture"), ("the verifier produced no reward", "no_reward")):
        if failure.startswith(prefix):
            return kind
    return failure.split(":", 1)[0].strip() or "error"


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
    if args.measure:
        return True, None
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
           "serve with --enable-auto-tool-choice --tool-call-parser <the parser of your model family, hermes for "
           "Qwen3>")

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
    from openenv.harbor.client import HarborEnv

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
    for name in harness_names(args.harness):
        harness = harnesses.get(name)
        if harness is None and ":" not in name:  # `module:Class` is a custom harness the server imports
            pf.add("harness", FAIL, f"unknown harness {name!r}; this server has: "
                   f"{', '.join(closest_first(name, harnesses))}")
        elif harness and harness.get("status", "").split(":")[0] in ("blocked", "unsupported"):
            pf.add("harness", FAIL, f"harness {name!r} cannot run on this server: {harness['status']}",
                   "pick a validated harness")
        else:
            pf.add("harness", PASS, f"{name} ({harness.get('status', '?') if harness else 'custom import'})")

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
    if args.measure:
        pf.add("server's engine", PASS, f"{llm.get('url')}: {llm.get('capture_level') or '?'} capture (measuring needs "
               "no token ids)")
    elif llm.get("capture_level") != "tokens" or not llm.get("ok", True):
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
    if args.measure:
        # Measuring samples through the Harbor server's own engine and loads no weights: the trainer's vLLM, its
        # weight sync and its capture tier do not matter.
        pf.add("measure", PASS, f"{args.eval_k} rollouts per task, {args.max_inflight} in flight; no trainer")
        served = {"id": "", "max_model_len": None}
    else:
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
    from openenv.harbor.client import HarborEnv

    client = HarborEnv(base_url=harbor_url)
    try:
        total = client.num_tasks(split)
        return [t.model_dump() for start in range(0, total, page)
                for t in client.get_task_range(split, start, min(start + page, total))]
    finally:
        client.close()


def numbered_checkpoints(output_dir: str) -> list[Path]:
    """checkpoint-N dirs, newest first."""
    steps = [(int(m[1]), p) for p in Path(output_dir).glob("checkpoint-*")
             if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)) and p.is_dir()]
    return [p for _, p in sorted(steps, reverse=True)]


def checkpoint_problem(path: Path) -> str | None:
    """Why a resume from `path` would fail or silently lose state, or None.

    Structural checks only (every file a resume loads is present and complete): reading a multi-GB optimizer state
    to the end would not fit in a preemption grace period. transformers resumes with a fresh optimizer, without a
    word, when optimizer.pt or scheduler.pt is missing, so both are required.
    """
    import zipfile

    from safetensors import SafetensorError, safe_open

    try:
        int(json.loads((path / "trainer_state.json").read_text())["global_step"])
        int(json.loads((path / "rollout_state.json").read_text())["prompt_index"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    index = path / "model.safetensors.index.json"
    try:
        weights = ({path / f for f in json.loads(index.read_text())["weight_map"].values()} if index.is_file()
                   else {path / "model.safetensors"})
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        return f"{index.name}: {type(exc).__name__}: {exc}"
    for file in sorted(weights):
        try:
            with safe_open(str(file), "pt"):
                pass
        except (OSError, SafetensorError) as exc:
            return f"{file.name}: {exc}"
    for name in ("optimizer.pt", "scheduler.pt", *(f.name for f in path.glob("rng_state*.pth"))):
        try:
            with zipfile.ZipFile(path / name) as archive:
                archive.namelist()
        except (OSError, zipfile.BadZipFile) as exc:
            return f"{name}: {exc}"
    return None


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest checkpoint a resume can use; each newer one that is corrupt or partial is skipped with a warning."""
    for path in numbered_checkpoints(output_dir):
        problem = checkpoint_problem(path)
        if problem is None:
            return str(path)
        print(f"warning: skipping {path}: {problem}; trying the checkpoint before it", file=sys.stderr)
    return None


def resolve_resume(args: argparse.Namespace) -> str | None:
    if args.resume is None:
        if numbered_checkpoints(args.output_dir):
            raise UsageError(f"{args.output_dir} already holds checkpoints of another run; pass --resume to "
                             "continue it, or a new --run-name / --output-dir")
        return None
    if args.resume in ("latest", "auto"):
        path = latest_checkpoint(args.output_dir)
        if path is None and numbered_checkpoints(args.output_dir):
            # Starting over would write over them; a human should look first.
            raise UsageError(f"--resume: no usable checkpoint in {args.output_dir} (see the warnings above); "
                             "repair one, or remove them to start over")
        if path is None and args.resume == "latest":
            raise UsageError(f"--resume: no checkpoint-N in {args.output_dir}; pass the run's --run-name or "
                             "--output-dir, or a checkpoint path")
        return path
    if problem := checkpoint_problem(Path(args.resume)):
        raise UsageError(f"--resume {args.resume}: not a usable checkpoint ({problem})")
    return args.resume


# ----------------------------------------------------------------------------------------------------------------------
# Measure and curate: pass rates per task, and the tasks that can teach
# ----------------------------------------------------------------------------------------------------------------------
PASS_RATE_COLUMNS = ["task", "index", "harness", "sandbox", "k", "solved", "pass_rate", "mean_reward", "mean_turns",
                     "mean_wall_s", "errors"]


class Progress:
    """tasks done, solve rate so far, rollouts/min and ETA on one line: a tqdm bar when tqdm is installed."""

    def __init__(self, units: int, k: int):
        self.units, self.k, self.started = units, k, time.monotonic()
        self.done = self.solved = self.scored = self.units_done = 0
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=units * k, unit="rollout", dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            self.bar = None

    def update(self, solved: bool | None, unit_done: bool) -> None:
        self.done += 1
        self.scored += solved is not None
        self.solved += bool(solved)
        self.units_done += unit_done
        per_min = self.done / max(time.monotonic() - self.started, 1e-9) * 60
        rate = f"{self.solved / self.scored:.0%}" if self.scored else "-"
        status = f"tasks {self.units_done}/{self.units}, solved {rate}, {per_min:.1f} rollouts/min"
        if self.bar is not None:
            self.bar.set_postfix_str(status, refresh=False)
            self.bar.update(1)
        elif unit_done:
            eta = (self.units * self.k - self.done) / per_min if per_min else 0
            print(f"[eval] {status}, ETA {eta:.0f} min", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def measure_pass_rates(args: argparse.Namespace, split: str, tasks: list[dict[str, Any]],
                       llm: dict[str, Any]) -> list[dict[str, Any]]:
    """--eval-k rollouts of every task (under every harness), through the session code training uses.

    A rollout is solved when the verifier's reward (after --reward-key) is > 0, as OpenEnv's `result.solved` reads
    it: partial credit counts, and mean_reward says how much. Unscorable rollouts are errors, left out of the pass
    rate as they are left out of a GRPO baseline. Returns one row per (task, harness) that finished; Ctrl-C or a run
    of failures keeps what finished.
    """
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    from openenv.core.harness.capture.upstream import training_sampling

    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    factory = HarborSessionFactory(
        harbor_url=args.harbor_url, harness=harness_names(args.harness)[0], sandbox=args.sandbox,
        reward_key=args.reward_key, agent_step_limit=args.agent_step_limit, agent_timeout_s=args.agent_timeout,
        max_consecutive_failures=args.max_consecutive_failures,
        sampling=training_sampling({"temperature": args.temperature}), require_tokens=False,
        # A token-capturing engine samples exactly as in training; any other (a hosted model) at the same temperature.
        eval_sampling=None if llm.get("capture_level") == "tokens" else {"temperature": args.temperature, "top_p": 1.0},
        record_path=os.path.join(args.output_dir, "eval_rollouts.jsonl"))
    units = rotate_harnesses(task_rows(tasks, split), harness_names(args.harness))
    outcomes: list[list[HarborSession]] = [[] for _ in units]
    progress = Progress(len(units), args.eval_k)

    def run(unit: int) -> tuple[int, HarborSession]:
        session = HarborSession(factory, units[unit]["prompt"], unit)
        factory.live_sessions.add(session)
        try:
            session.wait_for_completion()
            if not session._client.server_session.closed:
                factory.record_outcome(session)
            return unit, session
        finally:
            session.close()

    stop_reason = None
    pool = ThreadPoolExecutor(max_workers=args.max_inflight, thread_name_prefix="harbor-eval")
    pending = set()
    jobs = iter([unit for unit in range(len(units)) for _ in range(args.eval_k)])
    try:
        for job in itertools.islice(jobs, args.max_inflight):
            pending.add(pool.submit(run, job))
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                try:
                    unit, session = future.result()
                except ValueError as exc:  # record_outcome: --max-consecutive-failures reached
                    stop_reason = str(exc)
                    raise KeyboardInterrupt from None
                outcomes[unit].append(session)
                progress.update(None if session.failure else bool(session.result.solved),
                                len(outcomes[unit]) == args.eval_k)
                if (job := next(jobs, None)) is not None:
                    pending.add(pool.submit(run, job))
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM: release the server's slots, keep what finished
        stop_reason = stop_reason or "interrupted"
        for session in list(factory.live_sessions):
            session.close()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        progress.close()
    rows = [pass_rate_row(units[unit]["prompt"][0], args.sandbox, sessions)
            for unit, sessions in enumerate(outcomes) if len(sessions) == args.eval_k]
    if stop_reason:
        print(redact(f"[eval] stopped early ({stop_reason}); {len(rows)} of {len(units)} tasks fully measured"),
              file=sys.stderr, flush=True)
    return rows


def pass_rate_row(prompt: dict[str, Any], sandbox: str, sessions: list[HarborSession]) -> dict[str, Any]:
    scored = [s.result for s in sessions if s.failure is None]
    solved = sum(r.solved for r in scored)

    def mean(values):
        return round(sum(values) / len(values), 4) if values else ""

    return {"task": prompt["harbor_task_name"], "index": prompt["harbor_task_index"],
            "harness": prompt["harbor_harness"], "sandbox": sandbox, "k": len(sessions), "solved": solved,
            "pass_rate": mean([r.solved for r in scored]), "mean_reward": mean([r.reward for r in scored]),
            "mean_turns": mean([r.n_turns for r in scored]), "mean_wall_s": mean([r.wall_s for r in scored]),
            "errors": len(sessions) - len(scored)}


def write_pass_rates(path: Path, rows: list[dict[str, Any]]) -> None:
    import csv

    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=PASS_RATE_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def read_pass_rates(path: str) -> list[dict[str, Any]]:
    import csv

    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as exc:
        raise UsageError(f"--curate {path}: cannot read it ({exc.strerror}); give a pass_rates.csv written by "
                         "--eval-only, or a bare --curate to measure first") from None
    missing = {"task", "k", "solved", "errors"} - set(rows[0] if rows else {})
    if not rows or missing:
        raise UsageError(f"--curate {path}: not a pass_rates.csv written by --eval-only "
                         f"({'no rows' if not rows else 'no column ' + ', '.join(sorted(missing))})")
    return rows


def pass_rates_by_task(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Task -> pass rate over all its scorable rollouts (pooled across harnesses); None when none was scorable."""
    counts: dict[str, list[int]] = {}
    for row in rows:
        solved, scored = counts.setdefault(row["task"], [0, 0])
        counts[row["task"]] = [solved + int(row["solved"]), scored + int(row["k"]) - int(row["errors"])]
    return {task: solved / scored if scored else None for task, (solved, scored) in counts.items()}


def signal_fraction(rates: list[float], group_size: int) -> float:
    """Expected fraction of GRPO groups whose rewards are not all equal: P(a group of G mixes solves and fails)."""
    return sum(1 - p ** group_size - (1 - p) ** group_size for p in rates) / len(rates) if rates else float("nan")


def print_pass_rates(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("\nno task was fully measured\n", flush=True)
        return
    print("\npass rates (solved = verifier reward > 0; errors are unscorable rollouts, left out of the rate)")
    header = ["task", "harness", "k", "solved", "pass_rate", "mean_reward", "mean_turns", "mean_wall_s", "errors"]
    widths = {h: max(len(h), *(len(str(r[h])) for r in rows)) for h in header}
    print("  " + "  ".join(f"{h:<{widths[h]}}" for h in header))
    for r in rows:
        print("  " + "  ".join(f"{r[h]!s:<{widths[h]}}" for h in header))
    scored = sum(int(r["k"]) - int(r["errors"]) for r in rows)
    solved = sum(int(r["solved"]) for r in rows)
    print(f"  {len(rows)} tasks, {sum(int(r['k']) for r in rows)} rollouts, {solved}/{scored} solved, "
          f"{sum(int(r['errors']) for r in rows)} errors\n", flush=True)


def curate(args: argparse.Namespace, rows: list[dict[str, Any]], source: str) -> Path:
    """Write the tasks whose pass rate lies inside --band as a --tasks file; print what the band does to the signal."""
    low, high = args.band
    rates = pass_rates_by_task(rows)
    below = [t for t, p in rates.items() if p is not None and p < low]
    inside = [t for t, p in rates.items() if p is not None and low <= p <= high]
    above = [t for t, p in rates.items() if p is not None and p > high]
    unmeasured = [t for t, p in rates.items() if p is None]
    out = Path(args.curated_tasks or os.path.join(args.output_dir, "curated_tasks.txt"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        f"# Learnable tasks: pass rate in [{low:g}, {high:g}] (solved sometimes, not always).\n"
        f"# Source: {source}\n# Written: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC} by async_grpo_harbor.py "
        f"--curate; use it as --tasks @{out}\n" + "".join(f"{t}\n" for t in inside))
    g = args.num_generations
    print_table(f"curate (band {low:g}-{high:g})", {
        "below band (never or rarely solved)": len(below),
        "inside band (kept)": len(inside),
        "above band (always or nearly always solved)": len(above),
        "unmeasured (every rollout unscorable)": len(unmeasured),
        f"groups with reward variance, G={g}, all measured tasks":
            f"{signal_fraction([p for p in rates.values() if p is not None], g):.1%}",
        f"groups with reward variance, G={g}, curated tasks": f"{signal_fraction([rates[t] for t in inside], g):.1%}",
        "written": f"{out} ({len(inside)} tasks)",
    })
    if not inside:
        print(f"warning: no task has a pass rate inside {low:g}-{high:g}; {out} lists none, so --tasks @{out} "
              "would be refused", file=sys.stderr)
    return out


def run_measure(args: argparse.Namespace, plan: dict[str, Any]) -> int:
    """--eval-only and --curate: no trainer, no weights, no torch."""
    if args.curate:
        curate(args, read_pass_rates(args.curate), args.curate)
        return 0
    split, tasks, llm = plan["split"], plan["tasks"], plan["llm"]
    print_table("async_grpo_harbor --eval-only", {
        "output dir": args.output_dir, "harbor": args.harbor_url,
        "engine (server side)": f"{llm.get('url', '?')} capture={llm.get('capture_level', '?')}",
        "split": split, "tasks": len(tasks), "harness / sandbox": f"{args.harness} / {args.sandbox}",
        "rollouts per task (and harness)": args.eval_k, "temperature": args.temperature,
        "max inflight": args.max_inflight, "reward key": args.reward_key or "reward",
        "agent step limit / timeout": f"{args.agent_step_limit} calls / {args.agent_timeout:g} s",
    })
    rows = measure_pass_rates(args, split, tasks, llm)
    path = Path(args.output_dir) / "pass_rates.csv"
    write_pass_rates(path, rows)
    print_pass_rates(rows)
    print(f"[eval] wrote {path}", flush=True)
    if args.curate == "":
        curate(args, [{k: str(v) for k, v in r.items()} for r in rows], str(path))
    return 0 if len(rows) == len(tasks) * len(harness_names(args.harness)) else 1


# ----------------------------------------------------------------------------------------------------------------------
# Trainer
# ----------------------------------------------------------------------------------------------------------------------
class RolloutAccounting:
    """Where a run's time and signal go, per optimizer step: read from the rollout records the factory writes.

    The factory runs in TRL's rollout child, whose only metrics channel takes a fixed set of keys; it appends one JSON
    line per finished rollout instead, and the trainer folds the lines that arrived since the previous step into its
    log (trainer_state.json, trackio) and one console line. A group counts once all its generations have finished;
    it has zero variance when its scorable rewards (the shaped ones TRL trains on) are all equal, so its advantages
    are all 0 and it teaches nothing. Counts start at this launch.
    """

    def __init__(self, path: str, num_generations: int, harnesses: list[str]):
        self.path, self.num_generations, self.harnesses = Path(path), num_generations, harnesses
        self.offset = self.path.stat().st_size if self.path.is_file() else 0
        self.pending: dict[Any, list[dict[str, Any]]] = {}
        self.groups_total = self.zero_total = 0
        self.by_harness: dict[str, list[int]] = {h: [0, 0] for h in harnesses}  # [groups, zero-variance groups]
        self.last = time.monotonic()

    def _new_records(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[:data.rfind(b"\n") + 1]  # a line still being written is read next time
        self.offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def step(self, step: int) -> dict[str, float]:
        records = self._new_records()
        now, elapsed = time.monotonic(), time.monotonic() - self.last
        self.last = now
        scored_groups, zero_groups = [], []
        for record in records:
            members = self.pending.setdefault(record["group"], [])
            members.append(record)
            if len(members) < self.num_generations:
                continue
            del self.pending[record["group"]]
            rewards = {m["train_reward"] if m["train_reward"] is not None else m["reward"]
                       for m in members if m["error"] is None}
            if not rewards:
                continue  # no sample at all: counted as errors, not as a group that trained on nothing
            scored_groups.append(record["group"])
            zero = len(rewards) == 1
            zero_groups += [record["group"]] if zero else []
            counts = self.by_harness.setdefault(record["harness"], [0, 0])
            counts[0] += 1
            counts[1] += zero
        self.groups_total += len(scored_groups)
        self.zero_total += len(zero_groups)

        ok = [r for r in records if r["error"] is None]
        errors: dict[str, int] = {}
        for r in records:
            if r["error"] is not None:
                errors[r["error"]] = errors.get(r["error"], 0) + 1
        metrics = {"harbor/rollouts": float(len(records)), "harbor/rollouts_per_min": len(records) / elapsed * 60,
                   "harbor/sandbox_s_per_step": sum(r["wall_s"] for r in records),
                   "harbor/errors": float(sum(errors.values())),
                   "harbor/budget_stops": float(sum(r["budget_stops"] for r in records)),
                   "harbor/groups": float(len(scored_groups)), "harbor/groups_total": float(self.groups_total),
                   "harbor/zero_variance_groups_total": float(self.zero_total)}
        metrics |= {f"harbor/errors/{kind}": float(n) for kind, n in errors.items()}
        if scored_groups:
            metrics["harbor/zero_variance_frac"] = len(zero_groups) / len(scored_groups)
        if self.groups_total:
            metrics["harbor/zero_variance_frac_cumulative"] = self.zero_total / self.groups_total
        if ok:
            metrics |= {"harbor/solve_rate": sum(r["reward"] > 0 for r in ok) / len(ok),
                        "harbor/wall_s_mean": sum(r["wall_s"] for r in ok) / len(ok),
                        "harbor/turns_mean": sum(r["turns"] for r in ok) / len(ok)}
            for phase in {name for r in ok for name in r["phases"]}:
                timed = [r["phases"][phase] for r in ok if phase in r["phases"]]
                metrics[f"harbor/phase_s/{phase}"] = sum(timed) / len(timed)
        if len(self.harnesses) > 1:
            for harness in self.harnesses:
                mine = [r for r in records if r["harness"] == harness]
                mine_ok = [r for r in mine if r["error"] is None]
                groups, zero = self.by_harness[harness]
                metrics[f"harbor/{harness}/rollouts"] = float(len(mine))
                metrics[f"harbor/{harness}/errors"] = float(len(mine) - len(mine_ok))
                if mine_ok:
                    metrics[f"harbor/{harness}/solve_rate"] = sum(r["reward"] > 0 for r in mine_ok) / len(mine_ok)
                    metrics[f"harbor/{harness}/wall_s_mean"] = sum(r["wall_s"] for r in mine_ok) / len(mine_ok)
                if groups:
                    metrics[f"harbor/{harness}/zero_variance_frac_cumulative"] = zero / groups

        share = f"{len(zero_groups) / len(scored_groups):.0%}" if scored_groups else "-"
        total = f"{self.zero_total / self.groups_total:.0%}" if self.groups_total else "-"
        print(f"[harbor] step {step}: {len(scored_groups)} groups scored "
              f"({','.join(map(str, scored_groups)) or '-'}), {len(zero_groups)} zero-variance "
              f"({','.join(map(str, zero_groups)) or '-'}) = {share}; cumulative {self.zero_total}/{self.groups_total} "
              f"= {total}; {len(records)} rollouts ({metrics['harbor/rollouts_per_min']:.1f}/min), sandbox "
              f"{metrics['harbor/sandbox_s_per_step']:.0f}s, errors {sum(errors.values())}"
              + "".join(f" {kind}={n}" for kind, n in errors.items()), flush=True)
        return metrics


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


class Preempted(BaseException):
    """A stop request that reached a point where training can stop without losing a step. A BaseException, like
    SystemExit, so no `except Exception` on the way out swallows it."""


class StopRequest:
    """SIGTERM / SIGUSR1 (SLURM's preemption notice, scancel, `kill`): save a checkpoint, exit for a requeue.

    Before training runs there is nothing to save, so the signal unwinds at once. Once it runs, the handler only takes
    note: unwinding from an arbitrary point could leave vLLM paused mid weight sync (TRL's pause/resume is not in a
    try/finally) or an optimizer step half applied. The trainer stops at the next safe point instead: the end of the
    current optimizer step, or within one queue poll if it is waiting for rollouts (whose end may be minutes away).
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.deferred = False
        self.resume_command = "the same command"

    def handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        # os.write, not print: the main thread may be inside a print, which a print here would re-enter.
        if self.signal_name is not None:
            os.write(1, f"[harbor] {name} again: already stopping; the checkpoint is written whole or not at all\n"
                     .encode())
            return
        self.signal_name = name
        if not self.deferred:
            os.write(1, f"[harbor] stopped by {name} before training started: nothing to save; exit code "
                        f"{REQUEUE_EXIT_CODE} (requeue). Resume: {self.resume_command}\n".encode())
            raise SystemExit(REQUEUE_EXIT_CODE)
        os.write(1, f"[harbor] {name}: stopping at the end of this optimizer step (sooner if it is waiting for "
                    "rollouts) to save a checkpoint\n".encode())


STOP = StopRequest()


def resume_command(argv: list[str], output_dir: str) -> str:
    """The command line that continues this run: the same arguments with `--resume auto` in this output dir."""
    kept, tokens = [], iter(argv)
    for token in tokens:
        if token == "--resume":
            following = next(tokens, None)
            if following is not None and following.startswith("-"):
                kept.append(following)
        elif not token.startswith("--resume="):
            kept.append(token)
    if not any(t == "--output-dir" or t.startswith("--output-dir=") for t in kept):
        kept += ["--output-dir", output_dir]
    return redact(shlex.join(["uv", "run", Path(sys.argv[0]).name, *kept, "--resume", "auto"]))


def write_json_atomic(path: Path, data: Any) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(data))
    os.replace(partial, path)


def publish_checkpoint(staged: Path, final: Path) -> None:
    """Put a completely written checkpoint in place with one rename, so checkpoint-N is never half-written."""
    replaced = final.with_name(f".replaced-{final.name}")
    if final.exists():  # an unusable checkpoint of this step, from before a fallback to an older one
        shutil.rmtree(replaced, ignore_errors=True)
        final.rename(replaced)
    staged.rename(final)
    shutil.rmtree(replaced, ignore_errors=True)


def save_for_requeue(trainer: Any, args: argparse.Namespace) -> int:
    """Checkpoint the last finished optimizer step, unless a checkpoint already holds it, and ask for a requeue."""
    step = trainer.state.global_step
    checkpoint = Path(args.output_dir) / f"checkpoint-{step}"
    if step and checkpoint_problem(checkpoint) is not None:
        # A step interrupted while waiting for rollouts is dropped whole: the weights and optimizer are still those
        # of the last finished step, and its gradients are not kept.
        trainer._save_checkpoint(trainer.model_wrapped, trial=None)
    saved = f"checkpoint {checkpoint} (step {step})" if step else "no optimizer step yet, nothing to save"
    print(f"[harbor] stopped by {STOP.signal_name}: {saved}; exit code {REQUEUE_EXIT_CODE} (requeue). Resume: "
          f"{STOP.resume_command}", flush=True)
    return REQUEUE_EXIT_CODE


def build_trainer(args: argparse.Namespace, split: str, tasks: list[dict[str, Any]]):
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, GenerationConfig, TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo.openenv_harness import HarnessRolloutWorker

    class HarborRolloutWorker(HarnessRolloutWorker):
        stop = stop_rollout_worker

        def check_health(self, stale_after_s: float) -> None:
            # TRL calls this each time the trainer has waited a queue poll for rollouts: a safe point to stop at.
            if STOP.signal_name is not None:
                raise Preempted(STOP.signal_name)
            super().check_health(stale_after_s)

    class StopAtStepEnd(TrainerCallback):
        def on_step_end(self, _args, _state, control, **_kwargs):
            if STOP.signal_name is not None:
                control.should_save = True
                control.should_training_stop = True

    class HarborGRPOTrainer(AsyncGRPOTrainer):
        _staging_dir: str | None = None

        def _get_output_dir(self, trial):
            # transformers and TRL write a checkpoint file by file into <output dir>/checkpoint-N; pointing them at a
            # staging dir while they do means a kill mid-save leaves no half-written checkpoint-N behind.
            return self._staging_dir or super()._get_output_dir(trial)

        def _save_checkpoint(self, model, trial):
            name = f"checkpoint-{self.state.global_step}"
            run_dir = Path(super()._get_output_dir(trial))
            staging = run_dir / f".staging-{name}"
            if self.accelerator.is_main_process:
                shutil.rmtree(staging, ignore_errors=True)  # left by a save that was killed
            self._staging_dir = str(staging)
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self._staging_dir = None
            self.accelerator.wait_for_everyone()  # every rank's files are in before the rename
            if not self.accelerator.is_main_process:
                return
            # TRL resumes at the first group it never trained. A group that yields no sample (every rollout of a
            # broken task failed) is never trained, so each later resume would restart there and replay everything
            # after it; resume after the last trained group instead.
            state_file = staging / name / "rollout_state.json"
            if state_file.is_file() and self._trained_groups:
                state = json.loads(state_file.read_text())
                start = self.rollout_worker._loop_kwargs["dataset_start_index"]
                state["prompt_index"] = start + max(self._trained_groups) + 1
                write_json_atomic(state_file, state)
            publish_checkpoint(staging / name, run_dir / name)
            staging.rmdir()

        def log(self, logs, start_time=None):
            if "loss" in logs and self.accelerator.is_main_process:
                logs.update(accounting.step(self.state.global_step))
            super().log(logs, start_time)

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
    dataset = Dataset.from_list(rotate_harnesses(task_rows(tasks, split), harness_names(args.harness)))
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    records = os.path.join(args.output_dir, "rollouts.jsonl")
    accounting = RolloutAccounting(records, args.num_generations, harness_names(args.harness))
    reward_fn = functools.partial(harbor_reward, step_limit=args.agent_step_limit,
                                  efficiency_weight=args.efficiency_weight)
    worker = HarborRolloutWorker(
        model_name=args.model, dataset=dataset, reward_funcs=[],
        processing_class=tokenizer, eos_token_ids=eos_ids, num_generations=args.num_generations,
        max_inflight_tasks=args.max_inflight, queue_maxsize=config.queue_maxsize,
        vllm_server_url=args.vllm_url, max_tokens=args.max_completion_length, temperature=args.temperature,
        request_timeout=config.request_timeout,
        harness_session_factory=functools.partial(
            HarborSessionFactory, harbor_url=args.harbor_url, harness=harness_names(args.harness)[0],
            sandbox=args.sandbox, reward_key=args.reward_key, agent_step_limit=args.agent_step_limit,
            agent_timeout_s=args.agent_timeout, max_consecutive_failures=args.max_consecutive_failures,
            record_path=records, reward_fn=reward_fn),
        rollout_reward_fn=reward_fn,
    )
    trainer = HarborGRPOTrainer(model=args.model, args=config, train_dataset=dataset, processing_class=tokenizer,
                                rollout_worker=worker)
    trainer.add_callback(StopAtStepEnd())
    return trainer


# ----------------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, STOP.handle)
    signal.signal(signal.SIGUSR1, STOP.handle)
    try:
        args = parse_args(argv)
        STOP.resume_command = resume_command(sys.argv[1:] if argv is None else argv, args.output_dir)
        if args.curate:  # from a pass_rates.csv: no server, no engine
            return run_measure(args, {})
    except UsageError as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 2
    rank = launch_rank()
    share = join_ranks() if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
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
        if code is not None:
            return code
        return run_measure(args, plan) if args.measure else train(args, plan, server)
    except KeyboardInterrupt:
        print(f"\n[harbor] interrupted; checkpoints so far are in {args.output_dir}", file=sys.stderr)
        return 130
    finally:
        if server is not None:
            server.stop()


def launch_rank() -> int:
    """This process's global rank under `accelerate launch` / torchrun; 0 when launched alone."""
    return int(os.environ.get("RANK", "0"))


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


def print_hyperparameters(args: argparse.Namespace, plan: dict[str, Any],
                          server: EmbeddedHarborServer | None) -> None:
    llm, tasks = plan["llm"], plan["tasks"]
    print_table("async_grpo_harbor", {
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


def train(args: argparse.Namespace, plan: dict[str, Any], server: EmbeddedHarborServer | None) -> int:
    if launch_rank() == 0:
        print_hyperparameters(args, plan, server)
    trainer = build_trainer(args, plan["split"], plan["tasks"])
    STOP.deferred = True
    try:
        trainer.train(resume_from_checkpoint=plan["resume"])
    except Preempted:
        pass  # unwinding ran TRL's cleanup: rollout child stopped, its server sessions released
    except RuntimeError as exc:
        cause = str(exc.__cause__ or exc)
        if ROLLOUTS_FAILING in cause:
            reason = cause.split(ROLLOUTS_FAILING, 1)[1].splitlines()[0].strip()
            print(f"error: training stopped: {reason}. Fix the cause, then relaunch with --output-dir "
                  f"{args.output_dir} --resume", file=sys.stderr)
            return 1
        raise
    if STOP.signal_name and trainer.state.global_step < args.max_steps:
        return save_for_requeue(trainer, args)
    trainer.save_model(args.output_dir)
    print(f"[harbor] done: {trainer.state.global_step} steps, model saved to {args.output_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
