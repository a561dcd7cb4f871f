# /// script
# requires-python = ">=3.12"
# dependencies = [
#     "trl==1.16.0",
#     "peft==0.21.2",  # --use-peft
#     # TRL's tree attention loads its CUDA kernel with it (trl[kernels] also pins it, via transformers' extra)
#     "kernels>=0.17.2,<0.19",
#     "openenv[harbor]==0.10.0",
#     # Exact: openenv[harbor] asks only harbor>=0.22.0, and Harbor decides how sandboxes start and harnesses install.
#     # The version the tests' Harbor server runs (tests/requirements-server.txt; tests/envs.sh leaves it out of the
#     # trainer's environment, Python 3.11, as Harbor needs 3.12).
#     "harbor==0.25.0",
#     "vllm==0.29.0",
#     # Exact: the script relies on private names of these and of TRL (each has a `# private:` reason beside it;
#     # tests/test_private_names.py checks them against these pins). vllm 0.29.0 pins this torch. tests/envs.sh
#     # installs every exact pin of this list, vllm aside, into the test environment (tests/test_packaging.py).
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

Run it (see README.md for the full walk-through):

    # one GPU (80 GB: LoRA; README.md says what a 141 GB card trains). 1. the policy server, bound to this host (the
    #    ipc backend unpickles what it is sent), on 0.40 of the GPU's total memory: the trainer gets the rest (the
    #    preflight's `trainer memory` row checks that it fits)
    VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1 vllm serve Qwen/Qwen3-4B-Instruct-2507 \
        --host 127.0.0.1 --port 8000 --gpu-memory-utilization 0.40 --max-model-len 32768 \
        --enable-auto-tool-choice --tool-call-parser hermes \
        --logprobs-mode processed_logprobs --return-tokens-as-token-ids \
        --weight-transfer-config '{"backend":"ipc"}'

    # 2. check everything with one paid rollout, then train on the same GPU; starts its own Harbor server
    #    (`openenv harbor serve`) on 127.0.0.1 and stops it at exit
    E2B_API_KEY=... HF_TOKEN=... uv run async_grpo_harbor.py --model Qwen/Qwen3-4B-Instruct-2507 \
        --vllm-url http://127.0.0.1:8000 --use-peft --lora-target-modules all-linear --check --probe-rollout
    E2B_API_KEY=... HF_TOKEN=... uv run async_grpo_harbor.py --model Qwen/Qwen3-4B-Instruct-2507 \
        --vllm-url http://127.0.0.1:8000 --use-peft --lora-target-modules all-linear

    # two GPUs: the policy server on GPU 0, bound to this host (its dev-mode routes drive it), weights pushed over NCCL
    CUDA_VISIBLE_DEVICES=0 VLLM_SERVER_DEV_MODE=1 vllm serve Qwen/Qwen3-4B-Instruct-2507 --host 127.0.0.1 \
        --port 8000 --max-model-len 32768 --enable-auto-tool-choice --tool-call-parser hermes \
        --logprobs-mode processed_logprobs --return-tokens-as-token-ids \
        --weight-transfer-config '{"backend":"nccl"}'

    # ... and the trainer on GPU 1 (never vLLM's)
    CUDA_VISIBLE_DEVICES=1 E2B_API_KEY=... HF_TOKEN=... uv run async_grpo_harbor.py \
        --model Qwen/Qwen3-4B-Instruct-2507 --vllm-url http://127.0.0.1:8000

    # check the whole set-up without training (one real rollout with --probe-rollout)
    uv run async_grpo_harbor.py ... --check --probe-rollout

    # resume the latest checkpoint of that run (same --run-name or --output-dir)
    uv run async_grpo_harbor.py ... --run-name <name printed at start> --resume

    # preemptible (SLURM requeue): one command for the first launch and every requeue; SIGTERM / SIGUSR1 save a
    # checkpoint and exit 75
    uv run async_grpo_harbor.py ... --run-name my-run --resume auto

    # LoRA (docs/capacity.md): float32 adapters on a bfloat16 base frozen on the trainer GPU, merged weights pushed
    # (vLLM as in 1., without --enable-lora); the merged model lands in <output dir>/merged for `vllm serve`
    uv run async_grpo_harbor.py ... --use-peft --lora-r 16 --lora-target-modules all-linear --learning-rate 1e-5

The sections below, in the order data flows (search for `# --- <name>`):

    Arguments        ScriptArguments, HarborGRPOConfig (TRL's config, this script's defaults), parse_args
    Tasks            the task list (--tasks) as TRL dataset rows, task_rows
    Session factory  HarborSessionFactory: one Harbor rollout (harness + sandbox + verifier) per TRL session
    Reward           harbor_reward (a rollout's score), shape_group_rewards (the group's, before TRL's advantages)
    Harbor server    EmbeddedHarborServer: the `openenv harbor serve` this script starts without --harbor-url
    Sizing           TrainerShape, checkpoint_disk, trainer_peak: the disk and GPU memory a run needs
    Preflight        PREFLIGHT_CHECKS: one check per row `--check` prints, run before any weights load
    Measure          run_measure (--eval-only, --curate), held_out_eval (--eval-tasks during training)
    Trainer          HarborRolloutLoop (in TRL's rollout child), RolloutAccounting, HarborGRPOTrainer (its
                     checkpoints, and resolve_resume: which one a resume continues), build_trainer
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

# The script is written against trl==1.16.0's experimental AsyncGRPO (pinned above); TRL's two-line warning about that
# API would otherwise open every refusal and the rollout child's log.
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
from tqdm import tqdm  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback  # noqa: E402
from transformers.trainer_utils import rotate_checkpoints, sort_checkpoints  # noqa: E402
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
# --use-peft's default learning rate: a LoRA update moves the weights through a rank-r product, so it trains at about
# ten times a full fine-tune's rate (Schulman et al., "LoRA Without Regret", 2025: RL included).
LORA_LEARNING_RATE = 1e-5


# --- Arguments --------------------------------------------------------------------------------------------------------
# One TrlParser over ScriptArguments (this script's flags), HarborGRPOConfig (AsyncGRPOConfig with this script's
# defaults and help) and LoraArguments: --help, --config recipes and every TRL field come from these declarations. A
# new flag is one field in one of them and one name in HELP_GROUPS; another TRL dataclass joins the parser's tuple (a
# name two of them declare must be init=False in one of them, or argparse refuses the second --name). Each help is a
# sentence or two; figures and the longer story are in docs/flags.md, under the flag's name.
def arg(default: Any, help: str, shown: str | None = None, **argparse_kwargs: Any) -> Any:
    """A field as TrlParser reads it. shown: what a default that names nothing ("", None) means, for --help."""
    if shown is not None:
        # ArgumentDefaultsHelpFormatter appends "(default: X)" unless the help names %(default); `.0s` prints nothing.
        help = f"{help} (default: {shown})%(default).0s"
    return field(default=default, metadata={"help": help, **argparse_kwargs})


HARBOR_SERVE = "this interpreter's `-m openenv.cli harbor serve`"  # --harbor-command's default, as --help says it


@dataclass
class ScriptArguments:
    model: str = arg("Qwen/Qwen3-4B-Instruct-2507",
                     "Model to train (hub id or local dir): the one vLLM serves, whose weights it replaces after "
                     "every optimizer step.")
    harbor_url: str = arg("", "Base URL of a running `openenv harbor serve` to use (docs/flags.md).",
                          shown="none: this script starts its own on 127.0.0.1 and stops it when it exits")
    harbor_retry_window: float = arg(
        300.0, "Seconds the Harbor server may stay unreachable (a restart) before the run stops; rollouts it lost "
               "start again (docs/flags.md).")
    harbor_command: str = arg("", "Without --harbor-url: the command that runs `openenv harbor serve`, its options "
                                  "appended (docs/flags.md).", shown=HARBOR_SERVE)
    harbor_expose: str = arg(
        "auto", "Without --harbor-url: how the harness reaches the capture proxy; auto picks by harness and sandbox "
                "and the preflight says why (docs/flags.md).", choices=["auto", "direct", "cloudflare", "gradio"])
    dataset: str = arg(DEFAULT_DATASET, "Harbor dataset spec the server serves (HF repo, dir or name@version); it "
                                        "selects the server split (docs/flags.md).")
    split: str = arg("", "Server split name, when it differs from --dataset.",
                     shown="the split named like --dataset; for the default dataset, the server's only split")
    tasks: str = arg("", "Tasks to train on, in this order: indices, ranges and task names (`0-49,57,hello-world`), "
                         "or `@file`, one per line (docs/flags.md).",
                     shown="the tasks.txt beside this script, for the default dataset")
    harness: str = arg("mini-swe-agent", "Agent harness the server runs in the sandbox; it owns its own loop.")
    sandbox: str = arg("e2b", "Harbor environment type the server starts per rollout; its credentials must be set on "
                              "the server (E2B_API_KEY for e2b).")
    reward_key: str = arg("", "For tasks that emit several rewards: the key to train on, or a comma-separated "
                              "preference list.", shown="the task's `reward`")
    agent_step_limit: int = arg(
        30, "Model calls per rollout (capped at the proxy): a memory guard, as a rollout's row grows by every turn "
            "(docs/flags.md).")
    efficiency_weight: float = arg(
        0.1, "Bonus in [0, 1) for solving with fewer agent turns, never above one correctness step; 0 disables it "
             "(docs/flags.md).")
    max_zero_variance_groups: int = arg(
        100, "Groups in a row whose rewards are all equal (kept out of training) before training stops; 0: train on "
             "them and never stop (docs/flags.md).")
    max_consecutive_failures: int = arg(
        32, "Unscorable rollouts in a row (sandbox down, bad credentials, agent crash) before training stops, instead "
            "of waiting forever for samples.")
    resume: str | None = arg(
        None, "Resume trainer state and task position: bare, from the output dir's latest checkpoint; `auto`, that "
              "or a fresh start; or a checkpoint path (docs/flags.md).", shown="a fresh start",
        nargs="?", const="latest")
    check: bool = arg(False, "Run the preflight checks (vLLM, Harbor server, sandbox, tasks, run dir), print their "
                             "table and exit, 0 when nothing FAILs; every training run runs them first.")
    probe_rollout: bool = arg(False, "With --check: one rollout of the first task, end to end (sandbox, harness, "
                                     "capture URL, reward key).")
    eval_only: bool = arg(
        False, "Measure instead of training: --eval-k rollouts per task (and harness) at --temperature, written to "
               "pass_rates.csv in the output dir (docs/flags.md).")
    eval_k: int = arg(8, "Rollouts per task for --eval-only and --eval-tasks; the pass rate's standard error is "
                         "sqrt(p(1-p)/k).")
    eval_tasks: str = arg(
        "", "Held-out tasks (--tasks syntax) measured before the first optimizer step, every --eval-steps and after "
            "the last: eval.csv, eval/* (docs/flags.md).", shown="none")
    allow_engine_mismatch: bool = arg(
        False, "Train although the Harbor server names another engine URL than --vllm-url (the same vLLM under "
               "another name); otherwise the preflight FAILs.")
    curate: str | None = arg(
        None, "Write a --tasks file of the tasks whose pass rate in PASS_RATES_CSV lies inside --band; bare, measure "
              "first as --eval-only does (docs/flags.md).", shown="off",
        nargs="?", const="", metavar="PASS_RATES_CSV")
    band: str = arg("0.1,0.9", "LOW,HIGH: the pass rates --curate keeps, inclusive; outside them groups score alike "
                               "and teach nothing.")
    curated_tasks: str = arg("", "Where --curate writes the task file.", shown="<output dir>/curated_tasks.txt")
    help_all: bool = arg(False, "Print this help and every other AsyncGRPOConfig field (TRL's and transformers' "
                                "TrainingArguments), each a flag and a recipe key too.")


@dataclass
class HarborGRPOConfig(AsyncGRPOConfig):
    """AsyncGRPOConfig with this script's defaults and help, the flags its own fields derive from, and those fields
    (init=False: not flags; `--name` names where they come from)."""

    # The title of the other AsyncGRPOConfig fields under --help-all; this class's own flags go to HELP_GROUPS'.
    # private: HfArgumentParser's documented hook for a dataclass's group title
    _argument_group_name = "every other AsyncGRPOConfig field (TRL's, and transformers' TrainingArguments)"
    vllm_url: str = arg("http://localhost:8000",
                        "Base URL of `vllm serve` (no /v1), where the trainer pushes weights over the backend of "
                        "vLLM's --weight-transfer-config, nccl or ipc (docs/flags.md).")
    dtype: str = arg(
        "float32", "The trainer's weights and AdamW state: float32 lets every update land; bfloat16 and float16 save "
                   "memory but round an update of the default learning rate to nothing (docs/flags.md).",
        choices=["float32", "bfloat16", "float16", "auto"])
    agent_timeout: float = arg(600.0, "Seconds the agent may run per rollout; 0 uses the task's own timeout.")
    num_generations: int = arg(
        8, "Rollouts per task per group (>= 2); advantages compare rollouts of the same task.")
    micro_batches_per_step: int = arg(
        4, "Micro-batches per optimizer step, each packed with rollouts up to vLLM's max_model_len tokens "
           "(docs/flags.md).")
    max_inflight: int = arg(16, "Rollouts (and sandboxes) running at once; size the Harbor server's "
                                "MAX_CONCURRENT_ENVS to at least twice this.")
    max_staleness: int = arg(4, "Optimizer steps a rollout may lag the current policy before it is dropped; never "
                                "below 1 in practice, as accelerate prefetches one batch.")
    delta: float = arg(
        3.0, "Dual clip: a trained token whose importance ratio (trainer / engine probability) exceeds this adds no "
             "gradient and at most delta x |advantage| to the loss, TRL GRPOConfig's `delta`; 0: off, TRL "
             "AsyncGRPO's one-sided clip (docs/flags.md).")
    temperature: float = arg(
        1.0, "Sampling temperature the proxy enforces on every agent call and the trainer scores at (> 0).")
    max_completion_length: int = arg(
        1024, "Tokens per model call (an agent turn); the Harbor server this script starts caps every turn there "
              "(docs/flags.md).")
    learning_rate: float = arg(1e-6, "AdamW learning rate, constant: rollouts per step vary with their length, so a "
                                     "decay horizon in steps means little. With --use-peft the default is "
                                     f"{LORA_LEARNING_RATE:g}: LoRA needs about ten times a full fine-tune's "
                                     "(docs/flags.md).")
    max_steps: int = arg(500, "Optimizer steps to train; the run's only stop condition (tasks are cycled).")
    eval_steps: float | None = arg(50, "Optimizer steps between held-out evals (--eval-tasks); below 1: that fraction "
                                       "of --max-steps; 0: only before training and after the last step.")
    output_dir: str = arg("", "Checkpoints and logs.", shown="runs/<run name>")
    run_name: str = arg("", "The run's name in the tracker and its output dir's; relaunches never write over each "
                            "other (docs/flags.md).",
                        shown="the --output-dir's name, else <model>-<harness>-<sandbox>-<SLURM job id or UTC time>")
    project: str = arg("async-grpo-harbor", "trackio project, so runs on one suite compare side by side.")
    report_to: str = arg("trackio", "Where metrics go: trackio (local, no account needed), none, or any HF integration.")
    save_steps: int = arg(50, "Optimizer steps between checkpoints: what a crash or preemption can lose.")
    save_total_limit: int | None = arg(
        2, "Checkpoints kept in the output dir, the oldest deleted once a newer one is complete; 0 keeps all "
           "(docs/flags.md).")
    # Set in __post_init__, from what the help says.
    gradient_accumulation_steps: int = field(default=1, init=False, metadata={"help": "from --micro-batches-per-step"})
    max_inflight_tasks: int = field(default=1, init=False, metadata={"help": "from --max-inflight"})
    vllm_server_base_url: str = field(default="", init=False, metadata={"help": "from --vllm-url"})
    request_timeout: int = field(default=0, init=False, metadata={"help": "from --agent-timeout (+ 30 min)"})
    ddp_timeout: int = field(default=0, init=False,
                             metadata={"help": "from --num-generations x (--agent-timeout + 30 min)"})
    save_strategy: str = field(default="steps", init=False, metadata={"help": "from --save-steps"})
    logging_steps: float = field(default=1, init=False, metadata={"help": "for the per-step rollout accounting"})
    resume_from_checkpoint: str | None = field(default=None, init=False, metadata={"help": "from --resume"})
    # bf16 autocast exists only on GPUs; elsewhere it would score at another precision than the engine. Without CUDA,
    # ranks join over gloo; accelerate only runs several processes on CPU when told.
    bf16: bool | None = field(default=None, init=False, metadata={"help": "from the hardware (bf16 autocast on GPUs)"})
    use_cpu: bool = field(default=False, init=False, metadata={"help": "from the hardware (CPU without CUDA)"})
    # A loop-owning harness trains the full-vocabulary policy at --temperature: the capture proxy refuses filters.
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
        # Ranks >= 1 wait in a collective while rank 0 collects a whole group, whose rollouts may run one after another
        # (NCCL's default is 10 min). TrainingArguments' device set-up creates the process group with ddp_timeout on
        # GPUs only (CPU ranks get 30 min): accelerate's state creates it first, with it, on both.
        self.ddp_timeout = int(self.num_generations * rollout_budget_s(self.agent_timeout))
        PartialState(cpu=not cuda, timeout=timedelta(seconds=self.ddp_timeout))
        self.save_total_limit = self.save_total_limit or None  # the script's 0 (keep all) is TRL's None
        super().__post_init__()


@dataclass
class LoraArguments:
    """TRL's ModelConfig LoRA fields, by its names, defaults and help (get_peft_config reads them: peft_config). Not
    ModelConfig itself: it also declares --dtype (the config's) and quantisation and DoRA, which this script does
    not train."""

    use_peft: bool = arg(
        False, "Whether to use PEFT for training: LoRA adapters on a frozen base, pushed merged, so serve vLLM "
               "without --enable-lora (docs/flags.md).")
    lora_r: int = arg(16, "LoRA R value.")
    lora_alpha: int = arg(32, "LoRA alpha.")
    lora_dropout: float = arg(0.05, "LoRA dropout.")
    lora_target_modules: list[str] | None = arg(
        None, "LoRA target modules; all-linear: every linear layer but the head.",
        shown="PEFT's for the architecture (q_proj v_proj for Qwen3)", nargs="+")
    use_rslora: bool = arg(False, "Whether to use Rank-Stabilized LoRA, which scales the adapter by "
                                  "`lora_alpha/√r` instead of `lora_alpha/r`.")


class UsageError(Exception):
    """Bad input or an unusable setup: reported as one line, exit code 2."""


class TrainingStopped(ValueError):
    """A stop this script decides, its reason written for the user as one line (`error: training stopped: ...`,
    exit 1). A ValueError: the one kind TRL's harness loop lets out of a rollout (wrapped in CaptureContractError),
    which ends TRL's rollout child and reaches the trainer through TRL's failure channel."""


class RolloutsFailing(TrainingStopped):
    """Rollouts stopped being scorable for a reason outside the policy: --max-consecutive-failures of them in a row, or
    the Harbor server gone for longer than --harbor-retry-window."""


class NoSignal(TrainingStopped):
    """--max-zero-variance-groups groups in a row scored all their rollouts alike: no advantage is left to learn."""


def stop_from_child(exc: RuntimeError) -> TrainingStopped | None:
    """The TrainingStopped the rollout child raised, rebuilt in the trainer: TRL's failure channel carries only the
    type's name and message, as the text of the RuntimeError its check_health raises from ("Name: message\n")."""
    name, _, message = str(exc.__cause__ or "").partition(": ")
    kind = {kind.__name__: kind for kind in (RolloutsFailing, NoSignal)}.get(name)
    return None if kind is None else kind(" ".join(message.split()))


# The fields declared here, listed by --help; the other AsyncGRPOConfig fields appear under --help-all.
OWN_FLAGS = ({f.name for f in dataclasses.fields(ScriptArguments) + dataclasses.fields(LoraArguments)}
             | set(HarborGRPOConfig.__annotations__))
# --help's sections, in the order a run uses them: every flag of OWN_FLAGS but --help-all, which stays with --help.
HELP_GROUPS = {
    "model and vLLM": ["model", "vllm_url", "dtype"],
    "Harbor server": ["harbor_url", "harbor_command", "harbor_expose", "harbor_retry_window", "dataset", "split",
                      "allow_engine_mismatch"],
    "tasks and rollouts": ["tasks", "harness", "sandbox", "agent_step_limit", "agent_timeout", "max_completion_length",
                           "temperature", "max_inflight"],
    "reward": ["reward_key", "efficiency_weight"],
    "training": ["num_generations", "micro_batches_per_step", "learning_rate", "max_steps", "max_staleness", "delta",
                 "max_zero_variance_groups", "max_consecutive_failures"],
    "run dir, checkpoints and logging": ["output_dir", "run_name", "resume", "save_steps", "save_total_limit",
                                         "report_to", "project"],
    "preflight": ["check", "probe_rollout"],
    "measure, held-out eval and curate": ["eval_only", "eval_k", "eval_tasks", "eval_steps", "curate", "band",
                                          "curated_tasks"],
    "LoRA (TRL's ModelConfig fields)": ["use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
                                        "use_rslora"],
}


class Parser(TrlParser):
    def error(self, message: str):  # argparse's usage block and its error line: one `error:` line instead
        raise UsageError(message)


def build_parser(help_all: bool = False) -> Parser:
    parser = Parser((ScriptArguments, HarborGRPOConfig, LoraArguments), allow_abbrev=False,  # `--mod X` must never mean --model
                    description="RL-train a model on a Harbor task suite through a loop-owning harness with TRL "
                                "AsyncGRPO. Each flag's details: docs/flags.md.",
                    usage="%(prog)s [--config RECIPE_YAML] [--flag VALUE ...]  (--help-all: every AsyncGRPOConfig "
                          "field too)")
    parser.add_argument("--config", metavar="RECIPE_YAML",  # TrlParser reads it before parsing; here for --help
                        help="A recipe, as in TRL's scripts: YAML of flags and AsyncGRPOConfig fields by their "
                             "underscored names; the command line overrides it (docs/flags.md).")
    # private: argparse lists its actions only as _actions and _option_string_actions (TrlParser reads them too)
    for action in parser._actions:
        if not (help_all or action.dest in OWN_FLAGS | {"help", "config"}):
            action.help = argparse.SUPPRESS
        # HfArgumentParser gives every field --name_with_underscores and --name-with-dashes. Both still parse (argparse
        # finds an option in its own table of names); --help and argparse's errors name the dashed one.
        action.option_strings = [name for name in action.option_strings
                                 if "_" not in name or name.replace("_", "-") not in action.option_strings]
    # HfArgumentParser makes a group per dataclass.
    # private: argparse has no public call to move an argument to another group (_action_groups, _group_actions)
    for title, names in HELP_GROUPS.items():
        group = parser.add_argument_group(title)
        for name in names:
            action = parser._option_string_actions[f"--{name.replace('_', '-')}"]
            for container in parser._action_groups:
                if action in container._group_actions:
                    container._group_actions.remove(action)
            group._group_actions.append(action)
    # The rest of AsyncGRPOConfig (shown by --help-all) comes last.
    parser._action_groups.sort(key=lambda group: group.title == HarborGRPOConfig._argument_group_name)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [part for arg in argv for part in (arg.split("=", 1) if arg.startswith("--config=") else [arg])]
    parser = build_parser(help_all="--help-all" in argv)
    if "--help-all" in argv:
        parser.print_help()
        raise SystemExit(0)
    recipe = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None
    defaults = [action.default for action in parser._actions]
    named = {parser._option_string_actions[a.split("=")[0]].dest for a in argv if a.split("=")[0] in
             parser._option_string_actions}

    def given() -> set[str]:  # what the command line or the recipe set
        return named | {action.dest for action, default in zip(parser._actions, defaults) if action.default != default}

    def trl_given() -> list[str]:  # AsyncGRPOConfig fields beyond the script's
        return sorted(given() - OWN_FLAGS - {"config"})

    try:
        script, config, lora, _, unknown_keys, unknown = parser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True)
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"--config {recipe}: {' '.join(str(exc).split())}") from None
    except ValueError as exc:  # TRL's and transformers' own checks, as the config is built (a scheduler's name)
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in trl_given()) or "none"
        raise UsageError(f"AsyncGRPOConfig could not be built (TRL flags given: {flags}): "
                         f"{' '.join(str(exc).split())}") from None
    if unknown_keys:
        raise UsageError(f"--config {recipe}: unknown key(s) {', '.join(k[2:] for k in unknown_keys[::2])}: not a "
                         "flag of this script nor an AsyncGRPOConfig field (--help-all lists them)")
    if unknown:
        name = unknown[0].split("=")[0].lstrip("-").replace("-", "_")
        decided = HarborGRPOConfig.__dataclass_fields__.get(name)
        close = difflib.get_close_matches(name, [a.dest for a in parser._actions], n=1)
        hint = (f"; this script sets it {decided.metadata['help']}" if decided and not decided.init
                else f"; did you mean --{close[0].replace('_', '-')}?" if close else "")
        raise UsageError(f"unrecognized arguments: {' '.join(unknown)}{hint} (--help-all lists every flag)")
    # One namespace for the script: its flags, HarborGRPOConfig's own fields, the config the trainer gets, and the
    # other AsyncGRPOConfig fields the user set (for the hyper-parameter table).
    args = argparse.Namespace(**vars(script), **vars(lora),
                              **{name: getattr(config, name) for name in HarborGRPOConfig.__annotations__},
                              config=config, trl={name: getattr(config, name) for name in trl_given()})
    positive = {"num_generations": 2, "micro_batches_per_step": 1, "max_inflight": 1, "agent_step_limit": 1,
                "max_steps": 1, "save_steps": 1, "max_consecutive_failures": 1, "max_completion_length": 1,
                "save_total_limit": 0, "eval_k": 1, "max_staleness": 0, "agent_timeout": 0, "harbor_retry_window": 0,
                "max_zero_variance_groups": 0, "eval_steps": 0}
    for name, low in positive.items():
        if (getattr(args, name) or 0) < low:  # save_total_limit may be None (TRL's `none`): keep all, as 0
            raise UsageError(f"--{name.replace('_', '-')} must be >= {low} (got {getattr(args, name)})")
    if args.use_peft and "dtype" not in given():
        args.dtype = config.dtype = "bfloat16"  # LoRA freezes the base: float32 copies of it would only cost memory
    if args.use_peft and "learning_rate" not in given():
        args.learning_rate = config.learning_rate = LORA_LEARNING_RATE
    if args.use_peft and args.lora_r < 1:
        raise UsageError(f"--lora-r must be >= 1 (got {args.lora_r})")
    args.measure = args.eval_only or args.curate == ""
    args.eval_steps = args.eval_steps or 0
    if args.eval_steps > 1 and args.eval_steps != int(args.eval_steps):
        raise UsageError(f"--eval-steps {args.eval_steps:g}: give a whole number of steps, or a fraction of "
                         "--max-steps below 1 (0.1: every tenth of the run)")
    # transformers' reading of a fraction: of the run's steps, rounded up (TrainerState.compute_steps).
    args.eval_steps = math.ceil(args.max_steps * args.eval_steps) if args.eval_steps < 1 else int(args.eval_steps)
    if config.eval_strategy != "no":  # transformers' IntervalStrategy, a str
        raise UsageError(f"--eval-strategy {config.eval_strategy.value}: AsyncGRPOTrainer takes no eval "
                         "dataset; measure held-out Harbor tasks during training with --eval-tasks SPEC --eval-steps N "
                         "--eval-k K")
    args.harnesses = [name.strip() for name in args.harness.split(",") if name.strip()]
    if not args.harnesses:
        raise UsageError("--harness is empty; name one, e.g. mini-swe-agent, or several: mini-swe-agent,terminus-2")
    try:
        low, high = (float(x) for x in args.band.split(","))
    except ValueError:
        raise UsageError(f"--band {args.band!r}: give two pass rates LOW,HIGH, e.g. 0.1,0.9") from None
    if not 0 <= low <= high <= 1:
        raise UsageError(f"--band {args.band!r}: need 0 <= LOW <= HIGH <= 1")
    args.band = low, high
    if args.max_inflight < args.num_generations and not args.measure:
        raise UsageError(f"--max-inflight ({args.max_inflight}) must be >= --num-generations "
                         f"({args.num_generations}): a group is only scored once all its rollouts finished")
    if not args.temperature > 0:
        raise UsageError(f"--temperature must be > 0 (got {args.temperature}): the proxy enforces a "
                         "full-vocabulary sampling policy")
    clip = 1 + (config.epsilon_high if config.epsilon_high is not None else config.epsilon)
    if args.delta and not args.delta > clip or args.delta < 0:
        raise UsageError(f"--delta must be above 1 + --epsilon-high ({clip:g}), or 0 to turn the bound off (got "
                         f"{args.delta:g}): below it, the bound would cut what the clip lets through")
    if not 0 <= args.efficiency_weight < 1:
        raise UsageError(f"--efficiency-weight must be in [0, 1) (got {args.efficiency_weight}): at 1 the bonus would "
                         "reach the next correctness level")
    args.harbor_url = args.harbor_url.rstrip("/")
    args.capture_url = ""  # the capture proxy as the sandboxes reach it, once the preflight reached it there too
    # The defaults --help describes (HARBOR_SERVE, the shipped tasks.txt), resolved on this machine.
    args.harbor_command = args.harbor_command or shlex.join([sys.executable, "-m", "openenv.cli", "harbor", "serve"])
    args.tasks = args.tasks or DEFAULT_TASKS
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
    args.config.run_name, args.config.output_dir = args.run_name, args.output_dir
    return args


