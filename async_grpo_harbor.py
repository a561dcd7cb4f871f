# /// script
# requires-python = ">=3.12"
# dependencies = [
#     "trl==1.16.0",
#     "peft==0.21.2",  # --use-peft
#     "kernels>=0.17.2,<0.19",  # TRL's tree attention loads its CUDA kernel with it
#     "openenv[harbor]==0.10.0",
#     # Exact: Harbor decides how sandboxes start and harnesses install (openenv[harbor] asks only >=0.22.0).
#     "harbor==0.25.0",
#     "vllm==0.29.0",
#     # Exact: the script uses private names of these and of TRL (tests/test_private_names.py checks them).
#     "transformers==5.24.0",
#     "accelerate==1.15.0",
#     "torch==2.13.0",
#     "e2b",
#     "trackio",
# ]
# ///
"""RL-train a language model on any Harbor task suite, through a loop-owning agent harness, with TRL's AsyncGRPO.

The harness (default mini-swe-agent) runs inside a sandbox (default e2b) and drives itself; its model calls go
through OpenEnv's capture proxy to your vLLM server, which records exact token ids and logprobs. Harbor's verifier
scores the workspace. This script turns each rollout into a GRPO sample and trains the policy that vLLM serves.

Run it (README.md walks through it):

    # one GPU (80 GB: LoRA). 1. vLLM on 0.40 of it, bound to this host (its ipc backend unpickles what it is sent)
    VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1 vllm serve Qwen/Qwen3-4B-Instruct-2507 \
        --host 127.0.0.1 --port 8000 --gpu-memory-utilization 0.40 --max-model-len 32768 \
        --enable-auto-tool-choice --tool-call-parser hermes \
        --logprobs-mode processed_logprobs --return-tokens-as-token-ids \
        --weight-transfer-config '{"backend":"ipc"}'

    # 2. check everything with one paid rollout, then train; the merged model lands in <output dir>/merged
    E2B_API_KEY=... HF_TOKEN=... uv run async_grpo_harbor.py --model Qwen/Qwen3-4B-Instruct-2507 \
        --vllm-url http://127.0.0.1:8000 --use-peft --lora-target-modules all-linear --check --probe-rollout
    E2B_API_KEY=... HF_TOKEN=... uv run async_grpo_harbor.py --model Qwen/Qwen3-4B-Instruct-2507 \
        --vllm-url http://127.0.0.1:8000 --use-peft --lora-target-modules all-linear

    # two GPUs: vLLM on GPU 0, weights pushed over NCCL ...
    CUDA_VISIBLE_DEVICES=0 VLLM_SERVER_DEV_MODE=1 vllm serve Qwen/Qwen3-4B-Instruct-2507 --host 127.0.0.1 \
        --port 8000 --max-model-len 32768 --enable-auto-tool-choice --tool-call-parser hermes \
        --logprobs-mode processed_logprobs --return-tokens-as-token-ids \
        --weight-transfer-config '{"backend":"nccl"}'
    # ... and the trainer on GPU 1
    CUDA_VISIBLE_DEVICES=1 E2B_API_KEY=... HF_TOKEN=... uv run async_grpo_harbor.py \
        --model Qwen/Qwen3-4B-Instruct-2507 --vllm-url http://127.0.0.1:8000

    # preemptible: one command for the first launch and every requeue; SIGTERM / SIGUSR1 checkpoint and exit 75
    uv run async_grpo_harbor.py ... --run-name my-run --resume auto

The sections below, in the order data flows (search for `# --- <name>`):

    Arguments        ScriptArguments, HarborGRPOConfig (TRL's config, this script's defaults), parse_args
    Tasks            the task list (--tasks) as TRL dataset rows, task_rows
    Session factory  HarborSessionFactory: one Harbor rollout (harness + sandbox + verifier) per TRL session
    Reward           harbor_reward (a rollout's score), shape_group_rewards (the group's, before TRL's advantages)
    Harbor server    EmbeddedHarborServer: the `openenv harbor serve` this script starts without --harbor-url
    Sizing           TrainerShape, trainer_peak: the disk and GPU memory a run needs
    Preflight        preflight: the rows `--check` prints, in order, run before any weights load
    Measure          run_measure (--eval-only), curate (--curate), held_out_eval (--eval-tasks during training)
    Trainer          HarborRolloutLoop (in TRL's rollout child: a group's reward, groups.jsonl), StepLog (the step
                     line), HarborGRPOTrainer (the dual clip, checkpoints, resume order), build_trainer
    Main             main: arguments -> preflight -> train(), whose `trainer.train(...)` is the training call
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import csv
import ctypes
import dataclasses
import difflib
import functools
import http.client
import ipaddress
import json
import math
import multiprocessing
import os
import pickle
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
import warnings
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, NamedTuple

# Pinned TRL: its warning about the experimental API would otherwise open every refusal and the rollout child's log.
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
# AsyncGRPOConfig's own default (gradient_checkpointing=True) draws transformers' rename warning on every command.
warnings.filterwarnings("ignore", message="`gradient_checkpointing` is deprecated", category=FutureWarning)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import yaml  # noqa: E402
from accelerate import PartialState  # noqa: E402
from accelerate.utils import broadcast_object_list, is_peft_model  # noqa: E402
from datasets import Dataset  # noqa: E402
from openenv.core.harness import ResourceSession, ResourceSessionFactory, TrainingTrace, VerifyResult  # noqa: E402
from openenv.core.harness.capture.upstream import training_sampling  # noqa: E402
from openenv.core.harness.capture.validate_llm import validate_llm  # noqa: E402
from openenv.harbor.capabilities import HOST_SIDE_AGENTS  # noqa: E402
from openenv.harbor.client import HarborEnv  # noqa: E402
from openenv.harbor.models import HarborRolloutResult  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback  # noqa: E402
from transformers.trainer_utils import sort_checkpoints  # noqa: E402
from trl import ModelConfig, TrlParser, get_peft_config  # noqa: E402
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer, packing  # noqa: E402
# private: TRL's weight manifest walks _iter_vllm_named_params; the merged push must name the same tensors, in order
from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params  # noqa: E402
# private: TRL's loop-owning harness loop; no public class or hook scores a finished group
from trl.experimental.async_grpo.openenv_harness import HarnessRolloutWorker, _HarnessRolloutLoop  # noqa: E402
from trl.experimental.async_grpo.vllm_client import VLLMClient  # noqa: E402
from trl.experimental.async_grpo.weight_transfer import WeightTransferClient  # noqa: E402

DEFAULT_DATASET = "AdithyaSK/data_agent_rl_environment_train"
DEFAULT_TASKS = f"@{Path(__file__).with_name('tasks.txt')}"
# EX_TEMPFAIL: "stopped on request, a checkpoint holds everything; relaunch me". SLURM wrappers requeue on it.
REQUEUE_EXIT_CODE = 75
# --use-peft's default learning rate: LoRA trains at ~10x a full fine-tune's ("LoRA Without Regret", 2025).
LORA_LEARNING_RATE = 1e-5


# --- Arguments --------------------------------------------------------------------------------------------------------
# One TrlParser over the script's flags and AsyncGRPOConfig with the script's defaults.
def arg(default: Any, help: str, shown: str | None = None, **argparse_kwargs: Any) -> Any:
    """A field as TrlParser reads it; shown: the default --help prints where the value is empty or this host's."""
    if shown is not None:  # argparse appends its own "(default: X)" unless the help names %(default)
        help = f"{help} (default: {shown})%(default).0s"
    return field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclass
class ScriptArguments:
    model: str = arg("Qwen/Qwen3-4B-Instruct-2507", "Model to train (hub id or local dir): the one vLLM serves.")
    harbor_url: str = arg("", "A running `openenv harbor serve` (docs/harbor-server.md).", shown="the script's own")
    harbor_retry_window: float = arg(300.0, "Seconds the Harbor server may stay unreachable before the run stops.")
    harbor_command: str = arg(shlex.join([sys.executable, "-m", "openenv.cli", "harbor", "serve"]),
                              "Without --harbor-url: the command that serves Harbor (docs/flags.md).",
                              shown="this interpreter's `-m openenv.cli harbor serve`")
    harbor_expose: str = arg("auto", "Without --harbor-url: how the harness reaches the capture proxy (docs/flags.md).",
                             choices=["auto", "direct", "cloudflare", "gradio"])
    dataset: str = arg(DEFAULT_DATASET, "Harbor dataset: HF repo, dir or name@version (docs/flags.md).")
    split: str = arg("", "Server split name, when it differs from --dataset.", shown="the one named like --dataset")
    tasks: str = arg(DEFAULT_TASKS, "Tasks, in order: `0-49,57,name` or `@file`.", shown="tasks.txt beside the script")
    harness: str = arg("mini-swe-agent", "Agent harness the server runs in the sandbox; `a,b` rotates them per group.")
    sandbox: str = arg("e2b", "Harbor environment per rollout; its credentials (E2B_API_KEY) set on the server.")
    reward_key: str = arg("", "Reward key to train on, or a comma-separated preference list.", shown="`reward`")
    agent_step_limit: int = arg(30, "Model calls per rollout: a memory guard; 30 turns of ~1k tokens fill 32k.")
    efficiency_weight: float = arg(0.1, "Bonus in [0, 1) for fewer agent turns; 0 disables it (docs/reward.md).")
    max_zero_variance_groups: int = arg(100, "All-equal groups in a row (kept out) that stop training; 0: never.")
    max_consecutive_failures: int = arg(32, "Unscorable rollouts in a row (sandbox, credentials) that stop training.")
    resume: str | None = arg(None, "Bare: the latest checkpoint; `auto`: that or a fresh start; or a checkpoint path.",
                             nargs="?", const="latest")
    check: bool = arg(False, "Print the preflight table and exit, 0 when nothing FAILs (training runs it first).")
    probe_rollout: bool = arg(False, "With --check: one rollout of the first task, end to end.")
    eval_only: bool = arg(False, "Measure pass rates instead of training: pass_rates.csv (docs/measure.md).")
    eval_k: int = arg(8, "Rollouts per task for --eval-only and --eval-tasks.")
    eval_tasks: str = arg("", "Held-out tasks (--tasks syntax) measured every --eval-steps.", shown="none")
    allow_engine_mismatch: bool = arg(False, "Train although the Harbor server names another engine than --vllm-url.")
    curate: str | None = arg(None, "Write a --tasks file of the tasks inside --band in PASS_RATES_CSV; bare: measure "
                                   "first.", nargs="?", const="", metavar="PASS_RATES_CSV")
    band: str = arg("0.1,0.9", "LOW,HIGH: the pass rates --curate keeps, inclusive.")
    curated_tasks: str = arg("", "Where --curate writes the task file.", shown="<output dir>/curated_tasks.txt")
    # TRL's ModelConfig LoRA fields (ModelConfig itself would add a second --dtype)
    use_peft: bool = arg(False, "LoRA adapters on a frozen base, pushed merged (docs/flags.md).")
    lora_r: int = arg(16, "LoRA R value.")
    lora_alpha: int = arg(32, "LoRA alpha.")
    lora_dropout: float = arg(0.05, "LoRA dropout.")
    lora_target_modules: list[str] | None = arg(None, "LoRA target modules; all-linear: every linear but the head.",
                                                shown="PEFT's for the architecture", nargs="+")
    use_rslora: bool = arg(False, "Rank-Stabilized LoRA: scale the adapter by lora_alpha/√r, not lora_alpha/r.")


@dataclass
class HarborGRPOConfig(AsyncGRPOConfig):
    vllm_url: str = arg("http://localhost:8000", "Base URL of `vllm serve` (no /v1), where weights are pushed.")
    dtype: str = arg("float32", "The trainer's weights and AdamW state (docs/flags.md).",
                     choices=["float32", "bfloat16", "float16", "auto"])
    agent_timeout: float = arg(600.0, "Seconds the agent may run per rollout; 0: the task's own timeout.")
    num_generations: int = arg(8, "Rollouts per task per group (>= 2); advantages compare them.")
    micro_batches_per_step: int = arg(4, "Micro-batches per optimizer step, each packed up to vLLM's max_model_len.")
    max_inflight: int = arg(16, "Rollouts (sandboxes) running at once; the server needs twice this many sessions.")
    max_staleness: int = arg(4, "Optimizer steps a rollout may lag the policy before it is dropped.")
    delta: float = arg(3.0, "Dual clip: a token whose importance ratio exceeds it adds no gradient (docs/flags.md).")
    temperature: float = arg(1.0, "Sampling temperature the proxy enforces on every agent call (> 0).")
    max_completion_length: int = arg(1024, "Tokens per agent turn, capped by the server (docs/harbor-server.md).")
    learning_rate: float = arg(1e-6, f"AdamW learning rate, constant; {LORA_LEARNING_RATE:g} with --use-peft.")
    max_steps: int = arg(500, "Optimizer steps to train; the run's only stop condition.")
    eval_steps: float | None = arg(50, "Steps between held-out evals; below 1: a fraction of --max-steps; 0: only "
                                       "before training and after the last step.")
    output_dir: str = arg("", "Checkpoints and logs.", shown="runs/<run name>")
    run_name: str = arg("", "The run's name in the tracker.", shown="--output-dir's, else model-harness-sandbox-time")
    project: str = arg("async-grpo-harbor", "trackio project, so runs on one suite compare side by side.")
    report_to: str = arg("trackio", "Where metrics go: trackio (local, no account), none, or any HF integration.")
    save_steps: int = arg(50, "Optimizer steps between checkpoints: what a crash or preemption can lose.")
    save_total_limit: int | None = arg(2, "Checkpoints kept, the oldest deleted after a newer one; 0 keeps all.")
    # The script sets these: not flags; naming one is refused with its help.
    gradient_accumulation_steps: int = field(default=1, init=False, metadata={"help": "from --micro-batches-per-step"})
    max_inflight_tasks: int = field(default=1, init=False, metadata={"help": "from --max-inflight"})
    vllm_server_base_url: str = field(default="", init=False, metadata={"help": "from --vllm-url"})
    request_timeout: int = field(default=0, init=False, metadata={"help": "from --agent-timeout"})
    ddp_timeout: int = field(default=0, init=False, metadata={"help": "from --num-generations x --agent-timeout"})
    save_strategy: str = field(default="steps", init=False, metadata={"help": "from --save-steps"})
    logging_steps: float = field(default=1, init=False, metadata={"help": "to 1: a line per step"})
    resume_from_checkpoint: str | None = field(default=None, init=False, metadata={"help": "from --resume"})
    eval_strategy: str = field(default="no", init=False,
                               metadata={"help": "to no; held-out evals: --eval-tasks SPEC --eval-steps N --eval-k K"})
    # bf16 autocast only on GPUs (elsewhere it scores at another precision than vLLM); CPU ranks need use_cpu.
    bf16: bool | None = field(default=None, init=False, metadata={"help": "from the hardware"})
    use_cpu: bool = field(default=False, init=False, metadata={"help": "from the hardware"})
    # The capture proxy refuses sampling filters: a loop-owning harness trains the full-vocabulary policy.
    top_p: float = field(default=1.0, init=False, metadata={"help": "to 1.0: the full vocabulary"})
    top_k: int = field(default=0, init=False, metadata={"help": "to 0: the full vocabulary"})
    min_p: float | None = field(default=None, init=False, metadata={"help": "to None: the full vocabulary"})
    repetition_penalty: float = field(default=1.0, init=False, metadata={"help": "to 1.0: the full vocabulary"})

    def __post_init__(self):
        cuda = torch.cuda.is_available()
        self.vllm_url = self.vllm_url.rstrip("/").removesuffix("/v1")
        self.gradient_accumulation_steps, self.max_inflight_tasks = self.micro_batches_per_step, self.max_inflight
        self.vllm_server_base_url, self.bf16, self.use_cpu = self.vllm_url, cuda, not cuda
        self.request_timeout = int(rollout_budget_s(self.agent_timeout))
        # Ranks >= 1 wait in a collective while rank 0 collects a group; accelerate's state sets this on CPU too.
        self.ddp_timeout = int(self.num_generations * rollout_budget_s(self.agent_timeout))
        PartialState(cpu=not cuda, timeout=timedelta(seconds=self.ddp_timeout))
        self.save_total_limit = self.save_total_limit or None  # the script's 0 (keep all) is TRL's None
        super().__post_init__()


class UsageError(Exception):
    """Bad input or an unusable setup: one `error:` line, exit code 2."""


class TrainingStopped(ValueError):  # a ValueError: the one kind TRL's harness loop lets out of a rollout
    """A stop this script decides: `error: training stopped: ...`, exit code 1."""


class RolloutsFailing(TrainingStopped):
    """Unscorable rollouts in a row, or the Harbor server gone past --harbor-retry-window."""


class NoSignal(TrainingStopped):
    """Groups in a row that scored all their rollouts alike: no advantage is left to learn."""


def stop_from_child(exc: RuntimeError) -> TrainingStopped | None:
    """The TrainingStopped the rollout child raised: TRL's check_health passes on only its "Name: message"."""
    name, _, message = str(exc.__cause__ or "").partition(": ")
    kind = {kind.__name__: kind for kind in (RolloutsFailing, NoSignal)}.get(name)
    return None if kind is None else kind(" ".join(message.split()))


class Parser(TrlParser):
    def __init__(self):
        super().__init__((ScriptArguments, HarborGRPOConfig), allow_abbrev=False,  # --mod: not --model
                         usage="%(prog)s [--config RECIPE_YAML] [--flag VALUE ...]", description="See docs/flags.md.")
        self.add_argument("--config", metavar="RECIPE_YAML", help="YAML of flags; the command line overrides it.")

    def error(self, message: str):  # one `error:` line, not argparse's usage block
        raise UsageError(message)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = [part for arg in (sys.argv[1:] if argv is None else argv)  # TrlParser reads only `--config PATH`
            for part in (arg.split("=", 1) if arg.startswith("--config=") else [arg])]
    parser = Parser()
    recipe = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None
    typed = {a.split("=")[0].lstrip("-").replace("-", "_") for a in argv if a.startswith("--")}
    defaults = vars(parser.parse_known_args([])[0])
    own = {f.name for f in dataclasses.fields(ScriptArguments)} | {*HarborGRPOConfig.__annotations__, "config"}

    def set_by_user() -> set[str]:  # fields the command line or the recipe set (TrlParser makes a recipe the defaults)
        now = vars(parser.parse_known_args([])[0])
        return {name for name in now if now[name] != defaults[name] or name in typed or f"no_{name}" in typed}

    try:
        script, config, _, unknown_keys, unknown = parser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True)
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"--config {recipe}: {' '.join(str(exc).split())}") from None
    except ValueError as exc:  # TRL's and transformers' own checks, as the config is built (a scheduler's name)
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in sorted(set_by_user() - own)) or "none"
        raise UsageError(f"AsyncGRPOConfig could not be built (TRL flags given: {flags}): "
                         f"{' '.join(str(exc).split())}") from None
    wrong = [key.removeprefix("--") for key in unknown_keys[::2]] or unknown
    if wrong:
        decided = HarborGRPOConfig.__dataclass_fields__.get(wrong[0].split("=")[0].lstrip("-").replace("-", "_"))
        fix = f"this script sets it {decided.metadata['help']}" if decided and not decided.init else "see --help"
        where = f"--config {recipe}: unknown key(s)" if unknown_keys else "unrecognized arguments:"
        raise UsageError(f"{where} {' '.join(wrong)}; {fix}")
    given = set_by_user()
    args = argparse.Namespace(**vars(script),
                              **{name: getattr(config, name) for name in HarborGRPOConfig.__annotations__},
                              config=config, trl={name: getattr(config, name) for name in sorted(given - own)})
    floors = {"num_generations": 2, "micro_batches_per_step": 1, "max_inflight": 1, "agent_step_limit": 1,
              "max_steps": 1, "save_steps": 1, "max_consecutive_failures": 1, "max_completion_length": 1,
              "save_total_limit": 0, "eval_k": 1, "max_staleness": 0, "agent_timeout": 0, "harbor_retry_window": 0,
              "max_zero_variance_groups": 0, "eval_steps": 0, "lora_r": 1}
    for name, low in floors.items():
        if (getattr(args, name) or 0) < low:  # save_total_limit None is TRL's `none`: keep all, as 0
            raise UsageError(f"--{name.replace('_', '-')} must be >= {low} (got {getattr(args, name)})")
    if args.use_peft and "dtype" not in given:
        args.dtype = config.dtype = "bfloat16"  # LoRA freezes the base: float32 copies of it would only cost memory
    if args.use_peft and "learning_rate" not in given:
        args.learning_rate = config.learning_rate = LORA_LEARNING_RATE
    args.measure = args.eval_only or args.curate == ""
    args.eval_steps = args.eval_steps or 0
    if args.eval_steps > 1 and args.eval_steps != int(args.eval_steps):
        raise UsageError(f"--eval-steps {args.eval_steps:g}: give a whole number of steps, or a fraction of "
                         "--max-steps below 1")
    # transformers' reading of a fraction: of the run's steps, rounded up (TrainerState.compute_steps).
    args.eval_steps = math.ceil(args.max_steps * args.eval_steps) if args.eval_steps < 1 else int(args.eval_steps)
    args.harnesses = [name.strip() for name in args.harness.split(",") if name.strip()]
    if not args.harnesses:
        raise UsageError("--harness is empty; name one, e.g. mini-swe-agent, or several: mini-swe-agent,terminus-2")
    try:
        low, high = (float(x) for x in args.band.split(","))
    except ValueError:
        low = high = math.nan  # refused below
    if not 0 <= low <= high <= 1:
        raise UsageError(f"--band {args.band}: give two pass rates LOW,HIGH, 0 <= LOW <= HIGH <= 1, e.g. 0.1,0.9")
    args.band = low, high
    if args.max_inflight < args.num_generations and not args.measure:  # a group is scored once all its rollouts end
        raise UsageError(f"--max-inflight ({args.max_inflight}) must be >= --num-generations ({args.num_generations})")
    if not args.temperature > 0:
        raise UsageError(f"--temperature must be > 0 (got {args.temperature})")
    clip = 1 + (config.epsilon_high if config.epsilon_high is not None else config.epsilon)
    if args.delta and not args.delta > clip or args.delta < 0:
        raise UsageError(f"--delta must be above 1 + --epsilon-high ({clip:g}), or 0 (got {args.delta:g})")
    if not 0 <= args.efficiency_weight < 1:
        raise UsageError(f"--efficiency-weight must be in [0, 1) (got {args.efficiency_weight})")
    if args.probe_rollout and not args.check:
        raise UsageError("--probe-rollout is part of --check; add --check")
    job = os.environ.get("SLURM_JOB_ID")
    if args.resume == "auto" and not (args.run_name or args.output_dir or job):
        raise UsageError("--resume auto needs a run name that survives a relaunch: pass --run-name (or --output-dir)")
    args.harbor_url = args.harbor_url.rstrip("/")
    args.capture_url = ""  # the capture proxy as the sandboxes reach it, once the preflight reached it there too
    # A relaunch into the same dir, or a requeued SLURM job, is the same run: it keeps its name in the tracker.
    stamp = f"slurm{job}" if job else f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"
    default_name = f"{Path(args.model.rstrip('/')).name}-{args.harness.replace(',', '+')}-{args.sandbox}-{stamp}"
    args.run_name = args.run_name or Path(args.output_dir.rstrip("/")).name or default_name
    args.output_dir = args.output_dir or os.path.join("runs", args.run_name)
    args.config.run_name, args.config.output_dir = args.run_name, args.output_dir
    return args