def peft_config(args: argparse.Namespace):
    """The LoraConfig of --use-peft, by TRL's own ModelConfig -> get_peft_config; None without it."""
    if not args.use_peft:
        return None
    config = get_peft_config(ModelConfig(
        model_name_or_path=args.model, use_peft=True, lora_r=args.lora_r, lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout, lora_target_modules=args.lora_target_modules, use_rslora=args.use_rslora))
    if args.lora_target_modules and args.lora_target_modules != ["all-linear"]:
        # ModelConfig turns a list of one name into a string, which PEFT matches as a regex against whole module paths
        # (`q_proj` would match none); names in a list it matches by suffix.
        config.target_modules = set(args.lora_target_modules)
    return config


def say(line: str) -> None:
    """One line to stdout in one write: print() writes the text and its newline apart, so lines of writers sharing
    the output (the rollout child's threads, the ranks of a launch) run into each other."""
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
    # Shapes of the credentials our users carry (HF, OpenAI-style, E2B), for text that comes from the Harbor server,
    # whose environment we cannot see.
    return re.sub(r"\b(hf_|sk-|e2b_)[A-Za-z0-9_-]{8,}", lambda m: f"{m[1]}<redacted>", text)


# --- Tasks ------------------------------------------------------------------------------------------------------------
def read_task_spec(spec: str) -> list[tuple[str, str]]:
    """`0-3,7,name` or `@file` -> [(entry, where it came from)], so errors can name the line. Checks all that needs
    no server; whether each entry names a task is `resolve_tasks`' job."""
    if spec.startswith("@"):
        path = Path(spec[1:])
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise UsageError(f"--tasks {spec}: cannot read {path} ({exc.strerror}); give a file of task "
                             "indices, ranges or names, one per line") from None
        entries = [(part.strip(), f"{path}:{number}") for number, line in enumerate(lines, 1)
                   for part in line.split("#", 1)[0].split(",") if part.strip()]
        if not entries:
            raise UsageError(f"--tasks {spec}: {path} lists no tasks (only blank lines and # comments)")
    else:
        entries = [(part.strip(), "--tasks") for part in spec.split(",") if part.strip()]
        if not entries:
            raise UsageError("--tasks is empty; give indices, ranges or names, e.g. 0-49,57,hello-world")
    for entry, where in entries:
        if (m := re.fullmatch(r"(\d+)-(\d+)", entry)) and int(m[1]) > int(m[2]):
            raise UsageError(f"{where}: range {entry!r} is backwards; write {m[2]}-{m[1]}")
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
        if m := re.fullmatch(r"(\d+)(?:-(\d+))?", entry):
            indices = range(int(m[1]), int(m[2] or m[1]) + 1)
        elif entry in by_name:
            chosen.append(by_name[entry])
            continue
        else:
            close = difflib.get_close_matches(entry, list(by_name), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UsageError(f"{where}: no task named {entry!r} in the served split ({n} tasks){hint}")
        if bad := [i for i in indices if i >= n]:
            raise UsageError(f"{where}: task index {bad[0]} is out of range: the served split has {n} tasks "
                             f"(0-{n - 1})")
        chosen += [catalogue[i] for i in indices]
    return chosen


def task_rows(tasks: list[dict[str, Any]], split: str, harnesses: list[str]) -> list[dict[str, Any]]:
    """One dataset row per task and harness: every task once per harness per pass over the rows, the harness changing
    from one row to the next.

    A row is a GRPO group (TRL repeats it for all its generations), so a group never mixes harnesses and its
    advantages compare like with like; shifting the assignment each pass keeps a task from always meeting the same
    harness when the task count is a multiple of the harness count. The task's identity rides in the prompt message
    because that is all TRL hands the session factory: the `seed` it passes is a group counter that differs per epoch
    and restarts at 0 on resume.
    """
    return [{"prompt": [{"role": "user", "content": f"[{t['task_name']}] {t.get('instruction', '')[:2000]}",
                         "harbor_split": split, "harbor_task_index": int(t["index"]),
                         "harbor_task_name": t["task_name"], "harbor_harness": harness}]}
            for shift in range(len(harnesses)) for i, t in enumerate(tasks)
            for harness in [harnesses[(i + shift) % len(harnesses)]]]


# --- Session factory: one Harbor rollout per TRL session --------------------------------------------------------------
def rollout_budget_s(agent_timeout: float) -> float:
    """How long one `run_rollout` call may take: the agent's timeout (0: the task's own, at most an hour), plus
    sandbox setup and verification."""
    return (agent_timeout or 3600.0) + 1800.0


class ServerLost(ConnectionError):
    """The Harbor server stopped answering, or answered that it does not know our session: it was stopped or
    restarted, and the rollout's sandbox went with it. `answered`: the server is up again (it said so itself)."""

    def __init__(self, message: str, answered: bool = False):
        super().__init__(message)
        self.answered = answered


class CaptureLost(ServerLost):
    """The capture proxy does not answer at the URL every sandbox is given: its tunnel or the proxy died, so a harness
    started now could reach no model. Waited for as a lost server is (one window); openenv cannot reopen a tunnel."""

    def __init__(self, message: str, url: str):
        super().__init__(message)
        self.url = url


class ServerFull(RuntimeError):
    """The Harbor server has no free session slot (MAX_CONCURRENT_ENVS)."""


class Failure(NamedTuple):
    """Why a rollout is unscorable: `kind` is the countable name (`harbor/errors/<kind>_total`), `message` the reason."""

    kind: str
    message: str


# The kind of the failure that stops the run at once, whatever --max-consecutive-failures says.
SERVER_GONE = "server_unreachable"


# How an agent may end and still be trained at the reward Harbor's verifier gave it (Harbor verifies after any
# AgentTimeoutError or NonZeroAgentExitCodeError, subclasses included: harbor/trial/single_step.py): the ends the
# policy brings about itself. It looped until --agent-timeout, or it talked past the context or the output cap, as a
# completion truncated at --max-completion-length is trained. Every other exception Harbor verified after is the
# harness or the inference path failing, not the policy: NonZeroAgentExitCodeError's subclasses (ApiError and its
# kin, NetworkConnectionError, AgentAuthenticationError, ModelNotFoundError, ...), which Harbor picks from the agent's
# output, and a plain NonZeroAgentExitCodeError, which is how mini-swe-agent (litellm) reaches Harbor when vLLM
# answers 5xx, drops the connection or is gone (Harbor's patterns do not know litellm's messages; seen on the rig).
POLICY_EXITS = {"AgentTimeoutError": "timeout", "ContextWindowExceededError": "context_window",
                "OutputTokenExceededError": "output_tokens"}


def agent_exit(r: HarborRolloutResult) -> str | None:
    """How the agent ended, for a rollout the verifier scored: "ok", or the POLICY_EXITS kind of its end. None: the
    rollout is unscorable (an exception without a reward, or one that is not the policy's: `judge_rollout`)."""
    if r.reward is None or not r.exception_type:
        return "ok" if r.ok else None
    return POLICY_EXITS.get(r.exception_type)


def judge_rollout(r: HarborRolloutResult, task: str, *, require_tokens: bool, reward_key: str) -> Failure | None:
    """Why a finished `run_rollout` cannot be trained on (None: it can). Training, --eval-only and the probe judge
    every result here. A rollout whose agent ended in one of POLICY_EXITS is scored like any other when the verifier
    scored it and its capture is valid: a policy that loops until --agent-timeout earns its reward, not a pass."""
    if r.reward is None and r.rewards:  # the server reports it as an error too (ok=False)
        return Failure("reward_key", f"--reward-key {reward_key or 'reward'!r} is not emitted by {task}; it emits: "
                                     f"{', '.join(sorted(r.rewards))}")
    exit_kind = agent_exit(r)
    if exit_kind not in (None, "ok") and require_tokens and (r.atif == "MISMATCH" or not r.n_trainable_tokens):
        # OpenEnv skips these two capture checks once the agent's failure has set ok=False (openenv/harbor/rollout.py).
        why = "trace reconciliation MISMATCH" if r.atif == "MISMATCH" else "no trainable token"
        return Failure("capture", f"the agent ended with {r.exception_type} and its capture is not trainable ({why})")
    if exit_kind is None:
        budget = next((x for x in r.findings if "context_budget_exhausted" in x), None)
        if budget and "no_turns" in (r.error or ""):
            # Seen on a real vLLM: it refuses a call whose prompt + max_tokens exceed its context (HTTP 400), the
            # proxy turns that into a stop the agent obeys, and the rollout's own error then blames the base URL.
            return Failure("context", f"vLLM refused the agent's first call as too long for its context "
                                      f"({budget[:240]}): the Harbor server's --max-output-tokens (this script's "
                                      "--max-completion-length) plus the task's prompt must fit vLLM's --max-model-len")
        if r.reward is not None and r.exception_type:
            return Failure(r.exception_type, f"{r.exception_type}: the agent's harness or its engine failed, so the "
                                             f"verifier's reward {r.reward:g} is not the policy's: {r.error}")
        return Failure(r.exception_type or "error", f"{r.exception_type or 'error'}: {r.error}")
    if r.rollout_type != "train" and require_tokens:
        return Failure("eval_tier", "the engine returned no token ids / processed logprobs (eval tier): restart vLLM "
                                    "with --return-tokens-as-token-ids --logprobs-mode processed_logprobs")
    fatal = next((x for x in r.findings if "[FATAL" in x), None)
    if fatal:
        return Failure("capture", f"capture finding {fatal}")
    if r.reward is None:
        return Failure("no_reward", "the verifier produced no reward")
    return None


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
        self._slot_calls = 0  # create and close calls in flight: each may hold a server slot until it returns
        self.settled = threading.Event()  # set while none is: once closed, this session then holds no server slot
        self.settled.set()

    def _begin_slot_call(self) -> None:  # with self._lock held
        self._slot_calls += 1
        self.settled.clear()

    def _end_slot_call(self) -> None:
        with self._lock:
            self._slot_calls -= 1
            if not self._slot_calls:
                self.settled.set()

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
        try:
            conn.request("POST", f"{self._prefix}/mcp", body, {"Content-Type": "application/json"})
            raw = conn.getresponse().read()
        except (OSError, http.client.HTTPException) as exc:
            if isinstance(exc, TimeoutError) and exc.errno is None:
                raise  # our own timeout: the rollout outlived its budget, the server may well be up
            # The server went away mid-call: killed, restarted, or its host gone (the keepalive's ETIMEDOUT).
            raise ServerLost(f"{type(exc).__name__}: {exc}") from exc
        reply = json.loads(raw or b"{}")
        error = reply.get("error")
        if error:
            message = f"harbor server: {method}: {error.get('message', error)}"
            # openenv 0.10's http_server: a session it never created (or lost in a restart) is "Unknown session_id"
            # (INVALID_PARAMS); a full server is SessionCapacityError's reply, the only one with max_sessions data.
            if str(error.get("message", "")).startswith("Unknown session_id"):
                raise ServerLost(message, answered=True)
            if "max_sessions" in (error.get("data") or {}):
                raise ServerFull(message)
            raise RuntimeError(message)
        return reply.get("result")

    def _call_once(self, method: str, params: dict[str, Any], interruptible: bool) -> Any:
        # Connected before it is published, so close() always finds a socket it can shut down.
        try:
            conn = self._open_connection()
        except OSError as exc:
            raise ServerLost(f"{type(exc).__name__}: {exc}") from exc
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
        with self._lock:
            self._begin_slot_call()
        try:
            session_id = self._call_once("openenv/session/create", {}, interruptible=False)["session_id"]
            with self._lock:
                self.session_id = session_id
                closed = self.closed
                if closed:
                    self._begin_slot_call()
            if closed:  # close() ran while the slot was being created: it could not release what it did not know
                self._release(session_id)
        finally:
            self._end_slot_call()

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
            if session_id is not None:
                self._begin_slot_call()
        self.closed_event.set()
        if waiting is not None:
            with contextlib.suppress(OSError):
                waiting.shutdown(socket.SHUT_RDWR)
        if session_id is not None:
            self._release(session_id)

    def renew(self) -> None:
        """Drop this session (the server lost it, or may still hold it: release it) so the next call opens a new one."""
        with self._lock:
            session_id, self.session_id = self.session_id, None
            if session_id is not None:
                self._begin_slot_call()
        if session_id is not None:
            self._release(session_id)

    def _release(self, session_id: str) -> None:
        """Free the server slot of `session_id`. The caller counted this as a slot call (`_begin_slot_call`) under the
        same lock that gave it the id, so `settled` never reads free before the slot is."""
        try:
            # Failing: the server is gone (its slots went with it) or already dropped the session.
            with contextlib.suppress(OSError, RuntimeError, ValueError):
                conn = self._open_connection(timeout=10)
                try:
                    self._post(conn, "openenv/session/close", {"session_id": session_id})
                finally:
                    conn.close()
        finally:
            self._end_slot_call()

    # `HarborEnv.run_rollout` (its exact wire contract) with its MCP calls riding this session. Not a `HarborEnv`
    # instance: its constructor builds an httpx client a rollout never uses, ~20 ms of CPU per rollout (TLS context).
    def run_rollout(self, **kwargs: Any) -> HarborRolloutResult:
        return HarborEnv.run_rollout(self, **kwargs)

    def _call(self, name: str, **kwargs: Any) -> Any:
        result = self.call_tool(name, kwargs)
        if isinstance(result, dict) and result.get("isError"):
            raise RuntimeError(f"tool {name!r} failed: {json.dumps(result.get('content'))[:300]}")
        return result


class HarborSession(ResourceSession):
    """One rollout: the harness runs on the server, we only wait for its result.

    Satisfies OpenEnv's `TrainableSession`: `wait_for_completion()` runs the rollout, `fetch_training_trace()` hands
    TRL the validated token capture, `verify()` forwards the verifier's reward. A failed rollout is unscorable
    (reward None), never fatal; only a run of them, or a Harbor server gone for longer than --harbor-retry-window,
    stops training (`HarborSessionFactory._stop_run`). A rollout its server lost starts again in a new session.
    """

    def __init__(self, factory: HarborSessionFactory, prompt: list[dict[str, Any]], group: int | None):
        self._factory = factory
        self._prompt = prompt
        self._split = prompt[0]["harbor_split"]
        self._task_index = int(prompt[0]["harbor_task_index"])
        self.task_name = prompt[0]["harbor_task_name"]
        self.harness = prompt[0].get("harbor_harness") or factory.harness
        self.group = group
        self.label = f"{factory.label} {group} task {self._task_index} ({self.task_name})"
        self._client = HarborServerSession(factory.harbor_url, factory.request_timeout_s)
        self.result: HarborRolloutResult | None = None
        self.failure: Failure | None = None
        self.started = 0.0
        self.retries = 0  # times this rollout started again in a new session, its first one lost to the server

    def initial_messages(self) -> list[dict[str, Any]]:
        return list(self._prompt)

    def list_tools(self) -> list:
        return []

    def call_tool(self, name: str, arguments: dict[str, Any]):
        raise NotImplementedError("the harness owns its loop; tools run inside the sandbox")

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        f = self._factory
        if not f.first_rollout_done(self):
            return 1
        try:
            return self._run()
        finally:
            f.pioneer_done(self)

    def _run(self) -> int:
        f, session = self._factory, self._client
        self.started = time.time()
        # The proxy accepts a training policy only from an engine it captures tokens from; any engine takes an eval one.
        policy = {"purpose": "eval", "eval_sampling": f.eval_sampling} if f.eval_sampling else {"sampling": f.sampling}
        lost, backoff, full_since = False, 1.0, None
        while True:
            try:
                f.reach_capture()
                if session.closed:  # stopped while the tunnel answered (up to its 30 s timeout)
                    return 1
                session.open()
                f.server_answered()
                self.retries += lost
                lost = False
                self.result = session.run_rollout(
                    split=self._split, task_index=self._task_index, harness=self.harness, sandbox=f.sandbox,
                    reward_key=f.reward_key, agent_timeout_sec=f.agent_timeout_s,
                    agent_step_limit=f.agent_step_limit, **policy,
                )
                break
            except ServerLost as exc:
                # Stopped or restarted: the sandbox went with the session, so the rollout starts again in a new
                # one once the server answers. The run waits for it once (one window for all rollouts), not per
                # rollout, and never counts these toward --max-consecutive-failures.
                if session.closed:
                    return 1
                lost = not isinstance(exc, CaptureLost)  # that one never started: nothing to start again
                left = f.server_lost(exc)
                if left <= 0:
                    self.failure = Failure(SERVER_GONE, (
                        f"the capture proxy has not answered at {exc.url}, the URL every sandbox is given, for "
                        f"{f.retry_window_s:g}s (last: {exc}): its tunnel or the proxy died, and openenv cannot reopen "
                        "either; a relaunch starts a new server and tunnel") if isinstance(exc, CaptureLost) else (
                        f"the Harbor server at {f.harbor_url} has not answered for {f.retry_window_s:g}s (last: "
                        f"{exc})"))
                    return 1
                wait = min(backoff, left)
            except ServerFull as exc:
                f.server_answered()
                if session.closed:
                    return 1
                full_since = full_since or time.monotonic()
                wait = min(backoff, full_since + f.retry_window_s - time.monotonic())
                if wait <= 0:
                    self.failure = Failure("server_full", f"harbor server call failed: {exc} (raise "
                                                          "MAX_CONCURRENT_ENVS on the Harbor server to >= 2 x "
                                                          "--max-inflight)")
                    return 1
            except Exception as exc:  # noqa: BLE001 - this rollout's failure, not the server's: judged unscorable
                self.failure = Failure("transport", f"harbor server call failed: {type(exc).__name__}: {exc}")
                return 1
            if session.closed_event.wait(wait):
                return 1
            session.renew()
            backoff = min(2 * backoff, 10.0)
        self.failure = judge_rollout(self.result, self.task_name, require_tokens=f.require_tokens,
                                     reward_key=f.reward_key)
        return 0 if self.failure is None else 1

    def fetch_training_trace(self) -> TrainingTrace:
        from openenv.harbor.contract import to_training_trace

        if self._client.closed:
            return TrainingTrace(turns=[])  # abandoned at stop: neither a sample nor a failure
        if self.failure is None:
            try:
                trace = to_training_trace(self.result)
            except (ValueError, TypeError, KeyError) as exc:
                # One malformed capture is this rollout's problem, not the run's: TRL stops its worker on any of these.
                self.failure = Failure("capture", f"capture rejected: {exc}")
        self._factory.record_outcome(self)
        return TrainingTrace(turns=[]) if self.failure is not None else trace

    def verify(self, transcript: list[dict[str, Any]], final_state: Any | None = None) -> VerifyResult:
        if self.failure is not None or self.result is None:
            return VerifyResult(env_reward=None, done=True,
                                metrics={"failure": self.failure.message if self.failure else None})
        r = self.result
        return VerifyResult(env_reward=r.reward, done=True,
                            metrics={"wall_s": r.wall_s, "turns": r.n_turns, **r.phase_timings})

    def close(self) -> None:
        self._client.close()
        # Only once released: a stop waits on every live session's `settled`, this one's release included.
        self._factory.live_sessions.discard(self)


# Sandboxes that build a task's template on its first use, where rollouts starting together race the build (see
# SHARED_TEMPLATE_NAME): a factory's first rollout starts alone, the others once it has ended, its template built.
TEMPLATE_BUILDING_SANDBOXES = {"e2b"}
# The sandboxes whose first rollout has ended in this process: a later factory here (each held-out eval's) finds the
# template built and starts its rollouts together.
TEMPLATES_BUILT: set[str] = set()


class HarborSessionFactory(ResourceSessionFactory):
    """Creates one `HarborSession` per rollout. Built inside TRL's rollout child as `factory(sampling=...)`.

    `sampling` is the trainer's own policy (temperature), forwarded to every `run_rollout` so the proxy samples at
    the temperature the trainer scores at. `capture_url`: the capture proxy as every sandbox is told to reach it,
    asked before each rollout starts its sandbox ("": not known here, a server of the user's own).
    """

    def __init__(self, *, harbor_url: str, harness: str, sandbox: str, reward_key: str, agent_step_limit: int,
                 agent_timeout_s: float, max_consecutive_failures: int, retry_window_s: float = 300.0,
                 sampling: dict[str, Any] | None = None, require_tokens: bool = True, record_path: str = "",
                 eval_sampling: dict[str, Any] | None = None, label: str = "group", split_by_harness: bool = False,
                 record_fields: dict[str, Any] | None = None, capture_url: str = ""):
        self.harbor_url, self.harness, self.sandbox, self.reward_key = harbor_url, harness, sandbox, reward_key
        self.capture_url = capture_url
        self._pioneer: HarborSession | None = None  # the first rollout, alone where the sandbox builds templates
        self._pioneer_ended = threading.Event()
        if sandbox not in TEMPLATE_BUILDING_SANDBOXES or sandbox in TEMPLATES_BUILT:
            self._pioneer_ended.set()
        self.agent_step_limit, self.agent_timeout_s = agent_step_limit, agent_timeout_s
        self.request_timeout_s, self.retry_window_s = rollout_budget_s(agent_timeout_s), retry_window_s
        self.max_consecutive_failures, self.split_by_harness = max_consecutive_failures, split_by_harness
        self.sampling = dict(sampling or {})
        # False for --eval-only: a rollout of an engine without token ids is measurable, just not trainable.
        self.require_tokens = require_tokens
        self.eval_sampling = dict(eval_sampling or {})
        self.label = label  # what a rollout's console line calls its unit: a training group, a held-out eval's task
        self.record_path = record_path  # one JSON line per finished rollout, for the user to read
        self.record_fields = dict(record_fields or {})  # on every record: a held-out eval's optimizer step
        self.metrics_queue: Any = None  # TRL's, set by the rollout loop that owns this factory in TRL's child
        self._lock = threading.Lock()
        self._consecutive_failures = 0
        self._outage_since: float | None = None  # since when the server has not answered (monotonic)
        self.live_sessions: set[HarborSession] = set()
        self.closing = False
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
        # The trainer holds the other end of this pipe, which reads as closed once it is gone however it died (SIGKILL,
        # OOM), already closed included.
        import multiprocessing.connection

        def leave_with_trainer(trainer=multiprocessing.parent_process().sentinel) -> None:
            multiprocessing.connection.wait([trainer])
            os.kill(os.getpid(), signal.SIGTERM)  # _abandon, in the main thread: no rollout starts meanwhile

        threading.Thread(target=leave_with_trainer, name="harbor-trainer-watch", daemon=True).start()

    def _abandon(self, exit_code: int) -> None:
        # A second SIGTERM (the trainer's own stop, a second `kill`) would run this again inside the wait below, and
        # exit before the releases the first one is waiting for.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sessions = self.close_sessions()
        # A create or release still in flight ends with the slot free; os._exit would cut it short, and a trainer
        # SIGKILLed as the next group starts would leave the server's slots taken.
        deadline = time.monotonic() + 10.0
        for session in sessions:
            session._client.settled.wait(max(0.0, deadline - time.monotonic()))
        os._exit(exit_code)

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> HarborSession:
        # `seed` is TRL's group counter: only a label here, the task itself comes from the prompt.
        session = HarborSession(self, list(task), seed)
        self.live_sessions.add(session)
        if self.closing:  # read after the add: close_sessions() either closes this session or set the flag first
            session.close()
        return session

    def close_sessions(self) -> list[HarborSession]:
        """Release the server session of every rollout, and close any session created from now on at once: a rollout
        submitted as the stop began creates its session after this snapshot. The factory is done with after this."""
        self.closing = True
        sessions = list(self.live_sessions)
        for session in sessions:
            session.close()
        return sessions

    def _say(self, line: str) -> None:
        with self._lock:  # rollouts finish on several threads at once
            say(redact(line))

    def first_rollout_done(self, session: HarborSession) -> bool:
        """Wait, unless `session` is the first rollout, until the first one has ended (at once where the sandbox
        builds no template). False: `session` was closed meanwhile."""
        with self._lock:
            self._pioneer = self._pioneer or session
        while session is not self._pioneer and not self._pioneer_ended.wait(1.0):
            if session._client.closed:
                return False
        return True

    def pioneer_done(self, session: HarborSession) -> None:
        if session is self._pioneer:
            TEMPLATES_BUILT.add(self.sandbox)
            self._pioneer_ended.set()

    def reach_capture(self) -> None:
        """Raise CaptureLost unless the capture proxy answers at the URL the sandboxes are given: no paid sandbox
        starts for a harness that could reach no model."""
        if not self.capture_url:
            return
        try:
            health = http_json(f"{self.capture_url}/health", timeout=30)
        except (OSError, ValueError) as exc:
            raise CaptureLost(f"{type(exc).__name__}: {exc}", self.capture_url) from exc
        if not isinstance(health, dict) or health.get("status") != "ok":
            raise CaptureLost(f"/health answered {str(health)[:200]}", self.capture_url)

    def server_lost(self, exc: ServerLost) -> float:
        """A rollout lost its server: seconds left before the run gives up on it (<= 0: it is gone).

        One window for the whole run, from the first call that found the server gone to the first that finds it
        back, so a dead server ends the run one window after it died, however many rollouts wait for it.
        """
        if exc.answered:  # it answered: up again, and only this rollout's session is gone
            self.server_answered()
            return self.retry_window_s
        now = time.monotonic()
        with self._lock:
            first, self._outage_since = self._outage_since is None, self._outage_since or now
            since, waiting = self._outage_since, len(self.live_sessions)
        if first and isinstance(exc, CaptureLost):
            self._say(f"[harbor] the capture proxy is not answering at {exc.url}, the URL every sandbox is given "
                      f"({exc}): its tunnel or the proxy is down or too slow; no rollout starts until it answers, "
                      f"for at most "
                      f"{self.retry_window_s:g}s (--harbor-retry-window)")
        elif first:
            self._say(f"[harbor] the Harbor server at {self.harbor_url} is not answering ({exc}) with {waiting} "
                      f"rollouts in flight: they start again in new sessions when it is back, if within "
                      f"{self.retry_window_s:g}s (--harbor-retry-window)")
        return since + self.retry_window_s - now

    def server_answered(self) -> None:
        with self._lock:
            since, self._outage_since = self._outage_since, None
        if since is not None:
            self._say(f"[harbor] the Harbor server answers again after {time.monotonic() - since:.0f}s (its capture "
                      "proxy too, where asked); rollouts it lost start again in new sessions")

    def record_outcome(self, session: HarborSession) -> None:
        failure, r = session.failure, session.result
        with self._lock:
            self._consecutive_failures = 0 if failure is None else self._consecutive_failures + 1
            count = self._consecutive_failures
        self._write_record(session)
        self._push_metrics(session)
        retried = f", restarted {session.retries}x in a new session" if session.retries else ""
        if failure is None:
            phases = "".join(f", {name} {seconds:.1f}s" for name, seconds in r.phase_timings.items())
            stops = f", {r.budget_stop_count} budget stops" if r.budget_stop_count else ""
            ended = f", agent {agent_exit(r)}" if not r.ok else ""
            self._say(f"[harbor] {session.label}: reward {r.reward:g} in {r.n_turns} turns, {r.wall_s:.1f}s, harness "
                      f"{session.harness}{phases}{stops}{ended}{retried}")
        elif failure.kind != SERVER_GONE:  # that one is the run's, said once by the stop below
            self._say(f"[harbor] {session.label}: unscorable: {failure.message[:300]} (harness {session.harness}"
                      f"{retried})")
        if failure is not None and failure.kind == SERVER_GONE:
            self._stop_run(failure.message)
        if failure is not None and count >= self.max_consecutive_failures:
            self._stop_run(f"{count} consecutive rollouts were unscorable; the last: {failure.message[:500]}")

    def _stop_run(self, reason: str) -> None:
        """Stop training, through the one channel TRL offers: a ValueError out of `fetch_training_trace()`, which the
        script's rollout loop hands to the trainer without a traceback (`HarborRolloutLoop._run_loops`)."""
        raise RolloutsFailing(redact(reason))

    def _write_record(self, session: HarborSession) -> None:
        if not self.record_path:
            return
        r, failure = session.result, session.failure
        record = {
            "time": time.time(), **self.record_fields, "group": session.group, "task": session.task_name,
            "index": session._task_index, "harness": session.harness, "sandbox": self.sandbox,
            "reward": r.reward if r is not None and failure is None else None,
            "turns": r.n_turns if r is not None else 0, "wall_s": r.wall_s if r is not None else 0.0,
            "budget_stops": r.budget_stop_count if r is not None else 0,
            "phases": dict(r.phase_timings) if r is not None else {},
            "error": failure.kind if failure else None, "failure": redact(failure.message[:300]) if failure else None,
            "started": session.started, "retries": session.retries,
            "trial": (r.trial_name or None) if r is not None else None,
            "exit": agent_exit(r) if r is not None and failure is None else None,
        }
        with self._lock, open(self.record_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def _push_metrics(self, session: HarborSession) -> None:
        """This rollout's figures, onto TRL's metric queue, which the trainer drains into each optimizer step's log
        and reduces by name: a `_total` summed over the step, a (numerator, denominator) pair as a rate."""
        if self.metrics_queue is None:
            return
        r, failure = session.result, session.failure
        m = {"harbor/rollouts_total": 1.0, "harbor/errors_total": float(failure is not None),
             "harbor/sandbox_s_total": r.wall_s if r is not None else 0.0,
             "harbor/budget_stops_total": float(r.budget_stop_count) if r is not None else 0.0}
        if failure is not None:
            m[f"harbor/errors/{failure.kind}_total"] = 1.0
        else:  # TRL's rollout/turns_mean and rollout/duration_s also average the unscorable rollouts, at 0 turns
            m |= {"harbor/solve_rate": (float(r.reward > 0), 1.0), "harbor/wall_s_mean": (r.wall_s, 1.0),
                  "harbor/turns_mean": (float(r.n_turns), 1.0)}
            m |= {f"harbor/phase_s/{name}": (seconds, 1.0) for name, seconds in r.phase_timings.items()}
            if (ended := agent_exit(r)) != "ok":
                m[f"harbor/agent_exits/{ended}_total"] = 1.0
        if self.split_by_harness:
            m |= {f"harbor/{session.harness}/{key[7:]}": m[key] for key in (
                "harbor/rollouts_total", "harbor/errors_total", "harbor/solve_rate", "harbor/wall_s_mean") if key in m}
        try:
            self.metrics_queue.put_nowait(m)
        except queue.Full:
            pass  # never hold a rollout up for a figure, as TRL's own pushes do


def session_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What every rollout of a run shares, training and --eval-only alike."""
    return {"harbor_url": args.harbor_url, "harness": args.harnesses[0], "sandbox": args.sandbox,
            "reward_key": args.reward_key, "agent_step_limit": args.agent_step_limit,
            "agent_timeout_s": args.agent_timeout, "max_consecutive_failures": args.max_consecutive_failures,
            "retry_window_s": args.harbor_retry_window, "capture_url": args.capture_url}


# --- Reward -----------------------------------------------------------------------------------------------------------
class RolloutScore(NamedTuple):
    """What one rollout brings to its group's rewards: how correct it was, and how few turns it took."""

    correctness: float  # the verifier's reward
    efficiency: float  # 1 - turns / --agent-step-limit, in [0, 1]


def harbor_reward(outcome: Any, *, step_limit: int) -> RolloutScore | None:
    """TRL's per-rollout reward hook: the rollout's score, or None when it could not be scored (left out of the group
    baseline). The reward TRL trains on needs the whole group; `shape_group_rewards` makes it."""
    r = outcome.env_reward
    if r is None:
        return None
    turns = len(outcome.trace) or outcome.tool_call_count
    return RolloutScore(float(r), max(0.0, 1.0 - turns / step_limit))


def shape_group_rewards(scores: list[RolloutScore | None], efficiency_weight: float) -> list[float | None]:
    """One group's rewards: correctness, plus an efficiency bonus that can only order rollouts of equal correctness.

    TRL normalises every group, A = (reward - mean) / (std + 1e-8), which erases any scale: in a group whose rollouts
    all solve, a bonus of 1.05 vs 1.07 would come out as advantages of about +-1, as large as a pass/fail split. So
    the bonus exists only in groups that mix correctness levels, and is sized by the group's smallest step between
    two levels (`gap`): reward = c + w * gap * efficiency for solved rollouts (c > 0), c otherwise. With w < 1 no
    bonus reaches the next level, and, since one std divides the whole group, efficiency moves an advantage by at
    most w times what one correctness step moves it. Unsolved rollouts get no bonus: giving up early never pays.
    A group of one correctness level gets its plain rewards, all equal: zero variance, kept out of training.
    """
    levels = sorted({s.correctness for s in scores if s is not None})
    gap = min((b - a for a, b in zip(levels, levels[1:])), default=0.0)
    return [None if s is None else s.correctness + (efficiency_weight * gap * s.efficiency if s.correctness > 0 else 0)
            for s in scores]


def zero_variance(rewards: list[float | None]) -> bool:
    """All scorable rewards of a group exactly equal: TRL gives every one of them advantage 0, so it teaches nothing.
    Exact equality on purpose: any difference, however small, is scaled up to unit variance by the normalisation."""
    return len({r for r in rewards if r is not None}) <= 1


# --- The Harbor server: the user's (--harbor-url), or one this script starts and owns ---------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The harness version the Harbor server this script starts installs in each sandbox: the one the tests run
# (tests/requirements-server.txt). Without one Harbor installs the newest on the day, so a long run would train
# another harness than it was checked with. The user's OPENENV_HARBOR_AGENT_VERSIONS (openenv's own switch: a JSON
# object of harness name -> exact version) wins per harness.
HARNESS_VERSIONS = {"mini-swe-agent": "2.4.6"}
# openenv 0.10's own test of a pinned version (openenv/harbor/rollout.py): one it refuses fails every rollout.
EXACT_VERSION = re.compile(r"[0-9]+(?:\.[0-9]+){1,3}(?:[-+][A-Za-z0-9.-]+)?")
# Harbor names an e2b template after its task and builds it when the alias is missing; the alias exists from the
# moment a build starts, so rollouts visiting a task at once race the build and the losers fail with `tag 'default'
# does not exist`. Under one shared name (openenv's HARBOR_SHARED_ENV_NAME) a template is built once per distinct
# environment (its hash stays in the alias), not once per task. The user's HARBOR_SHARED_ENV_NAME wins.
SHARED_TEMPLATE_NAME = "async-grpo-harbor"


def harbor_server_env() -> dict[str, str]:
    """What the Harbor server this script starts gets on top of this process's environment."""
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
    """`openenv harbor serve` as a child of this process, so one command runs everything after `vllm serve`. Bound to
    127.0.0.1, with the --expose that --harbor-expose picks (the preflight resolves auto): OpenEnv's default (gradio)
    opens a public tunnel whatever the sandbox. `public_url`: the capture proxy's URL as the server hands it to every
    sandbox (a tunnel's, or 127.0.0.1's), from the line the server prints at start."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.log_path = Path(args.output_dir) / "harbor_server.log"
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.capture_port = 0
        self.public_url = ""

    def start(self, served_model: str, timeout_s: float = 1800.0) -> float:
        """Start the server and wait until its Task API answers; returns the seconds that took."""
        a = self.args
        port, self.capture_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = shlex.split(a.harbor_command) + [
            "--dataset", a.dataset, "--llm-url", f"{a.vllm_url}/v1", "--host", "127.0.0.1", "--port", str(port),
            "--capture-port", str(self.capture_port), "--expose", a.harbor_expose,
            "--max-output-tokens", str(a.max_completion_length)]
        if served_model:
            cmd += ["--model", served_model]
        slots = max(2 * a.max_inflight, int(os.environ.get("MAX_CONCURRENT_ENVS", "0") or 0))
        t0 = time.monotonic()
        with self.log_path.open("a") as log:
            log.write(f"\n===== {datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S} UTC: {shlex.join(cmd)}\n")
            log.flush()
            started_at = log.tell()
            env = {**os.environ, **harbor_server_env(), "MAX_CONCURRENT_ENVS": str(slots)}
            try:
                # PR_SET_PDEATHSIG (prctl 1): the kernel sends the server SIGTERM when its parent thread ends, even by
                # SIGKILL or OOM, when no cleanup of ours runs.
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=env,
                                             start_new_session=True,
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
            # openenv 0.10's serve_harbor prints `capture   <where> -> <URL>` before it serves; no route reports it.
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


# --- Sizing: the disk and GPU memory a run needs, from --model's config alone -----------------------------------------
@functools.cache
def model_shape(model: str) -> tuple[int, str]:
    """(parameters, checkpoint dtype) of --model, from its config alone: no weights are read."""
    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    return params, str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")


def lora_model(args: argparse.Namespace):
    """--use-peft's model on the meta device, from --model's config alone (no weights are read): the modules PEFT
    resolves --lora-target-modules to (its default for the architecture, all-linear), as training will."""
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
    """What the trainer holds for --model at --dtype: the sizes its checkpoints and its GPU memory follow from."""
    params: int  # every parameter of --model
    width: int  # bytes per weight at the trainer's dtype
    adapter: int  # trained LoRA adapter parameters (float32); 0 for a full fine-tune
    adapted_inputs: int  # input features of the linears LoRA adapts, summed over one decoder layer
    layers: int
    hidden: int
    intermediate: int
    merged: int = 0  # parameters of the base weights LoRA adapts: the copies a merged push makes of them
    largest: int = 0  # elements of the largest tensor a push sends (the embeddings or the LM head)


def trainer_shape(args: argparse.Namespace) -> TrainerShape | None:
    """From --model's config alone (no weights are read); None when it cannot be read, --dtype auto resolved, or
    --lora-target-modules names no module of it (the LoRA targets row)."""
    dtype = trainer_dtype(args)
    if dtype is None or model_shape_error(args) is not None:
        return None
    config = AutoConfig.from_pretrained(args.model)
    text = config.get_text_config()
    adapter = adapted = merged = 0
    if args.use_peft:
        from peft.tuners.lora import LoraLayer

        try:
            model = lora_model(args)
        except ValueError:  # PEFT's NoMatchingPeftModuleError
            return None
        adapter = model.get_nb_trainable_parameters()[0]
        layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
        adapted = sum(m.in_features for m in layers) // text.num_hidden_layers
        merged = sum(m.get_base_layer().weight.numel() for m in layers)
    intermediate = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
    return TrainerShape(model_shape(args.model)[0], torch.finfo(getattr(torch, dtype)).bits // 8, adapter, adapted,
                        text.num_hidden_layers, text.hidden_size, intermediate, merged,
                        text.hidden_size * max(text.vocab_size, intermediate))


class CheckpointDisk(NamedTuple):
    """Bytes a run writes into --output-dir: its checkpoints while it trains, the merged model (LoRA) at the end."""
    each: int  # one checkpoint-N
    kept: int  # how many the rotation keeps (--save-total-limit)
    merged: int  # <output dir>/merged, written once at the end; 0 for a full fine-tune
    peak: int  # the most the output dir holds at once


def checkpoint_disk(args: argparse.Namespace, shape: TrainerShape) -> CheckpointDisk:
    kept = args.save_total_limit or max(1, args.max_steps // args.save_steps)
    if args.use_peft:
        # transformers saves a PEFT model's adapter only, and torch's AdamW state (two moments) of the adapter.
        each, merged = shape.adapter * 4 * 3, shape.params * shape.width
    else:
        # transformers saves the weights and torch's AdamW state (two moments) in the weights' dtype.
        each, merged = shape.params * shape.width * 3, 0
    return CheckpointDisk(each, kept, merged, (kept + 1) * each + merged)  # the oldest goes once the newest is whole


# The trainer's peak memory per token of a packed row, beyond the layer inputs gradient checkpointing keeps, fitted to
# every peak bench/gpu_capacity.py recorded on an H200 through TRL's loss path (gradient checkpointing, fused chunked LM
# head, bf16 autocast, fused AdamW; tests/test_trainer_memory.py holds each within 2 % of the projection): one decoder
# layer recomputed with its gradients costs these bytes per (hidden + intermediate) feature (measured 19.9 / 18.1 in a
# Qwen3-4B full fine-tune at float32 / bfloat16; 12.5-13.1 over a frozen bfloat16 base of 8B-32B), and every linear LoRA
# adapts these per input feature (5.9-6.0: PEFT's dropout copy, its mask and their gradient).
RECOMPUTE_FULL, RECOMPUTE_FROZEN, LORA_INPUT = 20, 13, 6
# The weight push's staging copies: CUDA-IPC pushes bfloat16 copies in 1 GiB chunks (0.7-1.1 GiB over the trainer's
# peak, measured on an H200); no push stages more than the served weights. A merged LoRA push over CUDA IPC keeps
# every merged copy until vLLM's /finish_weight_update instead (CudaIpcWeightTransfer.send_weights says why).
PUSH_STAGING = 2**30
# vLLM loading a pushed tensor allocates beside its own share of the card: the tensor cast to its dtype where the
# dtypes differ, and its loader's working copy; up to this many copies of the largest pushed tensor at vLLM's dtype.
VLLM_PUSH_COPIES = 2
# What torch's caching allocator does not count on the trainer's GPU (kernels' code, library handles, NCCL's buffers):
# a cap on the allocator has to leave it free.
OUTSIDE_ALLOCATOR = 2**29
# vLLM's own buffers beyond weights and KV cache (activations, CUDA graphs, sampler): Qwen3-4B at 0.35 of an H200 held
# 7.5 GiB of weights and 40.5 GiB of KV cache of its 49.1 GiB.
VLLM_BUFFERS = int(1.1 * 2**30)
# What torch's caching allocator reserves beyond the bytes it hands out, as a share of the trainer's own parts (the
# constants above are fitted to peak allocated memory, but running out of memory, and the per-process cap on a shared
# card, act on reserved memory): freed blocks of one size are cached rather than reused for another, and the merged
# copies of a CUDA-IPC push take new blocks beside the step's cached ones. Set by the largest gap on record: Qwen3-4B
# float32 at 32k rows reserved 78.8 GiB over 67.4 projected (+16.8 %); LoRA's gaps are 1-8 % (H200, bench/results),
# the quick start's 4.9 % (31.48 GiB reserved on one H100, its push included).
ALLOCATOR_RESERVE = 0.17
# Past the measured error, so a projection this close to the limit warns instead of passing.
MEMORY_TOLERANCE = 0.05
# The tokens a rollout starts with (system prompt + task) when a row is planned as prompt + turns x tokens per turn
# (docs/capacity.md; the rig's mini-swe-agent prompt is ~1.1k).
PROMPT_TOKENS = 1500


def dtype_bytes(name: str) -> int:
    """Bytes per element of a torch dtype by name ("bfloat16"); 2 where torch has no such dtype."""
    dtype = getattr(torch, name, None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 2


def longest_row(args: argparse.Namespace, max_model_len: int | None) -> int | None:
    """Tokens one trainer rank forwards at most in a micro-batch: TRL packs rollouts into a row up to its token budget
    (unset: vLLM's max_model_len, TRL's own default), or takes per_device_train_batch_size rollouts without one."""
    budget = args.config.token_budget
    if budget is not None and budget > 0:
        return budget
    if not max_model_len:
        return None
    return max_model_len if budget is None else args.config.per_device_train_batch_size * max_model_len


def trainer_peak(shape: TrainerShape, row: int, ranks: int = 1, fsdp: bool = False, backend: str | None = None,
                 served_width: int = 2) -> dict[str, int]:
    """Peak bytes torch's allocator reserves on one trainer GPU in an optimizer step over a `row`-token row, by part;
    on a GPU vLLM shares (`backend` ipc), with what vLLM allocates beside its share while it loads a push of
    `served_width`-byte weights.

    Gradient checkpointing keeps every layer's input (at the weights' width: embeddings and norms run outside bf16
    autocast) until backward, which frees them layer by layer while it adds that layer's gradients: the peak holds the
    larger of the two, plus the layer being recomputed.
    """
    lora = shape.adapter > 0
    trained, width = (shape.adapter, 4) if lora else (shape.params, shape.width)  # PEFT trains float32 adapters
    shard = ranks if fsdp else 1  # FSDP shards weights, gradients and AdamW state; DDP gives every rank all of them
    grads, saved = trained * width // shard, row * shape.layers * shape.hidden * shape.width
    recompute = (RECOMPUTE_FROZEN if lora else RECOMPUTE_FULL) * (shape.hidden + shape.intermediate)
    parts = {"frozen base": shape.params * shape.width // shard if lora else 0,
             # torch's AdamW keeps both moments in the weight's dtype
             f"{'adapters' if lora else 'weights'} + AdamW": 3 * trained * width // shard,
             "gradients" if grads >= saved else "saved layer inputs": max(grads, saved),
             # accelerate's DDP copies every gradient into its buckets (gradient_as_bucket_view off)
             "DDP buckets": grads if ranks > 1 and not fsdp else 0,
             "layer recomputed": row * (recompute + LORA_INPUT * shape.adapted_inputs),
             "push staging": max(min(PUSH_STAGING, 2 * shape.params),
                                 shape.merged * shape.width if lora and backend == "ipc" else 0)}
    parts["allocator reserve"] = int(ALLOCATOR_RESERVE * sum(parts.values()))
    parts["vLLM's push copies"] = VLLM_PUSH_COPIES * shape.largest * served_width if backend == "ipc" else 0
    return {part: n for part, n in parts.items() if n}


def longest_fitting_row(shape: TrainerShape, limit: int, ranks: int, fsdp: bool, upto: int, **push: Any) -> int:
    low, high = 0, upto
    while low < high:
        mid = (low + high + 1) // 2
        fits = sum(trainer_peak(shape, mid, ranks, fsdp, **push).values()) <= limit
        low, high = (mid, high) if fits else (low, mid - 1)
    return low


def vllm_floor(args: argparse.Namespace, shape: TrainerShape, tokens: int) -> int:
    """Bytes a vLLM serving --model needs at the least: bfloat16 weights, the KV cache of one `tokens`-long sequence and
    VLLM_BUFFERS."""
    text = AutoConfig.from_pretrained(args.model).get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_per_token = 2 * shape.layers * getattr(text, "num_key_value_heads", text.num_attention_heads) * head_dim * 2
    return 2 * shape.params + tokens * kv_per_token + VLLM_BUFFERS


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:,.1f} MiB"


def human_bytes(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


# --- Preflight (`--check`, and every run): refuse a setup that would train on nothing, before loading weights ---------
PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
# Where a backend's sandboxes run is said by neither openenv's capabilities nor Harbor's EnvironmentCapabilities.
# Harbor backends whose sandboxes run off this host: they cannot reach a capture proxy advertised as 127.0.0.1.
OFF_HOST_SANDBOXES = {"e2b", "modal", "daytona", "runloop", "langsmith", "ec2", "gke", "ack", "openshift", "novita",
                      "islo", "tensorlake", "cwsandbox", "use-computer", "cua-cloud", "blaxel", "beam", "skypilot",
                      "hf-sandbox", "hyperbrowser", "vercel", "prime", "mosaic", "sail", "kernel"}
# Harbor backends on this host whose sandboxes still get their own network namespace: their 127.0.0.1 is not ours.
OWN_NETWORK_SANDBOXES = {"docker", "podman", "apple-container", "kata"}
# What each cloud backend reads from the environment of the process that starts it (the Harbor server). The server's
# capabilities check them all (the `sandbox` row), but only once it is up; openenv's check_sandbox needs harbor here.
SANDBOX_CREDENTIALS = {"e2b": "E2B_API_KEY", "daytona": "DAYTONA_API_KEY", "runloop": "RUNLOOP_API_KEY"}


class Preflight:
    """The table `--check` prints, one row per check: PASS, WARN (trains, but read this), FAIL (will not train; the fix
    is on the row) or SKIP. It also holds what the checks have found so far, which the checks after them read
    (PREFLIGHT_CHECKS runs them in order) and training takes on (the plan)."""

    def __init__(self, args: argparse.Namespace, server: EmbeddedHarborServer | None = None):
        self.args, self.server = args, server
        self.rows: list[tuple[str, str, str, str]] = []
        self.plan: dict[str, Any] = {"resume": None}  # what training takes from the preflight; rank 0 sends it on
        self.writable = False  # --output-dir takes files
        self.task_spec_read = False  # --tasks parses, before any server is asked for its tasks
        self.sandbox_reachable = True  # credentials and capture URL, as far as this process can tell
        self.served: dict[str, Any] | None = None  # vLLM's model, as it reports it and itself (check_vllm_reachable)
        self.vllm_config: dict[str, Any] | None = None  # its resolved config (/server_info: dev mode only)
        self.vllm_env: dict[str, Any] = {}  # its environment as /server_info reports it
        self.llm_report: Any = None  # OpenEnv's probe of vLLM (validate_llm)
        self.capabilities: dict[str, Any] | None = None  # the Harbor server's, once it answers
        self.splits: list[dict[str, Any]] = []  # the splits it serves

    @functools.cached_property
    def gpu_apps(self) -> dict[str, list[tuple[int, str, float]]] | None:
        """nvidia-smi's processes by GPU UUID (None: no nvidia-smi answers), asked once for the checks that read it."""
        return gpu_processes()

    def add(self, check: str, status: str, detail: str, fix: str = "") -> bool:
        self.rows.append((check, status, redact(detail), fix))
        return status != FAIL

    def confirm(self, check: str, how: str) -> None:
        """A WARN that a later check proved harmless turns PASS, saying how."""
        self.rows = [(c, PASS, f"{d}; {how}", "") if c == check and s == WARN else (c, s, d, f)
                     for c, s, d, f in self.rows]

    def settle(self, check: str, status: str, how: str, fix: str = "") -> bool:
        """A row judged before a later check could look: that check's status (PASS keeps the row's own), saying how."""
        self.rows = [(c, s if status == PASS else status, f"{d}; {redact(how)}", f if status == PASS else fix)
                     if c == check else (c, s, d, f) for c, s, d, f in self.rows]
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

    @functools.cached_property
    def shape(self) -> TrainerShape | None:
        """What the trainer will hold, sized from --model's config (the checkpoints and trainer memory rows)."""
        return trainer_shape(self.args)

    # What a PreflightCheck's `needs` names: a check runs only where each of its needs holds.
    @property
    def training(self) -> bool:
        return not self.args.measure

    @property
    def measuring(self) -> bool:
        return self.args.measure

    @property
    def peft(self) -> bool:
        return self.args.use_peft

    @property
    def vllm_answers(self) -> bool:
        return self.served is not None

    @property
    def vllm_dev_mode(self) -> bool:
        return self.vllm_config is not None

    @property
    def ipc(self) -> bool:
        """vLLM shares the trainer's GPU and takes its pushes as CUDA-IPC handles."""
        return (self.served or {}).get("weight_transfer") == "ipc"

    @property
    def own_server(self) -> bool:
        return self.server is not None

    @property
    def vllm_down(self) -> bool:
        return self.training and self.served is None

    @property
    def ready_for_harbor(self) -> bool:
        """What the Harbor server's checks build on: it samples from vLLM (measuring: from its own engine), writes its
        log into --output-dir, starts the sandboxes and serves --tasks."""
        return ((self.measuring or self.vllm_answers) and self.writable and self.sandbox_reachable
                and self.task_spec_read)

    @property
    def harbor_answers(self) -> bool:
        return self.capabilities is not None

    @property
    def split_served(self) -> bool:
        return "split" in self.plan

    @property
    def tasks_found(self) -> bool:
        return "tasks" in self.plan

    @property
    def eval_tasks_given(self) -> bool:
        return bool(self.args.eval_tasks) and self.training


def check_output_dir(pf: Preflight) -> None:
    out = Path(pf.args.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        pf.add("output dir", FAIL, f"cannot write to {out} ({exc.strerror})",
               "give a writable --output-dir (checkpoints and logs go there)")
        return
    pf.writable = pf.add("output dir", PASS, str(out))


def check_resume(pf: Preflight) -> None:
    try:
        resume = resolve_resume(pf.args)
    except UsageError as exc:
        pf.add("resume", FAIL, str(exc))
        return
    if mismatch := lora_mismatch(pf.args, resume):
        pf.add("resume", FAIL, mismatch)
        return
    pf.add("resume", PASS, resume or "fresh start")
    pf.plan["resume"] = resume


def check_task_spec(pf: Preflight) -> None:
    """The --tasks file or spec alone; which of its tasks the server serves is the later tasks row."""
    try:
        read_task_spec(pf.args.tasks)
    except UsageError as exc:
        pf.add("tasks", FAIL, str(exc))
        return
    pf.task_spec_read = True


def check_measure(pf: Preflight) -> None:
    # Measuring samples through the Harbor server's own engine and loads no weights: the trainer's vLLM, its weight
    # sync and its capture tier do not matter.
    pf.add("measure", PASS, f"{pf.args.eval_k} rollouts per task, {pf.args.max_inflight} in flight; no trainer")


def check_grpo(pf: Preflight) -> None:
    pf.add("GRPO", PASS, f"{pf.args.num_generations} generations per group, {pf.args.max_inflight} rollouts in flight")


def http_json(url: str, timeout: float = 10.0) -> Any:
    """TRL's VLLMClient reads /v1/models and /server_info too, but with no timeout (a port that accepts and never
    answers hangs the preflight) and without the served model's id."""
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read())


def check_vllm_reachable(pf: Preflight) -> None:
    """What vLLM serves and says of itself, asked once: the rows after this one judge it."""
    args = pf.args
    try:
        served = http_json(f"{args.vllm_url}/v1/models")["data"][0]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        pf.add("vLLM reachable", FAIL, f"vLLM is not reachable at {args.vllm_url} ({exc})",
               "start it first (the `vllm serve` command in this script's docstring) or fix --vllm-url")
        return
    pf.add("vLLM reachable", PASS, f"{args.vllm_url} serves {served['id']}")
    # vLLM's resolved config, behind VLLM_SERVER_DEV_MODE like the weight-sync routes: where it answers, it says what
    # a probe can only infer (TRL reads the served dtype from it too).
    try:
        info = http_json(f"{args.vllm_url}/server_info?config_format=json")
        config, model_config = info["vllm_config"], info["vllm_config"]["model_config"]
    except (OSError, ValueError, KeyError, TypeError):
        info, config, model_config = {}, None, {}
    pf.vllm_config, pf.vllm_env = config, info.get("vllm_env") or {}
    # The one place the backend is decided: vLLM's own --weight-transfer-config (build_trainer and the trainer-memory
    # row follow it), with the share of the GPU vLLM sized itself to.
    served["weight_transfer"] = ((config or {}).get("weight_transfer_config") or {}).get("backend")
    served["gpu_memory_utilization"] = ((config or {}).get("cache_config") or {}).get("gpu_memory_utilization")
    served["dtype"] = str(model_config.get("dtype") or "").removeprefix("torch.") or None
    served["max_model_len"] = served.get("max_model_len") or model_config.get("max_model_len")
    served["logprobs_mode"] = model_config.get("logprobs_mode")
    pf.served = served
    pf.plan["max_model_len"], pf.plan["weight_transfer"] = served["max_model_len"], served["weight_transfer"]
    pf.llm_report = validate_llm(args.vllm_url, served["id"], timeout=60.0)


def check_served_model(pf: Preflight) -> None:
    args, served = pf.args, pf.served
    names = {served["id"], served.get("root") or ""}
    if args.model in names or Path(args.model.rstrip("/")).name in {Path(n.rstrip("/")).name for n in names if n}:
        pf.add("served model", PASS, f"--model {args.model} is what vLLM serves")
    else:
        pf.add("served model", FAIL, f"vLLM serves {served.get('root') or served['id']} but --model is {args.model}: "
               "the trainer would push its weights into another model", "serve --model with vLLM, or fix --model")


def check_capture_tier(pf: Preflight) -> None:
    """Token ids from OpenEnv's probe; processed logprobs from vLLM's own config where it answers, else measured.

    The probe measures logprobs at two temperatures and cannot tell on a near-uniform model (a random or tiny one);
    vLLM's `--logprobs-mode` in /server_info decides it whatever the model.
    """
    report, logprobs_mode = pf.llm_report, pf.served["logprobs_mode"]
    fix = "restart vLLM with --logprobs-mode processed_logprobs"
    if logprobs_mode and logprobs_mode != "processed_logprobs":
        what = ("pre-temperature logprobs (vLLM's default)" if logprobs_mode == "raw_logprobs"
                else "logits, not logprobs")
        pf.add("capture tier", FAIL, f"vLLM's /server_info: logprobs_mode {logprobs_mode}, i.e. {what}: every "
               "importance ratio would be wrong, so the proxy grades its rollouts eval tier", fix)
    elif report.logprobs_mode == "raw":  # OpenEnv's probe then grades the engine eval tier whatever vLLM says
        pf.add("capture tier", FAIL, "the engine returns raw (pre-temperature) logprobs, measured: every importance "
               "ratio would be wrong, so the proxy grades its rollouts eval tier", fix)
    elif report.capture_level != "tokens":
        flags = {"logprobs": "--return-tokens-as-token-ids"}.get(
            report.capture_level, "--return-tokens-as-token-ids --logprobs-mode processed_logprobs")
        pf.add("capture tier", FAIL, f"the engine's rollouts would be eval tier ({report.capture_level or 'nothing'} "
               "captured, no token ids): nothing to train on", f"restart vLLM with {flags}")
    elif logprobs_mode:
        pf.add("capture tier", PASS, "train: token ids + processed logprobs (vLLM's /server_info: logprobs_mode "
               "processed_logprobs)")
    elif report.logprobs_mode == "processed":
        pf.add("capture tier", PASS, "train: token ids + processed logprobs (measured at two temperatures)")
    else:
        pf.add("capture tier", WARN, "train: token ids + logprobs, but whether they are processed (temperature-"
               "scaled) could not be measured, and vLLM's /server_info (dev mode) did not say",
               "make sure vLLM runs with --logprobs-mode processed_logprobs")


def check_tool_calls(pf: Preflight) -> None:
    tools = {"ok": (PASS, "a tool call round-trips"),
             "rejected": (FAIL, "vLLM refuses tool calls, which every agent harness makes"),
             "no-tool-call": (WARN, "the model answered a tool request in prose"),
             "unknown": (WARN, "could not tell whether tool calls work")}
    status, detail = tools.get(pf.llm_report.tool_support, (WARN, "not probed"))
    pf.add("tool calls", status, detail,
           "serve with --enable-auto-tool-choice --tool-call-parser <the parser of your model family, hermes for "
           "Qwen3>")


def check_weight_transfer(pf: Preflight) -> None:
    if pf.vllm_config is None:
        pf.add("weight transfer", FAIL, "vLLM's dev endpoints are off: the trainer cannot push weights after a step",
               "restart vLLM with VLLM_SERVER_DEV_MODE=1 in its environment")
        return
    backend = pf.served["weight_transfer"]
    if not pf.vllm_config.get("weight_transfer_config"):
        pf.add("weight transfer", FAIL, "vLLM has no weight transfer engine: the trainer cannot push weights",
               "restart vLLM with --weight-transfer-config '{\"backend\":\"nccl\"}'")
    elif backend == "ipc" and pf.vllm_env.get("VLLM_ALLOW_INSECURE_SERIALIZATION") is False:
        # vLLM's ipc backend unpickles every push (its CUDA-IPC handles): it must be allowed to.
        pf.add("weight transfer", FAIL, "vLLM serves the ipc backend without VLLM_ALLOW_INSECURE_SERIALIZATION=1 "
               "(its /server_info): it would refuse to unpickle the CUDA-IPC handles of every push",
               "restart vLLM with VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1 in its environment and "
               "--host 127.0.0.1")
    elif backend == "ipc":
        pf.add("weight transfer", PASS, "enabled (ipc): weights pushed as CUDA-IPC handles, vLLM on the trainer's GPU")
    elif backend == "nccl":
        pf.add("weight transfer", PASS, f"enabled ({backend})")
    else:
        pf.add("weight transfer", FAIL, f"vLLM's weight transfer backend is {backend!r}: this script pushes over "
               "nccl (vLLM on a GPU of its own) or ipc (vLLM on the trainer's GPU)",
               "restart vLLM with --weight-transfer-config '{\"backend\":\"nccl\"}' (two GPUs) or "
               "'{\"backend\":\"ipc\"}' with --host 127.0.0.1 (one GPU, shared)")


def url_port(url: str) -> int:
    parts = urllib.parse.urlsplit(url)
    return parts.port or (443 if parts.scheme == "https" else 80)


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listening_sockets(port: int) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, str]]:
    """(address, socket inode) of every TCP socket listening on `port` in this network namespace."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                address, hex_port = fields[1].split(":")
                if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: TCP_LISTEN
                    raw = bytes.fromhex(address)  # 32-bit words, each in the kernel's (little-endian) byte order
                    ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
                    found.append((getattr(ip, "ipv4_mapped", None) or ip, fields[9]))
    return found


def check_vllm_on_loopback(pf: Preflight) -> None:
    """Dev mode (VLLM_SERVER_DEV_MODE, which the weight push needs) serves /collective_rpc and the weight-transfer
    routes to whoever reaches vLLM's port: with ipc they unpickle what they are sent (FAIL beyond loopback); with nccl
    they let anyone pause vLLM or load other weights into it (WARN: a multi-node run needs vLLM reachable)."""
    args = pf.args
    url, port = urllib.parse.urlsplit(args.vllm_url), url_port(args.vllm_url)
    listening = [address for address, _ in listening_sockets(port)]
    if pf.ipc:
        status, elsewhere = FAIL, ""
        danger = "with ipc vLLM unpickles every weight push, so whoever reaches it can run code as vLLM's user"
    else:
        status = WARN
        danger = ("vLLM runs in dev mode (its /server_info answers), so whoever reaches it can call /collective_rpc "
                  "and the weight-transfer routes: pause it, or load other weights into it")
        elsewhere = ("; a multi-node run needs vLLM reachable from the trainer's node: there, keep its port inside the "
                     "cluster's private network")
    if not is_loopback(url.hostname or ""):
        pf.add("vLLM on loopback", status, f"--vllm-url {args.vllm_url} is not a loopback address: {danger}",
               f"serve vLLM with --host 127.0.0.1 and give --vllm-url http://127.0.0.1:{port}{elsewhere}")
    elif exposed := [str(a) for a in listening if not a.is_loopback]:
        pf.add("vLLM on loopback", status, f"vLLM listens on {exposed[0]} port {port}, beyond this host: {danger}",
               f"restart vLLM with --host 127.0.0.1{elsewhere}")
    elif not listening:
        pf.add("vLLM on loopback", WARN, f"--vllm-url is loopback, but no socket listening on port {port} is visible "
               "here (another network namespace?): whether vLLM is reachable beyond this host is unknown",
               "make sure vLLM runs with --host 127.0.0.1")
    elif pf.ipc and (job := next((f"{name}={os.environ[name]}" for name in ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")
                                  if os.environ.get(name)), None)):
        # Loopback keeps other hosts out, not the other users of this one: a scheduler's node runs their jobs too.
        pf.add("vLLM on loopback", WARN, f"vLLM listens on {', '.join(sorted({str(a) for a in listening}))} port "
               f"{port} only, but this host is shared ({job}: a scheduler's node, other users' jobs may run on it) "
               f"and every local user reaches its loopback: {danger}",
               "run the job on a node of its own (SLURM: --exclusive), or serve vLLM on a GPU of its own with "
               "--weight-transfer-config '{\"backend\":\"nccl\"}', which unpickles nothing")
    else:
        pf.add("vLLM on loopback", PASS, f"vLLM listens on {', '.join(sorted({str(a) for a in listening}))} port "
               f"{port} only")


def check_trainer_ranks(pf: Preflight) -> None:
    if (ranks := int(os.environ.get("WORLD_SIZE", "1"))) > 1:
        pf.add("trainer ranks", FAIL, f"{ranks} trainer processes (WORLD_SIZE): vLLM's ipc backend takes each push "
               "from one process on its GPU",
               "launch one trainer process (python or uv run, not accelerate launch / torchrun), or serve vLLM on a "
               "GPU of its own with --weight-transfer-config '{\"backend\":\"nccl\"}'")


def check_dtype(pf: Preflight) -> None:
    """The precision the trainer scores at against the one vLLM samples at: on a GPU the trainer computes under bf16
    autocast whatever its weights are (the config's bf16, HarborGRPOConfig; accelerate wraps the forward),
    elsewhere in its weights' dtype. TRL's own start-up warning compares weight dtypes only."""
    if pf.vllm_config is None:
        pf.add("dtype", SKIP, "vLLM's dev endpoints are off, so its dtype cannot be read")
        return
    args, served_dtype, on_gpu = pf.args, pf.served["dtype"] or "", pf.args.bf16
    trains = trainer_dtype(args)
    computes = "bfloat16" if on_gpu else trains
    weights = f"the trainer's weights are {trains} (--dtype {args.dtype})"
    if not served_dtype:
        pf.add("dtype", WARN, "vLLM did not report its dtype")
    elif computes is None:
        pf.add("dtype", WARN, f"vLLM serves {served_dtype}; --dtype auto could not be resolved "
               f"({model_shape_error(args)})")
    elif served_dtype == computes == trains:
        pf.add("dtype", PASS, f"vLLM serves {served_dtype}, {weights}")
    elif served_dtype == computes:
        # 2 x H200: step-1 importance ratio 1.0004, kl 0.002 (bench/results/2026-12-01-h200.md).
        pf.add("dtype", PASS, f"vLLM serves bfloat16 and the trainer scores under bfloat16 autocast; {weights}, "
               "rounded to bfloat16 by each push (TRL's start-up warning about this is expected)")
    elif on_gpu:
        pf.add("dtype", WARN, f"vLLM serves {served_dtype}, the trainer scores under bfloat16 autocast on GPU "
               f"whatever its weights ({trains}): the precision gap shows up in every importance ratio",
               "serve with vLLM's --dtype bfloat16")
    else:
        pf.add("dtype", WARN, f"vLLM serves {served_dtype}, {weights}; TRL warns about this at start too. Each push "
               "rounds them to the served dtype, and the precision gap between trainer and server shows up in the "
               "importance ratio",
               f"serve with vLLM's --dtype {trains} to match, or train in {served_dtype} after reading --dtype's help "
               "(its risk at small learning rates)")


def check_lora_engine(pf: Preflight) -> None:
    if pf.vllm_config.get("lora_config"):
        # TRL would then sync the adapter alone, registered as `trl-policy-vN`, which only its own worker asks for:
        # the capture proxy asks for the served model, so every rollout would sample the untrained base.
        pf.add("LoRA", FAIL, "vLLM runs with --enable-lora (its /server_info has a lora_config): TRL would push the "
               "adapter under its own names, which the Harbor capture proxy never requests, so every rollout would "
               "sample the untrained base model",
               "restart vLLM without --enable-lora (and its --max-lora-rank / --max-loras): --use-peft pushes merged "
               "weights")
    else:
        pf.add("LoRA", PASS, f"merged sync: every push sends the base weights with the r={pf.args.lora_r} adapter "
               "folded in (vLLM runs without --enable-lora)")


# What mini-swe-agent 2.4.6 shows the model of a command's output each turn (its config/mini.yaml, which Harbor's
# install runs with `-c mini`): all of it under 10,000 characters, else the first and the last 5,000.
MINI_SWE_AGENT_OUTPUT_CHARS = 10_000


def check_context(pf: Preflight) -> None:
    """A rollout's context grows each turn by the completion and by the command output the harness shows back. The
    completions are capped (--max-completion-length); the output is whatever the policy's commands print, up to the
    harness's own cut: this row counts the first and names the tokens left for the second."""
    args, max_len = pf.args, pf.served["max_model_len"]
    turns, completion = args.agent_step_limit, args.max_completion_length
    worst = PROMPT_TOKENS + turns * completion
    counted = f"~{PROMPT_TOKENS:,}-token prompt + {turns} turns x {completion} tokens = {worst:,}"
    if set(args.harnesses) == {"mini-swe-agent"}:
        output = (f"the command output mini-swe-agent shows back each turn (all of it up to "
                  f"{MINI_SWE_AGENT_OUTPUT_CHARS:,} characters, else the first and last "
                  f"{MINI_SWE_AGENT_OUTPUT_CHARS // 2:,})")
    else:
        output = "the command output the harness shows back each turn"
    if not max_len:
        pf.add("context", WARN, "vLLM did not report its max_model_len")
    elif worst > max_len:
        pf.add("context", WARN, f"{counted} > vLLM's max_model_len {max_len:,}, before {output}: a rollout that uses "
               "its whole turn budget ends at the context limit",
               "lower --agent-step-limit or --max-completion-length, or raise vLLM's --max-model-len")
    else:
        pf.add("context", PASS, f"{counted} fit max_model_len {max_len:,}; {max_len - worst:,} tokens are left for "
               f"{output}, which depends on the commands and is not counted here: a rollout whose commands print "
               "more ends at the context limit")


def tied_lora_targets(model: Any) -> list[str]:
    """The modules of a PEFT model whose LoRA adapter sits on a weight the model ties to another: its input
    embeddings and its output head share one tensor, and an adapter on one of them leaves the other at the base."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    pair = [m.get_base_layer() if isinstance(m, LoraLayer) else m
            for m in (base.get_input_embeddings(), base.get_output_embeddings())]
    if None in pair or pair[0].weight is not pair[1].weight:
        return []
    return [name for name, m in base.named_modules() if isinstance(m, LoraLayer)
            and m.get_base_layer().weight is pair[0].weight]


def check_lora_targets(pf: Preflight) -> None:
    args = pf.args
    if model_shape_error(args) is not None:
        return  # the checkpoints row says why --model's config cannot be read
    try:
        lora = lora_model(args)
    except ValueError as exc:  # PEFT's NoMatchingPeftModuleError
        pf.add("LoRA targets", FAIL, f"--lora-target-modules: {exc}", "name modules of --model, or all-linear")
        return
    if tied := tied_lora_targets(lora):
        pf.add("LoRA targets", FAIL, f"--lora-target-modules {' '.join(args.lora_target_modules or [])} puts an "
               f"adapter on {', '.join(tied)}, whose weight {args.model} ties between its input embeddings and its "
               "output head: the adapter would change one of the two only, and the merged push both",
               "leave embed_tokens and lm_head out of --lora-target-modules (all-linear does), or train without "
               "--use-peft")


def check_precision(pf: Preflight) -> None:
    args, dtype = pf.args, trainer_dtype(pf.args)
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" and dtype not in (None, "float32"):
        # accelerate's FSDP2 prepare upcasts trainable parameters to float32 after TRL has told vLLM their dtype,
        # so every push would send other bytes than vLLM expects (fsdp_utils: "Upcast to fp32 master weights").
        pf.add("precision", FAIL, f"--dtype {args.dtype} under FSDP: accelerate upcasts the weights to float32 "
               f"after TRL announced them to vLLM as {dtype}, so weight pushes would not match",
               "--dtype float32 (FSDP keeps float32 weights anyway and computes in bf16)")
    elif os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" and args.use_peft:
        # The merged push folds the adapter in per layer from local tensors (HarborGRPOTrainer._streaming_iter).
        pf.add("precision", FAIL, "--use-peft under FSDP: this script's merged push reads whole adapter tensors, "
               "which FSDP shards", "train LoRA on one trainer process (docs/capacity.md, LoRA), or without FSDP")
    elif args.use_peft and dtype is not None:
        # The trained tensors are the adapters, float32 whatever --dtype (PEFT's autocast_adapter_dtype).
        half_step = 2.0 ** math.floor(math.log2(0.02)) * torch.finfo(torch.float32).eps / 2
        pf.add("precision", PASS if args.learning_rate >= half_step else WARN,
               f"LoRA: base weights {dtype}, frozen; adapters and their AdamW moments float32 (steps of "
               f"~{args.learning_rate:g} land); each push rounds the folded-in base once to {dtype}, never the "
               "trainer's copy")
    elif dtype in ("bfloat16", "float16", "float32"):
        # An AdamW step moves a weight by about the learning rate. Below half the dtype's spacing at a typical
        # weight (0.02, Qwen3's initializer range) the sum rounds back to the old weight: no update at all.
        typical = 0.02
        half_step = 2.0 ** math.floor(math.log2(typical)) * torch.finfo(getattr(torch, dtype)).eps / 2
        if args.learning_rate < half_step:
            pf.add("precision", WARN, f"{dtype} weights: an AdamW step moves a weight by ~--learning-rate "
                   f"{args.learning_rate:g}, below half the {dtype} spacing at |w| = {typical} ({half_step:.1e}): "
                   "most updates round to no change and the run silently stops learning",
                   f"--dtype float32 (docs/capacity.md), or a learning rate well above {half_step:.0e}")
        else:
            pf.add("precision", PASS, f"{dtype} weights: AdamW steps of ~{args.learning_rate:g} exceed half the "
                   f"{dtype} spacing at |w| = {typical} ({half_step:.1e})")


def check_checkpoints(pf: Preflight) -> None:
    args, shape, dtype = pf.args, pf.shape, trainer_dtype(pf.args)
    if (problem := model_shape_error(args)) is not None:
        pf.add("checkpoints", SKIP, f"size unknown: {problem}")
        return
    if not pf.writable or shape is None:  # the output dir's row, or a --lora-target-modules without a shape to size
        return
    disk, free = checkpoint_disk(args, shape), shutil.disk_usage(args.output_dir).free
    pf.plan["checkpoint_bytes"] = disk.each
    written = f"{disk.kept} kept (--save-total-limit {args.save_total_limit}) + 1 being written"
    if args.use_peft:
        detail = (f"~{human_bytes(disk.each)} each ({shape.adapter / 1e6:.2f} M adapter params x 12 B: float32 "
                  f"adapter + 2 AdamW moments); {written}, and the merged model at the end "
                  f"({human_bytes(disk.merged)}) = {human_bytes(disk.peak)}; {human_bytes(free)} free in "
                  f"{args.output_dir}")
    else:
        params = shape.params
        count = f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params / 1e6:.2f} M"
        detail = (f"~{human_bytes(disk.each)} each ({count} params x {3 * shape.width} B: {dtype} weights + 2 AdamW "
                  f"moments); {written} = {human_bytes(disk.peak)}; {human_bytes(free)} free in {args.output_dir}")
    pf.add("checkpoints", WARN if free < disk.peak else PASS, detail,
           "free disk space, lower --save-total-limit, or give an --output-dir on a larger disk")


def nvidia_smi(*query: str) -> str | None:
    """What `nvidia-smi QUERY` prints; None when no nvidia-smi answers."""
    try:
        return subprocess.run(["nvidia-smi", *query], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_processes() -> dict[str, list[tuple[int, str, float]]] | None:
    """GPU uuid -> [(pid, command line, GiB)] of the compute processes nvidia-smi lists; None when it cannot."""
    out = nvidia_smi("--query-compute-apps=gpu_uuid,pid,used_memory,process_name", "--format=csv,noheader,nounits")
    if out is None:
        return None
    apps: dict[str, list[tuple[int, str, float]]] = {}
    for line in out.splitlines():
        uuid, pid, mib, name = ([*(x.strip() for x in line.split(",", 3))] + ["", "", "", ""])[:4]
        if not pid.isdigit():
            continue
        # vLLM titles its GPU processes VLLM::EngineCore / VLLM::Worker_*; nvidia-smi may show only `python`.
        with contextlib.suppress(OSError):
            name = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace") or name
        apps.setdefault(uuid.lower().removeprefix("gpu-"), []).append(
            (int(pid), name, float(mib) / 1024 if mib.replace(".", "").isdigit() else 0.0))
    return apps


def cpu_shares_cuda() -> bool:
    """Whether a CPU trainer's push hands vLLM CUDA memory: torch shares none from CPU tensors (the CPU tests stand in
    for it)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    return reduce_tensor(torch.zeros(1))[0] is rebuild_cuda_tensor