def peft_config(args: argparse.Namespace):
    """--use-peft's LoraConfig, by TRL's ModelConfig -> get_peft_config; None without it."""
    if not args.use_peft:
        return None
    config = get_peft_config(ModelConfig(model_name_or_path=args.model, use_peft=True, lora_r=args.lora_r,
                                         lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                                         lora_target_modules=args.lora_target_modules, use_rslora=args.use_rslora))
    if args.lora_target_modules and args.lora_target_modules != ["all-linear"]:
        # ModelConfig turns one name into a string, which PEFT matches as a regex on whole module paths.
        config.target_modules = set(args.lora_target_modules)
    return config


def say(line: str) -> None:  # in one write: print()'s text and newline apart interleave with other writers'
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def print_table(title: str, rows: dict[str, Any]) -> None:
    width = max(len(k) for k in rows)
    print(f"\n{title}\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows.items()) + "\n", flush=True)


def redact(text: str) -> str:
    """Blank out secret-looking environment values and token shapes, so no message we print leaks a credential."""
    for name, value in os.environ.items():
        if len(value) >= 6 and re.search(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", name, re.I):
            text = text.replace(value, f"<{name}>")
    # HF, OpenAI-style and E2B token shapes, in the Harbor server's text (its environment is not ours).
    return re.sub(r"\b(hf_|sk-|e2b_)[A-Za-z0-9_-]{8,}", lambda m: f"{m[1]}<redacted>", text)


# --- Tasks ------------------------------------------------------------------------------------------------------------
def read_task_spec(spec: str) -> list[tuple[str, str]]:
    """`0-3,7,name` or `@file` -> [(entry, where it came from)], so an error can name the file's line."""
    lines, empty = [(spec, "--tasks")], "--tasks is empty; give indices, ranges or names, e.g. 0-49,57,hello-world"
    if spec.startswith("@"):
        path = Path(spec[1:])
        try:
            text = path.read_text()
        except OSError as exc:
            raise UsageError(f"--tasks {spec}: cannot read {path} ({exc.strerror}); give a file of task "
                             "indices, ranges or names, one per line") from None
        lines = [(line.split("#", 1)[0], f"{path}:{number}") for number, line in enumerate(text.splitlines(), 1)]
        empty = f"--tasks {spec}: {path} lists no tasks (only blank lines and # comments)"
    entries = [(part.strip(), where) for line, where in lines for part in line.split(",") if part.strip()]
    if not entries:
        raise UsageError(empty)
    for entry, where in entries:
        if (m := re.fullmatch(r"(\d+)-(\d+)", entry)) and int(m[1]) > int(m[2]):
            raise UsageError(f"{where}: range {entry!r} is backwards; write {m[2]}-{m[1]}")
    return entries


def resolve_tasks(entries: list[tuple[str, str]], catalogue: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each entry's catalogue tasks; an entry that names no task is an error, never skipped."""
    by_name = {key: task for task in reversed(catalogue) for key in (task["task_id"], task["task_name"])}
    n, chosen = len(catalogue), []
    for entry, where in entries:
        if m := re.fullmatch(r"(\d+)(?:-(\d+))?", entry):
            if (last := int(m[2] or m[1])) >= n:
                raise UsageError(f"{where}: task index {last} is out of range: the served split has {n} tasks "
                                 f"(0-{n - 1})")
            chosen += catalogue[int(m[1]):last + 1]
        elif entry in by_name:
            chosen.append(by_name[entry])
        else:
            close = difflib.get_close_matches(entry, list(by_name), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UsageError(f"{where}: no task named {entry!r} in the served split ({n} tasks){hint}")
    return chosen


def task_rows(tasks: list[dict[str, Any]], split: str, harnesses: list[str]) -> list[dict[str, Any]]:
    """A row (a GRPO group) per task and harness, the harness shifting each pass. The task rides in the prompt: TRL
    hands the session factory nothing else."""
    return [{"prompt": [{"role": "user", "content": f"[{t['task_name']}] {t.get('instruction', '')[:2000]}",
                         "harbor_split": split, "harbor_task_index": int(t["index"]),
                         "harbor_task_name": t["task_name"], "harbor_harness": harness}]}
            for shift in range(len(harnesses)) for i, t in enumerate(tasks)
            for harness in [harnesses[(i + shift) % len(harnesses)]]]


# --- Session factory: one Harbor rollout per TRL session --------------------------------------------------------------
def rollout_budget_s(agent_timeout: float) -> float:
    """The agent's timeout (0: the task's own, at most an hour), plus setup and verification."""
    return (agent_timeout or 3600.0) + 1800.0


class ServerLost(ConnectionError):
    """`what` (the Harbor server; CaptureLost: the capture proxy) does not answer: the rollout's sandbox is gone."""

    def __init__(self, what: str, why: str):
        super().__init__(f"{what}: {why}")
        self.what, self.why = what, why


class CaptureLost(ServerLost):
    """The capture proxy does not answer at the URL every sandbox is given: a harness started now reaches no model."""


class SessionLost(RuntimeError):
    """The Harbor server answers, but no longer knows our session (it restarted): its sandbox went with it."""


class ServerFull(RuntimeError):
    """The Harbor server has no free session slot (MAX_CONCURRENT_ENVS)."""


class Failure(NamedTuple):
    """Why a rollout is unscorable: `kind` counts it (`harbor/errors/<kind>_total`), `message` says why."""

    kind: str
    message: str


SERVER_GONE = "server_unreachable"  # the failure kind that stops the run at once
# The agent ends the policy brings about itself, trained at the verifier's reward (Harbor verifies after them); any
# other end is the harness or the inference path failing (mini-swe-agent exits so on a vLLM 5xx).
POLICY_EXITS = {"AgentTimeoutError": "timeout", "ContextWindowExceededError": "context_window",
                "OutputTokenExceededError": "output_tokens"}


def agent_exit(r: HarborRolloutResult) -> str | None:
    """How a verified rollout's agent ended: "ok", or its POLICY_EXITS kind. None: the rollout is unscorable."""
    if r.reward is None or not r.exception_type:
        return "ok" if r.ok else None
    return POLICY_EXITS.get(r.exception_type)


def judge_rollout(r: HarborRolloutResult, task: str, *, require_tokens: bool, reward_key: str) -> Failure | None:
    """Why a finished rollout cannot be trained on (None: it can), for training, --eval-only and the probe alike."""
    if r.reward is None and r.rewards:
        return Failure("reward_key", f"--reward-key {reward_key or 'reward'!r} is not emitted by {task}; it emits: "
                                     f"{', '.join(sorted(r.rewards))}")
    exit_kind = agent_exit(r)
    if exit_kind not in (None, "ok") and require_tokens and (r.atif == "MISMATCH" or not r.n_trainable_tokens):
        # OpenEnv skips these two capture checks once the agent's failure has set ok=False (openenv/harbor/rollout.py).
        why = "trace reconciliation MISMATCH" if r.atif == "MISMATCH" else "no trainable token"
        return Failure("capture", f"the agent ended with {r.exception_type} and its capture is not trainable ({why})")
    budget = next((x for x in r.findings if "context_budget_exhausted" in x), None)
    if exit_kind is None and budget and "no_turns" in (r.error or ""):
        # vLLM refuses a first call past its context (HTTP 400); the rollout's own error then blames the base URL.
        return Failure("context", f"vLLM refused the agent's first call as too long for its context ({budget[:240]}): "
                                  "the Harbor server's --max-output-tokens (this script's --max-completion-length) "
                                  "plus the task's prompt must fit vLLM's --max-model-len")
    if exit_kind is None and r.reward is not None and r.exception_type:
        return Failure(r.exception_type, f"{r.exception_type}: the agent's harness or its engine failed, its reward "
                                         f"is not the policy's: {r.error}")
    if exit_kind is None:
        return Failure(r.exception_type or "error", f"{r.exception_type or 'error'}: {r.error}")
    if r.rollout_type != "train" and require_tokens:
        return Failure("eval_tier", "the engine returned no token ids (eval tier): restart vLLM with "
                                    "--return-tokens-as-token-ids --logprobs-mode processed_logprobs")
    fatal = next((x for x in r.findings if "[FATAL" in x), None)
    if fatal:
        return Failure("capture", f"capture finding {fatal}")
    return Failure("no_reward", "the verifier produced no reward") if r.reward is None else None


class HarborServerSession:
    """A session slot on the Harbor server over HTTP MCP; `cut()`, from any thread, ends the call in flight. Not
    HarborEnv's websocket, whose close the server reads only once the rollout returns: the next run finds it full."""

    def __init__(self, base_url: str, timeout_s: float):
        self.base_url, self.url, self.timeout_s = base_url, urllib.parse.urlsplit(base_url), timeout_s
        self.session_id: str | None = None
        self.closed = False
        self._lock = threading.Lock()  # between a call publishing its socket and cut() shutting it
        self._waiting: socket.socket | None = None

    def open(self) -> None:
        if self.session_id is None:
            self.session_id = self._post("openenv/session/create", {})["session_id"]

    def run_rollout(self, **kwargs: Any) -> HarborRolloutResult:  # HarborEnv's own wire contract, on this session
        self.open()
        return HarborEnv.run_rollout(self, **kwargs)

    def _call(self, name: str, **arguments: Any) -> Any:  # what HarborEnv.run_rollout calls
        result = self._post("tools/call", {"name": name, "arguments": arguments, "session_id": self.session_id}, True)
        if isinstance(result, dict) and result.get("isError"):
            raise RuntimeError(f"tool {name!r} failed: {json.dumps(result.get('content'))[:300]}")
        return result

    def close(self) -> None:
        session_id, self.session_id = self.session_id, None
        with contextlib.suppress(OSError, RuntimeError, ValueError):  # the server is gone, or dropped it already
            if session_id is not None:
                self._post("openenv/session/close", {"session_id": session_id}, timeout_s=10)

    def cut(self) -> None:
        with self._lock:
            self.closed, waiting = True, self._waiting
        if waiting is not None:
            with contextlib.suppress(OSError):
                waiting.shutdown(socket.SHUT_RDWR)

    def _post(self, method: str, params: dict[str, Any], cut: bool = False, timeout_s: float = 0.0) -> Any:
        connection = http.client.HTTPSConnection if self.url.scheme == "https" else http.client.HTTPConnection
        conn = connection(self.url.hostname, self.url.port, timeout=timeout_s or self.timeout_s)
        body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
        try:
            conn.connect()
            # A rollout is one request silent for minutes: keepalive keeps a NAT from dropping it unseen, and finds
            # a vanished host in 90 s, not Linux's default 2 h 11 min.
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6)):
                if hasattr(socket, option):  # Linux's names; macOS has no TCP_KEEPIDLE
                    conn.sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
            with self._lock:
                if cut and self.closed:
                    raise RuntimeError("session closed")
                self._waiting = conn.sock if cut else None
            conn.request("POST", f"{self.url.path.rstrip('/')}/mcp", body, {"Content-Type": "application/json"})
            reply = json.loads(conn.getresponse().read() or b"{}")
        except (OSError, http.client.HTTPException) as exc:
            if isinstance(exc, TimeoutError) and exc.errno is None:
                raise  # our own timeout: the rollout outlived its budget, the server may well be up
            raise ServerLost(f"the Harbor server at {self.base_url}", f"{type(exc).__name__}: {exc}") from exc
        finally:
            if cut:
                self._waiting = None
            conn.close()
        error = reply.get("error")
        if not error:
            return reply.get("result")
        message = f"harbor server: {method}: {error.get('message', error)}"
        if "max_sessions" in (error.get("data") or {}):  # openenv 0.10's http_server: only a full server's reply
            raise ServerFull(message)
        kind = SessionLost if str(error.get("message", "")).startswith("Unknown session_id") else RuntimeError
        raise kind(message)


# Sandboxes that build a task's template on first use, racing rollouts that start together (SHARED_TEMPLATE_NAME): a
# process's first rollout (it takes FIRST_ROLLOUT for good) starts alone.
TEMPLATE_BUILDING_SANDBOXES = {"e2b"}
FIRST_ROLLOUT, FIRST_ROLLOUT_ENDED = threading.Lock(), threading.Event()


class HarborSession(ResourceSession):
    """One rollout, as OpenEnv's `TrainableSession`, run by `wait_for_completion()` in a server session of its own."""

    def __init__(self, factory: HarborSessionFactory, prompt: list[dict[str, Any]], group: int | None):
        self._factory, self._prompt, self.group = factory, prompt, group
        self.task_name, self.task_index = prompt[0]["harbor_task_name"], int(prompt[0]["harbor_task_index"])
        self.harness = prompt[0].get("harbor_harness") or factory.harness
        self._client = HarborServerSession(factory.harbor_url, factory.request_timeout_s)
        self._stopped = threading.Event()
        self.result: HarborRolloutResult | None = None
        self.failure: Failure | None = None
        self.started = 0.0
        self.retries = 0  # times this rollout started again in a new session, the server having lost its sandbox

    def initial_messages(self) -> list[dict[str, Any]]:
        return list(self._prompt)

    def list_tools(self) -> list:
        return []

    def call_tool(self, name: str, arguments: dict[str, Any]):
        raise NotImplementedError("the harness owns its loop; tools run inside the sandbox")

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        f = self._factory
        with f.running_changed:
            if f.closing:
                self.close()
                return 1
            f.running.add(self)
        gated = f.sandbox in TEMPLATE_BUILDING_SANDBOXES
        first = gated and FIRST_ROLLOUT.acquire(blocking=False)
        try:
            while gated and not first and not FIRST_ROLLOUT_ENDED.wait(1.0):
                if self._stopped.is_set():
                    return 1
            self.failure = self._run()
            return 0 if self.failure is None and self.result is not None else 1
        finally:
            if first:  # only the first rollout's end lets the others start, not that of one stopped while waiting
                FIRST_ROLLOUT_ENDED.set()
            self._client.close()  # this thread alone takes and frees the slot: none is left behind
            with f.running_changed:
                f.running.discard(self)
                f.running_changed.notify_all()

    def _run(self) -> Failure | None:
        """Unscorable, never fatal; a rollout whose sandbox the server lost starts again in a new session."""
        f, client = self._factory, self._client
        self.started = time.time()
        # The proxy takes a training policy only from an engine it captures tokens from; any engine takes an eval one.
        policy = {"purpose": "eval", "eval_sampling": f.eval_sampling} if f.eval_sampling else {"sampling": f.sampling}
        # streak: the answer (SessionLost or ServerFull) the server keeps giving, and since when: the window it gets
        lost, backoff, streak, waited, last = False, 1.0, (None, 0.0), 0.0, ""
        while not self._stopped.is_set():
            try:
                f.reach_capture()
                if self._stopped.is_set():  # stopped while the tunnel answered (up to its 30 s timeout)
                    return None
                client.open()
                f.outage(None)
                self.retries, lost = self.retries + lost, False
                self.result = client.run_rollout(
                    split=self._prompt[0]["harbor_split"], task_index=self.task_index, harness=self.harness,
                    sandbox=f.sandbox, reward_key=f.reward_key, agent_timeout_sec=f.agent_timeout_s,
                    agent_step_limit=f.agent_step_limit, **policy)
                return judge_rollout(self.result, self.task_name, require_tokens=f.require_tokens,
                                     reward_key=f.reward_key)
            except ServerLost as exc:
                if self._stopped.is_set():
                    return None
                lost = lost or not isinstance(exc, CaptureLost)  # a rollout the capture check held never started
                streak, wait, last = (None, 0.0), min(backoff, f.outage(exc)), str(exc)
                if wait <= 0:
                    return Failure(SERVER_GONE, f"{exc.what} has not answered for {f.retry_window_s:g}s "
                                                f"(last: {exc.why})")
            except (SessionLost, ServerFull) as exc:  # the server answers (no outage): a new session, within the window
                f.outage(None)
                lost, last = lost or isinstance(exc, SessionLost), str(exc)
                streak = streak if streak[0] is type(exc) else (type(exc), time.monotonic())
                wait = min(backoff, streak[1] + f.retry_window_s - time.monotonic())
                if wait <= 0 and isinstance(exc, ServerFull):
                    return Failure("server_full", f"{exc}: raise MAX_CONCURRENT_ENVS on the Harbor server to >= 2 x "
                                                  "--max-inflight")
                if wait <= 0:
                    return Failure("session_lost", f"{exc}, again for {f.retry_window_s:g}s (--harbor-retry-window)")
            except Exception as exc:  # noqa: BLE001 - this rollout's failure, not the server's: judged unscorable
                return Failure("transport", f"harbor server call failed: {type(exc).__name__}: {exc}")
            if waited + wait > 3 * f.retry_window_s:  # a window restarts when the answer changes: bound them all
                return Failure("retries", f"the rollout kept failing to start through {waited:.0f}s of retries (3 x "
                                          f"--harbor-retry-window); the last: {last}")
            waited += wait
            self._stopped.wait(wait)
            client.close()
            backoff = min(2 * backoff, 10.0)
        return None

    def fetch_training_trace(self) -> TrainingTrace:
        from openenv.harbor.contract import to_training_trace

        if self._stopped.is_set():
            return TrainingTrace(turns=[])  # abandoned at stop: neither a sample nor a failure
        try:
            trace = to_training_trace(self.result) if self.failure is None else TrainingTrace(turns=[])
        except (ValueError, TypeError, KeyError) as exc:  # TRL would stop its worker on any of these
            self.failure, trace = Failure("capture", f"capture rejected: {exc}"), TrainingTrace(turns=[])
        self._factory.record_outcome(self)
        return trace

    def verify(self, transcript: list[dict[str, Any]], final_state: Any | None = None) -> VerifyResult:
        return VerifyResult(env_reward=None if self.failure or self.result is None else self.result.reward, done=True)

    def close(self) -> None:
        """From any thread: stop the rollout; its own thread frees its slot on the way out."""
        self._stopped.set()
        self._client.cut()


class HarborSessionFactory(ResourceSessionFactory):
    """Built in TRL's rollout child, `sampling` being the trainer's policy. `capture_url`: "" for a server of yours."""

    def __init__(self, *, harbor_url: str, harness: str, sandbox: str, reward_key: str, agent_step_limit: int,
                 agent_timeout_s: float, max_consecutive_failures: int, retry_window_s: float = 300.0,
                 sampling: dict[str, Any] | None = None, require_tokens: bool = True, record_path: str = "",
                 eval_sampling: dict[str, Any] | None = None, label: str = "group", split_by_harness: bool = False,
                 record_fields: dict[str, Any] | None = None, capture_url: str = ""):
        self.harbor_url, self.harness, self.sandbox, self.reward_key = harbor_url, harness, sandbox, reward_key
        self.capture_url, self.agent_step_limit, self.agent_timeout_s = capture_url, agent_step_limit, agent_timeout_s
        self.request_timeout_s, self.retry_window_s = rollout_budget_s(agent_timeout_s), retry_window_s
        self.max_consecutive_failures, self.split_by_harness = max_consecutive_failures, split_by_harness
        self.sampling, self.eval_sampling = dict(sampling or {}), dict(eval_sampling or {})
        self.require_tokens = require_tokens  # False for --eval-only: an engine without token ids is measurable
        self.label = label  # what a rollout's console line calls its unit: a training group, a held-out eval's task
        self.record_path, self.record_fields = record_path, dict(record_fields or {})
        self.metrics_queue: Any = None  # TRL's, set by the rollout loop that owns this factory in TRL's child
        self._lock = threading.Lock()
        self._consecutive_failures = 0
        self._outage_since: float | None = None  # since when the server or the capture proxy has not answered
        self._outage_what = ""  # which of the two
        self.running: set[HarborSession] = set()  # inside wait_for_completion: each may hold a server slot
        self.running_changed = threading.Condition()  # never taken by the main thread, where abandon runs
        self.closing = False
        if multiprocessing.parent_process() is not None and threading.current_thread() is threading.main_thread():
            self._leave_with_trainer()

    def _leave_with_trainer(self) -> None:
        """In TRL's rollout child: leave only through the trainer or with it (SIGKILL, OOM), every slot freed."""
        import multiprocessing.connection

        def abandon(signum: int, frame: Any) -> None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one would exit before the slots below are free
            self.close_sessions()
            with self.running_changed:
                self.running_changed.wait_for(lambda: not self.running, timeout=10.0)
            os._exit(128 + signum)

        def watch(trainer=multiprocessing.parent_process().sentinel) -> None:  # reads as closed once it is gone
            multiprocessing.connection.wait([trainer])
            os.kill(os.getpid(), signal.SIGTERM)  # abandon, in the main thread: no rollout starts meanwhile

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the trainer stops us
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the trainer's stop request; it stops us when it is ready
        signal.signal(signal.SIGTERM, abandon)
        threading.Thread(target=watch, name="harbor-trainer-watch", daemon=True).start()

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> HarborSession:
        return HarborSession(self, list(task), seed)  # `seed`: TRL's group counter, a label; the prompt is the task

    def close_sessions(self) -> None:
        """Stop every running rollout (each frees its slot as it ends) and every one that would start from now on."""
        with self.running_changed:
            self.closing, running = True, list(self.running)
        for session in running:
            session.close()

    def _say(self, line: str) -> None:
        with self._lock:  # rollouts finish on several threads at once
            say(redact(line))

    def reach_capture(self) -> None:
        """No paid sandbox starts for a harness that could reach no model: the capture proxy answers where they do."""
        try:
            if self.capture_url:
                http_json(f"{self.capture_url}/health", timeout=30)
        except (OSError, ValueError) as exc:
            raise CaptureLost(f"the capture proxy at {self.capture_url}", f"{type(exc).__name__}: {exc}") from exc

    def outage(self, exc: ServerLost | None) -> float:
        """Seconds left of the run's one outage window: from the first `exc` to the first call answered (None)."""
        now = time.monotonic()
        with self._lock:
            since, what = self._outage_since, self._outage_what
            self._outage_since = None if exc is None else since or now
            self._outage_what = what if exc is None or since else exc.what
            waiting = sum(s.result is None for s in list(self.running))
        if exc is None and since is not None:
            self._say(f"[harbor] {what} answers again after {now - since:.0f}s")
        elif exc is not None and since is None:
            self._say(f"[harbor] {exc.what} is not answering ({exc.why}) with {waiting} rollouts in flight: they "
                      f"start again once it answers, within {self.retry_window_s:g}s (--harbor-retry-window)")
        return (since or now) + self.retry_window_s - now

    def record_outcome(self, session: HarborSession) -> None:
        """Its record, metrics and line; RolloutsFailing (which TRL lets out) for a lost server or too many failures."""
        failure, r, harness = session.failure, session.result, session.harness
        with self._lock:
            self._consecutive_failures = 0 if failure is None else self._consecutive_failures + 1
            count = self._consecutive_failures
        record = {"time": time.time(), **self.record_fields, "group": session.group, "task": session.task_name,
                  "index": session.task_index, "harness": harness, "sandbox": self.sandbox,
                  "reward": r.reward if failure is None else None, "turns": r.n_turns if r else 0,
                  "wall_s": r.wall_s if r else 0.0, "budget_stops": r.budget_stop_count if r else 0,
                  "error": failure.kind if failure else None,
                  "failure": redact(failure.message[:300]) if failure else None, "started": session.started,
                  "retries": session.retries, "trial": (r.trial_name or None) if r else None,
                  "exit": agent_exit(r) if failure is None else None}
        if self.record_path:
            with self._lock, open(self.record_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        self._push_metrics(record)
        label = f"{self.label} {session.group} task {session.task_index} ({session.task_name})"
        retried = f", restarted {session.retries}x in a new session" if session.retries else ""
        if failure is None:
            stops = f", {r.budget_stop_count} budget stops" if r.budget_stop_count else ""
            ended = f", agent {record['exit']}" if not r.ok else ""
            self._say(f"[harbor] {label}: reward {r.reward:g} in {r.n_turns} turns, {r.wall_s:.1f}s, harness "
                      f"{harness}{stops}{ended}{retried}")
        elif failure.kind == SERVER_GONE:
            raise RolloutsFailing(redact(failure.message))
        else:
            self._say(f"[harbor] {label}: unscorable: {record['failure']} (harness {harness}{retried})")
        if failure and count >= self.max_consecutive_failures:
            raise RolloutsFailing(redact(f"{count} consecutive rollouts were unscorable; the last: "
                                         f"{failure.message[:500]}"))

    def _push_metrics(self, record: dict[str, Any]) -> None:
        """Onto TRL's metric queue, reduced by name into each step's log: a `_total` summed, a (sum, count) a rate."""
        if self.metrics_queue is None:
            return
        m = {"harbor/rollouts_total": 1.0, "harbor/errors_total": float(record["error"] is not None),
             "harbor/sandbox_s_total": record["wall_s"], "harbor/budget_stops_total": float(record["budget_stops"])}
        if record["error"] is not None:
            m[f"harbor/errors/{record['error']}_total"] = 1.0
        else:  # TRL's rollout/turns_mean and rollout/duration_s also average the unscorable rollouts, at 0 turns
            m |= {"harbor/solve_rate": (float(record["reward"] > 0), 1.0),
                  "harbor/wall_s_mean": (record["wall_s"], 1.0), "harbor/turns_mean": (float(record["turns"]), 1.0)}
            if record["exit"] != "ok":
                m[f"harbor/agent_exits/{record['exit']}_total"] = 1.0
        if self.split_by_harness:
            m |= {f"harbor/{record['harness']}/{key[7:]}": m[key] for key in (
                "harbor/rollouts_total", "harbor/errors_total", "harbor/solve_rate", "harbor/wall_s_mean") if key in m}
        with contextlib.suppress(queue.Full):  # never hold a rollout up for a figure, as TRL's own pushes do
            self.metrics_queue.put_nowait(m)


def session_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What every rollout of a run shares, training and --eval-only alike."""
    return {"harbor_url": args.harbor_url, "harness": args.harnesses[0], "sandbox": args.sandbox,
            "reward_key": args.reward_key, "agent_step_limit": args.agent_step_limit,
            "agent_timeout_s": args.agent_timeout, "max_consecutive_failures": args.max_consecutive_failures,
            "retry_window_s": args.harbor_retry_window, "capture_url": args.capture_url}


# --- Reward -----------------------------------------------------------------------------------------------------------
class RolloutScore(NamedTuple):
    correctness: float  # the verifier's reward
    efficiency: float  # 1 - turns / --agent-step-limit, in [0, 1]


def harbor_reward(outcome: Any, *, step_limit: int) -> RolloutScore | None:
    """TRL's per-rollout reward hook: None when unscorable (left out of the group baseline)."""
    if outcome.env_reward is None:
        return None
    turns = len(outcome.trace) or outcome.tool_call_count
    return RolloutScore(float(outcome.env_reward), max(0.0, 1.0 - turns / step_limit))


def shape_group_rewards(scores: list[RolloutScore | None], efficiency_weight: float) -> list[float | None]:
    """c + w * gap * efficiency if solved (c > 0), else c; gap: the group's smallest step between correctness levels,
    0 in a group of one level, so normalisation cannot blow a bonus up to a pass/fail split (docs/reward.md)."""
    levels = sorted({s.correctness for s in scores if s is not None})
    gap = min((b - a for a, b in zip(levels, levels[1:])), default=0.0)
    return [None if s is None else s.correctness + (efficiency_weight * gap * s.efficiency if s.correctness > 0 else 0)
            for s in scores]


def zero_variance(rewards: list[float | None]) -> bool:
    """Exactly equal, on purpose: the normalisation scales any difference, however small, up to unit variance."""
    return len({r for r in rewards if r is not None}) <= 1


# --- The Harbor server: the user's (--harbor-url), or one this script starts and owns ---------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The harness version our server installs in each sandbox: the one the tests run (tests/requirements-server.txt), not
# the newest on the day. The user's OPENENV_HARBOR_AGENT_VERSIONS (openenv's own JSON switch) wins per harness.
HARNESS_VERSIONS = {"mini-swe-agent": "2.4.6"}
EXACT_VERSION = re.compile(r"[0-9]+(?:\.[0-9]+){1,3}(?:[-+][A-Za-z0-9.-]+)?")  # openenv/harbor/rollout.py's own test
# Harbor builds an e2b template per task on first use, and rollouts visiting a task at once race the build. Under one
# shared name (openenv's HARBOR_SHARED_ENV_NAME; the user's wins) a template is built once per distinct environment.
SHARED_TEMPLATE_NAME = "async-grpo-harbor"


def harbor_server_env() -> dict[str, str]:
    """What our Harbor server gets on top of this process's environment."""
    raw = os.environ.get("OPENENV_HARBOR_AGENT_VERSIONS", "")
    try:
        theirs = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:
        theirs = None
    if not isinstance(theirs, dict) or not all(isinstance(v, str) and EXACT_VERSION.fullmatch(v)
                                               for v in theirs.values()):
        raise UsageError(f"OPENENV_HARBOR_AGENT_VERSIONS={raw!r}: give a JSON object of harness name -> exact "
                         f"version, e.g. '{json.dumps(HARNESS_VERSIONS)}', or unset it")
    return {"OPENENV_HARBOR_AGENT_VERSIONS": json.dumps({**HARNESS_VERSIONS, **theirs}),
            "HARBOR_SHARED_ENV_NAME": os.environ.get("HARBOR_SHARED_ENV_NAME") or SHARED_TEMPLATE_NAME,
            "PYTHONUNBUFFERED": "1"}  # its `capture ... -> URL` line reaches the log before it serves


class EmbeddedHarborServer:
    """`openenv harbor serve` as a child, on 127.0.0.1 with --harbor-expose's --expose (OpenEnv's default, gradio,
    opens a public tunnel whatever the sandbox). `public_url`: the capture proxy's URL as the sandboxes get it."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.log_path = Path(args.output_dir) / "harbor_server.log"
        self.proc: subprocess.Popen | None = None
        self.url, self.capture_port, self.public_url = "", 0, ""

    def start(self, served_model: str, timeout_s: float = 1800.0) -> float:
        """Starts the server, waits until its Task API answers; returns the seconds that took."""
        a = self.args
        port, self.capture_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = shlex.split(a.harbor_command) + [
            "--dataset", a.dataset, "--llm-url", f"{a.vllm_url}/v1", "--host", "127.0.0.1", "--port", str(port),
            "--capture-port", str(self.capture_port), "--expose", a.harbor_expose,
            "--max-output-tokens", str(a.max_completion_length)] + (["--model", served_model] if served_model else [])
        slots = max(2 * a.max_inflight, int(os.environ.get("MAX_CONCURRENT_ENVS", "0") or 0))
        t0 = time.monotonic()
        with self.log_path.open("a") as log:
            log.write(f"\n===== {datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S} UTC: {shlex.join(cmd)}\n")
            log.flush()
            started_at = log.tell()
            env = {**os.environ, **harbor_server_env(), "MAX_CONCURRENT_ENVS": str(slots)}
            try:
                # prctl(PR_SET_PDEATHSIG, SIGTERM): the server ends when the thread that started it ends, even by
                # SIGKILL or OOM.
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=env, start_new_session=True,
                                             preexec_fn=lambda: ctypes.CDLL(None).prctl(1, signal.SIGTERM))
            except OSError as exc:
                raise UsageError(f"cannot start the Harbor server `{shlex.join(cmd[:4])}` ({exc.strerror}); "
                                 "install openenv[harbor] (Python >= 3.12) or set --harbor-command") from None
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise UsageError(f"the Harbor server exited with code {self.proc.returncode} while starting (log: "
                                 f"{self.log_path})")
            try:
                http_json(f"{self.url}/harbor_env/splits", timeout=5)
            except (OSError, ValueError):
                time.sleep(0.5)
                continue
            # openenv 0.10 prints `capture   <where> -> <URL>` before it serves; no route reports it.
            with self.log_path.open(errors="replace") as log:
                log.seek(started_at)
                printed = re.search(r"^capture\s.* -> (\S+)\s*$", log.read(), re.M)
            self.public_url = printed[1].rstrip("/") if printed else ""
            return time.monotonic() - t0
        self.stop()
        raise UsageError(f"the Harbor server did not answer within {timeout_s:.0f}s; see {self.log_path}")

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


# --- Sizing: the disk and GPU memory a run needs, from --model's config alone (no weights are read) ------------------
# The memory projection's constants, from bench/results (docs/capacity.md derives the projection term by term).
# Bytes per row token per (hidden + intermediate) feature backward recomputes (full fine-tune / frozen base), and per
# input feature LoRA adapts: fitted to every H200 peak on record, all within 2 %.
RECOMPUTE_FULL, RECOMPUTE_FROZEN, LORA_INPUT = 20, 13, 6
PUSH_STAGING = 2**30  # a push's bfloat16 chunk: 0.7-1.1 GiB over the trainer's peak, measured on an H200
VLLM_PUSH_COPIES = 2  # vLLM loads a pushed tensor beside its share: cast to its dtype, and its loader's copy
OUTSIDE_ALLOCATOR = 2**29  # what torch's allocator does not count (kernels, library handles): a cap leaves it free
ALLOCATOR_RESERVE = 0.17  # reserved beyond allocated: the largest gap on record, Qwen3-4B float32 at 32k rows
MEMORY_TOLERANCE = 0.05  # past the measured error: a projection this close to the limit warns
PROMPT_TOKENS = 1500  # a rollout's first prompt, when a row is planned as prompt + turns x tokens


@functools.cache
def model_shape(model: str) -> tuple[int, str]:
    """(parameters, checkpoint dtype) of --model."""
    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    return params, str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")


def lora_model(args: argparse.Namespace):
    """--use-peft's model on the meta device, its adapters where training will place them."""
    from peft import get_peft_model  # --use-peft only: TRL keeps peft optional

    with torch.device("meta"), warnings.catch_warnings():
        # PEFT's warning about an adapter on tied embeddings: check_lora_targets refuses them in one line instead.
        warnings.filterwarnings("ignore", message="Model (has|with) `tie_word_embeddings=True`")
        return get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model)),
                              peft_config(args))


def model_shape_error(args: argparse.Namespace) -> str | None:
    try:
        model_shape(args.model)
    except Exception as exc:  # noqa: BLE001 - any reason the config cannot be read means the same here
        return f"cannot read --model's config: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return None


def trainer_dtype(args: argparse.Namespace) -> str | None:
    """The dtype the trainer's weights load in (TRL passes --dtype to from_pretrained; auto: the checkpoint's)."""
    if args.dtype != "auto":
        return args.dtype
    return None if model_shape_error(args) else model_shape(args.model)[1]


class TrainerShape(NamedTuple):
    params: int  # every parameter of --model
    width: int  # bytes per weight at the trainer's dtype
    adapter: int  # trained LoRA adapter parameters (float32); 0 for a full fine-tune
    merged: int  # parameters of the base weights LoRA adapts: the copies a merged push makes of them
    largest: int  # elements of the largest tensor a push sends (the embeddings or the LM head)
    saved: int  # bytes per row token of the layer inputs gradient checkpointing keeps
    recomputed: int  # bytes per row token of the layer backward recomputes


def trainer_shape(args: argparse.Namespace) -> TrainerShape | None:
    """None where --model's config or --dtype auto is unreadable, or --lora-target-modules names no module of it."""
    dtype = trainer_dtype(args)
    if dtype is None or model_shape_error(args) is not None:
        return None
    text = AutoConfig.from_pretrained(args.model).get_text_config()
    layers, hidden = text.num_hidden_layers, text.hidden_size
    adapter = adapted = merged = 0
    if args.use_peft:
        from peft.tuners.lora import LoraLayer

        try:
            model = lora_model(args)
        except ValueError:  # PEFT's NoMatchingPeftModuleError
            return None
        adapter = model.get_nb_trainable_parameters()[0]
        adapted_layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
        adapted = sum(m.in_features for m in adapted_layers) // layers
        merged = sum(m.get_base_layer().weight.numel() for m in adapted_layers)
    intermediate = getattr(text, "intermediate_size", None) or 4 * hidden
    width = getattr(torch, dtype).itemsize
    recomputed = (RECOMPUTE_FROZEN if adapter else RECOMPUTE_FULL) * (hidden + intermediate) + LORA_INPUT * adapted
    return TrainerShape(model_shape(args.model)[0], width, adapter, merged, hidden * max(text.vocab_size, intermediate),
                        layers * hidden * width, recomputed)


def trainer_peak(shape: TrainerShape, row: int, ranks: int = 1, fsdp: bool = False, backend: str | None = None,
                 served_width: int = 2) -> dict[str, int]:
    """Peak bytes torch reserves on one trainer GPU in a step over a `row`-token row, by part (ipc: and vLLM's)."""
    lora, ipc = shape.adapter > 0, backend == "ipc"
    trained, width = (shape.adapter, 4) if lora else (shape.params, shape.width)  # PEFT trains float32 adapters
    shard = ranks if fsdp else 1  # FSDP shards weights, gradients and AdamW state; DDP gives every rank all of them
    grads, saved = trained * width // shard, row * shape.saved
    parts = {"frozen base": shape.params * shape.width // shard if lora else 0,
             f"{'adapters' if lora else 'weights'} + AdamW": 3 * trained * width // shard,  # both moments at width
             # backward frees the saved inputs layer by layer as it adds that layer's gradients
             "gradients" if grads >= saved else "saved layer inputs": max(grads, saved),
             "DDP buckets": grads if ranks > 1 and not fsdp else 0,  # accelerate's DDP copies every gradient
             "layer recomputed": row * shape.recomputed,
             # a merged LoRA push over CUDA IPC keeps every merged copy until vLLM's /finish_weight_update
             "push staging": max(min(PUSH_STAGING, 2 * shape.params), shape.merged * shape.width if ipc else 0)}
    parts["allocator reserve"] = int(ALLOCATOR_RESERVE * sum(parts.values()))
    parts["vLLM's push copies"] = VLLM_PUSH_COPIES * shape.largest * served_width if ipc else 0
    return {part: n for part, n in parts.items() if n}


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:,.1f} MiB"


def human_bytes(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


# --- Preflight (`--check`, and every run): refuse a setup that would train on nothing, before loading weights ---------
PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
# Harbor backends whose sandboxes run off this host: they cannot reach a capture proxy advertised as 127.0.0.1.
OFF_HOST_SANDBOXES = {"e2b", "modal", "daytona", "runloop", "langsmith", "ec2", "gke", "ack", "openshift", "novita",
                      "islo", "tensorlake", "cwsandbox", "use-computer", "cua-cloud", "blaxel", "beam", "skypilot",
                      "hf-sandbox", "hyperbrowser", "vercel", "prime", "mosaic", "sail", "kernel"}
# Harbor backends on this host whose sandboxes still get their own network namespace: their 127.0.0.1 is not ours.
OWN_NETWORK_SANDBOXES = {"docker", "podman", "apple-container", "kata"}
# What each cloud backend reads from the environment of the Harbor server, which inherits ours.
SANDBOX_CREDENTIALS = {"e2b": "E2B_API_KEY", "daytona": "DAYTONA_API_KEY", "runloop": "RUNLOOP_API_KEY"}


class Preflight:
    """The rows `--check` prints, the plan training takes from them, and what vLLM said of itself for later rows."""

    def __init__(self, args: argparse.Namespace, server: EmbeddedHarborServer | None = None):
        self.args, self.server = args, server
        self.rows: list[tuple[str, str, str, str]] = []  # (check, PASS/WARN/FAIL/SKIP, detail, fix)
        self.plan: dict[str, Any] = {"resume": None}  # what training takes from the preflight; rank 0 sends it on
        self.writable = False  # --output-dir takes files
        self.served: dict[str, Any] | None = None  # vLLM's model and config, as it reports them
        self.vllm_config: dict[str, Any] | None = None  # its resolved config (/server_info: dev mode only)
        self.vllm_env: dict[str, Any] = {}

    @functools.cached_property
    def gpu_apps(self) -> dict[str, list[tuple[int, str, float]]] | None:
        return gpu_processes()

    @functools.cached_property
    def shape(self) -> TrainerShape | None:
        return trainer_shape(self.args)

    @property
    def ipc(self) -> bool:
        """vLLM shares the trainer's GPU and takes its pushes as CUDA-IPC handles."""
        return (self.served or {}).get("weight_transfer") == "ipc"

    def add(self, check: str, status: str, detail: str, fix: str = "") -> bool:
        self.rows.append((check, status, redact(" ".join(detail.splitlines())), fix))  # one line, as `error:`
        return status != FAIL

    def amend(self, check: str, how: str, status: str | None = None, fix: str = "") -> bool:
        """Appends what a later check found to an earlier row; its status and fix too where that check decides."""
        self.rows = [(c, status or s, f"{d}; {redact(how)}", fix if status else f) if c == check else (c, s, d, f)
                     for c, s, d, f in self.rows]
        return status != FAIL

    def verdict(self) -> int | None:
        """Prints the table and one `error:` line naming the first FAIL (exit 2); else 0 after --check, else None."""
        width = max(len(row[0]) for row in self.rows)
        print("\npreflight")
        for check, status, detail, fix in self.rows:
            print(f"  {status}  {check:<{width}}  {detail}")
            if fix and status in (WARN, FAIL):
                print(" " * (width + 10) + f"fix: {fix}")
        print(flush=True)
        failures = [row for row in self.rows if row[1] == FAIL]
        if failures:
            _, _, detail, fix = failures[0]
            more = len(failures) - 1
            print(f"error: {detail}" + (f"; {fix}" if fix else "")
                  + (f" (and {more} more failed check{'s' * (more > 1)} above)" if more else ""), file=sys.stderr)
            return 2
        if self.args.check:
            print(f"preflight: no failures ({sum(row[1] == WARN for row in self.rows)} warnings)", flush=True)
            return 0
        return None


def check_output_dir(pf: Preflight) -> None:
    out = pf.args.output_dir
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as exc:
        pf.add("output dir", FAIL, f"cannot write to {out} ({exc.strerror})", "give a writable --output-dir")
        return
    pf.writable = pf.add("output dir", PASS, out)


def check_resume(pf: Preflight) -> None:
    try:
        resume = resolve_resume(pf.args)
        problem = lora_mismatch(pf.args, resume)
    except UsageError as exc:
        resume, problem = None, str(exc)
    if pf.add("resume", FAIL if problem else PASS, problem or resume or "fresh start"):
        pf.plan["resume"] = resume


def check_task_spec(pf: Preflight) -> bool:
    try:  # the --tasks file or spec alone, before any server says which tasks it serves (the later tasks row)
        read_task_spec(pf.args.tasks)
    except UsageError as exc:
        return pf.add("tasks", FAIL, str(exc))
    return True


def http_json(url: str, timeout: float = 10.0) -> Any:
    # TRL's VLLMClient asks with no timeout: a port that accepts and never answers would hang the preflight.
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read())