def cpu_pushes_nccl() -> bool:
    """Whether a CPU trainer can push to an nccl vLLM: NCCL moves GPU memory only, and torch builds it only with CUDA
    (the CPU tests stand in for NCCL over HTTP)."""
    return torch.distributed.is_nccl_available()


# The oldest NVIDIA driver (Linux) that runs a build of each CUDA major version: NVIDIA's CUDA minor version
# compatibility table (CUDA 13.x: >= 580; CUDA 13.0 GA shipped with 580.65.06). torch 2.13's wheels are CUDA 13.0.
CUDA_DRIVER_FLOOR = {13: 580, 12: 525, 11: 450}


def nvidia_driver() -> str | None:
    """The NVIDIA driver's version as nvidia-smi reports it (e.g. 580.65.06); None when no nvidia-smi answers."""
    out = nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader") or ""
    return next((line.strip() for line in out.splitlines() if line.strip()), None)


def driver_problem() -> tuple[str, str]:
    """Why this process sees no CUDA device, as far as the driver tells: (what was found, the fix)."""
    cuda, driver = torch.version.cuda, nvidia_driver()
    floor = CUDA_DRIVER_FLOOR.get(int(cuda.split(".")[0])) if cuda else None
    need = f"NVIDIA driver >= {floor} (Linux), the oldest that runs CUDA {cuda}" if floor else "a newer NVIDIA driver"
    if driver is None:
        return "no NVIDIA driver answers (nvidia-smi is missing or fails)", f"install {need}"
    if floor and driver.split(".")[0].isdigit() and int(driver.split(".")[0]) < floor:
        return f"the NVIDIA driver is {driver}, too old for CUDA {cuda}", f"install {need}"
    return (f"the NVIDIA driver is {driver}{f', new enough for CUDA {cuda},' if floor else ''} but no GPU is visible "
            "to this process",
            "make the trainer's GPU visible: CUDA_VISIBLE_DEVICES=<its index or GPU-UUID, nvidia-smi -L>")