def check_vllm_reachable(pf: Preflight) -> Any:
    """What vLLM serves and its resolved config (dev mode only), for the later rows; returns OpenEnv's probe of it."""
    url = pf.args.vllm_url
    try:
        served = http_json(f"{url}/v1/models")["data"][0]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        pf.add("vLLM reachable", FAIL, f"vLLM is not reachable at {url} ({exc})",
               "start it first (the `vllm serve` command in this script's docstring) or fix --vllm-url")
        return None
    pf.add("vLLM reachable", PASS, f"{url} serves {served['id']}")
    model_config = {}
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        info = http_json(f"{url}/server_info?config_format=json")
        model_config = info["vllm_config"]["model_config"]
        pf.vllm_config, pf.vllm_env = info["vllm_config"], info.get("vllm_env") or {}
    config = pf.vllm_config or {}
    served["weight_transfer"] = (config.get("weight_transfer_config") or {}).get("backend")  # build_trainer follows
    served["gpu_memory_utilization"] = (config.get("cache_config") or {}).get("gpu_memory_utilization")
    served["dtype"] = str(model_config.get("dtype") or "").removeprefix("torch.") or None
    served["max_model_len"] = served.get("max_model_len") or model_config.get("max_model_len")
    served["logprobs_mode"] = model_config.get("logprobs_mode")
    pf.served = served
    pf.plan["max_model_len"], pf.plan["weight_transfer"] = served["max_model_len"], served["weight_transfer"]
    return validate_llm(url, served["id"], timeout=60.0)


def check_served_model(pf: Preflight) -> None:
    served, model = pf.served, pf.args.model
    if Path(model.rstrip("/")).name in {Path(n.rstrip("/")).name for n in (served["id"], served.get("root")) if n}:
        pf.add("served model", PASS, f"--model {model} is what vLLM serves")
    else:
        pf.add("served model", FAIL, f"vLLM serves {served.get('root') or served['id']} but --model is {model}",
               "serve --model with vLLM, or fix --model")


def check_capture_tier(pf: Preflight, report: Any) -> None:
    """Token ids from OpenEnv's probe; processed logprobs from vLLM's /server_info in dev mode, else measured at two
    temperatures (which a near-uniform model, random or tiny, leaves undecided)."""
    mode, fix = pf.served["logprobs_mode"], "restart vLLM with --logprobs-mode processed_logprobs"
    if mode and mode != "processed_logprobs":
        pf.add("capture tier", FAIL, f"vLLM's /server_info: logprobs_mode {mode}: wrong importance ratios", fix)
    elif report.logprobs_mode == "raw":  # OpenEnv's probe then grades the engine eval tier whatever vLLM says
        pf.add("capture tier", FAIL, "the engine returns raw (pre-temperature) logprobs, measured", fix)
    elif report.capture_level != "tokens":
        flags = "" if report.capture_level == "logprobs" else " --logprobs-mode processed_logprobs"
        pf.add("capture tier", FAIL, f"no token ids captured ({report.capture_level or 'nothing'}): nothing to train "
               "on", f"restart vLLM with --return-tokens-as-token-ids{flags}")
    elif mode or report.logprobs_mode == "processed":
        how = "vLLM's /server_info: logprobs_mode processed_logprobs" if mode else "measured at two temperatures"
        pf.add("capture tier", PASS, f"train: token ids + processed logprobs ({how})")
    else:
        pf.add("capture tier", WARN, "train: token ids + logprobs, processed or raw unknown (no dev mode to ask)", fix)


def check_tool_calls(pf: Preflight, report: Any) -> None:
    status, detail = {"ok": (PASS, "a tool call round-trips"),
                      "rejected": (FAIL, "vLLM refuses tool calls, which every agent harness makes"),
                      "no-tool-call": (WARN, "the model answered a tool request in prose")}.get(
        report.tool_support, (WARN, "could not tell whether tool calls work"))
    pf.add("tool calls", status, detail,
           "serve with --enable-auto-tool-choice --tool-call-parser <your model family's parser, hermes for Qwen3>")


def check_weight_transfer(pf: Preflight) -> None:
    backend = pf.served["weight_transfer"]
    if pf.vllm_config is None:
        pf.add("weight transfer", FAIL, "vLLM's dev endpoints are off: the trainer cannot push its weights",
               "restart vLLM with VLLM_SERVER_DEV_MODE=1 in its environment")
    elif backend not in ("nccl", "ipc"):
        pf.add("weight transfer", FAIL, f"vLLM has no nccl or ipc weight transfer engine (backend {backend!r})",
               "restart vLLM with --weight-transfer-config '{\"backend\":\"nccl\"}' (a GPU of its own) or "
               "'{\"backend\":\"ipc\"}' and --host 127.0.0.1")
    elif backend == "ipc" and pf.vllm_env.get("VLLM_ALLOW_INSECURE_SERIALIZATION") is False:
        # vLLM's ipc backend unpickles every push (its CUDA-IPC handles): it must be allowed to.
        pf.add("weight transfer", FAIL, "vLLM's ipc backend would refuse to unpickle every push",
               "restart vLLM with VLLM_ALLOW_INSECURE_SERIALIZATION=1 in its environment and --host 127.0.0.1")
    else:
        pf.add("weight transfer", PASS, f"enabled ({backend})")


def url_port(url: str) -> int:
    parts = urllib.parse.urlsplit(url)
    return parts.port or (443 if parts.scheme == "https" else 80)


def parent_pid(pid: int) -> int | None:
    """From /proc; None when the process is gone."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return None


def port_listeners(port: int) -> tuple[set[str], set[int]]:
    """The addresses TCP sockets listen on `port` at in this network namespace, and the processes holding them with
    their descendants (vLLM's engine core, on the GPU, is its API server's child): vLLM reports neither."""
    addresses, inodes = set(), set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                address, hex_port = fields[1].split(":")
                if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: TCP_LISTEN
                    raw = bytes.fromhex(address)  # 32-bit words, each in the kernel's (little-endian) byte order
                    ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
                    addresses.add(str(getattr(ip, "ipv4_mapped", None) or ip))
                    inodes.add(f"socket:[{fields[9]}]")
    parents, tree = {}, set()
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):  # not a pid, gone meanwhile, or another user's
            parents[int(proc.name)] = parent_pid(int(proc.name))
            if inodes and any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                tree.add(int(proc.name))
    while grown := {pid for pid, parent in parents.items() if parent in tree} - tree:
        tree |= grown
    return addresses, tree


def check_vllm_on_loopback(pf: Preflight) -> None:
    """Dev mode serves /collective_rpc and the weight-transfer routes to whoever reaches vLLM: with ipc they unpickle
    what they are sent; with nccl they pause vLLM or load other weights (a multi-node run needs them reachable)."""
    url, port = pf.args.vllm_url, url_port(pf.args.vllm_url)
    listening = sorted(port_listeners(port)[0])
    beyond = [f"vLLM listens on {address} port {port}, beyond this host" for address in listening
              if not ipaddress.ip_address(address).is_loopback]
    host = urllib.parse.urlsplit(url).hostname or ""
    with contextlib.suppress(ValueError):  # a name: only localhost is known to be loopback
        host = "localhost" if ipaddress.ip_address(host).is_loopback else host
    if host != "localhost":
        beyond.insert(0, f"--vllm-url {url} is not a loopback address")
    job = next((f"{name}={os.environ[name]}" for name in ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")
                if os.environ.get(name)), None)
    danger = "with ipc vLLM unpickles every weight push, so whoever reaches it can run code as vLLM's user"
    if beyond and not pf.ipc:
        pf.add("vLLM on loopback", WARN, f"{beyond[0]}: in dev mode whoever reaches vLLM can pause it or load other "
               "weights into it", "restart vLLM with --host 127.0.0.1, or (multi-node) keep its port private")
    elif beyond:
        pf.add("vLLM on loopback", FAIL, f"{beyond[0]}: {danger}", "restart vLLM with --host 127.0.0.1")
    elif not listening:
        pf.add("vLLM on loopback", WARN, f"no socket listening on port {port} is visible here",
               "run vLLM with --host 127.0.0.1")
    elif pf.ipc and job:  # every user of a scheduler's shared node reaches its loopback
        pf.add("vLLM on loopback", WARN, f"this host is shared ({job}) and every local user reaches its loopback: "
               f"{danger}", "run the job on a node of its own (SLURM: --exclusive), or use the nccl backend")
    else:
        pf.add("vLLM on loopback", PASS, f"vLLM listens on {', '.join(listening)} port {port} only")


def check_trainer_ranks(pf: Preflight) -> None:
    if (ranks := int(os.environ.get("WORLD_SIZE", "1"))) > 1:
        pf.add("trainer ranks", FAIL, f"{ranks} trainer processes (WORLD_SIZE): vLLM's ipc backend takes each push "
               "from one", "launch one trainer process, or use the nccl backend (vLLM on a GPU of its own)")


def check_dtype(pf: Preflight) -> None:
    """vLLM's dtype against the trainer's compute dtype: bf16 autocast on a GPU, else its weights' (TRL's warning)."""
    if pf.vllm_config is None:
        pf.add("dtype", SKIP, "vLLM's dev endpoints are off, so its dtype cannot be read")
        return
    args, served, trains = pf.args, pf.served["dtype"], trainer_dtype(pf.args)
    computes = "bfloat16" if args.bf16 else trains
    weights = f"the trainer's weights are {trains} (--dtype {args.dtype})"
    if not served or not trains:
        pf.add("dtype", WARN, f"not compared: vLLM's dtype is {served or 'unreported'}, the trainer's "
               f"{trains or model_shape_error(args)}")
    elif served == computes:
        autocast = "" if computes == trains else " and the trainer scores under bfloat16 autocast"
        pf.add("dtype", PASS, f"vLLM serves {served}{autocast}, {weights}")
    else:
        trainer = f"{weights}; TRL warns about this"
        if args.bf16:
            trainer = "the trainer scores under bfloat16 autocast on GPU"
        pf.add("dtype", WARN, f"vLLM serves {served}, {trainer}: the gap shows in every importance ratio",
               f"serve with vLLM's --dtype {computes}")


def check_lora_engine(pf: Preflight) -> None:
    # With --enable-lora TRL syncs the adapter alone, as `trl-policy-vN`, which only its own worker asks for.
    if pf.vllm_config.get("lora_config"):
        pf.add("LoRA", FAIL, "vLLM runs with --enable-lora: every rollout would sample the untrained base model",
               "restart vLLM without --enable-lora (and its --max-lora-rank / --max-loras)")
    else:
        pf.add("LoRA", PASS, f"merged sync: each push folds the r={pf.args.lora_r} adapter into the base weights")

# What mini-swe-agent 2.4.6 shows the model of a command's output each turn (its config/mini.yaml, which Harbor's
# install runs with `-c mini`): all of it under 10,000 characters, else the first and the last 5,000.
MINI_SWE_AGENT_OUTPUT_CHARS = 10_000


def check_context(pf: Preflight) -> None:
    """The prompt and every turn's completion; the rest of the context holds the command output shown back."""
    args, max_len = pf.args, pf.served["max_model_len"]
    worst = PROMPT_TOKENS + args.agent_step_limit * args.max_completion_length
    counted = (f"~{PROMPT_TOKENS:,}-token prompt + {args.agent_step_limit} turns x {args.max_completion_length} "
               f"tokens = {worst:,}")
    shown = "the harness shows back"
    if set(args.harnesses) == {"mini-swe-agent"}:
        shown = f"(mini-swe-agent shows up to {MINI_SWE_AGENT_OUTPUT_CHARS:,} characters of each)"
    if not max_len:
        pf.add("context", WARN, "vLLM did not report its max_model_len")
    elif worst > max_len:
        pf.add("context", WARN, f"{counted} > vLLM's max_model_len {max_len:,}",
               "lower --agent-step-limit or --max-completion-length, or raise vLLM's --max-model-len")
    else:
        pf.add("context", PASS, f"{counted} fit max_model_len {max_len:,}, leaving {max_len - worst:,} tokens for "
               f"command output {shown}")


def check_lora_targets(pf: Preflight) -> None:
    """No adapter on a weight the input embeddings and output head share: the merged push would change both."""
    from peft.tuners.lora import LoraLayer

    if model_shape_error(pf.args) is not None:
        return  # the checkpoints row says why --model's config cannot be read
    try:
        base = lora_model(pf.args).get_base_model()
    except ValueError as exc:  # PEFT's NoMatchingPeftModuleError
        pf.add("LoRA targets", FAIL, f"--lora-target-modules: {exc}", "name modules of --model, or all-linear")
        return
    pair = [m.get_base_layer() if isinstance(m, LoraLayer) else m
            for m in (base.get_input_embeddings(), base.get_output_embeddings())]
    if None in pair or pair[0].weight is not pair[1].weight:
        return
    tied = [name for name, m in base.named_modules()
            if isinstance(m, LoraLayer) and m.get_base_layer().weight is pair[0].weight]
    if tied:
        pf.add("LoRA targets", FAIL, f"an adapter on {', '.join(tied)}, a weight {pf.args.model} ties between its "
               "input embeddings and its output head", "leave embed_tokens and lm_head out of --lora-target-modules")


def check_precision(pf: Preflight) -> None:
    args, dtype = pf.args, trainer_dtype(pf.args)
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    if fsdp and dtype not in (None, "float32"):  # accelerate's FSDP2 upcasts after TRL announced the dtype to vLLM
        pf.add("precision", FAIL, f"--dtype {args.dtype} under FSDP: accelerate upcasts the weights to float32, so "
               "weight pushes would not match", "--dtype float32 (FSDP keeps float32 weights anyway)")
    elif fsdp and args.use_peft:  # the merged push folds whole adapter tensors in, which FSDP shards
        pf.add("precision", FAIL, "--use-peft under FSDP: the merged push cannot read sharded adapters",
               "train LoRA on one trainer process (docs/capacity.md, LoRA), or without FSDP")
    elif dtype in ("bfloat16", "float16", "float32"):
        # An AdamW step moves a weight by ~lr: below half the spacing at |w| 0.02 (Qwen3's init range) it rounds away
        trained = "float32" if args.use_peft else dtype
        half_step = 2.0 ** math.floor(math.log2(0.02)) * torch.finfo(getattr(torch, trained)).eps / 2
        what = f"LoRA: float32 adapters on a frozen {dtype} base" if args.use_peft else f"{dtype} weights"
        if args.learning_rate < half_step:
            pf.add("precision", WARN, f"{what}: --learning-rate {args.learning_rate:g} is below half the {trained} "
                   f"spacing at |w| = 0.02 ({half_step:.1e}), so most updates round to no change",
                   f"--dtype float32, or a learning rate well above {half_step:.0e}")
        else:
            pf.add("precision", PASS, f"{what}: --learning-rate {args.learning_rate:g} >= {half_step:.1e}")


def check_checkpoints(pf: Preflight) -> None:
    args, shape = pf.args, pf.shape
    if (problem := model_shape_error(args)) is not None:
        pf.add("checkpoints", SKIP, f"size unknown: {problem}")
        return
    if not pf.writable or shape is None:  # the output dir's row, or a --lora-target-modules without a shape to size
        return
    # transformers saves the trained tensors (LoRA: the float32 adapter) with AdamW's two moments at their width
    count, width = (shape.adapter, 4) if args.use_peft else (shape.params, shape.width)
    each, merged = 3 * count * width, shape.params * shape.width if args.use_peft else 0
    kept = args.save_total_limit or max(1, args.max_steps // args.save_steps)
    peak = (kept + 1) * each + merged  # the oldest goes once the newest is whole
    free = shutil.disk_usage(args.output_dir).free
    pf.plan["checkpoint_bytes"] = each
    what = "float32 adapter" if args.use_peft else f"{trainer_dtype(args)} weights"
    pf.add("checkpoints", WARN if free < peak else PASS,
           f"~{human_bytes(each)} each ({what} + 2 AdamW moments); {kept} kept + 1 being written"
           f"{' + the merged model' if merged else ''} = {human_bytes(peak)}; {human_bytes(free)} free",
           "free disk space, lower --save-total-limit, or give an --output-dir on a larger disk")


def nvidia_smi(query: str) -> list[list[str]] | None:
    """nvidia-smi's answer to `--query-...=fields`, one list of fields a line; None when no nvidia-smi answers."""
    try:
        out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [[field.strip() for field in line.split(",", query.count(","))] for line in out.splitlines() if line]


def gpu_processes() -> dict[str, list[tuple[int, str, float]]] | None:
    """GPU uuid -> [(pid, command line, GiB)] of the compute processes nvidia-smi lists; None when it cannot."""
    if (found := nvidia_smi("--query-compute-apps=gpu_uuid,pid,used_memory,process_name")) is None:
        return None
    apps: dict[str, list[tuple[int, str, float]]] = {}
    for uuid, pid, mib, name in (row for row in found if len(row) == 4 and row[1].isdigit()):
        # vLLM titles its GPU processes VLLM::EngineCore / VLLM::Worker_*; nvidia-smi may show only `python`.
        with contextlib.suppress(OSError):
            name = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace") or name
        apps.setdefault(uuid.lower().removeprefix("gpu-"), []).append(
            (int(pid), name, float(mib) / 1024 if mib.replace(".", "").isdigit() else 0.0))
    return apps


# The oldest NVIDIA driver (Linux) that runs each CUDA major: NVIDIA's CUDA compatibility table. torch 2.13: CUDA 13.0.
CUDA_DRIVER_FLOOR = {13: 580, 12: 525, 11: 450}


def check_trainer_gpu(pf: Preflight) -> None:
    from torch.distributed import is_nccl_available
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    built, cuda = f"torch {torch.__version__}", torch.version.cuda
    visible = f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus and cuda:
        floor = CUDA_DRIVER_FLOOR.get(int(cuda.split(".")[0]), 0)  # 0: a CUDA major this table does not know
        driver = (nvidia_smi("--query-gpu=driver_version") or [["none (nvidia-smi fails)"]])[0][0]
        old = not driver.split(".")[0].isdigit() or int(driver.split(".")[0]) < floor
        pf.add("trainer GPU", FAIL, f"{built} is built for CUDA {cuda} but sees no CUDA device ({visible}; NVIDIA "
               f"driver: {driver})", f"install NVIDIA driver >= {floor} (Linux)" if old else
               "make the trainer's GPU visible: CUDA_VISIBLE_DEVICES=<its index or GPU-UUID, nvidia-smi -L>")
    elif not gpus:
        # NCCL moves GPU memory only, and torch shares no CUDA memory from CPU tensors (the CPU tests stand in for both)
        pushes = reduce_tensor(torch.zeros(1))[0] is rebuild_cuda_tensor if pf.ipc else is_nccl_available()
        if pushes:
            pf.add("trainer GPU", SKIP, "no CUDA device visible: the trainer runs on CPU")
        else:
            how = "CUDA IPC cannot push weights from a CPU trainer" if pf.ipc else "NCCL moves GPU memory only"
            where = "on vLLM's GPU" if pf.ipc else "on a GPU of its own"
            pf.add("trainer GPU", FAIL, f"no CUDA device visible to the trainer ({built}, a CPU build; {visible}): "
                   f"{how}", f"run this script {where} with the CUDA torch of its header (`uv run`; NVIDIA driver >= "
                   f"{CUDA_DRIVER_FLOOR[13]})")
    else:
        held, busy, mine, ranks = [], [], [], int(os.environ.get("WORLD_SIZE", "1"))
        for index in range(min(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), gpus)):  # one GPU a local rank
            props = torch.cuda.get_device_properties(index)
            mine.append(label := f"cuda:{index} ({props.name})")
            others = [a for a in (pf.gpu_apps or {}).get(str(props.uuid).lower().removeprefix("gpu-"), [])
                      if a[0] != os.getpid()]
            vllm = [a for a in others if "vllm" in a[1].lower()]
            # This run's other ranks hold their GPUs too (accelerate's set_device): the launcher started them.
            jobs = [a for a in others if not (ranks > 1 and parent_pid(a[0]) == os.getppid())]
            if vllm:
                held.append(f"{label} is vLLM's: pid {vllm[0][0]} holds {sum(a[2] for a in vllm):.1f} GiB")
            elif jobs:
                busy.append(f"{label}: {len(jobs)} other process(es) hold {sum(a[2] for a in jobs):.1f} GiB")
        fix = "give vLLM and the trainer different GPUs (CUDA_VISIBLE_DEVICES): NCCL refuses two ranks on one device"
        if pf.ipc:
            pf.add("trainer GPU", PASS, f"{'; '.join(held) or ', '.join(mine)}: shared with vLLM on purpose "
                   "(the ipc backend pushes weights within one card)")
        elif held:
            pf.add("trainer GPU", FAIL, "; ".join(held), fix)
        elif busy:
            pf.add("trainer GPU", WARN, "; ".join(busy) + ", which may grow into the trainer's memory",
                   "give the trainer a GPU no other job uses (CUDA_VISIBLE_DEVICES)")
        elif pf.gpu_apps is None:
            pf.add("trainer GPU", WARN, f"{', '.join(mine)}: nvidia-smi is unavailable, so whether vLLM shares it is "
                   "unknown", fix)
        else:
            pf.add("trainer GPU", PASS, f"{', '.join(mine)}: no other process on it")


def check_same_gpu(pf: Preflight) -> None:
    """CUDA IPC maps memory of one physical GPU: vLLM must run on the trainer's own, by UUID."""
    if not torch.cuda.is_available():
        pf.add("same GPU", SKIP, "not compared: the trainer has no CUDA device (the trainer GPU row)")
        return
    props, apps = torch.cuda.get_device_properties(0), pf.gpu_apps or {}
    mine = str(props.uuid).lower().removeprefix("gpu-")
    # The processes serving --vllm-url's port first (another run's vLLM may share this host), else any vLLM by name.
    server = port_listeners(url_port(pf.args.vllm_url))[1] - {os.getpid()} if apps else set()
    vllm = {uuid: pids for uuid, procs in apps.items() if (pids := [a[0] for a in procs if a[0] in server])}
    vllm = vllm or {uuid: pids for uuid, procs in apps.items()
                    if (pids := [a[0] for a in procs if "vllm" in a[1].lower() and a[0] != os.getpid()])}
    # A MIG instance's UUID is not its parent GPU's, and nvidia-smi lists processes by either.
    mig = (mine.startswith("mig-") or " MIG " in f" {props.name} " or any(uuid.startswith("mig-") for uuid in apps)
           or os.environ.get("CUDA_VISIBLE_DEVICES", "").upper().startswith("MIG-"))
    if not mig and mine in vllm:
        pf.add("same GPU", PASS, f"cuda:0 ({props.name}, GPU-{mine}) is vLLM's GPU (pid {vllm[mine][0]})")
    elif not mig and vllm:
        theirs = next(iter(vllm))
        pf.add("same GPU", FAIL, f"vLLM runs on GPU-{theirs} (pid {vllm[theirs][0]}), the trainer on cuda:0 = "
               f"GPU-{mine}: CUDA IPC reaches only the same GPU",
               f"start this script with CUDA_VISIBLE_DEVICES=GPU-{theirs}")
    else:
        why = "MIG" if mig else "no nvidia-smi" if pf.gpu_apps is None else "nvidia-smi shows no vLLM process"
        pf.add("same GPU", WARN, f"whether vLLM runs on cuda:0 ({props.name}) could not be verified ({why})",
               "start vLLM and this script with the same "
               "CUDA_VISIBLE_DEVICES=GPU-<UUID> (MIG-<UUID> under MIG; nvidia-smi -L)")


def check_attention_kernel(pf: Preflight) -> None:
    """TRL's tree attention, run once now: a kernel that cannot load fails here, not after the first paid group."""
    if not torch.cuda.is_available():
        pf.add("attention kernel", SKIP, "CUDA only: TRL's tree attention runs kernels-community/flash-attn3")
        return
    props = torch.cuda.get_device_properties(0)
    gpu = f"{props.name} (compute capability {props.major}.{props.minor}), torch {torch.__version__}"
    try:  # TRL loads its kernel from the hub at the first call, and caches it
        q = torch.randn(1, 2, 8, 64, device="cuda:0", dtype=torch.bfloat16)
        cu = torch.tensor([0, 8], device="cuda:0", dtype=torch.int32)
        packing.tree_attention(None, q, q, q, None, tree_kv_index=torch.arange(8, device="cuda:0"),
                               tree_cu_seqlens_q=cu, tree_cu_seqlens_k=cu, tree_max_seqlen_q=8, tree_max_seqlen_k=8)
        torch.cuda.synchronize(0)
    except Exception as exc:  # noqa: BLE001 - `kernels` missing, the hub unreachable, no build for this GPU: all fail
        pf.add("attention kernel", FAIL, redact(f"TRL's tree attention (kernels-community/flash-attn3) cannot run on "
                                                f"{gpu}: {type(exc).__name__}: {exc}").splitlines()[0][:300],
               "train on a Hopper GPU (H100 / H200) with `kernels`; offline, pre-fetch it (docs/troubleshooting.md)")
        return
    pf.add("attention kernel", PASS, f"kernels-community/flash-attn3 (version 1) loaded and ran on {gpu}")


def check_trainer_memory(pf: Preflight) -> None:
    """The trainer's projected peak against what it may use on its GPU; beside vLLM (ipc) that is what vLLM's
    --gpu-memory-utilization leaves of the card, where the plan caps the trainer, projected or not."""
    args, shape, served = pf.args, pf.shape, pf.served or {}
    share = served.get("gpu_memory_utilization") if pf.ipc else None
    ranks, fsdp = int(os.environ.get("WORLD_SIZE", "1")), os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    peak = functools.partial(trainer_peak, ranks=ranks, fsdp=fsdp, backend=served.get("weight_transfer"),
                             served_width=getattr(torch, str(served.get("dtype")), torch.bfloat16).itemsize)
    row, budget = served.get("max_model_len"), "vLLM's max_model_len"  # TRL packs rollouts into rows up to its budget
    if (args.config.token_budget or 0) > 0:
        row, budget = args.config.token_budget, "--token-budget"
    elif args.config.token_budget is not None and row:  # no packing: per_device_train_batch_size rollouts a row
        row *= args.config.per_device_train_batch_size
    parts = peak(shape, row or 0) if shape else {}
    need, beside = sum(parts.values()), parts.get("vLLM's push copies", 0)
    try:
        free, total = torch.cuda.mem_get_info(0)
    except (AssertionError, RuntimeError):  # torch built without CUDA asserts; with CUDA but no device it raises
        free = total = 0
    limit = (min(free, int(total * (1 - share))) if share else free) - OUTSIDE_ALLOCATOR
    vllm = f"; vLLM's share {share:g} x {gib(total)} = {gib(share * total)}" if share else ""
    room = (f"{gib(limit)} the trainer may use on cuda:0 ({gib(free)} free of {gib(total)}{vllm}, less "
            f"{gib(OUTSIDE_ALLOCATOR)})")
    # vLLM's own copies while it loads a push come out of the same room: the trainer is capped below them.
    fraction = min(1.0, max(0, limit - beside + torch.cuda.memory_reserved(0)) / total) if total and share else 0
    cap = f"; capped at train start (memory fraction {fraction:.3f})" if fraction else ""
    what = (f"LoRA r {args.lora_r} on a frozen {trainer_dtype(args)} base" if args.use_peft
            else f"full fine-tune, {trainer_dtype(args)} weights")
    what += f", FSDP over {ranks} ranks" if fsdp and ranks > 1 else f", {ranks} DDP ranks" if ranks > 1 else ""
    rows = f"a {row:,}-token row ({budget})" if row else "the static part alone (the row once vLLM answers)"
    detail = f"projected peak {gib(need)} for {rows}, {what}: {', '.join(f'{k} {gib(n)}' for k, n in parts.items())}"
    tight = shape and total and need * (1 + MEMORY_TOLERANCE) > limit
    fix = memory_fixes(args, shape, peak, limit, row or 0) if tight else ""
    if shape is None:
        status, detail = SKIP, (f"not projected: {model_shape_error(args) or '--dtype auto: its dtype is unknown'}"
                                + (f"; {room}{cap}" if cap else ""))
    elif not total:
        status, detail = SKIP, f"{detail}; no GPU to compare against (the trainer runs on CPU)"
    elif need > limit:
        pf.add("trainer memory", FAIL, f"{detail} > {room}", fix)
        return  # nothing trains
    elif row is None:
        status, detail = SKIP, f"{detail}: fits {room}{cap}"
    elif tight:
        status, detail = WARN, f"{detail}, within {MEMORY_TOLERANCE:.0%} of {room}{cap}"
    else:
        status, detail = PASS, f"{detail}; fits {room}{cap}"
    pf.add("trainer memory", status, detail, fix)
    if fraction:
        pf.plan["gpu_memory_fraction"] = fraction