def check_trainer_gpu(pf: Preflight) -> None:
    if not torch.cuda.is_available():
        visible = f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}"
        if torch.version.cuda:
            found, fix = driver_problem()
            pf.add("trainer GPU", FAIL, f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but sees "
                   f"no CUDA device ({visible}): {found}", fix)
        elif torch.version.hip:
            pf.add("trainer GPU", FAIL, f"torch {torch.__version__} is built for ROCm {torch.version.hip} but sees "
                   f"no GPU ({visible})", "make the trainer's GPU visible (HIP_VISIBLE_DEVICES), or check its driver")
        elif pf.ipc and not cpu_shares_cuda():
            pf.add("trainer GPU", FAIL, f"no CUDA device visible to the trainer (torch {torch.__version__}, "
                   f"{visible}), but vLLM serves the ipc backend: CUDA IPC cannot push weights from a CPU trainer",
                   "run this script on vLLM's GPU (CUDA_VISIBLE_DEVICES=GPU-<its UUID, nvidia-smi -L>) with a CUDA "
                   "build of torch (`uv run` installs it from this script's header)")
        elif not pf.ipc and not cpu_pushes_nccl():
            pf.add("trainer GPU", FAIL, f"no CUDA device visible to the trainer (torch {torch.__version__}, a CPU "
                   f"build; {visible}): it pushes its weights to vLLM over NCCL, which moves GPU memory only",
                   "run this script on a GPU of its own with a CUDA build of torch (`uv run` installs it from this "
                   f"script's header; it needs NVIDIA driver >= {CUDA_DRIVER_FLOOR[13]})")
        else:
            pf.add("trainer GPU", SKIP, "no CUDA device visible: the trainer runs on CPU")
        return
    fix = ("give vLLM and the trainer different GPUs: CUDA_VISIBLE_DEVICES=0 for `vllm serve`, CUDA_VISIBLE_DEVICES=1 "
           "for this script (NCCL refuses two ranks on one device)")
    apps = pf.gpu_apps
    # The trainer's ranks on this node take the first visible GPUs, one each.
    local = min(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()) if apps is not None else 0
    held, shared, free = [], [], []
    for index in range(local):
        props = torch.cuda.get_device_properties(index)
        label = f"cuda:{index} ({props.name})"
        others = [a for a in apps.get(str(props.uuid).lower().removeprefix("gpu-"), []) if a[0] != os.getpid()]
        vllm = [a for a in others if "vllm" in a[1].lower()]
        if vllm:
            held.append(f"{label} is vLLM's: pid {vllm[0][0]} holds {sum(a[2] for a in vllm):.1f} GiB")
        elif others:
            shared.append(f"{label}: {len(others)} other process(es) hold {sum(a[2] for a in others):.1f} GiB")
        else:
            free.append(label)
    if pf.ipc:
        pf.add("trainer GPU", PASS, f"{'; '.join(held + shared) or ', '.join(free) or 'cuda:0'}: shared with vLLM on "
               "purpose (the ipc backend pushes weights within one card)")
    elif held:
        pf.add("trainer GPU", FAIL, "; ".join(held), fix)
    elif apps is None:
        # No nvidia-smi (or none that answers): memory is all that can be seen, and only for rank 0's own GPU.
        free_b, total_b = torch.cuda.mem_get_info(0)
        pf.add("trainer GPU", WARN if (total_b - free_b) / total_b > 0.25 else PASS,
               f"cuda:0: {(total_b - free_b) / 2**30:.1f} of {total_b / 2**30:.0f} GiB already in use (nvidia-smi "
               "unavailable, so who holds it is unknown)", fix)
    elif shared:
        pf.add("trainer GPU", WARN, "; ".join(shared) + "; the trainer needs the whole card", fix)
    else:
        pf.add("trainer GPU", PASS, f"{', '.join(free)}: no other process on it")