def memory_fixes(args: argparse.Namespace, shape: TrainerShape, peak: Callable[..., dict[str, int]], limit: int,
                 row: int) -> str:
    """The flags that bring the projection under `limit` with MEMORY_TOLERANCE to spare."""
    fixes, low, high = [], 0, row
    while low < high:  # the longest row that fits
        mid = (low + high + 1) // 2
        fits = sum(peak(shape, mid).values()) * (1 + MEMORY_TOLERANCE) <= limit
        low, high = (mid, high) if fits else (low, mid - 1)
    tokens = low // 1024 * 1024
    if tokens >= PROMPT_TOKENS + args.max_completion_length:
        steps = min(args.agent_step_limit, (tokens - PROMPT_TOKENS) // args.max_completion_length)
        where = (f"--token-budget {tokens}" if (args.config.token_budget or 0) > 0
                 else f"serve vLLM with --max-model-len {tokens}")
        fixes.append(f"{where} and --agent-step-limit {steps} ({args.max_completion_length}-token turns)")
    lora = None if args.use_peft else trainer_shape(argparse.Namespace(**{**vars(args), "use_peft": True,
                                                                           "dtype": "bfloat16"}))
    if lora and sum(peak(lora, row).values()) * (1 + MEMORY_TOLERANCE) <= limit:
        fixes.append(f"--use-peft (LoRA r {args.lora_r} on a bfloat16 base)")
    return "; or ".join(fixes) or "train on a GPU with more free memory, or shard it with FSDP (slurm/README.md)"


def check_credentials(pf: Preflight) -> bool:
    args, var = pf.args, SANDBOX_CREDENTIALS.get(pf.args.sandbox)
    if var and not os.environ.get(var):
        return pf.add("credentials", FAIL, f"{var} is not set: every {args.sandbox} sandbox would fail to start",
                      f"export {var} (the Harbor server this script starts inherits it)")
    if args.dataset == DEFAULT_DATASET and not os.environ.get("HF_TOKEN"):
        return pf.add("credentials", WARN, "HF_TOKEN is not set: the default suite's tasks fetch data with it",
                      "export HF_TOKEN")
    return pf.add("credentials", PASS, f"{var} set" if var else f"{args.sandbox} needs none that this script knows of")


def check_capture_url(pf: Preflight) -> bool:
    """Before our server starts: where it advertises the capture proxy (--harbor-expose). The harness, not the
    trainer, calls it, from wherever the harness runs."""
    args, tunnel = pf.args, "cloudflare" if shutil.which("cloudflared") else "gradio"
    in_sandbox = ", ".join(h for h in args.harnesses if h not in HOST_SIDE_AGENTS)
    runs = f"{in_sandbox} runs inside the {args.sandbox} sandbox"
    if not in_sandbox:
        picked, why = "direct", f"{args.harness} runs host-side (openenv's HOST_SIDE_AGENTS)"
    elif args.sandbox in OFF_HOST_SANDBOXES:
        picked, why = tunnel, f"{runs}, which runs off this host"
    elif args.sandbox in OWN_NETWORK_SANDBOXES:
        picked, why = tunnel, f"{runs}, which has its own network namespace (docker's bridge network)"
    else:
        picked, why = "direct", f"{runs}; whether that reaches this host's 127.0.0.1 is not known here"
    known = not in_sandbox or picked != "direct"
    probe = "confirm with --check --probe-rollout (one real rollout), or set --harbor-expose"
    if args.harbor_expose == "auto":
        args.harbor_expose = picked
        return pf.add("capture URL", PASS if known else WARN, f"--harbor-expose auto: {picked}. {why}", probe)
    if args.harbor_expose == "direct" and picked != "direct":
        return pf.add("capture URL", FAIL, f"--harbor-expose direct advertises 127.0.0.1, which the harness cannot "
                      f"reach: {why}", f"--harbor-expose {picked} (or auto)")
    if args.harbor_expose == "cloudflare" and tunnel != "cloudflare":
        return pf.add("capture URL", FAIL, "--harbor-expose cloudflare needs `cloudflared` on PATH",
                      "install cloudflared, or use --harbor-expose gradio")
    unknown = args.harbor_expose == "direct" and not known
    return pf.add("capture URL", WARN if unknown else PASS, f"--harbor-expose {args.harbor_expose}"
                  + (f": {why}" if unknown else ""), probe)


def check_capture_reached(pf: Preflight) -> bool:
    """Our server up: the URL it hands every sandbox (the tunnel's, when one is picked) reaches its capture proxy."""
    url, fix = pf.server.public_url, "check this host's access to the tunnel's service, or pick another --harbor-expose"
    if not url:
        return pf.amend("capture URL", f"the Harbor server printed no capture URL (log: {pf.server.log_path})",
                        FAIL, fix)
    try:
        ours = http_json(f"http://127.0.0.1:{pf.server.capture_port}/health", timeout=15)
        theirs = http_json(f"{url}/health", timeout=30)
    except (OSError, ValueError) as exc:
        return pf.amend("capture URL", f"{url}/health, the URL every sandbox is given, does not answer here "
                        f"({type(exc).__name__}: {exc})", FAIL, fix)
    if not isinstance(theirs, dict) or theirs.get("instance") != ours.get("instance"):
        return pf.amend("capture URL", f"{url}/health answers, but not as this server's capture proxy", FAIL, fix)
    pf.args.capture_url = url
    return pf.amend("capture URL", f"{url}/health reached this server's capture proxy from here")


def check_harbor_server(pf: Preflight) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
    """Ours started, or yours reached: (its splits, its capabilities), which the rows after this one judge."""
    args, server = pf.args, pf.server
    if server is not None:
        try:
            seconds = server.start(pf.served["id"] if pf.served else "")
        except UsageError as exc:
            last = server.log_path.read_text(errors="replace").strip().splitlines()[-1:]
            pf.add("Harbor server", FAIL, ": ".join([str(exc), *last]), "fix what its log says, or pass --harbor-url")
            return None
        args.harbor_url = server.url
    try:
        with contextlib.closing(HarborEnv(base_url=args.harbor_url)) as client:
            found = client.splits(), client.capabilities()
    except Exception as exc:  # noqa: BLE001 - any failure here means the same thing to the user
        pf.add("Harbor server", FAIL, f"Harbor server not reachable at {args.harbor_url} ({type(exc).__name__}: "
               f"{exc})", "start `openenv harbor serve ... --expose direct`, fix --harbor-url, or drop it")
        return None
    if server is not None:
        pf.add("Harbor server", PASS, f"started {server.url} in {seconds:.0f}s (log: {server.log_path})")
    elif args.sandbox in TEMPLATE_BUILDING_SANDBOXES:
        pf.add("Harbor server", PASS, f"{args.harbor_url} (yours: it needs HARBOR_SHARED_ENV_NAME and "
               "OPENENV_HARBOR_AGENT_VERSIONS set, docs/harbor-server.md)")
    else:
        pf.add("Harbor server", PASS, f"{args.harbor_url} (yours)")
    return found


def closest_first(name: str, choices: Any) -> str:
    return ", ".join(difflib.get_close_matches(name, list(choices), n=len(choices), cutoff=0))


def check_harness(pf: Preflight, capabilities: dict[str, Any]) -> None:
    served = {h["name"]: h for h in capabilities.get("harnesses", [])}
    for name in pf.args.harnesses:
        status = served[name].get("status", "?") if name in served else "custom import"
        if name not in served and ":" not in name:  # `module:Class` is a custom harness the server imports
            pf.add("harness", FAIL, f"unknown harness {name!r}; this server has: {closest_first(name, served)}")
        elif status.split(":")[0] in ("blocked", "unsupported"):
            pf.add("harness", FAIL, f"harness {name!r} cannot run on this server: {status}", "pick a validated harness")
        else:
            pf.add("harness", PASS, f"{name} ({status})")


def check_sandbox(pf: Preflight, capabilities: dict[str, Any]) -> None:
    name, served = pf.args.sandbox, {s["name"]: s for s in capabilities.get("sandboxes", [])}
    try:  # the server advertises (and checks the credentials of) only a few of the sandboxes Harbor knows
        from harbor.models.environment_type import EnvironmentType
        known = {t.value for t in EnvironmentType}
    except ImportError:
        known = OFF_HOST_SANDBOXES | OWN_NETWORK_SANDBOXES
    if name not in served and name in known:
        pf.add("sandbox", WARN, f"the Harbor server does not advertise {name!r}, so its credentials were not checked",
               "run `openenv harbor info` on the server")
    elif name not in served:
        pf.add("sandbox", FAIL, f"unknown sandbox {name!r}; this server has: {closest_first(name, served)}")
    elif not served[name].get("available"):
        pf.add("sandbox", FAIL, f"sandbox {name!r} is not usable on the Harbor server: {served[name].get('detail')}",
               "set its credentials in the Harbor server's environment")
    else:
        pf.add("sandbox", PASS, f"{name} ({served[name].get('detail') or 'available'})")


def check_servers_engine(pf: Preflight, capabilities: dict[str, Any]) -> None:
    args = pf.args
    pf.plan["llm"] = llm = capabilities.get("llm") or {}
    url, level = llm.get("url", "?"), llm.get("capture_level") or "unknown"
    # Compared as given: this host cannot tell the server's localhost from ours (--allow-engine-mismatch).
    engine, ours = (urllib.parse.urlsplit(u) for u in (llm.get("url", ""), args.vllm_url))
    if args.measure:
        pf.add("server's engine", PASS, f"{url}: {level} capture (measuring needs no token ids)")
    elif level != "tokens" or not llm.get("ok", True):
        pf.add("server's engine", FAIL, f"the Harbor server's engine {url} captures {level}, not tokens",
               "restart vLLM with --return-tokens-as-token-ids --logprobs-mode processed_logprobs, then the server")
    elif (engine.hostname, engine.port) != (ours.hostname, ours.port):
        pf.add("server's engine", WARN if args.allow_engine_mismatch else FAIL, f"the Harbor server samples from {url}"
               f", the trainer pushes to {args.vllm_url}", "point both at one vLLM, or pass --allow-engine-mismatch")
    else:
        pf.add("server's engine", PASS, f"{url}: tokens, the vLLM the trainer updates")


def check_session_slots(pf: Preflight) -> None:
    """Taken and released. Held-out evals run beside training's rollouts, each with up to --max-inflight at once."""
    args = pf.args
    needed = args.max_inflight * (2 if args.eval_tasks and not args.measure else 1)
    sessions = [HarborServerSession(args.harbor_url, timeout_s=30) for _ in range(needed)]
    try:
        for opened, session in enumerate(sessions):
            session.open()
        pf.add("session slots", PASS, f">= {needed} free")
    except (OSError, RuntimeError) as exc:
        pf.add("session slots", FAIL, f"only {opened} free session slots of the {needed} --max-inflight (x2 with "
               f"--eval-tasks) needs ({exc})", f"restart the Harbor server with MAX_CONCURRENT_ENVS={2 * needed}")
    finally:
        for session in sessions:
            session.close()


def check_dataset(pf: Preflight, splits: list[dict[str, Any]]) -> None:
    args, names = pf.args, [s["name"] for s in splits]
    # A server started on a local copy of the default suite names its split by path.
    default_copy = names[0] if len(names) == 1 and args.dataset == DEFAULT_DATASET else ""
    split = args.split or (args.dataset if args.dataset in names else default_copy)
    if split not in names:
        pf.add("dataset", FAIL, f"the Harbor server does not serve {args.split or args.dataset!r}; it serves: "
               f"{', '.join(names) or 'nothing'}", f"start it with --dataset {args.dataset}, or pass --split")
    elif error := splits[names.index(split)].get("error"):
        pf.add("dataset", FAIL, f"the Harbor server could not load {split!r}: {error}")
    else:
        pf.add("dataset", PASS, f"{split} ({splits[names.index(split)].get('num_tasks', '?')} tasks)")
        pf.plan["split"] = split


def fetch_catalogue(harbor_url: str, split: str, page: int = 500) -> list[dict[str, Any]]:
    with contextlib.closing(HarborEnv(base_url=harbor_url)) as client:
        total = client.num_tasks(split)
        return [t.model_dump() for start in range(0, total, page)
                for t in client.get_task_range(split, start, min(start + page, total))]


def check_tasks(pf: Preflight, catalogue: list[dict[str, Any]]) -> None:
    args, split = pf.args, pf.plan["split"]
    if args.tasks == DEFAULT_TASKS and split != DEFAULT_DATASET and args.dataset != DEFAULT_DATASET:
        pf.add("tasks", FAIL, f"--tasks: the default task list is for {DEFAULT_DATASET}",
               f"give the tasks of {split!r} (e.g. --tasks 0-99)")
        return
    try:
        pf.plan["tasks"] = tasks = resolve_tasks(read_task_spec(args.tasks), catalogue)
    except UsageError as exc:
        pf.add("tasks", FAIL, str(exc))
        return
    more = ", ..." if len(tasks) > 5 else ""
    pf.add("tasks", PASS, f"{len(tasks)}: {', '.join(t['task_name'] for t in tasks[:5])}{more}")


def check_eval_tasks(pf: Preflight, catalogue: list[dict[str, Any]]) -> None:
    args = pf.args
    try:
        pf.plan["eval_tasks"] = tasks = resolve_tasks(read_task_spec(args.eval_tasks), catalogue)
    except UsageError as exc:
        pf.add("eval tasks", FAIL, str(exc).replace("--tasks", "--eval-tasks", 1))
        return
    every = f", every {args.eval_steps} steps" if args.eval_steps else ""
    pf.add("eval tasks", PASS, f"{len(tasks)} x {args.eval_k} rollouts, before training{every} and after it")


# e2b refuses a lifetime beyond the plan's with a plain SandboxException (400), told apart by its text alone.
E2B_LIFETIME_REFUSED = "Timeout cannot be greater than"
# A sandbox plan refusing Harbor's sandboxes, by the e2b SDK exception type Harbor records: (what it did, the fix).
PLAN_REFUSALS = {
    "RateLimitException": ("refused another sandbox (429): the plan's concurrent-sandbox limit",
                           "lower --max-inflight"),
    "ServiceBusyException": ("had no capacity for a sandbox (503)", "retry later; nothing was started"),
    "AuthenticationException": ("refused the API key (401)", "set a valid E2B_API_KEY where the Harbor server runs"),
    "SandboxNotRunningException": ("ended the sandbox mid-rollout", "lower --agent-timeout to the plan's lifetime"),
    E2B_LIFETIME_REFUSED: ("refused the sandbox's lifetime (400): Harbor asks 24 h for every e2b sandbox",
                           "a plan whose sandboxes may live 24 h (e2b Pro)"),
}


def check_probe_rollout(pf: Preflight) -> None:
    """One real rollout, scored by the verifier: proves sandbox, harness, capture URL and reward key end to end."""
    args, task = pf.args, pf.plan["tasks"][0]
    key = args.reward_key or "reward"
    if not args.probe_rollout:
        pf.add("reward key", SKIP, f"{key!r}: not probed (`--check --probe-rollout` runs one rollout to confirm it)")
        return
    t0 = time.monotonic()
    try:
        with contextlib.closing(HarborServerSession(args.harbor_url, rollout_budget_s(args.agent_timeout))) as client:
            r = client.run_rollout(split=pf.plan["split"], task_index=int(task["index"]), harness=args.harnesses[0],
                                   sandbox=args.sandbox, reward_key=args.reward_key,
                                   agent_timeout_sec=args.agent_timeout, agent_step_limit=args.agent_step_limit,
                                   sampling={"temperature": args.temperature})
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the rest of the table still matters
        pf.add("probe rollout", FAIL, f"{task['task_name']}: {type(exc).__name__}: {exc}")
        return
    failure = judge_rollout(r, task["task_name"], require_tokens=not args.measure, reward_key=args.reward_key)
    if failure is not None and failure.kind == "reward_key":
        pf.add("reward key", FAIL, failure.message, "pass one of those to --reward-key (a list is tried in order)")
        return
    if r.reward is not None:
        pf.add("reward key", PASS, f"{key!r} = {r.reward:g} ({', '.join(sorted(r.rewards)) or 'none'} emitted)")
    where = f"{task['task_name']} in {time.monotonic() - t0:.0f}s, {r.n_turns} turns"
    lifetime = r.exception_type == "SandboxException" and E2B_LIFETIME_REFUSED in (r.error or "")
    refused = PLAN_REFUSALS.get(E2B_LIFETIME_REFUSED if lifetime else r.exception_type or "")
    if failure is not None and refused:
        pf.add("probe rollout", FAIL, f"{where}: {args.sandbox} {refused[0]} ({r.exception_type}: "
               f"{' '.join((r.error or '').split())[:300]})", refused[1])
    elif failure is not None:
        pf.add("probe rollout", FAIL, f"{where}: {failure.message[:500]}",
               f"read the agent log tail: {r.agent_log_tail[-200:]!r}" if r.agent_log_tail else "")
    elif pf.add("probe rollout", PASS if r.rollout_type == "train" else FAIL,
                f"{where}, {r.rollout_type} tier, {r.n_trainable_tokens} trainable tokens") and r.n_turns:
        pf.amend("capture URL", f"the probe rollout's harness reached it ({r.n_turns} model calls)", PASS)


def preflight(args: argparse.Namespace, server: EmbeddedHarborServer | None = None) -> tuple[int | None, dict]:
    """Every row in the order `--check` prints them: (Preflight.verdict's exit code, the plan training takes). The
    rows that need no server run even while vLLM is down; a row whose input an earlier FAIL took away is left out."""
    pf, training = Preflight(args, server), not args.measure
    check_output_dir(pf)
    if training and pf.writable:
        check_resume(pf)
    spec_read = check_task_spec(pf)
    if training:
        pf.add("GRPO", PASS, f"{args.num_generations} generations per group, {args.max_inflight} rollouts in flight")
        report = check_vllm_reachable(pf)
    else:  # measuring samples through the Harbor server's own engine and loads no weights: no vLLM or trainer rows
        pf.add("measure", PASS, f"{args.eval_k} rollouts per task, {args.max_inflight} in flight; no trainer")
    if pf.served is not None:
        check_served_model(pf)
        check_capture_tier(pf, report)
        check_tool_calls(pf, report)
        check_weight_transfer(pf)
        if pf.vllm_config is not None:
            check_vllm_on_loopback(pf)
        if pf.ipc:
            check_trainer_ranks(pf)
        check_dtype(pf)
        if pf.vllm_config is not None and args.use_peft:
            check_lora_engine(pf)
        check_context(pf)
    if training:
        if args.use_peft:
            check_lora_targets(pf)
        check_precision(pf)
        check_checkpoints(pf)
        check_trainer_gpu(pf)
        if pf.ipc:
            check_same_gpu(pf)
        check_attention_kernel(pf)
        check_trainer_memory(pf)
    reachable = True  # the sandboxes start and reach the capture proxy, as far as this process can tell
    if server is not None:
        reachable = check_credentials(pf)
        reachable = check_capture_url(pf) and reachable
    found = None
    if training and pf.served is None:
        pf.add("Harbor server", SKIP, "not checked: vLLM must answer first (the server samples from it)")
    elif pf.writable and reachable and spec_read:
        found = check_harbor_server(pf)
    if found is not None:
        splits, capabilities = found
        if server is not None:
            reachable = check_capture_reached(pf)
        check_harness(pf, capabilities)
        check_sandbox(pf, capabilities)
        check_servers_engine(pf, capabilities)
        check_session_slots(pf)
        check_dataset(pf, splits)
    if "split" in pf.plan:
        catalogue = fetch_catalogue(args.harbor_url, pf.plan["split"])
        check_tasks(pf, catalogue)
        if "tasks" in pf.plan and args.eval_tasks and training:
            check_eval_tasks(pf, catalogue)
    if "tasks" in pf.plan and reachable:
        check_probe_rollout(pf)
    return pf.verdict(), pf.plan


# --- Measure and curate: pass rates per task, and the tasks that can teach --------------------------------------------
PASS_RATE_COLUMNS = ["task", "index", "harness", "sandbox", "k", "solved", "pass_rate", "mean_reward", "mean_turns",
                     "mean_wall_s", "errors"]


def measure_pass_rates(args: argparse.Namespace, plan: dict[str, Any], tasks: list[dict[str, Any]],
                       step: int | None = None) -> list[dict[str, Any]]:
    """--eval-k rollouts per task and harness -> pass_rates.csv, or eval.csv for held-out eval `step`: a row per task
    measured in full. A stop, --max-consecutive-failures or Ctrl-C (raised again in a held-out eval) cuts it short."""
    factory = HarborSessionFactory(
        **session_settings(args), sampling=training_sampling({"temperature": args.temperature}), require_tokens=False,
        # A token-capturing engine samples exactly as in training; any other (a hosted model) at the same temperature.
        eval_sampling=(None if plan["llm"].get("capture_level") == "tokens"
                       else {"temperature": args.temperature, "top_p": 1.0}),
        record_path=os.path.join(args.output_dir, "eval_rollouts.jsonl"),
        label="group" if step is None else "held-out eval", record_fields=None if step is None else {"step": step})
    units = [row["prompt"] for row in task_rows(tasks, plan["split"], args.harnesses)]
    outcomes: list[list[HarborSession]] = [[] for _ in units]

    def run(unit: int) -> None:
        session = factory.create(units[unit], unit)
        try:
            session.wait_for_completion()
            if not session._client.closed:  # closed by a stop: abandoned, no outcome
                factory.record_outcome(session)
                outcomes[unit].append(session)
        finally:
            session.close()

    def stop_requested() -> str | None:  # during training a signal only takes note (StopRequest): seen here
        return f"stopped by {STOP.signal_name}" if STOP.deferred and STOP.signal_name is not None else None

    stop_reason = stop_requested()  # one already under way: no sandbox is started for nothing
    pool = ThreadPoolExecutor(max_workers=args.max_inflight, thread_name_prefix="harbor-eval")
    running = set() if stop_reason else {pool.submit(run, unit) for unit in range(len(units))
                                         for _ in range(args.eval_k)}
    try:
        while running and stop_reason is None:
            finished, running = wait_futures(running, timeout=1.0, return_when=FIRST_COMPLETED)
            for future in finished:
                try:
                    future.result()
                except RolloutsFailing as exc:  # record_outcome: --max-consecutive-failures reached
                    stop_reason = str(exc)
            if stop_reason is None and running:
                stop_reason = stop_requested()
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C; SIGTERM before training
        stop_reason = "interrupted"
        if step is not None:
            raise
    finally:
        if stop_reason is not None:  # the queued rollouts never start; those in flight release their server slots
            pool.shutdown(wait=False, cancel_futures=True)
            factory.close_sessions()
        pool.shutdown(wait=True, cancel_futures=True)
    if stop_reason:
        print(redact(f"[eval] stopped early ({stop_reason})"), file=sys.stderr, flush=True)
    rows = [{"step": step, **pass_rate_row(units[unit][0], args.sandbox, sessions)}
            for unit, sessions in enumerate(outcomes) if len(sessions) == args.eval_k]
    path = Path(args.output_dir) / ("pass_rates.csv" if step is None else "eval.csv")
    new = step is None or not path.is_file()
    with open(path, "w" if new else "a", newline="") as f:
        writer = csv.DictWriter(f, ([] if step is None else ["step"]) + PASS_RATE_COLUMNS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerows(rows)
    return rows


def pass_rate_row(prompt: dict[str, Any], sandbox: str, sessions: list[HarborSession]) -> dict[str, Any]:
    scored = [s.result for s in sessions if s.failure is None]
    means = {column: round(sum(getattr(r, field) for r in scored) / len(scored), 4) if scored else ""
             for column, field in [("pass_rate", "solved"), ("mean_reward", "reward"), ("mean_turns", "n_turns"),
                                   ("mean_wall_s", "wall_s")]}
    return {"task": prompt["harbor_task_name"], "index": prompt["harbor_task_index"],
            "harness": prompt["harbor_harness"], "sandbox": sandbox, "k": len(sessions),
            "solved": sum(r.solved for r in scored), "errors": len(sessions) - len(scored), **means}


def tally(rows: list[dict[str, Any]]) -> tuple[int, int, int]:
    """(solved, scored, errors) over `rows`, measured or read from a CSV."""
    errors = sum(int(r["errors"]) for r in rows)
    return sum(int(r["solved"]) for r in rows), sum(int(r["k"]) for r in rows) - errors, errors


def pass_rates_by_task(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Task -> pass rate over its scorable rollouts under every harness; None when none was scorable."""
    tallies = {task: tally([r for r in rows if r["task"] == task]) for task in dict.fromkeys(r["task"] for r in rows)}
    return {task: solved / scored if scored else None for task, (solved, scored, _) in tallies.items()}


def held_out_eval(args: argparse.Namespace, plan: dict[str, Any], step: int) -> dict[str, float]:
    """--eval-tasks on step `step`'s weights -> eval.csv rows and eval/* metrics; one cut short logs no eval/pass_rate:
    a rate over another task set compares with no other step's."""
    rows = measure_pass_rates(args, plan, plan["eval_tasks"], step)
    solved, scored, errors = tally(rows)
    planned = len(plan["eval_tasks"]) * len(args.harnesses)
    metrics = {f"eval/{task}/pass_rate": rate for task, rate in pass_rates_by_task(rows).items() if rate is not None}
    metrics |= {"eval/tasks": planned, "eval/tasks_measured": len(rows)}
    if len(rows) < planned:
        units = "tasks" if len(args.harnesses) == 1 else "task-harness pairs"
        say(f"[harbor] eval at step {step} cut short: {len(rows)} of {planned} held-out {units} measured in full, "
            f"so no eval/pass_rate; {errors} errors")
        return metrics
    if scored:
        metrics["eval/pass_rate"] = solved / scored
        metrics["eval/mean_reward"] = sum((r["mean_reward"] or 0) * (r["k"] - r["errors"]) for r in rows) / scored
    rate = f"{solved / scored:.2f} ({solved}/{scored})" if scored else "- (0/0)"
    say(f"[harbor] eval at step {step}: pass rate {rate} on {len(plan['eval_tasks'])} held-out tasks, {errors} errors "
        "(eval.csv)")
    return metrics


def whole_eval(entry: dict[str, Any]) -> bool:
    """A log entry of a held-out eval that measured every planned task."""
    return "eval/tasks" in entry and entry.get("eval/tasks_measured") == entry["eval/tasks"]


def eval_budget_s(args: argparse.Namespace, tasks: int) -> float:
    """Waves of --max-inflight rollouts, each within its rollout budget after up to --harbor-retry-window's wait."""
    waves = math.ceil(tasks * len(args.harnesses) * args.eval_k / args.max_inflight)
    return waves * (rollout_budget_s(args.agent_timeout) + args.harbor_retry_window)


def curate(args: argparse.Namespace, source: str) -> None:
    """The tasks of a pass_rates.csv inside --band -> a --tasks file; prints the expected share of groups of G whose
    rewards vary, 1 - p^G - (1-p)^G, before and after."""
    try:
        rows = list(csv.DictReader(Path(source).read_text().splitlines()))
    except OSError as exc:
        raise UsageError(f"--curate {source}: cannot read it ({exc.strerror}); give a pass_rates.csv written by "
                         "--eval-only, or a bare --curate to measure first") from None
    missing = {"task", "k", "solved", "errors"} - set(rows[0] if rows else {})
    if not rows or missing:
        raise UsageError(f"--curate {source}: not a pass_rates.csv written by --eval-only "
                         f"({'no rows' if not rows else 'no column ' + ', '.join(sorted(missing))})")
    (low, high), g = args.band, args.num_generations
    rates = pass_rates_by_task(rows)
    measured = {t: p for t, p in rates.items() if p is not None}
    inside = [t for t, p in measured.items() if low <= p <= high]
    out = Path(args.curated_tasks or os.path.join(args.output_dir, "curated_tasks.txt"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# Learnable tasks: pass rate in [{low:g}, {high:g}] (solved sometimes, not always).\n"
                   f"# Source: {source}\n# Written: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC} by "
                   f"async_grpo_harbor.py --curate; use it as --tasks @{out}\n" + "".join(f"{t}\n" for t in inside))

    def varied(tasks: list[str]) -> str:
        return f"{sum(1 - rates[t] ** g - (1 - rates[t]) ** g for t in tasks) / len(tasks):.1%}" if tasks else "-"

    print_table(f"curate (band {low:g}-{high:g})", {
        "tasks": f"{sum(p < low for p in measured.values())} below the band, {len(inside)} inside (kept), "
                 f"{sum(p > high for p in measured.values())} above, {len(rates) - len(measured)} unmeasured",
        f"groups with reward variance (G={g})": f"{varied(list(measured))} on all measured tasks, "
                                                  f"{varied(inside)} on the curated",
        "written": f"{out} ({len(inside)} tasks)" if inside else f"{out}, listing none: --tasks @{out} is refused",
    })


def run_measure(args: argparse.Namespace, plan: dict[str, Any]) -> int:
    """--eval-only, with a bare --curate after it: no trainer, no weights, no torch."""
    print_hyperparameters(args, plan)
    rows = measure_pass_rates(args, plan, plan["tasks"])
    solved, scored, errors = tally(rows)
    units = len(plan["tasks"]) * len(args.harnesses)
    path = Path(args.output_dir) / "pass_rates.csv"
    say(f"[eval] {len(rows)} of {units} tasks measured in full, {solved}/{scored} solved, {errors} errors: {path}")
    if args.curate == "" and rows:
        curate(args, str(path))
    return 0 if len(rows) == units else 1


# --- Trainer ----------------------------------------------------------------------------------------------------------
# A group's size on each sample: FreshestGroupFirst tells a whole group from one whose last samples are on their way.
GROUP_SAMPLES = "harbor_group_samples"
GROUPS_FILE = "groups.jsonl"  # in the output dir: how each group settled, which a checkpoint's resume order reads


class HarborRolloutLoop(_HarnessRolloutLoop):
    """TRL's harness loop, in its rollout child: rewards shaped, zero-variance groups kept out (unless
    --max-zero-variance-groups 0), and a run of them a NoSignal stop."""

    def __init__(self, *, efficiency_weight: float, max_zero_variance_groups: int,
                 harness_session_factory: Callable[..., Any], metrics_queue: Any, failed_event: Any,
                 exception_info_queue: Any, groups_path: str = "", **loop_kwargs: Any):
        self.failed_event, self.failures = failed_event, exception_info_queue  # TRL's failure channel
        factory = functools.partial(self.build_factory, harness_session_factory, metrics_queue)
        super().__init__(harness_session_factory=factory, metrics_queue=metrics_queue, failed_event=failed_event,
                         exception_info_queue=exception_info_queue, **loop_kwargs)
        self.efficiency_weight, self.groups_path = efficiency_weight, groups_path
        self.max_zero_variance_groups = max_zero_variance_groups
        self.flat_run: list[bool] = []  # zero-variance groups since the last group with variance: all solved?
        self.solved_any = False  # a scored rollout of this launch solved its task: a later run of none is a fall

    def build_factory(self, build: Callable[..., Any], metrics_queue: Any, **kwargs: Any) -> Any:
        self.factory = build(**kwargs)
        self.factory.metrics_queue = metrics_queue  # each rollout's metrics join TRL's
        return self.factory

    # private: TRL's one step from a scored group to samples; no public hook shapes a group's rewards
    async def _score_group(self, group):
        group.rollout_rewards = shape_group_rewards(group.rollout_rewards, self.efficiency_weight)
        samples = await super()._score_group(group)
        for sample in samples:
            sample.metrics[GROUP_SAMPLES] = len(samples)
        if self.stop_event.is_set():
            return samples  # cut short by the stop (its unfinished rollouts are empty): no group to count or settle
        rewards = [r for r in group.rollout_rewards if r is not None]
        zero = bool(rewards) and zero_variance(rewards)
        self.solved_any = self.solved_any or any(r > 0 for r in rewards)
        kept_out = zero and self.max_zero_variance_groups > 0
        if self.groups_path:  # how each group settled: a resume runs no group settled other than with samples
            task = group.prompts[0][0]
            record = {"time": time.time(), "group": group.group_id, "visit": self.dataset.visit(group.group_id),
                      "task": task["harbor_task_name"], "harness": task["harbor_harness"],
                      "outcome": "no_scorable" if not rewards else "zero_variance" if kept_out else "samples"}
            with open(self.groups_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        # private: TRL's metric accumulators (_counters, _rates), pushed with its own; no public call adds a metric
        counters, rates = self._counters, self._rates
        counters["harbor/groups_total"] += 1
        if not rewards:
            counters["harbor/not_trained/no_scorable_groups_total"] += 1
            return samples  # none scorable, so no samples: --max-consecutive-failures watches these
        keys = ["harbor/zero_variance_frac"]
        if self.factory.split_by_harness:
            keys.append(f"harbor/{group.prompts[0][0]['harbor_harness']}/zero_variance_frac")
        for key in keys:
            rates[key][0] += zero
            rates[key][1] += 1
        counters["harbor/zero_variance_groups_total"] += zero
        if not zero:
            self.flat_run = []
            return samples
        counters["harbor/not_trained/zero_variance_groups_total"] += kept_out
        self.factory._say(f"[harbor] group {group.group_id}: zero variance, every scored rollout {rewards[0]:g}: "
                          + ("kept out of training" if kept_out else "trained at advantage 0"))
        if not kept_out:
            return samples
        self.flat_run.append(rewards[0] > 0)
        if len(self.flat_run) >= self.max_zero_variance_groups:
            solved = sum(self.flat_run)
            # A policy that solved tasks earlier and now solves none has collapsed (measured: an lr too high for it).
            fix = "Train on tasks curated by --eval-only --curate, or raise --max-zero-variance-groups"
            if self.solved_any and not solved:
                fix = ("Earlier groups of this run solved tasks, so the policy may have collapsed: resume from a "
                       "checkpoint before the fall (--resume PATH; the step lines' solve rate shows when) with a lower "
                       "--learning-rate")
            self.stop(NoSignal(
                f"the last {len(self.flat_run)} groups each scored all their rollouts alike ({solved} solved by every "
                f"rollout, {len(self.flat_run) - solved} by none): no advantage to learn from. {fix}"))
        return []

    def stop(self, reason: TrainingStopped) -> None:
        """Ends the child's loops; the trainer's check_health raises `reason` (stop_from_child), with no traceback."""
        self.failures.put_nowait((type(reason).__name__, str(reason), ""))
        self.failed_event.set()
        self.stop_event.set()

    # private: where TRL's child runs its loops; what leaves it, TRL's run() prints with three tracebacks
    async def _run_loops(self, stop_event) -> None:
        self.stop_event = stop_event
        try:
            await super()._run_loops(stop_event)
        except ValueError as exc:
            stop = exc if isinstance(exc, TrainingStopped) else exc.__cause__  # TRL's CaptureContractError wraps it
            if not isinstance(stop, TrainingStopped):
                raise
            self.stop(stop)
            # TRL's gather leaves the generate loop running: closing the event loop under it prints a traceback.
            others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)


def read_only(*queues: Any) -> None:
    """Closes the trainer's write ends of the child's queues: else a dead child's pipe never reads as closed."""
    for q in queues:
        q._writer.close()  # private: mp.Queue has no public way to close its write end


class ChildQueue:
    """A queue the rollout child writes (`read_only`), which reads as empty once the child is gone."""

    def __init__(self, mp_queue: Any):
        self.mp_queue = mp_queue

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        try:
            return self.mp_queue.get(block, timeout)
        except (EOFError, OSError):  # the child is gone; OSError: in the middle of an item (connection._recv)
            if block and timeout:
                time.sleep(timeout)  # the wait a live child's empty queue would have taken
            raise queue.Empty from None

    def get_nowait(self) -> Any:
        return self.get(block=False)

    def qsize(self) -> int:
        return self.mp_queue.qsize()


class FreshestGroupFirst(ChildQueue):
    """The rollout queue TRL's dataset reads, one sample per `get`: first one past --max-staleness (TRL drops it), then
    the rest of the group under way (a group's samples share a micro-batch), then the newest group with a non-zero
    advantage, then the newest other; ties in the order scored. TRL's order, the order scored, trains old and
    zero-variance groups while fresher ones with a signal wait."""

    def __init__(self, mp_queue: Any, version: Callable[[], int], max_staleness: int):
        super().__init__(mp_queue)
        self.version, self.max_staleness = version, max_staleness
        self.held: list[Any] = []  # taken from the child's queue and not handed over yet, in the order scored
        self.missing: dict[int, int] = {}  # group -> how many of its samples have not arrived yet
        self.group: int | None = None  # the group being handed over

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        self.take_arrived()
        while not self.held or (self.group in self.missing and all(s.group_id != self.group for s in self.held)):
            self.arrive(super().get(block, timeout))  # waits as TRL asked; raises queue.Empty as it expects
            self.take_arrived()
        now, held = self.version(), range(len(self.held))
        stale = [i for i in held if now - self.held[i].model_version > self.max_staleness]
        current = [i for i in held if self.held[i].group_id == self.group]
        if stale or current:
            first = (stale or current)[0]
        else:
            signal = {s.group_id for s in self.held if s.advantage != 0}
            first = max(held, key=lambda i: (self.held[i].group_id in signal, self.held[i].model_version))  # ties: 1st
            self.group = self.held[first].group_id
        return self.held.pop(first)  # by index: a sample's numpy fields make == between samples ambiguous

    def arrive(self, sample: Any) -> None:
        group, size = sample.group_id, sample.metrics.pop(GROUP_SAMPLES, 1)
        left = self.missing.get(group, size) - 1
        if left > 0:
            self.missing[group] = left
        else:
            self.missing.pop(group, None)
        self.held.append(sample)

    def take_arrived(self) -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                self.arrive(super().get(block=False))

    def qsize(self) -> int:
        return len(self.held) + super().qsize()


def stop_rollout_worker(worker: Any, timeout_s: float = 30.0) -> None:  # a loaded machine's child took over 10 s
    """TRL's `stop()` without its hangs (a child that cannot exit while its queues are unread, an Event set after the
    child's exit): the queues drain while the child exits, then SIGTERM, then SIGKILL; drained metrics are kept."""
    # private: TRL's worker holds its child only as _process, and its stop Event as _stop_event_mp
    proc, t0, kept = worker._process, time.monotonic(), queue.Queue()

    def drain(seconds: float = 0.0) -> None:
        deadline = time.monotonic() + seconds
        while True:
            for q in (worker.rollout_buffer, worker.metrics_queue):
                with contextlib.suppress(queue.Empty, OSError, EOFError, ValueError):
                    while True:
                        item = q.get_nowait()
                        if q is worker.metrics_queue:
                            kept.put(item)
            if not proc.is_alive() or time.monotonic() >= deadline:
                return
            proc.join(timeout=0.05)

    if proc is None or proc.pid is None:  # stopped, or never started
        return
    if proc.is_alive():
        threading.Thread(target=worker._stop_event_mp.set, daemon=True).start()
        drain(timeout_s)
    if proc.is_alive():
        say(f"[harbor] rollout worker still running after {timeout_s:g}s: terminating it")
        proc.terminate()
        drain(15.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    else:
        say(f"[harbor] rollout worker exited on its own in {time.monotonic() - t0:.1f}s (exit code {proc.exitcode})")
    drain()  # what the child flushed as it exited
    worker._process, worker.metrics_queue = None, kept


class Preempted(BaseException):
    """A stop where training loses no step; like SystemExit, no `except Exception` on the way out swallows it."""


class StopRequest:
    """SIGTERM / SIGUSR1 (SLURM's preemption notice, scancel, `kill`): checkpoint, exit for a requeue. Once training
    runs, the handler only takes note: unwinding could leave vLLM paused mid weight sync or a step half applied."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.deferred = False
        self.resume_command = "the same command"

    def handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        # os.write: the main thread may be inside a print. Rank 0 alone speaks: a launcher signals every rank.
        say = (lambda text: os.write(1, text.encode())) if launch_rank() == 0 else (lambda text: None)
        if self.signal_name is not None:
            say(f"[harbor] {name} again: already stopping\n")
            return
        self.signal_name = name
        if not self.deferred:
            say(f"[harbor] stopped by {name} before training started: nothing to save; exit code "
                f"{REQUEUE_EXIT_CODE} (requeue). Resume: {self.resume_command}\n")
            raise SystemExit(REQUEUE_EXIT_CODE)
        say(f"[harbor] {name}: stopping at the end of this optimizer step (sooner if it is waiting for rollouts) to "
            "save a checkpoint\n")


STOP = StopRequest()


def resume_command(argv: list[str], output_dir: str) -> str:
    """The same arguments with `--resume auto` in this output dir."""
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


def save_for_requeue(trainer: Any, args: argparse.Namespace) -> int:
    """Checkpoints the last optimizer step unless a checkpoint holds it; every rank calls it, a save is collective."""
    step = trainer.state.global_step
    checkpoint = Path(args.output_dir) / f"checkpoint-{step}"
    # Rank 0 decides for all: ranks that judged the files apart could split into a save and no save.
    save = bool(step) and trainer.accelerator.is_main_process and checkpoint_problem(checkpoint) is not None
    if broadcast_object_list([save], from_process=0)[0]:
        # private: transformers writes a resumable checkpoint (optimizer, RNG, state) only in _save_checkpoint
        trainer._save_checkpoint(trainer.model_wrapped, trial=None)
        trainer.complete_checkpoint()
    name = STOP.signal_name or "a stop on rank 0"
    if not trainer.accelerator.is_main_process:
        say(f"[harbor] rank {trainer.accelerator.process_index}: stopped with rank 0 by {name}; exit code "
            f"{REQUEUE_EXIT_CODE}")
        return REQUEUE_EXIT_CODE
    saved = "no optimizer step yet, nothing to save"
    if step:
        ranks = trainer.accelerator.num_processes
        rollout = json.loads((checkpoint / "rollout_state.json").read_text())
        saved = (f"checkpoint {checkpoint} (step {step}{f', all {ranks} ranks' if ranks > 1 else ''}); a resume "
                 f"runs its {len(rollout['pending'])} untrained groups first, then tasks from position "
                 f"{rollout['prompt_index']}")
    say(f"[harbor] stopped by {name}: {saved}; exit code {REQUEUE_EXIT_CODE} (requeue). Resume: "
        f"{STOP.resume_command}")
    return REQUEUE_EXIT_CODE


class VisitOrder:
    """The rows TRL's worker visits, a group each: first the groups a stopped run left untrained (`pending`, as visit
    numbers: visit n is row n % len(rows)), then every row from visit `start` on; later passes in the plain order."""

    def __init__(self, rows: Any, pending: list[int], start: int):
        self.rows, self.pending, self.start = rows, list(pending), start
        self.passes = 0

    def __iter__(self):
        first, self.passes = self.passes == 0, self.passes + 1
        n = len(self.rows)
        rows = [v % n for v in self.pending] + list(range(self.start % n, n)) if first else range(n)
        return (self.rows[i] for i in rows)

    def visit(self, group: int) -> int:  # TRL counts groups from 0 at every launch
        return self.pending[group] if group < len(self.pending) else self.start + group - len(self.pending)

    def after(self, seen: int, done: set[int]) -> tuple[list[int], int]:
        """A resume's order when this launch's groups below `seen` may have been taken and `done` need no rerun."""
        pending = [self.visit(g) for g in range(seen) if g not in done] + self.pending[seen:]
        return pending, self.start + max(0, seen - len(self.pending))


STOP_BATCH = "harbor_stop"  # the key of the batch that carries a stop to every rank (get_train_dataloader)


def stop_batch_on_preempt(batches, num_processes: int):
    try:
        yield from batches
    except Preempted:
        yield {STOP_BATCH: torch.ones(num_processes)}  # one row per rank: accelerate splits a batch across ranks


IPC_CHUNK_BYTES = 1 << 30  # bytes per POST /update_weights, as vLLM's own IPC trainer stages


class WeightTransferRefused(RuntimeError):
    """vLLM refused a weight push for a reason fixed where vLLM runs."""


class CudaIpcWeightTransfer(WeightTransferClient):
    """TRL's weight transfer over vLLM's `ipc` backend, for vLLM on the trainer's GPU (where NCCL refuses a second
    rank): chunks of CUDA-IPC handles. Not TRL's __init__: it needs vLLM installed here."""

    def __init__(self, vllm_url: str, weight_sync_timeout: float, chunk_bytes: int = IPC_CHUNK_BYTES):
        self.vllm, self.weight_sync_timeout, self.chunk_bytes = VLLMClient(vllm_url), weight_sync_timeout, chunk_bytes
        self.model_update_group, self.sent = None, []

    def init_weight_transfer(self) -> None:
        self.vllm.wait_for_server_ready()
        # The unpacked form, a handle per tensor: the empty init_info of vLLM 0.26 and 0.29, whose packed forms differ.
        self.vllm.init_weight_transfer_engine({}, timeout=self.weight_sync_timeout)

    def send_weights(self, iterator) -> None:
        self.vllm.start_weight_update(timeout=self.weight_sync_timeout)
        # CUDA IPC: the sender keeps each tensor until vLLM's finish_weight_update; the memory row counts `sent`.
        self.sent, chunk, size = [], [], 0
        try:
            for name, tensor in iterator:
                tensor = tensor.detach().contiguous()  # a parameter goes as it is, zero-copy, in its own dtype
                if chunk and size + tensor.nbytes > self.chunk_bytes:
                    self.update(chunk)
                    chunk, size = [], 0
                chunk.append((name, tensor))
                self.sent.append(tensor)
                size += tensor.nbytes
            if chunk:
                self.update(chunk)
        except Exception as exc:
            with contextlib.suppress(Exception):  # best effort, as TRL's client: the error below matters
                self.vllm.finish_weight_update(timeout=self.weight_sync_timeout)
            self.sent = []
            if found := re.search(r"IPC handle not found for GPU UUID ([\w-]+)", str(exc)):
                raise WeightTransferRefused(
                    f"vLLM runs on another GPU than the trainer ({found[0]}). Start this script with "
                    f"CUDA_VISIBLE_DEVICES=GPU-{found[1].lower().removeprefix('gpu-')}") from exc
            answer = " ".join(str(exc).split())[:300]  # vLLM 0.26 answers a refused push with a bare 500
            raise WeightTransferRefused(
                f"weight push to vLLM at {self.vllm.server_url} over CUDA IPC failed ({answer}); the cause is in "
                "vLLM's server log; most likely vLLM runs on another GPU than the trainer, or without its ipc "
                "settings: run it on the trainer's GPU, started as VLLM_SERVER_DEV_MODE=1 "
                "VLLM_ALLOW_INSECURE_SERIALIZATION=1 vllm serve ... --weight-transfer-config '{\"backend\":\"ipc\"}'"
            ) from exc
        self.vllm.finish_weight_update(timeout=self.weight_sync_timeout)
        self.sent = []
        torch.cuda.ipc_collect()  # the copies dropped, once vLLM unmapped them, back to the allocator now

    def update(self, chunk: list[tuple[str, torch.Tensor]]) -> None:
        torch.cuda.synchronize()  # vLLM reads the memory from its own process: every queued copy must have landed
        # vLLM looks each handle up by its own device's str(uuid) and rebuilds it from reduce_tensor's args alone.
        handles = [{str(torch.cuda.get_device_properties(t.device).uuid):
                    torch.multiprocessing.reductions.reduce_tensor(t)[1]} for _, t in chunk]
        self.vllm.update_weights({
            "names": [name for name, _ in chunk], "shapes": [list(t.shape) for _, t in chunk],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in chunk],
            "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode()}, timeout=self.weight_sync_timeout)


class HarborRolloutWorker(HarnessRolloutWorker):
    """TRL's harness worker, running HarborRolloutLoop in resume order, stopping on a signal (check_health)."""

    _loop_cls = HarborRolloutLoop  # private: TRL's worker starts the loop class named here; no argument names it
    stop = stop_rollout_worker
    pending: list[int] = []  # the untrained groups of the checkpoint resumed from (build_trainer)

    def start(self) -> None:
        # private: TRL's worker holds the child's arguments only as _loop_kwargs (and writes them there itself)
        kw = self._loop_kwargs
        self.order = VisitOrder(kw["dataset"], self.pending, kw["dataset_start_index"])  # TRL's resumed position
        kw.update(dataset=self.order, dataset_start_index=0)
        super().start()
        read_only(self.rollout_buffer, self.metrics_queue)
        self.metrics_queue = ChildQueue(self.metrics_queue)  # TRL's log() reads it

    def check_health(self, stale_after_s: float) -> None:
        # TRL calls this each time the trainer has waited a queue poll for rollouts: a safe point to stop at.
        if STOP.signal_name is not None:
            raise Preempted(STOP.signal_name)
        try:
            super().check_health(stale_after_s)
        except RuntimeError as exc:
            stop = stop_from_child(exc)
            if stop is None:
                raise
            raise stop from None  # the child's reason is the whole story: TRL's wrapping adds nothing to it


class StopAtStepEnd(TrainerCallback):
    """Ends training at the step's end, with a save, once any rank has a stop request; completes each checkpoint;
    resumes at --learning-rate."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, _state, _control, optimizer=None, lr_scheduler=None, **_kwargs):
        # A resume loads the checkpoint's rate with its optimizer and schedule: the flag wins (lowered after a fall).
        base = getattr(lr_scheduler, "base_lrs", None)
        if not base or not base[0] or base[0] == args.learning_rate:  # a fresh start, or an lr-0 run: nothing to scale
            return
        scale = args.learning_rate / base[0]
        for group in optimizer.param_groups:
            group.update({key: group[key] * scale for key in ("lr", "initial_lr") if key in group})
        state = lr_scheduler.state_dict()
        # private: torch's _last_lr, a state_dict key: transformers logs a step's rate from it, before the step
        lr_scheduler.load_state_dict({**state, **{key: [lr * scale for lr in state[key]]
                                                  for key in ("base_lrs", "_last_lr") if key in state}})

    def on_step_end(self, _args, _state, control, **_kwargs):
        trainer = self.trainer
        # A signal may reach some ranks only, or at other times: they agree here, as TRL's epoch stop does.
        asked = torch.tensor(int(STOP.signal_name is not None), device=trainer.accelerator.device)
        if int(trainer.accelerator.reduce(asked, reduction="sum").item()):
            trainer.stop_agreed = control.should_save = control.should_training_stop = True

    def on_save(self, _args, _state, _control, **_kwargs):
        self.trainer.complete_checkpoint()


class HeldOutEval(TrainerCallback):
    """--eval-tasks on rank 0 before the first step, every --eval-steps and at the last, after the step's push; the
    other ranks wait in `group`, a gloo group whose timeout is the eval's budget (eval_budget_s)."""

    def __init__(self, trainer, args: argparse.Namespace, plan: dict[str, Any], group):
        self.trainer, self.args, self.plan, self.group = trainer, args, plan, group

    def run(self, state, control) -> None:
        step, trainer = state.global_step, self.trainer
        # One the resumed checkpoint holds whole is not measured twice; one cut short by the stop is measured again.
        record = next((e for e in state.log_history if e.get("step") == step and whole_eval(e)), None)
        if record is not None:
            trainer.held_out[step] = record.get("eval/pass_rate")
            if trainer.accelerator.is_main_process:
                say(f"[harbor] eval at step {step}: on record in the resumed checkpoint, not measured again")
            return
        if trainer.accelerator.is_main_process:
            if step >= state.max_steps and trainer.rollout_worker is not None:  # the final eval
                trainer.rollout_worker.stop()
                say("[harbor] rollout worker stopped: no training rollout runs beside the final eval")
            metrics = held_out_eval(self.args, self.plan, step)
            if whole_eval(metrics):
                trainer.held_out[step] = metrics.get("eval/pass_rate")
            should_log = control.should_log  # on_log clears it, which would drop the step's own log line
            Trainer.log(trainer, metrics)  # transformers' own: TRL's log() would take the step's metrics too
            control.should_log = should_log
        if self.group is not None:
            dist.barrier(group=self.group)

    def on_train_begin(self, _args, state, control, **_kwargs):
        self.run(state, control)

    def on_step_end(self, _args, state, control, **_kwargs):
        every = self.args.eval_steps
        if state.global_step >= state.max_steps or (every and state.global_step % every == 0):
            self.run(state, control)


class StepLog(Trainer):
    """The step line and the launch's totals. HarborGRPOTrainer's MRO runs its log() between TRL's, which reduced the
    child's metrics into the step's log, and transformers', which records it."""

    def log(self, logs, start_time=None):
        if "loss" in logs and self.accelerator.is_main_process:
            self.step_line(self.state.global_step, logs)
        elif self.accelerator.is_main_process:  # the run's closing log: what TRL counted after the last step
            self.count(logs)
        super().log(logs, start_time)

    def count(self, metrics: dict[str, Any]) -> None:
        self.totals.update({k: v for k, v in metrics.items() if k.endswith("_total") and isinstance(v, float)})

    def step_line(self, step: int, logs: dict[str, Any]) -> None:
        now = time.monotonic()
        elapsed, self.last_step_at = now - self.last_step_at, now
        batches, self.step_batches = self.step_batches, []
        trained = sorted(set().union(*batches) - self.trained_groups)
        self.trained_groups.update(trained)
        samples = sum(sum(groups.values()) for groups in batches)
        (high, low, beyond, tokens, informative), self.terms = self.terms, NO_TERMS
        n = collections.Counter({key.removeprefix("harbor/"): value for key, value in logs.items()
                                 if key.endswith("_total") and value})
        logs |= {"harbor/rollouts_per_min": n["rollouts_total"] / elapsed * 60,
                 "harbor/trained/groups": float(len(trained)), "harbor/trained/samples": float(samples)}
        ratio = signal = ""
        if tokens:
            logs |= {"harbor/trained/informative_token_frac": informative / tokens, "harbor/ratio_max": high,
                     "harbor/ratio_min": low, "harbor/ratio_beyond_bound_frac": beyond / tokens}
            signal = f", {informative / tokens:.0%} with a non-zero advantage"
            ratio = f"; importance ratio {low:.3g}-{high:.3g}, {beyond / tokens:.0%} beyond the bound"
        self.count(logs)
        self.totals.update(trained_tokens=int(tokens), informative_tokens=int(informative))
        scored, rate = int(n["rollouts_total"] - n["errors_total"]), logs.get("harbor/solve_rate")
        frac = logs.get("harbor/zero_variance_frac")
        errors = "".join(f" {kind}={k}" for kind, k in error_kinds(logs).items())
        say(f"[harbor] step {step}: {int(n['groups_total'])} groups finished, "
            f"{int(n['zero_variance_groups_total'])} zero-variance ({'-' if frac is None else f'{frac:.0%}'}); "
            f"{int(n['rollouts_total'])} rollouts ({logs['harbor/rollouts_per_min']:.1f}/min), sandbox "
            f"{n['sandbox_s_total']:.0f}s, solve rate {'-' if rate is None else f'{rate:.2f}'} "
            f"({round((rate or 0) * scored)}/{scored}), errors {int(n['errors_total'])}{errors}; trained "
            f"{len(trained)} groups ({','.join(map(str, trained)) or '-'}), {samples} samples, {tokens:.0f} tokens"
            f"{signal}{ratio}")

    def totals_line(self, unlogged: list[dict[str, Any]]) -> None:
        """Where this launch's rollouts and groups went; `unlogged`: what the rollout child sent after the last log."""
        for metrics in unlogged:
            self.count(metrics)
        t = collections.Counter({key.removeprefix("harbor/"): int(n) for key, n in self.totals.items()})
        groups, reached = t["groups_total"], len(self.trained_groups)
        kept_out, none = t["not_trained/zero_variance_groups_total"], t["not_trained/no_scorable_groups_total"]
        signal = (f", {t['informative_tokens'] / t['trained_tokens']:.0%} with a non-zero advantage"
                  if t["trained_tokens"] else "")
        errors, evals = error_kinds(self.totals), self.held_out

        def rate(step: int) -> str:
            return f"{'-' if evals[step] is None else f'{evals[step]:.2f}'} (step {step})"

        say(f"[harbor] rollouts: {t['rollouts_total']} finished, {t['errors_total']} unscorable; groups: {groups} "
            f"finished, {reached} reached the loss ({t['trained_tokens']} tokens{signal}); not trained: {kept_out} "
            f"zero-variance (kept out), {none} with no scorable rollout, {groups - reached - kept_out - none} dropped "
            f"as stale or left at the stop ({t['sample/dropped_stale_total']} stale samples)"
            + (f"; unscorable: {', '.join(f'{kind} {n}' for kind, n in errors.most_common())}" if errors else "")
            + (f"; held-out pass rate {rate(min(evals))} -> {rate(max(evals))}" if evals else ""))


# A step's loss terms over every rank: ratio max, min, how many beyond --delta, how many, how many with an advantage.
NO_TERMS = (-math.inf, math.inf, 0.0, 0.0, 0.0)


def error_kinds(counts: dict[str, Any]) -> collections.Counter:
    """The unscorable rollouts counted (harbor/errors/<kind>_total), by kind."""
    return collections.Counter({key[14:-6]: int(n) for key, n in counts.items()
                                if key.startswith("harbor/errors/") and key.endswith("_total") and n})


class HarborGRPOTrainer(AsyncGRPOTrainer, StepLog):
    """AsyncGRPOTrainer with this script's accounting, stops, resume order and merged LoRA pushes."""

    def __init__(self, *a, **kw):
        self.last_step_at, self.totals, self.trained_groups = time.monotonic(), collections.Counter(), set()
        self.collated: collections.deque = collections.deque()  # samples per group of each micro-batch collated,
        self.step_batches: list[collections.Counter] = []  # and of those this step trained
        self.terms = NO_TERMS
        self.held_out: dict[int, float | None] = {}  # whole held-out evals: step -> eval/pass_rate
        self.collated_groups, self.stop_agreed = frozenset(), False
        super().__init__(*a, **kw)
        if self.rollout_worker is not None:  # TRL's eos ids (tokenizer's + model's); it sets them only on its own
            self.rollout_worker._loop_kwargs["eos_token_ids"] = self.eos_token_ids  # private: see start()
            self.rollout_queue = FreshestGroupFirst(self.rollout_worker.rollout_buffer,  # TRL's dataset reads it
                                                    lambda: self.model_version, self.args.max_staleness)
        model = self.accelerator.unwrap_model(self.model)
        if is_peft_model(model):
            # PEFT's in-place merge and unmerge drift the bfloat16 base at each push: _streaming_iter sums out of place.
            model.merge_adapter = model.unmerge_adapter = lambda *a, **kw: None

    def train(self, *a, **kw):
        try:
            return super().train(*a, **kw)
        finally:  # TRL's own `finally` has stopped the rollout child, keeping what it sent after the last log
            if self.accelerator.is_main_process:
                unlogged = self.rollout_worker.metrics_queue
                self.totals_line([unlogged.get() for _ in range(unlogged.qsize())])

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        if self.accelerator.is_main_process:  # the only process that collates (accelerate dispatches batches)
            base = getattr(loader, "base_dataloader", loader)
            self.collated_groups = base.collate_fn.groups_trained  # TRL's collator adds each group it collates
            base.collate_fn = functools.partial(self.collate, base.collate_fn)
            # A stop that ends rank 0's wait reaches the ranks waiting in accelerate's broadcast as one more batch.
            # private: torch's DataLoader makes each pass's iterator in _get_iterator; no public hook wraps it
            make = base._get_iterator
            base._get_iterator = lambda: stop_batch_on_preempt(make(), self.accelerator.num_processes)
        return loader

    def collate(self, collate, examples):
        (rows,) = examples  # TRL's collator sees a micro-batch whole: every rank's row
        self.collated.append(collections.Counter(sample["group_id"] for row in rows for sample in row.samples))
        return collate(examples)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, count = super().get_batch_samples(epoch_iterator, num_batches, device)
        if any(STOP_BATCH in batch for batch in batches):
            self.stop_agreed = True
            raise Preempted(STOP.signal_name or "a stop on rank 0")
        return batches, count

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.is_main_process and self.collated:  # accelerate collates one ahead of the step
            self.step_batches.append(self.collated.popleft())
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # Bounded on the way out of the forward, every loss term and TRL's own metrics see the bounded ratio.
        hook = model.register_forward_hook(functools.partial(self.bound_ratio, inputs))
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            hook.remove()

    def bound_ratio(self, inputs, _module, _args, outputs):
        """The dual clip (--delta): TRL clips r = p_trainer / p_engine only where it helps the advantage's sign, so a
        negative-advantage token adds r x |A|, unbounded; capped at delta it adds delta x |A| and no gradient. A packed
        position several samples share gets its lowest bound."""
        selected = inputs["token_index"] >= 0
        index, old = inputs["token_index"][selected], inputs["old_log_probs"][selected]
        log_probs = outputs.log_probs.flatten()
        with torch.no_grad():
            ratio = torch.exp(log_probs[index].float() - old.float())
            extremes = (torch.stack([ratio.max(), -ratio.min()]) if ratio.numel()
                        else torch.full((2,), -math.inf, device=ratio.device))
            high, low = self.accelerator.gather(extremes[None]).amax(0).tolist()
            counts = [(ratio > (self.args.delta or math.inf)).sum(), (inputs["advantages"][selected] != 0).sum(),
                      torch.tensor(ratio.numel(), device=ratio.device)]
            beyond, informative, terms = self.accelerator.reduce(torch.stack(counts).float(), reduction="sum").tolist()
            h, l, b, t, i = self.terms
            self.terms = (max(h, high), min(l, -low), b + beyond, t + terms, i + informative)
        if self.args.delta:
            cap = torch.full_like(log_probs, math.inf).scatter_reduce(
                0, index, (old + math.log(self.args.delta)).to(log_probs.dtype), reduce="amin")
            outputs.log_probs = torch.minimum(log_probs, cap).view_as(outputs.log_probs)
        return outputs

    def complete_checkpoint(self) -> None:
        """Writes the resume order into the checkpoint just saved, last: it marks the checkpoint whole. Settled, never
        run again: a group a step trained, one kept out, one with no scorable rollout (a rerun would fail again)."""
        if not self.accelerator.is_main_process:
            return
        state_file = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}" / "rollout_state.json"
        state, order = json.loads(state_file.read_text()), self.rollout_worker.order
        groups = Path(self.args.output_dir) / GROUPS_FILE
        lines = groups.read_text().split("\n")[:-1] if groups.is_file() else []  # whole lines: the child writes on
        last = {r["visit"]: r for r in map(json.loads, lines)}  # the last line of a visit says how it settled
        kept_out = {r["group"] for r in last.values()
                    if r["outcome"] != "samples" and order.visit(r["group"]) == r["visit"]}
        done = self.trained_groups | kept_out
        seen = max(self.collated_groups | done, default=-1) + 1
        state["pending"], state["prompt_index"] = order.after(seen, done)
        state_file.write_text(json.dumps(state))

    # private: TRL has no switch for merged sync only; its probe would advise the --enable-lora the preflight refuses
    def _init_lora_sync(self, model):
        return False

    # private: the tensors TRL's merged push sends; no public hook supplies them
    def _streaming_iter(self):
        model = self.accelerator.unwrap_model(self.model)
        if not is_peft_model(model):
            yield from super()._streaming_iter()
            return
        from peft.tuners.lora import LoraLayer

        layers = {id(m.get_base_layer().weight): m for m in model.modules() if isinstance(m, LoraLayer)}
        for name, param in _iter_vllm_named_params(model):
            tensor, layer = param.detach(), layers.get(id(param))
            if layer is not None:
                with torch.no_grad():  # W + delta in float32, rounded once: PEFT's merge arithmetic
                    for adapter in layer.active_adapters:
                        tensor = tensor + layer.get_delta_weight(adapter)
                tensor = tensor.to(param.dtype)
            yield name, tensor.to(self.accelerator.device)


def checkpoint_problem(path: Path) -> str | None:
    """Why a resume from `path` would fail, or None. A save writes the resume order last (complete_checkpoint)."""
    try:
        int(json.loads((path / "trainer_state.json").read_text())["global_step"])
        rollout = json.loads((path / "rollout_state.json").read_text())
        int(rollout["prompt_index"])
        if "pending" not in rollout:
            return "a save cut short (rollout_state.json holds no resume order)"
        [int(visit) for visit in rollout["pending"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def resolve_resume(args: argparse.Namespace) -> str | None:
    checkpoints = [Path(p) for p in reversed(sort_checkpoints(args.output_dir))]  # newest first
    if args.resume is None:
        if checkpoints:
            raise UsageError(f"{args.output_dir} already holds checkpoints of another run; pass --resume to "
                             "continue it, or a new --run-name / --output-dir")
        return None
    if args.resume in ("latest", "auto"):
        for path in checkpoints:
            problem = checkpoint_problem(path)
            if problem is None:
                return str(path)
            print(f"warning: skipping {path}: {problem}; trying the checkpoint before it", file=sys.stderr)
        if checkpoints:  # starting over would write over them
            raise UsageError(f"--resume: no usable checkpoint in {args.output_dir} (see the warnings above); "
                             "repair one, or remove them to start over")
        if args.resume == "latest":
            raise UsageError(f"--resume: no checkpoint-N in {args.output_dir}; pass the run's --run-name or "
                             "--output-dir, or a checkpoint path")
        return None
    if problem := checkpoint_problem(Path(args.resume)):
        raise UsageError(f"--resume {args.resume}: not a usable checkpoint ({problem})")
    return args.resume


def lora_mismatch(args: argparse.Namespace, checkpoint: str | None) -> str | None:
    """A LoRA checkpoint resumed without --use-peft, full weights with it (transformers would load nothing), or an
    adapter other --lora-* flags built (PEFT would fail on another rank, rescale with another alpha)."""
    saved = Path(checkpoint or "") / "adapter_config.json"
    if checkpoint is not None and args.use_peft and saved.is_file():
        config = json.loads(saved.read_text())
        flags = {"r": args.lora_r, "lora_alpha": args.lora_alpha, "use_rslora": args.use_rslora}
        differ = [f"{key} {config.get(key)!r} (flags: {value!r})" for key, value in flags.items()
                  if config.get(key) != value]
        # PEFT saves the modules its target_modules resolved to: so are the flags' (resolving to none: another row).
        if model_shape_error(args) is None:
            with contextlib.suppress(ValueError):
                ours = set(lora_model(args).peft_config["default"].target_modules)
                theirs = set(config.get("target_modules") or [])
                if ours != theirs:  # named by kind: all-linear resolves to every layer's modules by path
                    saved_on, flags_on = (" ".join(sorted({n.split(".")[-1] for n in names}))
                                          for names in (theirs, ours))
                    differ.append(f"target_modules {saved_on} (flags: {flags_on})")
        return (f"{checkpoint} holds an adapter of another shape: {', '.join(differ)}; resume with the run's "
                "--lora-* flags") if differ else None
    if checkpoint is None or args.use_peft == saved.is_file():
        return None
    if args.use_peft:
        return (f"{checkpoint} holds full weights, not a LoRA adapter: resume it without --use-peft, or start a "
                "LoRA run in a new --output-dir")
    return f"{checkpoint} holds a LoRA adapter: resume it with --use-peft (and the run's --lora-* flags)"


def build_trainer(args: argparse.Namespace, split: str, tasks: list[dict[str, Any]],
                  plan: dict[str, Any] | None = None):
    config, plan = args.config, plan or {}
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=config.trust_remote_code)
    dataset = Dataset.from_list(task_rows(tasks, split, args.harnesses))
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    worker = HarborRolloutWorker(
        model_name=args.model, dataset=dataset, reward_funcs=[],
        processing_class=tokenizer, vllm_server_url=config.vllm_server_base_url,
        max_tokens=config.max_completion_length,  # AsyncGRPOTrainer's own worker takes the same config fields:
        **{k: getattr(config, k) for k in ("num_generations", "max_inflight_tasks", "queue_maxsize", "temperature",
                                           "request_timeout", "log_completions", "num_completions_to_print")},
        harness_session_factory=functools.partial(HarborSessionFactory, **session_settings(args),
                                                  record_path=os.path.join(args.output_dir, "rollouts.jsonl"),
                                                  split_by_harness=len(args.harnesses) > 1),
        rollout_reward_fn=functools.partial(harbor_reward, step_limit=args.agent_step_limit),
        efficiency_weight=args.efficiency_weight, max_zero_variance_groups=args.max_zero_variance_groups,
        groups_path=os.path.join(args.output_dir, GROUPS_FILE),
    )
    if plan.get("resume"):  # TRL reads the checkpoint's position itself; the untrained groups before it go first
        worker.pending = json.loads((Path(plan["resume"]) / "rollout_state.json").read_text())["pending"]
    # vLLM's --weight-transfer-config decided the backend (check_weight_transfer); nccl: TRL's WeightTransferClient.
    transfer = (CudaIpcWeightTransfer(args.vllm_url, config.weight_sync_timeout)
                if plan.get("weight_transfer") == "ipc" else None)
    trainer = HarborGRPOTrainer(model=args.model, args=config, train_dataset=dataset, processing_class=tokenizer,
                                rollout_worker=worker, peft_config=peft_config(args), weight_transfer=transfer)
    if plan.get("eval_tasks"):
        group = None
        if dist.is_initialized() and dist.get_world_size() > 1:  # every rank builds its trainer: all create it
            budget = eval_budget_s(args, len(plan["eval_tasks"]))
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=budget))
        trainer.add_callback(HeldOutEval(trainer, args, plan, group))
    trainer.add_callback(StopAtStepEnd(trainer))  # after the eval: a stop that cut it short stops this step
    return trainer


# --- Main -------------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    for signum in (signal.SIGTERM, signal.SIGUSR1):  # what SLURM, scancel and `kill` send to stop a run
        signal.signal(signum, STOP.handle)
    try:
        args = parse_args(argv)
        STOP.resume_command = resume_command(sys.argv[1:] if argv is None else argv, args.output_dir)
        if args.curate:  # from a pass_rates.csv: no server, no engine
            curate(args, args.curate)
            return 0
    except UsageError as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 2
    rank = launch_rank()
    # Rank 0 alone runs the preflight and the Harbor server (TRL's rollouts run there); the others get its plan here.
    group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=args.ddp_timeout))
             if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None)
    server = None if args.harbor_url or rank else EmbeddedHarborServer(args)
    try:
        code, plan = None, {}
        if rank == 0:
            code, plan = preflight(args, server)
        if group is not None:
            shared = [(code, plan, args.run_name, args.output_dir, args.harbor_url)]
            dist.broadcast_object_list(shared, src=0, group=group)
            code, plan, args.run_name, args.output_dir, args.harbor_url = shared[0]
            args.config.run_name, args.config.output_dir = args.run_name, args.output_dir
        if code is None:
            return run_measure(args, plan) if args.measure else train(args, plan, server)
    except KeyboardInterrupt:
        print(f"\n[harbor] interrupted; checkpoints so far are in {args.output_dir}", file=sys.stderr)
        return 130
    finally:
        if server is not None:
            server.stop()
    if group is not None:
        dist.destroy_process_group()  # left to the interpreter's exit, it can abort a rank that ends here (SIGABRT)
    return code