def serving_processes(port: int) -> set[int]:
    """The processes holding a socket listening on `port`, and all their descendants: vLLM's API server holds the
    port, its engine core (the process on the GPU) is a child of it."""
    inodes = {f"socket:[{inode}]" for _, inode in listening_sockets(port)}
    parents, tree = {}, set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):  # gone meanwhile, or another user's
            parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                tree.add(int(proc.name))
    while grown := {pid for pid, parent in parents.items() if parent in tree} - tree:
        tree |= grown
    return tree


def check_same_gpu(pf: Preflight) -> None:
    """CUDA IPC maps memory of one physical GPU: vLLM must run on the trainer's own, by UUID (indices differ with
    CUDA_VISIBLE_DEVICES)."""
    if not torch.cuda.is_available():
        pf.add("same GPU", SKIP, "no CUDA device visible: CUDA IPC needs the trainer on vLLM's GPU" if cpu_shares_cuda()
               else "not compared: the trainer has no CUDA device (the trainer GPU row)")
        return
    apps, vllm_url = pf.gpu_apps, pf.args.vllm_url
    props = torch.cuda.get_device_properties(0)
    mine = str(props.uuid).lower().removeprefix("gpu-")
    fix = "start this script with vLLM's GPU visible first: CUDA_VISIBLE_DEVICES=GPU-<its UUID, nvidia-smi -L>"
    if apps is None:
        pf.add("same GPU", WARN, "nvidia-smi is unavailable, so which GPU vLLM runs on is unknown: a push from "
               "another GPU fails at the first step", fix)
        return
    mig = (mine.startswith("mig-") or " MIG " in f" {props.name} "
           or os.environ.get("CUDA_VISIBLE_DEVICES", "").upper().startswith("MIG-"))
    if mig or any(uuid.startswith("mig-") for uuid in apps):
        # A MIG instance's UUID is not its parent GPU's, and nvidia-smi lists processes by either: no comparison
        # of the two tells whether vLLM shares the trainer's instance.
        pf.add("same GPU", WARN, f"cuda:0 ({props.name}) is a MIG instance ({str(props.uuid)}): whether vLLM runs "
               "on the same GPU instance could not be verified; a push from another fails at the first step",
               "start vLLM and this script with the same CUDA_VISIBLE_DEVICES=MIG-<UUID, nvidia-smi -L>")
        return
    port = url_port(vllm_url)
    server = serving_processes(port) - {os.getpid()}
    how = f"the processes serving port {port}"
    vllm = {uuid: [a for a in procs if a[0] in server] for uuid, procs in apps.items()}
    if not any(vllm.values()):  # its processes unseen here (another user's, another PID namespace): by name
        how = "the processes named vllm"
        vllm = {uuid: [a for a in procs if "vllm" in a[1].lower() and a[0] != os.getpid()]
                for uuid, procs in apps.items()}
    vllm = {uuid: procs for uuid, procs in vllm.items() if procs}
    if mine in vllm:
        pf.add("same GPU", PASS, f"cuda:0 ({props.name}, GPU-{mine}) is vLLM's GPU ({how}: pid {vllm[mine][0][0]})")
    elif vllm:
        theirs = next(iter(vllm))
        pf.add("same GPU", FAIL, f"vLLM runs on GPU-{theirs} ({how}: pid {vllm[theirs][0][0]}), the trainer on "
               f"cuda:0 = GPU-{mine}: CUDA IPC reaches only the same physical GPU",
               f"start this script with CUDA_VISIBLE_DEVICES=GPU-{theirs}")
    else:
        pf.add("same GPU", WARN, "no process of vLLM's shows on any GPU here (nvidia-smi), so whether it runs on "
               f"cuda:0 (GPU-{mine}) is unknown: a push from another GPU fails at the first step", fix)