def launch_rank() -> int:
    """This process's global rank under `accelerate launch` / torchrun; 0 when launched alone."""
    return int(os.environ.get("RANK", "0"))


def print_hyperparameters(args: argparse.Namespace, plan: dict[str, Any]) -> None:
    """The settings the preflight table does not show; secrets redacted, *_token fields hidden as transformers does."""
    names = ["temperature", "agent_step_limit", "agent_timeout"]
    if not args.measure:
        names += ["micro_batches_per_step", "max_staleness", "max_completion_length", "learning_rate", "max_steps",
                  "save_steps", "efficiency_weight", "max_consecutive_failures", "report_to", "project"]
        names += ["lora_r", "lora_alpha", "use_rslora", "lora_dropout", "lora_target_modules"] if args.use_peft else []
    values = {name: getattr(args, name) for name in names} | args.trl  # and the TRL fields set beyond these
    rows = {f"--{k.replace('_', '-')}": f"<{k.upper()}>" if k.endswith("_token") else redact(str(v))
            for k, v in values.items()}
    if args.measure:
        print_table("async_grpo_harbor --eval-only", rows)
        return
    evals, ranks = plan.get("eval_tasks") or [], int(os.environ.get("WORLD_SIZE", "1"))
    held_out = f"{len(evals)} tasks x {args.eval_k} rollouts, before training and every {args.eval_steps or '-'} steps"
    if ranks > 1:
        held_out += f"; the other ranks wait up to {timedelta(seconds=eval_budget_s(args, len(evals)))} for each"
        timeout = timedelta(seconds=args.ddp_timeout)
        rows["ranks"] = f"{ranks} ranks ({dist.get_backend()}), collective timeout {timeout}"
    print_table("async_grpo_harbor", {
        "run name": args.run_name,
        "zero-variance groups": (f"kept out; stop after {args.max_zero_variance_groups} in a row"
                                 if args.max_zero_variance_groups else "trained (advantages 0)"),
        "held-out eval": held_out if evals else "none (--eval-tasks)", **rows,
    })