def check_attention_kernel(pf: Preflight) -> None:
    """TRL's own kernel loader, now: the hub download and the GPU check take seconds here, not a failed first step
    after weights, the first weight push and the first paid sandbox group. TRL caches the module it returns."""
    if not torch.cuda.is_available():
        pf.add("attention kernel", SKIP, "CUDA only: TRL's tree attention runs FlashAttention-3 from the hub "
               "(kernels-community/flash-attn3), which has no CPU build")
        return
    repo = "kernels-community/aiter-flash-attn (version 2)" if torch.version.hip else \
        "kernels-community/flash-attn3 (version 1)"
    props = torch.cuda.get_device_properties(0)
    gpu = f"{props.name} (compute capability {props.major}.{props.minor}), torch {torch.__version__}"
    gpu_fix = ("TRL 1.16's AsyncGRPO attends only through this kernel: train on a GPU it is built for "
              "(FlashAttention-3: Hopper, compute capability 9.0, e.g. H100 / H200)")
    try:
        # private: TRL's own kernel loader, which caches what it loads; no public call loads it
        kernel = packing._flash_attn()
    except ImportError as exc:
        pf.add("attention kernel", FAIL, f"TRL's tree attention imports `kernels`: {exc}",
               "install it: pip install 'kernels>=0.17.2,<0.19' (`uv run` installs it from this script's header)")
        return
    except Exception as exc:  # noqa: BLE001 - classified below; the message is the library's
        message = redact(f"{type(exc).__name__}: {exc}")[:600]
        offline = (os.environ.get("HF_HUB_OFFLINE") not in (None, "", "0")
                   or re.search(r"offline|connect|resolve|timed? ?out|local snapshot|cached", message, re.I))
        if offline:
            pf.add("attention kernel", FAIL, f"{repo} could not be fetched from the hub: {message}",
                   "pre-fetch it into a hub cache on a machine with internet and the same torch and CUDA: "
                   "HF_HOME=/shared/hf python -c \"from kernels import get_kernel; "
                   "get_kernel('kernels-community/flash-attn3', version=1)\"; then train with HF_HOME=/shared/hf "
                   "HF_HUB_OFFLINE=1")
        else:
            pf.add("attention kernel", FAIL, f"{repo} has no build for this GPU and torch: {gpu}: {message}", gpu_fix)
        return
    try:  # one tiny causal call: a build that loads can still refuse this GPU when it runs
        q = torch.randn(8, 2, 64, device="cuda:0", dtype=torch.bfloat16)
        cu = torch.tensor([0, 8], device="cuda:0", dtype=torch.int32)
        kernel.flash_attn_varlen_func(q, q, q, cu, cu, 8, 8, causal=True)
        torch.cuda.synchronize(0)
    except Exception as exc:  # noqa: BLE001
        pf.add("attention kernel", FAIL, f"{repo} loaded but cannot run on {gpu}: {type(exc).__name__}: {exc}"[:700],
               gpu_fix)
        return
    pf.add("attention kernel", PASS, f"{repo} loaded and ran on {gpu}")


def gpu_memory() -> tuple[int, int] | None:
    """(free, total) bytes on the trainer's GPU (rank 0's cuda:0) as the driver reports them; None without one."""
    try:
        return torch.cuda.mem_get_info(0)
    except (AssertionError, RuntimeError):  # torch built without CUDA asserts; with CUDA but no device it raises
        return None


def check_trainer_memory(pf: Preflight) -> None:
    """The trainer's projected peak on its GPU against what it may use there, before any weights load or paid rollout.

    On a GPU vLLM shares (the ipc backend) that is what vLLM's --gpu-memory-utilization leaves of the card's total:
    vLLM sized its KV cache and activations to that share at start and need not hold all of it at every moment. The
    plan then caps the trainer there (train() applies it), so it never grows into vLLM's share, whether or not its
    peak could be projected.
    """
    check, args, shape, served = "trainer memory", pf.args, pf.shape, pf.served or {}
    memory = gpu_memory()
    backend, utilisation = served.get("weight_transfer"), served.get("gpu_memory_utilization")
    shared = backend == "ipc"
    facts, cap, room, limit, total = {}, "", "", 0, 0  # facts: what training takes, unless the row FAILs
    if memory is not None:
        free, total = memory
        usable = min(free, int(total * (1 - utilisation))) if shared and utilisation else free
        limit = usable - OUTSIDE_ALLOCATOR
        vllm = (f"; vLLM shares this GPU and sized itself to --gpu-memory-utilization {utilisation:g} x {gib(total)} = "
                f"{gib(utilisation * total)}" if shared and utilisation else "")
        room = (f"{gib(limit)} the trainer may use on cuda:0 ({gib(free)} free of {gib(total)}{vllm}; "
                f"{gib(OUTSIDE_ALLOCATOR)} left for what torch's allocator does not count)")
    served_width = dtype_bytes(str(served.get("dtype") or "bfloat16"))
    push = {"backend": backend, "served_width": served_width}
    # vLLM's own copies while it loads a push come out of the same room: the trainer is capped below them.
    beside = trainer_peak(shape, 0, **push).get("vLLM's push copies", 0) if shape else 0
    if memory is not None and shared:
        facts["gpu_memory_fraction"] = fraction = min(1.0, max(0, limit - beside + torch.cuda.memory_reserved(0))
                                                      / total)
        cap = (f"; the trainer is capped there at train start (torch.cuda.set_per_process_memory_fraction "
               f"{fraction:.3f}{f', less {gib(beside)} for vLLM to load a push' if beside else ''}), so it never "
               "grows into vLLM's share")
    if shape is None:
        pf.add(check, SKIP, f"not projected: {model_shape_error(args) or '--dtype auto: its dtype is unknown'}"
               + (f"; {room}{cap}" if cap else ""))
        pf.plan |= facts
        return
    row = longest_row(args, served.get("max_model_len"))
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    parts = trainer_peak(shape, row or 0, ranks, fsdp, **push)
    need = sum(parts.values())
    dtype = trainer_dtype(args)
    what = (f"LoRA r {args.lora_r} on a frozen {dtype} base" if shape.adapter else f"full fine-tune, {dtype} weights")
    what += f", FSDP over {ranks} ranks" if fsdp and ranks > 1 else f", {ranks} DDP ranks" if ranks > 1 else ""
    budget = "--token-budget" if (args.config.token_budget or 0) > 0 else "vLLM's max_model_len"
    rows = (f"a {row:,}-token row (TRL packs rollouts up to its token budget, here {budget})" if row
            else "the static part alone (the row is TRL's token budget, vLLM's max_model_len: unknown)")
    detail = f"projected peak {gib(need)} for {rows}, {what}: {', '.join(f'{k} {gib(n)}' for k, n in parts.items())}"
    if memory is None:
        pf.add(check, SKIP, f"{detail}; no GPU to compare against (the trainer runs on CPU)")
        return
    if need > limit:
        pf.add(check, FAIL, f"{detail} > {room}: training would run out of GPU memory at its first step, after a "
               "group of paid rollouts", memory_fixes(args, shape, need, limit, total, row or 0, ranks, fsdp,
                                                      utilisation if shared else None, **push))
        return  # nothing trains
    pf.plan |= facts
    if row is None:
        pf.add(check, SKIP, f"{detail}: fits {room}; the activations are projected once vLLM answers{cap}")
        return
    if need * (1 + MEMORY_TOLERANCE) > limit:
        pf.add(check, WARN, f"{detail}, within {MEMORY_TOLERANCE:.0%} of {room}{cap}",
               memory_fixes(args, shape, need, limit, total, row, ranks, fsdp, utilisation if shared else None,
                            **push))
    else:
        pf.add(check, PASS, f"{detail}; fits {room}, {gib(limit - need)} to spare{cap}")


def memory_fixes(args: argparse.Namespace, shape: TrainerShape, need: int, limit: int, total: int, row: int,
                 ranks: int, fsdp: bool, utilisation: float | None, **push: Any) -> str:
    """The concrete ways to bring the projection under `limit` with MEMORY_TOLERANCE to spare, each with its
    numbers."""
    fixes = []
    fits = longest_fitting_row(shape, int(limit / (1 + MEMORY_TOLERANCE)), ranks, fsdp, row, **push)
    tokens = fits // 1024 * 1024
    if tokens >= PROMPT_TOKENS + args.max_completion_length:
        steps = min(args.agent_step_limit, (tokens - PROMPT_TOKENS) // args.max_completion_length)
        where = (f"--token-budget {tokens}" if (args.config.token_budget or 0) > 0
                 else f"serve vLLM with --max-model-len {tokens} (TRL's token budget)")
        fixes.append(f"{where} and pass --agent-step-limit {steps}, so a rollout of {args.max_completion_length}-token "
                     f"turns still fits (the longest row with {MEMORY_TOLERANCE:.0%} to spare: {fits:,} tokens)")
    if utilisation:
        lower = math.floor((utilisation - (need * (1 + MEMORY_TOLERANCE) - limit) / total) * 100) / 100
        least = vllm_floor(args, shape, row)
        if lower * total >= least:
            fixes.append(f"restart vLLM with --gpu-memory-utilization {lower:.2f} (now {utilisation:g}; it needs "
                         f"{least / total:.2f} at the least: {gib(least)} for its weights, one {row:,}-token "
                         "sequence's KV cache and its buffers)")
    if not args.use_peft:
        lora = trainer_shape(argparse.Namespace(**{**vars(args), "use_peft": True, "dtype": "bfloat16"}))
        peak = lora and sum(trainer_peak(lora, row, ranks, fsdp, **push).values())
        if peak and peak * (1 + MEMORY_TOLERANCE) <= limit:
            fixes.append(f"--use-peft (LoRA r {args.lora_r} on a bfloat16 base: {gib(peak)} projected for this row)")
    return "; or ".join(fixes) or ("train on a GPU with more free memory, or shard the trainer with FSDP "
                                   "(slurm/README.md)")


def check_credentials(pf: Preflight) -> None:
    """Before starting our own server: what only this process can see (its environment)."""
    args = pf.args
    var = SANDBOX_CREDENTIALS.get(args.sandbox)
    if var and not os.environ.get(var):
        pf.sandbox_reachable = pf.add("credentials", FAIL, f"{var} is not set: every {args.sandbox} sandbox would "
                                      "fail to start", f"export {var} before launching (the Harbor server this script "
                                      "starts inherits it)")
    elif args.dataset == DEFAULT_DATASET and not os.environ.get("HF_TOKEN"):
        pf.add("credentials", WARN, "HF_TOKEN is not set: the default suite's tasks fetch their data with it",
               "export HF_TOKEN")
    else:
        pf.add("credentials", PASS, f"{var} set" if var else f"{args.sandbox} needs none that this script knows of")


def pick_expose(args: argparse.Namespace) -> tuple[str, str, bool]:
    """--harbor-expose auto: (the server's --expose, why, whether the rule knows). The harness, not the trainer,
    calls the capture proxy, from wherever it runs."""
    in_sandbox = [h for h in args.harnesses if h not in HOST_SIDE_AGENTS]
    if not in_sandbox:
        return "direct", (f"{args.harness} runs host-side, in the Harbor server's process (openenv's "
                          "HOST_SIDE_AGENTS), so its model calls reach 127.0.0.1 whatever the sandbox"), True
    where = ("runs off this host" if args.sandbox in OFF_HOST_SANDBOXES
             else "has its own network namespace (docker's bridge network), where 127.0.0.1 is the sandbox itself"
             if args.sandbox in OWN_NETWORK_SANDBOXES else "")
    if where:
        tunnel = "cloudflare" if shutil.which("cloudflared") else "gradio"
        how = ("cloudflared is on PATH" if tunnel == "cloudflare"
               else "no cloudflared on PATH; gradio's tunnel ships with openenv")
        return tunnel, f"{', '.join(in_sandbox)} runs inside the {args.sandbox} sandbox, which {where}: {how}", True
    return "direct", (f"{', '.join(in_sandbox)} runs inside the {args.sandbox} sandbox; whether that reaches this "
                      "host's 127.0.0.1 is not known here"), False


def check_capture_url(pf: Preflight) -> None:
    """Before starting our own server, which advertises the capture proxy where --harbor-expose says."""
    args = pf.args
    picked, why, known = pick_expose(args)
    probe = "confirm with --check --probe-rollout (one real rollout), or set --harbor-expose"
    if args.harbor_expose == "auto":
        args.harbor_expose = picked
        pf.add("capture URL", PASS if known else WARN, f"--harbor-expose auto: {picked}. {why}", probe)
    elif args.harbor_expose == "direct" and picked != "direct":
        pf.sandbox_reachable = pf.add("capture URL", FAIL, f"--harbor-expose direct advertises 127.0.0.1, which the "
                                      f"harness cannot reach: {why}", f"--harbor-expose {picked} (or auto)")
    elif args.harbor_expose == "cloudflare" and not shutil.which("cloudflared"):
        pf.sandbox_reachable = pf.add("capture URL", FAIL, "--harbor-expose cloudflare needs `cloudflared` on PATH",
                                      "install cloudflared, or use --harbor-expose gradio")
    elif args.harbor_expose == "direct" and not known:
        pf.add("capture URL", WARN, f"--harbor-expose direct: {why}", probe)
    else:
        pf.add("capture URL", PASS, f"--harbor-expose {args.harbor_expose}")


def check_capture_reached(pf: Preflight) -> None:
    """Our server started: one request through the URL it hands every sandbox (the tunnel's, when one is picked)
    reaches this server's own capture proxy. Training asks it again before each rollout (`reach_capture`)."""
    server, fix = pf.server, "a URL that does not answer here answers no sandbox: check this host's outbound " \
                             "access to the tunnel's service, or pick another --harbor-expose"
    if not server.public_url:
        pf.sandbox_reachable = pf.settle("capture URL", FAIL, "the Harbor server printed no `capture ... -> URL` "
                                         f"line (log: {server.log_path})", fix)
        return
    try:
        ours = http_json(f"http://127.0.0.1:{server.capture_port}/health", timeout=15)
        theirs = http_json(f"{server.public_url}/health", timeout=30)
    except (OSError, ValueError) as exc:
        pf.sandbox_reachable = pf.settle("capture URL", FAIL, f"{server.public_url}/health, the URL every sandbox "
                                         f"is given, does not answer here ({type(exc).__name__}: {exc})", fix)
        return
    if not isinstance(theirs, dict) or theirs.get("instance") != ours.get("instance"):
        pf.sandbox_reachable = pf.settle("capture URL", FAIL, f"{server.public_url}/health answers, but not as this "
                                         f"server's capture proxy ({str(theirs)[:200]})", fix)
        return
    pf.settle("capture URL", PASS, f"{server.public_url}/health reached this server's capture proxy from here")
    pf.args.capture_url = server.public_url


def check_harbor_waits_for_vllm(pf: Preflight) -> None:
    pf.add("Harbor server", SKIP, "not checked: vLLM must answer first (the server samples from it); harness, "
           "sandbox, dataset and task names are checked once it does")


def closest_first(name: str, choices: Any) -> list[str]:
    return difflib.get_close_matches(name, list(choices), n=len(choices), cutoff=0)


def harbor_environment_types() -> set[str]:
    """Sandbox types Harbor itself knows; the server advertises (and credential-checks) only a few of them."""
    try:
        from harbor.models.environment_type import EnvironmentType
    except ImportError:
        return OFF_HOST_SANDBOXES | {"docker", "podman"}
    return {t.value for t in EnvironmentType}


def check_harbor_server(pf: Preflight) -> None:
    """Ours started, or yours reached: its splits and capabilities, which the rows after this one judge."""
    args, server = pf.args, pf.server
    if server is not None:
        try:
            seconds = server.start(pf.served["id"] if pf.served else "")
        except UsageError as exc:
            tail = server.log_path.read_text(errors="replace").splitlines()[-15:]
            pf.add("Harbor server", FAIL, "\n".join([str(exc), *(f"    {line}" for line in tail)]),
                   "fix what its log says, or pass --harbor-url")
            return
        args.harbor_url = server.url
        pf.add("Harbor server", PASS, f"started {server.url} in {seconds:.0f}s (log: {server.log_path})")
    client = HarborEnv(base_url=args.harbor_url)
    try:
        splits = client.splits()
        capabilities = client.capabilities()
    except Exception as exc:  # noqa: BLE001 - any failure here means the same thing to the user
        pf.add("Harbor server", FAIL, f"Harbor server not reachable at {args.harbor_url} ({type(exc).__name__}: "
               f"{exc})", "start `openenv harbor serve ... --expose direct`, fix --harbor-url, or drop --harbor-url "
               "to let this script start one")
        return
    finally:
        client.close()
    if server is None and args.sandbox in TEMPLATE_BUILDING_SANDBOXES:
        pf.add("Harbor server", PASS, f"{args.harbor_url} (yours; its environment is not visible from here: it "
               f"needs HARBOR_SHARED_ENV_NAME and OPENENV_HARBOR_AGENT_VERSIONS, docs/harbor-server.md)")
    elif server is None:
        pf.add("Harbor server", PASS, f"{args.harbor_url} (yours)")
    pf.splits, pf.capabilities = splits, capabilities


def check_harness(pf: Preflight) -> None:
    harnesses = {h["name"]: h for h in pf.capabilities.get("harnesses", [])}
    for name in pf.args.harnesses:
        harness = harnesses.get(name)
        if harness is None and ":" not in name:  # `module:Class` is a custom harness the server imports
            pf.add("harness", FAIL, f"unknown harness {name!r}; this server has: "
                   f"{', '.join(closest_first(name, harnesses))}")
        elif harness and harness.get("status", "").split(":")[0] in ("blocked", "unsupported"):
            pf.add("harness", FAIL, f"harness {name!r} cannot run on this server: {harness['status']}",
                   "pick a validated harness")
        else:
            pf.add("harness", PASS, f"{name} ({harness.get('status', '?') if harness else 'custom import'})")


def check_sandbox(pf: Preflight) -> None:
    args = pf.args
    sandboxes = {s["name"]: s for s in pf.capabilities.get("sandboxes", [])}
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


def check_servers_engine(pf: Preflight) -> None:
    args = pf.args
    pf.plan["llm"] = llm = pf.capabilities.get("llm") or {}
    # Names are compared as given: this host cannot tell the server's localhost from ours (--allow-engine-mismatch).
    engine, ours = (urllib.parse.urlsplit(url) for url in (llm.get("url", ""), args.vllm_url))
    if args.measure:
        pf.add("server's engine", PASS, f"{llm.get('url')}: {llm.get('capture_level') or '?'} capture (measuring needs "
               "no token ids)")
    elif llm.get("capture_level") != "tokens" or not llm.get("ok", True):
        pf.add("server's engine", FAIL, f"the Harbor server's engine {llm.get('url', '?')} cannot be trained on "
               f"(capture level {llm.get('capture_level') or 'unknown'}): vLLM must run with "
               "--return-tokens-as-token-ids and --logprobs-mode processed_logprobs",
               "restart vLLM with those flags, then the Harbor server")
    elif (engine.hostname, engine.port) != (ours.hostname, ours.port):
        pf.add("server's engine", WARN if args.allow_engine_mismatch else FAIL, f"the Harbor server samples from "
               f"{llm.get('url')} but weights go to {args.vllm_url}: unless they are the same vLLM, no rollout uses "
               "the trained weights", "point both at the same vLLM, or pass --allow-engine-mismatch if they are")
    else:
        pf.add("server's engine", PASS, f"{llm.get('url')}: tokens, the vLLM the trainer updates")


def check_session_slots(pf: Preflight) -> None:
    """Taken and released. Held-out evals run beside training's rollouts, each with up to --max-inflight at once."""
    args = pf.args
    needed = args.max_inflight * (2 if args.eval_tasks and not args.measure else 1)
    sessions = [HarborServerSession(args.harbor_url, timeout_s=30) for _ in range(needed)]
    try:
        for opened, session in enumerate(sessions):
            session.open()
        pf.add("session slots", PASS, f">= {needed} free (--max-inflight"
               f"{', twice: --eval-tasks' if needed > args.max_inflight else ''})")
    except (OSError, RuntimeError) as exc:
        pf.add("session slots", FAIL, f"the Harbor server has only {opened} free session slots of the {needed} that "
               f"--max-inflight (x2 with --eval-tasks) needs ({exc}); restart it with MAX_CONCURRENT_ENVS="
               f"{2 * needed} (twice that leaves room for a previous run's sessions)")
    finally:
        for session in sessions:
            session.close()


def check_dataset(pf: Preflight) -> None:
    args, splits = pf.args, pf.splits
    names = [s["name"] for s in splits]
    # A server started on a local copy of the default suite names its split by path.
    default_copy = names[0] if len(names) == 1 and args.dataset == DEFAULT_DATASET else ""
    split = args.split or (args.dataset if args.dataset in names else default_copy)
    if split not in names:
        pf.add("dataset", FAIL, f"the Harbor server does not serve {args.split or args.dataset!r}; it serves: "
               f"{', '.join(names) or 'nothing'}",
               f"start it with --dataset {args.dataset}, pass --split, or drop --harbor-url")
        return
    split_info = next(s for s in splits if s["name"] == split)
    if split_info.get("error"):
        pf.add("dataset", FAIL, f"the Harbor server could not load {split!r}: {split_info['error']}")
        return
    pf.add("dataset", PASS, f"{split} ({split_info.get('num_tasks', '?')} tasks)")
    pf.plan["split"] = split


def fetch_catalogue(harbor_url: str, split: str, page: int = 500) -> list[dict[str, Any]]:
    client = HarborEnv(base_url=harbor_url)
    try:
        total = client.num_tasks(split)
        return [t.model_dump() for start in range(0, total, page)
                for t in client.get_task_range(split, start, min(start + page, total))]
    finally:
        client.close()


def check_tasks(pf: Preflight) -> None:
    args, split = pf.args, pf.plan["split"]
    if args.tasks == DEFAULT_TASKS and split != DEFAULT_DATASET and args.dataset != DEFAULT_DATASET:
        pf.add("tasks", FAIL, f"--tasks: the default task list is for {DEFAULT_DATASET}",
               f"give the tasks of {split!r} (e.g. --tasks 0-99)")
        return
    try:
        tasks = resolve_tasks(read_task_spec(args.tasks), fetch_catalogue(args.harbor_url, split))
    except UsageError as exc:
        pf.add("tasks", FAIL, str(exc))
        return
    pf.add("tasks", PASS, f"{len(tasks)}: {', '.join(t['task_name'] for t in tasks[:5])}"
           f"{', ...' if len(tasks) > 5 else ''}")
    pf.plan["tasks"] = tasks


def check_eval_tasks(pf: Preflight) -> None:
    args = pf.args
    try:
        pf.plan["eval_tasks"] = resolve_tasks(read_task_spec(args.eval_tasks),
                                              fetch_catalogue(args.harbor_url, pf.plan["split"]))
        pf.add("eval tasks", PASS, f"{len(pf.plan['eval_tasks'])} held out, {args.eval_k} rollouts each, before "
               f"training{f', every {args.eval_steps} steps' if args.eval_steps else ''} and after the last step")
    except UsageError as exc:
        pf.add("eval tasks", FAIL, str(exc).replace("--tasks", "--eval-tasks", 1))


# e2b answers a lifetime beyond the plan's with a plain SandboxException (400), told apart by its text alone.
E2B_LIFETIME_REFUSED = "Timeout cannot be greater than"
# A sandbox provider's plan refusing Harbor's sandboxes, as a rollout's result holds it: Harbor records the e2b SDK's
# exception type (e2b/api/__init__.py maps the API's HTTP status to it) and message as exception_type and error.
PLAN_REFUSALS = {
    "RateLimitException": ("refused another sandbox (429): the plan's concurrent-sandbox limit (or its start rate) is "
                           "reached", "lower --max-inflight to at most the plan's concurrent sandboxes (e2b: 20 on "
                           "Hobby, 100 on Pro) less those other runs hold, or raise the plan's limit"),
    "ServiceBusyException": ("had no capacity for a sandbox (503)", "retry later; nothing was started"),
    "AuthenticationException": ("refused the API key (401)", "set a valid key (E2B_API_KEY) where the Harbor server "
                                                             "runs"),
    "SandboxNotRunningException": ("ended the sandbox mid-rollout (killed, or its lifetime ran out)",
                                   "lower --agent-timeout: with setup and verification it must fit the plan's sandbox "
                                   "lifetime"),
    E2B_LIFETIME_REFUSED: (
        "refused the sandbox's lifetime (400): Harbor asks 24 h for every e2b sandbox (harbor 0.25's E2BEnvironment; "
        "openenv 0.10 passes no shorter one), beyond the plan's cap", "a plan whose sandboxes may live 24 h (e2b Pro; "
                                                                      "Hobby caps them at 1 h)"),
}


def plan_refusal(r: HarborRolloutResult) -> tuple[str, str] | None:
    """(what the provider refused, the fix) when a rollout's sandbox was refused by the plan or quota, else None."""
    lifetime = r.exception_type == "SandboxException" and E2B_LIFETIME_REFUSED in (r.error or "")
    return PLAN_REFUSALS.get(E2B_LIFETIME_REFUSED if lifetime else r.exception_type or "")


def check_probe_rollout(pf: Preflight) -> None:
    """One real rollout, scored by the verifier: proves sandbox, harness, capture URL and reward key end to end."""
    args, task = pf.args, pf.plan["tasks"][0]
    key = args.reward_key or "reward"
    if not args.probe_rollout:
        pf.add("reward key", SKIP, f"{key!r}: not probed (`--check --probe-rollout` runs one rollout to confirm it)")
        return
    client = HarborServerSession(args.harbor_url, rollout_budget_s(args.agent_timeout))
    t0 = time.monotonic()
    try:
        r = client.run_rollout(split=pf.plan["split"], task_index=int(task["index"]), harness=args.harnesses[0],
                               sandbox=args.sandbox, reward_key=args.reward_key, agent_timeout_sec=args.agent_timeout,
                               agent_step_limit=args.agent_step_limit, sampling={"temperature": args.temperature})
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the rest of the table still matters
        pf.add("probe rollout", FAIL, f"{task['task_name']}: {type(exc).__name__}: {exc}")
        return
    finally:
        client.close()
    failure = judge_rollout(r, task["task_name"], require_tokens=not args.measure, reward_key=args.reward_key)
    where = f"{task['task_name']} in {time.monotonic() - t0:.0f}s, {r.n_turns} turns"
    if failure is not None and failure.kind == "reward_key":
        pf.add("reward key", FAIL, failure.message,
               "pass one of those to --reward-key (a comma-separated list is tried in order)")
        return
    if r.reward is not None:
        pf.add("reward key", PASS, f"{key!r} = {r.reward:g} ({', '.join(sorted(r.rewards)) or 'none'} emitted)")
    if failure is not None and (refused := plan_refusal(r)):
        pf.add("probe rollout", FAIL, f"{where}: {args.sandbox} {refused[0]} ({r.exception_type}: "
               f"{' '.join((r.error or '').split())[:300]})", refused[1])
    elif failure is not None:
        pf.add("probe rollout", FAIL, f"{where}: {failure.message[:500]}",
               f"read the agent log tail: {r.agent_log_tail[-200:]!r}" if r.agent_log_tail else "")
    else:
        pf.add("probe rollout", PASS if r.rollout_type == "train" else FAIL,
               f"{where}, {r.rollout_type} tier, {r.n_trainable_tokens} trainable tokens")
        if r.n_turns:
            pf.confirm("capture URL", f"the probe rollout's harness reached it ({r.n_turns} model calls)")


class PreflightCheck(NamedTuple):
    """A row of the preflight (a few, where one question asked once answers them), as `--check` prints it."""
    rows: tuple[str, ...]  # the rows it may add
    run: Callable[[Preflight], None]
    needs: tuple[str, ...]  # Preflight's conditions that must all hold for it to run; else it adds no row
    protects: str  # what it protects the user from


# Every check, in the order `--check` prints them: cheapest first. The checks that need no server run whatever a server
# says, so one table shows every local problem even while vLLM is down; a check whose `needs` a failure left unmet
# adds no row, which ends the table where nothing after it could mean anything.
PREFLIGHT_CHECKS = [
    PreflightCheck(("output dir",), check_output_dir, (),
                   "a run whose first checkpoint cannot be written, after a step of paid rollouts"),
    PreflightCheck(("resume",), check_resume, ("training", "writable"),
                   "writing over another run's checkpoints, and resuming from a damaged one or one of another shape"),
    PreflightCheck(("tasks",), check_task_spec, (),
                   "a typo in --tasks found only once the servers are up"),
    PreflightCheck(("measure",), check_measure, ("measuring",),
                   "measuring other counts than meant: rollouts per task and in flight, said before any is paid for"),
    PreflightCheck(("GRPO",), check_grpo, ("training",),
                   "training on other group sizes than meant: said before any rollout is paid for"),
    PreflightCheck(("vLLM reachable",), check_vllm_reachable, ("training",),
                   "a trainer that loads its weights for a vLLM that is not up, or at another URL"),
    PreflightCheck(("served model",), check_served_model, ("vllm_answers",),
                   "pushing the trainer's weights into another model than vLLM serves"),
    PreflightCheck(("capture tier",), check_capture_tier, ("vllm_answers",),
                   "rollouts with nothing to train on (no token ids) or with wrong importance ratios (raw logprobs)"),
    PreflightCheck(("tool calls",), check_tool_calls, ("vllm_answers",),
                   "agent rollouts that fail at their first tool call"),
    PreflightCheck(("weight transfer",), check_weight_transfer, ("vllm_answers",),
                   "a trainer that cannot push its weights, so that every rollout samples the untrained model"),
    PreflightCheck(("vLLM on loopback",), check_vllm_on_loopback, ("vllm_dev_mode",),
                   "anyone who reaches a dev-mode vLLM driving it (pausing it, loading other weights), or with ipc "
                   "running code as its user: it unpickles every push"),
    PreflightCheck(("trainer ranks",), check_trainer_ranks, ("ipc",),
                   "several trainer processes pushing to an ipc vLLM, which takes each push from one"),
    PreflightCheck(("dtype",), check_dtype, ("vllm_answers",),
                   "a precision gap between trainer and vLLM in every importance ratio"),
    PreflightCheck(("LoRA",), check_lora_engine, ("vllm_dev_mode", "peft"),
                   "every rollout sampling the untrained base: an --enable-lora vLLM gets adapters under names the "
                   "capture proxy never asks for"),
    PreflightCheck(("context",), check_context, ("vllm_answers",),
                   "rollouts cut at vLLM's context limit before their turn budget is spent"),
    PreflightCheck(("LoRA targets",), check_lora_targets, ("training", "peft"),
                   "adapters PEFT cannot place, or one on a tied weight that leaves its twin at the base"),
    PreflightCheck(("precision",), check_precision, ("training",),
                   "updates that round to no change, so the run silently stops learning; FSDP pushes of another "
                   "dtype than vLLM was told"),
    PreflightCheck(("checkpoints",), check_checkpoints, ("training",),
                   "a disk that fills mid-run"),
    PreflightCheck(("trainer GPU",), check_trainer_gpu, ("training",),
                   "a trainer on vLLM's GPU or a busy one (NCCL refuses two ranks on one device), or a CPU trainer "
                   "for CUDA IPC"),
    PreflightCheck(("same GPU",), check_same_gpu, ("ipc",),
                   "a CUDA IPC push from another GPU than vLLM's, which fails at the first step"),
    PreflightCheck(("attention kernel",), check_attention_kernel, ("training",),
                   "an attention kernel missing or unbuilt for this GPU, found at the first step: after the weights "
                   "load, the first push and the first paid group"),
    PreflightCheck(("trainer memory",), check_trainer_memory, ("training",),
                   "running out of GPU memory at the first step, after a group of paid rollouts, and a trainer that "
                   "grows into vLLM's share of its GPU"),
    PreflightCheck(("credentials",), check_credentials, ("own_server",),
                   "every sandbox failing to start for a missing API key"),
    PreflightCheck(("capture URL",), check_capture_url, ("own_server",),
                   "a harness that cannot reach the capture proxy, so that no rollout records a token"),
    PreflightCheck(("Harbor server",), check_harbor_waits_for_vllm, ("vllm_down",),
                   "a Harbor server started for a vLLM that does not answer: it samples from it"),
    PreflightCheck(("Harbor server",), check_harbor_server, ("ready_for_harbor",),
                   "a Harbor server that is down or fails to start (its log's tail is on the row)"),
    PreflightCheck(("capture URL",), check_capture_reached, ("own_server", "harbor_answers"),
                   "paid rollouts whose harness cannot reach the capture proxy: the URL the sandboxes are given is "
                   "asked once here, and before each rollout during training"),
    PreflightCheck(("harness",), check_harness, ("harbor_answers",),
                   "a harness name with a typo, or one this server cannot run"),
    PreflightCheck(("sandbox",), check_sandbox, ("harbor_answers",),
                   "a sandbox name with a typo, or one without credentials on the server"),
    PreflightCheck(("server's engine",), check_servers_engine, ("harbor_answers",),
                   "rollouts sampled from another vLLM than the one the trainer updates, or without token ids"),
    PreflightCheck(("session slots",), check_session_slots, ("harbor_answers",),
                   "rollouts refused by a server with fewer session slots than --max-inflight"),
    PreflightCheck(("dataset",), check_dataset, ("harbor_answers",),
                   "asking a server for a split it does not serve"),
    PreflightCheck(("tasks",), check_tasks, ("split_served",),
                   "task names or indices the served split lacks"),
    PreflightCheck(("eval tasks",), check_eval_tasks, ("tasks_found", "eval_tasks_given"),
                   "held-out tasks the served split lacks, found at the first eval"),
    PreflightCheck(("reward key", "probe rollout"), check_probe_rollout, ("tasks_found", "sandbox_reachable"),
                   "a reward key the verifier never emits, so that every reward is 0; one rollout proves sandbox, "
                   "harness, capture URL and reward key end to end"),
]


def preflight(pf: Preflight) -> dict[str, Any]:
    """Each check whose needs hold, in order; the plan that training takes from them."""
    for check in PREFLIGHT_CHECKS:
        if all(getattr(pf, need) for need in check.needs):
            check.run(pf)
    return pf.plan


# --- Measure and curate: pass rates per task, and the tasks that can teach --------------------------------------------
PASS_RATE_COLUMNS = ["task", "index", "harness", "sandbox", "k", "solved", "pass_rate", "mean_reward", "mean_turns",
                     "mean_wall_s", "errors"]


def measure_pass_rates(args: argparse.Namespace, split: str, tasks: list[dict[str, Any]],
                       llm: dict[str, Any], label: str = "group", step: int | None = None,
                       keep_on_interrupt: bool = True) -> list[dict[str, Any]]:
    """--eval-k rollouts of every task (under every harness), through the session code training uses. Solved: the
    verifier's reward (after --reward-key) is > 0, as OpenEnv's `result.solved` reads it (partial credit counts;
    mean_reward says how much). Unscorable rollouts are errors, left out of the pass rate as out of a GRPO baseline.

    Cut short by --max-consecutive-failures, by a stop request during training (seen within a poll), or by Ctrl-C:
    the rollouts in flight are abandoned and the tasks measured in full are returned; Ctrl-C is raised again unless
    `keep_on_interrupt` (--eval-only keeps what finished). `step`: a held-out eval's, on each record."""
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    factory = HarborSessionFactory(
        **session_settings(args), sampling=training_sampling({"temperature": args.temperature}), require_tokens=False,
        # A token-capturing engine samples exactly as in training; any other (a hosted model) at the same temperature.
        eval_sampling=None if llm.get("capture_level") == "tokens" else {"temperature": args.temperature, "top_p": 1.0},
        record_path=os.path.join(args.output_dir, "eval_rollouts.jsonl"), label=label,
        record_fields=None if step is None else {"step": step})
    units = task_rows(tasks, split, args.harnesses)
    outcomes: list[list[HarborSession]] = [[] for _ in units]
    progress = tqdm(total=len(units) * args.eval_k, unit="rollout", dynamic_ncols=True, file=sys.stderr)
    solved = scored = done = 0

    def run(unit: int) -> tuple[int, HarborSession]:
        session = factory.create(units[unit]["prompt"], unit)
        try:
            session.wait_for_completion()
            if not session._client.closed:
                factory.record_outcome(session)
            return unit, session
        finally:
            session.close()

    def stop_requested() -> str | None:  # during training a stop request only takes note (StopRequest): seen here
        return f"stopped by {STOP.signal_name}" if STOP.deferred and STOP.signal_name is not None else None

    interrupted, stop_reason = None, stop_requested()  # one already under way: no sandbox is started for nothing
    pool = ThreadPoolExecutor(max_workers=args.max_inflight, thread_name_prefix="harbor-eval")  # --max-inflight at once
    running = set() if stop_reason else {pool.submit(run, unit) for unit in range(len(units))
                                         for _ in range(args.eval_k)}
    try:
        while running and stop_reason is None:
            finished, running = wait_futures(running, timeout=1.0, return_when=FIRST_COMPLETED)
            for future in finished:
                try:
                    unit, session = future.result()
                except RolloutsFailing as exc:  # record_outcome: --max-consecutive-failures reached
                    stop_reason = str(exc)
                    continue
                outcomes[unit].append(session)
                scored += session.failure is None
                solved += session.failure is None and bool(session.result.solved)
                done += len(outcomes[unit]) == args.eval_k
                progress.set_postfix_str(f"tasks {done}/{len(units)}, solved "
                                         f"{f'{solved / scored:.0%}' if scored else '-'}", refresh=False)
                progress.update(1)
            if stop_reason is None and running:
                stop_reason = stop_requested()
    except (KeyboardInterrupt, SystemExit) as exc:  # Ctrl-C; SIGTERM before training
        stop_reason, interrupted = "interrupted", exc
    finally:
        if stop_reason is not None:  # release the server's slots, keep what finished
            pool.shutdown(wait=False, cancel_futures=True)  # before the sessions close: the queued rollouts never start
            factory.close_sessions()
        pool.shutdown(wait=True, cancel_futures=True)
        progress.close()
    rows = [pass_rate_row(units[unit]["prompt"][0], args.sandbox, sessions)
            for unit, sessions in enumerate(outcomes) if len(sessions) == args.eval_k]
    if stop_reason:
        print(redact(f"[eval] stopped early ({stop_reason}); {len(rows)} of {len(units)} tasks fully measured"),
              file=sys.stderr, flush=True)
    if interrupted is not None and not keep_on_interrupt:
        raise interrupted
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


def write_pass_rates(path: Path, rows: list[dict[str, Any]], columns: list[str] = PASS_RATE_COLUMNS,
                     append: bool = False) -> None:
    new = not (append and path.is_file())
    with open(path, "w" if new else "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerows(rows)


EVAL_COLUMNS = ["step", "task", "index", "harness", "k", "solved", "pass_rate", "mean_reward", "errors"]


def held_out_eval(args: argparse.Namespace, plan: dict[str, Any], step: int) -> dict[str, float]:
    """--eval-tasks on the weights of optimizer step `step` (0: before training): eval.csv rows, eval/* metrics.

    An eval cut short (a stop request, --max-consecutive-failures) writes the tasks it measured in full, and logs
    eval/tasks_measured below eval/tasks and no eval/pass_rate: a rate over another task set than the planned one
    compares with no other step's. Ctrl-C stops the run, as anywhere in training."""
    planned = len(plan["eval_tasks"]) * len(args.harnesses)
    rows = measure_pass_rates(args, plan["split"], plan["eval_tasks"], plan["llm"], label="held-out eval", step=step,
                              keep_on_interrupt=False)
    write_pass_rates(Path(args.output_dir) / "eval.csv", [{"step": step, **r} for r in rows], EVAL_COLUMNS,
                     append=True)
    scored = sum(r["k"] - r["errors"] for r in rows)
    solved = sum(r["solved"] for r in rows)
    errors = sum(r["errors"] for r in rows)
    metrics = {f"eval/{task}/pass_rate": rate for task, rate in pass_rates_by_task(rows).items() if rate is not None}
    metrics |= {"eval/tasks": planned, "eval/tasks_measured": len(rows)}
    rate = f"{solved / scored:.2f}" if scored else "-"
    if len(rows) < planned:
        units = "tasks" if len(args.harnesses) == 1 else "task-harness pairs"
        say(f"[harbor] eval at step {step} cut short: {len(rows)} of {planned} held-out {units} measured in full, "
            f"pass rate {rate} ({solved}/{scored}) over those alone, not comparable with other steps: no "
            f"eval/pass_rate; {errors} errors (eval.csv)")
        return metrics
    if scored:
        metrics["eval/pass_rate"] = solved / scored
        metrics["eval/mean_reward"] = sum(r["mean_reward"] * (r["k"] - r["errors"]) for r in rows
                                          if r["k"] > r["errors"]) / scored
    say(f"[harbor] eval at step {step}: pass rate {rate} ({solved}/{scored}) on {len(plan['eval_tasks'])} held-out "
        f"tasks, {errors} errors (eval.csv)")
    return metrics


def whole_eval(entry: dict[str, Any]) -> bool:
    """A log entry of a held-out eval that measured every planned task."""
    if "eval/tasks" in entry:
        return entry.get("eval/tasks_measured") == entry["eval/tasks"]
    return "eval/pass_rate" in entry  # logged before evals counted their tasks


def eval_budget_s(args: argparse.Namespace, tasks: int) -> float:
    """How long a held-out eval of `tasks` tasks may take: its rollouts run --max-inflight at a time, each within its
    rollout budget, after waiting up to --harbor-retry-window for a full or restarting server."""
    waves = math.ceil(tasks * len(args.harnesses) * args.eval_k / args.max_inflight)
    return waves * (rollout_budget_s(args.agent_timeout) + args.harbor_retry_window)


def read_pass_rates(path: str) -> list[dict[str, Any]]:
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
    measured = {t: p for t, p in rates.items() if p is not None}
    inside = [t for t, p in measured.items() if low <= p <= high]
    out = Path(args.curated_tasks or os.path.join(args.output_dir, "curated_tasks.txt"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        f"# Learnable tasks: pass rate in [{low:g}, {high:g}] (solved sometimes, not always).\n"
        f"# Source: {source}\n# Written: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC} by async_grpo_harbor.py "
        f"--curate; use it as --tasks @{out}\n" + "".join(f"{t}\n" for t in inside))
    g = args.num_generations
    print_table(f"curate (band {low:g}-{high:g})", {
        "below band (never or rarely solved)": sum(p < low for p in measured.values()),
        "inside band (kept)": len(inside),
        "above band (always or nearly always solved)": sum(p > high for p in measured.values()),
        "unmeasured (every rollout unscorable)": len(rates) - len(measured),
        f"groups with reward variance, G={g}, all measured tasks":
            f"{signal_fraction(list(measured.values()), g):.1%}",
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
    return 0 if len(rows) == len(tasks) * len(args.harnesses) else 1


# --- Trainer ----------------------------------------------------------------------------------------------------------
class PassRate:
    """Solve rate of each full pass over the task list (`groups` groups, whatever steps they straddle), unscorable
    rollouts left out, as of a GRPO baseline."""

    def __init__(self, groups: int):
        self.groups, self.done, self.solved, self.scored = groups, 0, 0, 0

    def add(self, solved: int, scored: int) -> tuple[int, int]:
        self.done, self.solved, self.scored = self.done + 1, self.solved + solved, self.scored + scored
        if self.done % self.groups:
            return 0, 0
        finished, self.solved, self.scored = (self.solved, self.scored), 0, 0
        return finished


class HarborRolloutLoop(_HarnessRolloutLoop):
    """TRL's loop-owning harness loop, run in TRL's rollout child, scoring each group the way this script trains: its
    rewards shaped (`shape_group_rewards`) before TRL normalises them into advantages, a zero-variance group kept out
    of the trainer's queue unless --max-zero-variance-groups is 0, and a run of such groups a NoSignal stop."""

    def __init__(self, *, efficiency_weight: float, max_zero_variance_groups: int, groups_per_pass: int,
                 harness_session_factory: Callable[..., Any], metrics_queue: Any, failed_event: Any,
                 exception_info_queue: Any, groups_path: str = "", **loop_kwargs: Any):
        self.failed_event, self.failures = failed_event, exception_info_queue  # TRL's failure channel
        factory = functools.partial(self.build_factory, harness_session_factory, metrics_queue)
        super().__init__(harness_session_factory=factory, metrics_queue=metrics_queue, failed_event=failed_event,
                         exception_info_queue=exception_info_queue, **loop_kwargs)
        self.efficiency_weight, self.groups_path = efficiency_weight, groups_path
        self.max_zero_variance_groups = max_zero_variance_groups
        self.flat_run: list[bool] = []  # zero-variance groups since the last group with variance: all solved?
        self.passes = PassRate(groups_per_pass)

    def build_factory(self, build: Callable[..., Any], metrics_queue: Any, **kwargs: Any) -> Any:
        """The session factory TRL's loop builds, which pushes each rollout's metrics onto TRL's metric queue."""
        self.factory = build(**kwargs)
        self.factory.metrics_queue = metrics_queue
        return self.factory

    # private: TRL's one step from a scored group to samples; no public hook shapes a group's rewards
    async def _score_group(self, group):
        scores = group.rollout_rewards
        group.rollout_rewards = shape_group_rewards(scores, self.efficiency_weight)
        samples = await super()._score_group(group)
        if self.stop_event.is_set():
            return samples  # cut short by the stop (its unfinished rollouts are empty): no group to count or settle
        rewards = [r for r in group.rollout_rewards if r is not None]
        zero = bool(rewards) and zero_variance(rewards)
        kept_out = zero and self.max_zero_variance_groups > 0
        self.settle(group, "no_scorable" if not rewards else "zero_variance" if kept_out else "samples")
        # private: TRL's metric accumulators (_counters, _rates), pushed with its own; no public call adds a metric
        counters, rates = self._counters, self._rates
        counters["harbor/groups_total"] += 1
        solved, scored = self.passes.add(sum(s is not None and s.correctness > 0 for s in scores), len(rewards))
        if scored:
            rates["harbor/solve_rate_pass"][0] += solved
            rates["harbor/solve_rate_pass"][1] += scored
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
            self.stop(NoSignal(
                f"the last {len(self.flat_run)} groups each scored all their rollouts alike ({solved} solved by every "
                f"rollout, {len(self.flat_run) - solved} by none), so no advantage was left to learn from: the tasks "
                "are too hard or too easy for the model. Measure pass rates (--eval-only --curate) and train on the "
                "curated list, or raise --max-zero-variance-groups"))
        return []

    def settle(self, group, outcome: str) -> None:
        """groups.jsonl: each scored group and how it settled; a resume runs no group settled without `samples`."""
        if self.groups_path:
            task = group.prompts[0][0]
            record = {"time": time.time(), "group": group.group_id, "visit": self.dataset.visit(group.group_id),
                      "task": task["harbor_task_name"], "harness": task["harbor_harness"], "outcome": outcome}
            with open(self.groups_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def stop(self, reason: TrainingStopped) -> None:
        """Ends the child's loops and hands `reason` to the trainer's check_health (`stop_from_child`) through TRL's
        failure channel, without the tracebacks TRL's child prints for a crash."""
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
    """Drops the trainer's write ends of the rollout child's queues once the child holds its own: a pipe never reads as
    closed while a write end is open, so a read would wait forever on an item the child died writing (SIGKILL, OOM)."""
    for q in queues:
        q._writer.close()  # private: mp.Queue has no public way to close its write end


class ChildQueue:
    """A queue the rollout child writes, as the trainer reads it (TRL's `get`, `get_nowait`, `qsize`): once the child
    is gone (its pipe closed, `read_only`), it reads as empty, as a live child's with nothing to hand over."""

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


def stop_rollout_worker(worker: Any, timeout_s: float = 10.0) -> None:
    """TRL's `stop()` without its waits: a 15 s join of a child that cannot exit while its queues are unread (mp.Queue
    flushes its pipe at exit), and the stop Event's `set()`, which waits forever once the child ended on its own (its
    watcher thread died unwoken). The queues drain while the child gets `timeout_s` to exit, then SIGTERM (it releases
    its server sessions), then SIGKILL; the metrics drained wait for the trainer's next log or its totals."""
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
    """A stop request at a point where training stops without losing a step; like SystemExit, no `except Exception`
    on the way out swallows it."""


class StopRequest:
    """SIGTERM / SIGUSR1 (SLURM's preemption notice, scancel, `kill`): save a checkpoint, exit for a requeue. Once
    training runs, the handler only takes note: unwinding could leave vLLM paused mid weight sync or a step half
    applied, so training stops at the step's end, or within one queue poll if it waits for rollouts."""

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


def save_for_requeue(trainer: Any, args: argparse.Namespace) -> int:
    """Checkpoints the last finished optimizer step, unless a checkpoint holds it, and asks for a requeue. Every rank
    calls it: a save is a collective (each rank writes its RNG state, FSDP gathers or writes shards)."""
    step = trainer.state.global_step
    checkpoint = Path(args.output_dir) / f"checkpoint-{step}"
    # Rank 0 decides for all: ranks that judged the files apart could split into a save and no save.
    save = bool(step) and trainer.accelerator.is_main_process and checkpoint_problem(checkpoint) is not None
    if broadcast_object_list([save], from_process=0)[0]:
        # A step cut short while waiting for rollouts is dropped whole: the weights and optimizer are the last step's.
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


# The key of the batch that carries a stop to every rank (HarborGRPOTrainer.get_train_dataloader).
STOP_BATCH = "harbor_stop"


def stop_batch_on_preempt(batches, num_processes: int):
    try:
        yield from batches
    except Preempted:
        yield {STOP_BATCH: torch.ones(num_processes)}  # one row per rank: accelerate splits a batch across ranks


# Bytes per POST /update_weights (or one larger tensor), as vLLM's own IPC trainer stages 1 GiB at a time.
IPC_CHUNK_BYTES = 1 << 30


class WeightTransferRefused(RuntimeError):
    """vLLM refused a weight push for a reason fixed where vLLM runs."""


class CudaIpcWeightTransfer(WeightTransferClient):
    """TRL's weight transfer over vLLM's `ipc` backend, for vLLM on the trainer's GPU (where NCCL refuses a second
    rank): a chunk of tensors per POST /update_weights, as CUDA-IPC handles. Not TRL's __init__: it needs vLLM here."""

    def __init__(self, vllm_url: str, weight_sync_timeout: float, chunk_bytes: int = IPC_CHUNK_BYTES):
        self.vllm, self.weight_sync_timeout, self.chunk_bytes = VLLMClient(vllm_url), weight_sync_timeout, chunk_bytes
        self.model_update_group, self.sent = None, []

    def init_weight_transfer(self) -> None:
        self.vllm.wait_for_server_ready()
        # The unpacked form, a handle per tensor: the empty init_info of vLLM 0.26 and 0.29, whose packed forms differ.
        self.vllm.init_weight_transfer_engine({}, timeout=self.weight_sync_timeout)

    def send_weights(self, iterator) -> None:
        self.vllm.start_weight_update(timeout=self.weight_sync_timeout)
        # torch's CUDA-IPC contract: the sender keeps a shared tensor while the receiver may use it, which vLLM does
        # until finish_weight_update. A merged LoRA weight is a copy: the trainer-memory row counts `sent` as staging.
        self.sent = []
        try:
            chunk, size = [], 0
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
                    f"vLLM runs on another GPU than the trainer ({found[0]}): CUDA IPC reaches only the same "
                    f"physical GPU; start this script with CUDA_VISIBLE_DEVICES=GPU-"
                    f"{found[1].lower().removeprefix('gpu-')}") from exc
            # vLLM 0.26 answers a push its workers refused with a bare 500: the cause is only in vLLM's own log.
            answer = " ".join(str(exc).split())[:300]
            raise WeightTransferRefused(
                f"weight push to vLLM at {self.vllm.server_url} over CUDA IPC failed ({answer}); the cause is in "
                "vLLM's server log (the output of `vllm serve`); most likely vLLM runs on another GPU than the trainer "
                "(compare `nvidia-smi -L` with this script's CUDA_VISIBLE_DEVICES), or without "
                "VLLM_ALLOW_INSECURE_SERIALIZATION=1, without which its ipc backend unpickles no handle: restart it "
                "with VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1 vllm serve ... --host 127.0.0.1 "
                "--weight-transfer-config '{\"backend\":\"ipc\"}'. vLLM keeps the weights it loaded and stays paused"
            ) from exc
        self.vllm.finish_weight_update(timeout=self.weight_sync_timeout)
        self.sent = []
        torch.cuda.ipc_collect()  # the copies dropped, once vLLM unmapped them, back to the allocator now

    def update(self, chunk: list[tuple[str, torch.Tensor]]) -> None:
        # vLLM reads the memory from its own process: every copy and merge queued on this one must have landed.
        torch.cuda.synchronize()
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
        # TRL set dataset_start_index from the resumed checkpoint; the untrained groups it left come first.
        # private: TRL's worker holds the child's arguments only as _loop_kwargs (and writes them there itself)
        kw = self._loop_kwargs
        self.order = VisitOrder(kw["dataset"], self.pending, kw["dataset_start_index"])
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
    """Ends training at this step's end, with a save, once any rank has a stop request (SIGTERM, SIGUSR1); completes
    every checkpoint saved."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, _args, _state, control, **_kwargs):
        trainer = self.trainer
        # A signal may reach some ranks only, or at other times: they agree here, as TRL's epoch stop does.
        asked = torch.tensor(int(STOP.signal_name is not None), device=trainer.accelerator.device)
        if int(trainer.accelerator.reduce(asked, reduction="sum").item()):
            trainer.stop_agreed = True
            control.should_save = True
            control.should_training_stop = True

    def on_save(self, _args, _state, _control, **_kwargs):
        self.trainer.complete_checkpoint()


class HeldOutEval(TrainerCallback):
    """--eval-tasks on rank 0 before the first step, every --eval-steps and at the last, at the step's end: after TRL
    pushed the step's weights, before StopAtStepEnd (a stop request cuts it short). The other ranks wait for it in
    `group`, a gloo group whose timeout is the eval's budget (eval_budget_s), not training's (ddp_timeout)."""

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
    """The step line and the launch's totals. After AsyncGRPOTrainer in HarborGRPOTrainer's MRO, its log() runs
    between TRL's, which reduced the rollout child's metrics into the step's log, and transformers', which records it.
    A micro-batch is trained once a training step took it: accelerate collates one ahead, which a stop leaves."""

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
        got = {key: logs.get(f"harbor/{key}") or 0.0 for key in ("rollouts_total", "errors_total", "groups_total",
                                                                  "zero_variance_groups_total", "sandbox_s_total")}
        logs |= {"harbor/rollouts_per_min": got["rollouts_total"] / elapsed * 60,
                 "harbor/trained/groups": float(len(trained)), "harbor/trained/samples": float(samples)}
        if tokens:
            logs |= {"harbor/trained/informative_token_frac": informative / tokens, "harbor/ratio_max": high,
                     "harbor/ratio_min": low, "harbor/ratio_beyond_bound_frac": beyond / tokens}
        self.count(logs)
        self.totals.update(trained_tokens=int(tokens), informative_tokens=int(informative))
        scored, rate = int(got["rollouts_total"] - got["errors_total"]), logs.get("harbor/solve_rate")
        frac = logs.get("harbor/zero_variance_frac")
        errors = "".join(f" {kind}={n}" for kind, n in error_kinds(logs).items())
        signal = f", {informative / tokens:.0%} with a non-zero advantage" if tokens else ""
        ratio = f"; importance ratio {low:.3g}-{high:.3g}, {beyond / tokens:.0%} beyond the bound" if tokens else ""
        say(f"[harbor] step {step}: {int(got['groups_total'])} groups finished, "
            f"{int(got['zero_variance_groups_total'])} zero-variance ({'-' if frac is None else f'{frac:.0%}'}); "
            f"{int(got['rollouts_total'])} rollouts ({logs['harbor/rollouts_per_min']:.1f}/min), sandbox "
            f"{got['sandbox_s_total']:.0f}s, solve rate {'-' if rate is None else f'{rate:.2f}'} "
            f"({round((rate or 0) * scored)}/{scored}), errors {int(got['errors_total'])}{errors}; trained "
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


# A step's loss terms, over every rank: importance ratio max and min, how many beyond --delta, how many, how many with
# a non-zero advantage.
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
            self.rollout_queue = ChildQueue(self.rollout_worker.rollout_buffer)  # TRL's dataset reads it
        model = self.accelerator.unwrap_model(self.model)
        if is_peft_model(model):
            # TRL's merged push calls PEFT's merge_adapter and unmerge_adapter: in bfloat16 the in-place round trip is
            # not exact, so the frozen base would drift at every push. _streaming_iter sends the sum out of place.
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
            # The other ranks wait in accelerate's broadcast of rank 0's next micro-batch: a stop that ends rank 0's
            # wait for rollouts reaches them as one more batch, and every rank leaves the step at the same point.
            # private: torch's DataLoader makes each pass's iterator in _get_iterator; no public hook wraps it
            make = base._get_iterator
            base._get_iterator = lambda: stop_batch_on_preempt(make(), self.accelerator.num_processes)
        return loader

    def collate(self, collate, examples):
        """TRL's collator, which sees a micro-batch whole: every rank's row."""
        (rows,) = examples
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
        if self.accelerator.is_main_process and self.collated:
            self.step_batches.append(self.collated.popleft())
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # TRL's loss reads the forward's `log_probs` at `token_index` against `old_log_probs`, the engine's: bounded
        # on the way out of the forward, every loss term and TRL's own metrics (`ratio`, `kl`) see the bounded ratio.
        hook = model.register_forward_hook(functools.partial(self.bound_ratio, inputs))
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            hook.remove()

    def bound_ratio(self, inputs, _module, _args, outputs):
        """The dual clip (--delta): TRL clips r = p_trainer / p_engine only where it helps the advantage's sign, so a
        negative-advantage token whose probability grew far past the engine's adds r x |A|, unbounded (measured on the
        CPU rig: r 1.9e8, grad norm 6e9). Capped at delta, as TRL's GRPOConfig `delta`, it adds delta x |A| and no
        gradient; a packed position several samples share, at its lowest bound."""
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
        """Writes the resume order into the checkpoint just saved, last: it marks the checkpoint whole. TRL's position
        would repeat trained groups after it and skip those collated ahead or dropped by a stop. Settled, never run
        again: a group a step trained, one kept out, and one with no scorable rollout (a rerun would fail again)."""
        if not self.accelerator.is_main_process:
            return
        state_file = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}" / "rollout_state.json"
        state, order = json.loads(state_file.read_text()), self.rollout_worker.order
        groups = Path(self.args.output_dir) / "groups.jsonl"
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


def numbered_checkpoints(output_dir: str) -> list[Path]:
    """checkpoint-N dirs, newest first, as transformers rotates them (its get_last_checkpoint gives only the newest)."""
    return [Path(p) for p in reversed(sort_checkpoints(output_dir))]


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


def lora_mismatch(args: argparse.Namespace, checkpoint: str | None) -> str | None:
    """A LoRA checkpoint resumed without --use-peft, or full weights with it (transformers would load nothing), or with
    other --lora-* flags (PEFT loads into the adapter the flags built: another rank fails, another alpha rescales)."""
    saved = Path(checkpoint or "") / "adapter_config.json"
    if checkpoint is not None and args.use_peft and saved.is_file():
        config = json.loads(saved.read_text())
        flags = {"r": args.lora_r, "lora_alpha": args.lora_alpha, "use_rslora": args.use_rslora}
        differ = [f"{key} {config.get(key)!r} (flags: {value!r})" for key, value in flags.items()
                  if config.get(key) != value]
        # PEFT saves the modules its target_modules resolved to: so are the flags' compared (the LoRA targets row says
        # so where they resolve to none, or --model is unreadable).
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
        efficiency_weight=args.efficiency_weight,
        max_zero_variance_groups=args.max_zero_variance_groups, groups_per_pass=len(dataset),
        groups_path=os.path.join(args.output_dir, "groups.jsonl"),
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
            return run_measure(args, {})
    except UsageError as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 2
    rank = launch_rank()
    # Under `accelerate launch` / torchrun rank 0 alone runs the preflight and the Harbor server (TRL runs rollouts on
    # the main process only); the others take its plan and run name, so N processes start one server and write one
    # run. The process group exists already (HarborGRPOConfig, with this timeout); this adds one for Python objects.
    group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=args.ddp_timeout))
             if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None)
    server = None if args.harbor_url or rank else EmbeddedHarborServer(args)
    try:
        code, plan = None, {}
        if rank == 0:
            pf = Preflight(args, server)
            plan = preflight(pf)
            pf.print()
            if pf.failures:
                print(pf.error_line(), file=sys.stderr)
                code = 2
            elif args.check:
                print(f"preflight: no failures ({sum(r[1] == WARN for r in pf.rows)} warnings)", flush=True)
                code = 0
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
        # A group left to the interpreter's exit can abort a rank that ends here (after --check: SIGABRT,
        # "terminate called without an active exception").
        dist.destroy_process_group()
    return code


def launch_rank() -> int:
    """This process's global rank under `accelerate launch` / torchrun; 0 when launched alone."""
    return int(os.environ.get("RANK", "0"))


def process_group_timeout() -> str:
    """The timeout of the process group training runs on, as torch holds it (what the NCCL watchdog enforces)."""
    try:
        # private: torch has no public getter of a process group's timeout (_get_backend, options._timeout)
        backend = dist.group.WORLD._get_backend(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        return f"{dist.get_world_size()} ranks ({dist.get_backend()}), collective timeout {backend.options._timeout}"
    except (AttributeError, RuntimeError, ValueError) as exc:  # private torch API: report, do not fail the run
        return f"{dist.get_world_size()} ranks (timeout unreadable: {exc})"


def print_hyperparameters(args: argparse.Namespace, plan: dict[str, Any],
                          server: EmbeddedHarborServer | None) -> None:
    llm, tasks = plan["llm"], plan["tasks"]
    ranks_wait = (f"; the other ranks wait up to {timedelta(seconds=eval_budget_s(args, len(plan['eval_tasks'])))} "
                  "for each" if plan.get("eval_tasks") and int(os.environ.get("WORLD_SIZE", "1")) > 1 else "")
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
        "dtype (trainer weights)": (f"{args.dtype} base (frozen), float32 LoRA adapters" if args.use_peft
                                    else args.dtype),
        **({"LoRA": f"r {args.lora_r}, alpha {args.lora_alpha}{' (rsLoRA)' if args.use_rslora else ''}, dropout "
                    f"{args.lora_dropout}, on {' '.join(args.lora_target_modules or ['PEFT default modules'])}; "
                    f"merged push; merged model written to {args.output_dir}/merged at the end"}
           if args.use_peft else {}),
        "checkpoints": (f"~{human_bytes(plan['checkpoint_bytes'])} each"
                        + (" (adapter + its AdamW state)" if args.use_peft else "") if plan.get("checkpoint_bytes")
                        else "size unknown") + f", the newest {args.save_total_limit or 'all'} kept",
        "efficiency weight": args.efficiency_weight, "stop after failures": args.max_consecutive_failures,
        "zero-variance groups": (f"kept out; stop after {args.max_zero_variance_groups} in a row"
                                 if args.max_zero_variance_groups else "trained (advantages 0)"),
        "held-out eval": (f"{len(plan['eval_tasks'])} tasks x {args.eval_k} rollouts, before training and every "
                          f"{args.eval_steps or '-'} steps{ranks_wait}" if plan.get("eval_tasks")
                          else "none (--eval-tasks)"),
        "report to": f"{', '.join(args.report_to) or 'none'} (project {args.project})",
        # AsyncGRPOConfig fields set beyond the script's flags; transformers hides *_token fields the same way
        **{f"{k} (TRL)": f"<{k.upper()}>" if k.endswith("_token") else redact(str(v)) for k, v in args.trl.items()},
        **({"ranks": process_group_timeout()} if int(os.environ.get("WORLD_SIZE", "1")) > 1 else {}),
    })


def train(args: argparse.Namespace, plan: dict[str, Any], server: EmbeddedHarborServer | None) -> int:
    if launch_rank() == 0:
        print_hyperparameters(args, plan, server)
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
        # The step's progress bar (stderr, no newline while it runs) still holds the line the error would join.
        print(file=sys.stderr)
        reason = str(exc)
        if isinstance(exc, RolloutsFailing):
            if server is not None and server.proc is not None and server.proc.poll() is not None:
                reason += (f" (the Harbor server this script started exited with code {server.proc.returncode}; "
                           f"its log: {server.log_path})")
            reason += f". Fix the cause, then relaunch with --output-dir {args.output_dir} --resume"
        print(f"error: training stopped: {reason}", file=sys.stderr)
        return 1
    if trainer.stop_agreed and trainer.state.global_step < args.max_steps:
        return save_for_requeue(trainer, args)
    trainer.save_model(args.output_dir)
    saved = args.output_dir
    if args.use_peft and trainer.accelerator.is_main_process:
        # save_model wrote the adapter only; what serves the finished run loads whole weights. merge_and_unload
        # folds the adapter in as every push did (rounded once to the base dtype).
        saved = os.path.join(args.output_dir, "merged")
        merged = trainer.accelerator.unwrap_model(trainer.model).merge_and_unload()
        merged.save_pretrained(saved)
        trainer.processing_class.save_pretrained(saved)
        saved += f" (adapter in {args.output_dir})"
    print(f"[harbor] done: {trainer.state.global_step} steps, model saved to {saved}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