def train(args: argparse.Namespace, plan: dict[str, Any], server: EmbeddedHarborServer | None) -> int:
    if launch_rank() == 0:
        print_hyperparameters(args, plan)
    if plan.get("gpu_memory_fraction"):  # vLLM shares this GPU: the trainer-memory row's cap
        torch.cuda.set_per_process_memory_fraction(plan["gpu_memory_fraction"], 0)
    trainer = build_trainer(args, plan["split"], plan["tasks"], plan)
    STOP.deferred = True
    try:
        trainer.train(resume_from_checkpoint=plan["resume"])
    except Preempted:
        pass  # every rank raised it at the same batch; unwinding ran TRL's cleanup (rollout child, server sessions)
    except WeightTransferRefused as exc:  # fixed where vLLM runs (mostly at the first push, before any rollout)
        print(f"\nerror: {exc}", file=sys.stderr)
        return 2
    except TrainingStopped as exc:
        reason = str(exc)
        if isinstance(exc, RolloutsFailing):
            if server is not None and server.proc is not None and server.proc.poll() is not None:
                reason += f" (our Harbor server exited with code {server.proc.returncode}; its log: {server.log_path})"
            reason += f". Fix the cause, then relaunch with --output-dir {args.output_dir} --resume"
        # The newline ends the step's progress bar, which holds the line on stderr while it runs.
        print(f"\nerror: training stopped: {reason}", file=sys.stderr)
        return 1
    if trainer.stop_agreed and trainer.state.global_step < args.max_steps:
        return save_for_requeue(trainer, args)
    trainer.save_model(args.output_dir)
    saved = args.output_dir
    if args.use_peft and trainer.accelerator.is_main_process:  # what serves the finished run loads whole weights
        saved = os.path.join(args.output_dir, "merged")
        merged = trainer.accelerator.unwrap_model(trainer.model).merge_and_unload()
        merged.save_pretrained(saved)
        trainer.processing_class.save_pretrained(saved)
        saved += f" (adapter in {args.output_dir})"
    print(f"[harbor] done: {trainer.state.global_step} steps, model saved to {saved}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
