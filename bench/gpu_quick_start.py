"""Benchmark (not a test): the README's first quick start, exactly as written, fits and trains on one 80 GB H100.

What runs, on one GPU of the lent machine (no hub, no internet; `../shared/gpu/README.md`, "One GPU, full stack"):
1. The quick start's model built here from its own config (bench/configs/Qwen3-4B-Instruct-2507.json: Qwen3-4B's
   shape, 151,936-token vocabulary, tied embeddings): random weights in bfloat16, saved as safetensors. Its tokenizer
   is the rig's (tests/rig/tiny_model.py: byte-level BPE, Qwen3's chat template and special tokens) padded to the
   config's vocabulary with decodable dummy tokens (` q<id>`), so every id a random model samples detokenizes.
2. `vllm serve` (vLLM 0.26.0 here, `python -m vllm.entrypoints.cli.main serve`) with the flags of the `vllm serve`
   line of README.md's first ```bash block under "## Quick start", read from the README, not copied: only the model
   (the local build for the hub id) and `--port` (a free one) change.
3. The rig's Harbor server (tests/rig/harbor_server.py, the `local` sandbox, task `coinflip` of tests/gpu/tasks,
   whose verifier flips a coin so every group's rewards vary), each agent turn capped at the script's
   --max-completion-length.
4. The script, through bench/memory_main.py (the trainer's peak GPU memory and packed row lengths after each
   optimizer step), with the README's `uv run async_grpo_harbor.py` flags plus only the rig's overrides, each
   recorded with its reason in the JSON. A random 4B writes --max-completion-length (1024) tokens every turn and
   never a valid tool call: one turn per rollout (--agent-step-limit 1) makes every rollout ~1.1k shared prompt
   tokens + 1024 of its own, so TRL's packer (TokenBudgetBatcher: a micro-batch closes when the next rollout's
   unique tokens no longer fit vLLM's max_model_len) fills each row to within one rollout of 32,768 tokens, and one
   micro-batch per step (--micro-batches-per-step 1; gradient accumulation adds no memory) makes 3 steps ~100
   rollouts, which fit one device call.
5. The record: OUT.json (card, flags, steps, trainer_peak_gib measured, vllm_gib from nvidia-smi, projected_gib from
   the preflight's `trainer memory` row, push seconds, importance ratio and longest row per step, wall times, the
   verdict: projection >= measured peak and within 25 % of it, beyond the row's 0.1 GiB rounding) and OUT.log (this
   bench's lines, the script's output, the tails of vLLM's and the Harbor server's logs). The last line printed is
   `quick-start: ...`.
A deadline (--deadline-s) SIGTERMs the script (it saves a checkpoint and exits 75); the record is still written, and
vLLM and the Harbor server are always stopped.

The device call (after the staged kit's calls 1-3, as `../shared/gpu/README.md` shows them; the lead copies the two
files to bench/results/):

    run(carry=[".proj"], timeout_s=600,
        command="cd .proj && { [ -f /tmp/agh-gpu-env.sh ] || { echo 'STAGE1 LOST'; exit 3; }; } && "
                "source /tmp/agh-gpu-env.sh && python3 bench/gpu_quick_start.py --deadline-s 460 "
                "--out $OUT/$(date -u +%Y-%m-%d)-h100-quick-start")

On CPU (no GPU): `python bench/gpu_quick_start.py --build-only --tiny --device cpu` builds and checks the same
tokenizer with a scaled-down config; `--plan` prints the commands read from the README; `--record-only WORK` writes
the record of a finished work directory again; `--rehearse --device cpu` runs the whole bench with the rig's engine
(tests/rig/engine.py) for vLLM and the rig's CPU stand-ins in the script (256-token turns; ~9 min on 2 cores).
Timeline on the GPU, estimated: build ~1 min, vLLM ready ~2-3 min (compiles and captures CUDA graphs: the README's
flags have no --enforce-eager; should it exit, one retry with it, recorded), Harbor server ~20 s, the script's
preflight and load ~1 min, 3 steps of ~30 rollouts each ~1.5-2 min.

Environment: AGH_SERVER_PYTHON (the Harbor server's interpreter), AGH_VLLM_PYTHONPATH (put first on vLLM's path),
AGH_GPU_OFFLINE_ATTENTION=1 (no hub: the rig's SDPA tree attention, as in tests/gpu/test_one_gpu.py; it holds more
memory than FlashAttention-3 would, so a projection at or above the measured peak is also one above FA3's).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RIG = ROOT / "tests" / "rig"
TASKS = ROOT / "tests" / "gpu" / "tasks"
TASK = "coinflip"
CONFIG = ROOT / "bench" / "configs" / "Qwen3-4B-Instruct-2507.json"
README = ROOT / "README.md"
SCRIPT = ROOT / "async_grpo_harbor.py"
NCCL_SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ROW = re.compile(r"^  (PASS|WARN|FAIL|SKIP)  (.+?)  +(.*)$", re.M)
TOLERANCE = 0.25
# --tiny: the same tokenizer and vocabulary, a scaled-down decoder (CPU checks of the build).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_window_layers=2)
BASH_TOOL = {"type": "function", "function": {
    "name": "bash", "description": "Execute a bash command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
STEP_KEYS = ("loss", "ratio", "kl", "grad_norm", "perf/weight_sync_s", "perf/step_s", "batch/row_tokens_max",
             "batch/samples_per_row", "batch/microbatches_per_step", "harbor/rollouts_total")


def gib(n: float | None) -> float | None:
    return None if n is None else round(n / 2**30, 2)


# ---- the README's quick start ------------------------------------------------------------------------------------

def quick_start(readme: Path = README) -> dict:
    """The `vllm serve` and `async_grpo_harbor.py` commands of the first ```bash block under "## Quick start"."""
    text = readme.read_text()
    start = text.index("\n## Quick start")
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    if block is None:
        raise SystemExit("error: README.md has no ```bash block under '## Quick start'")
    commands = [shlex.split(line, comments=True) for line in block[1].replace("\\\n", " ").splitlines()]
    serve = next(c for c in commands if "vllm" in c and "serve" in c)
    # The training command: the one before it (with --check) checks the same flags without training.
    train = next(c for c in commands if any(t.endswith("async_grpo_harbor.py") for t in c) and "--check" not in c)
    at = serve.index("serve", serve.index("vllm"))
    script_at = next(i for i, t in enumerate(train) if t.endswith("async_grpo_harbor.py"))

    def env(command: list[str]) -> dict[str, str]:
        """The command's leading NAME=value words."""
        assigned = {}
        for token in command:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", token):
                break
            assigned.update([token.split("=", 1)])
        return assigned

    return {"serve_env": env(serve), "serve_model": serve[at + 1], "serve_flags": serve[at + 2:],
            "script_env_names": sorted(env(train)), "script_flags": train[script_at + 1:],
            "serve_line": shlex.join(serve), "script_line": shlex.join(train)}


def flag_items(argv: list[str]) -> list[tuple[str, list[str]]]:
    """`--flag v1 v2 --other` -> [("--flag", ["v1", "v2"]), ("--other", [])]."""
    items: list[tuple[str, list[str]]] = []
    for token in argv:
        if token.startswith("--"):
            items.append((token, []))
        elif items:
            items[-1][1].append(token)
        else:
            raise SystemExit(f"error: README command has a positional argument {token!r} where flags were expected")
    return items


def with_flags(argv: list[str], changes: dict[str, list[str]]) -> list[str]:
    """argv with each flag of `changes` given those values: in place where argv has it, appended where not."""
    items = [(f, changes.get(f, v)) for f, v in flag_items(argv)]
    items += [(f, v) for f, v in changes.items() if f not in dict(items)]
    return [t for f, v in items for t in (f, *v)]


def flag_value(argv: list[str], flag: str) -> str | None:
    values = dict(flag_items(argv)).get(flag)
    return values[0] if values else None


def script_default(field: str) -> str:
    """A flag's default as the script declares it (`name: type = arg(<default>, ...`), read without importing it."""
    match = re.search(rf"^    {field}: [^=]+= arg\(\s*([^,\s]+)", SCRIPT.read_text(), re.M)
    if match is None:
        raise SystemExit(f"error: no default of {field} found in {SCRIPT.name}")
    return match[1]


# ---- the model ---------------------------------------------------------------------------------------------------

def pad_vocabulary(tokenizer_json: dict, vocab_size: int) -> int:
    """Add dummy tokens to the BPE model's vocabulary up to `vocab_size` ids; returns the first id added.

    No merge produces them, so every text encodes as before; each decodes to ` q<id>` (byte-level: `Ġ` is the space
    byte, ASCII letters and digits stand for themselves)."""
    vocab = tokenizer_json["model"]["vocab"]
    added = tokenizer_json["added_tokens"]
    ids = set(vocab.values()) | {t["id"] for t in added}
    if ids != set(range(len(ids))):
        raise SystemExit("error: the rig tokenizer's ids are not contiguous from 0")
    first = len(ids)
    if first > vocab_size:
        raise SystemExit(f"error: the rig tokenizer has {first} tokens, more than the config's {vocab_size}")
    taken = set(vocab) | {t["content"] for t in added}
    # tokenizers gives an added token that is not in the model's vocabulary the id len(vocabulary), whatever
    # tokenizer.json says: with the vocabulary padded that would move the markup tokens to its end.
    for token in added:
        if vocab.setdefault(token["content"], token["id"]) != token["id"]:
            raise SystemExit(f"error: added token {token['content']!r} has two ids")
    for i in range(first, vocab_size):
        token = f"\u0120q{i}"
        if token in taken:
            raise SystemExit(f"error: dummy token {token!r} is already in the vocabulary")
        vocab[token] = i
    return first


def check_tokenizer(out: Path, rig: Path, vocab_size: int) -> dict:
    """The padded tokenizer loads, encodes the rig's text and chat template as the rig's does, decodes every id."""
    import tiny_model
    from transformers import AutoTokenizer

    padded, base = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(rig)
    problems = []
    if len(padded) != vocab_size:
        problems.append(f"{len(padded)} tokens, not {vocab_size}")
    if padded.encode(tiny_model.CORPUS) != base.encode(tiny_model.CORPUS):
        problems.append("the rig's corpus encodes differently")
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": (TASKS / TASK / "instruction.md").read_text()}]

    def rendered(tok) -> list[int]:
        ids = tok.apply_chat_template(messages, tools=[BASH_TOOL], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    prompt = rendered(padded)
    if prompt != rendered(base):
        problems.append("the chat template renders differently")
    pieces = padded.convert_ids_to_tokens(list(range(vocab_size)))
    if any(p is None for p in pieces):
        problems.append(f"{sum(p is None for p in pieces)} ids have no token")
    last = padded.decode([vocab_size - 1])
    if last != f" q{vocab_size - 1}":
        problems.append(f"id {vocab_size - 1} decodes to {last!r}")
    sample = padded.decode(list(range(0, vocab_size, 4999)) + [vocab_size - 1], skip_special_tokens=True)
    for name in ("eos_token", "pad_token"):
        if getattr(padded, name) != getattr(base, name) or getattr(padded, f"{name}_id") != getattr(base, f"{name}_id"):
            problems.append(f"{name} differs from the rig's")
    if problems:
        raise SystemExit("error: padded tokenizer: " + "; ".join(problems))
    return {"tokens": len(padded), "prompt_tokens": len(prompt), "eos": padded.eos_token_id,
            "pad": padded.pad_token_id, "decoded_sample": sample[-60:]}


def build(out: Path, device: str, tiny: bool) -> dict:
    """The quick start's model from its own config (random bfloat16 weights) with the padded rig tokenizer."""
    sys.path.insert(0, str(RIG))
    import tiny_model
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    fields = json.loads(CONFIG.read_text()) | (TINY if tiny else {})
    recipe = hashlib.sha256(json.dumps(fields, sort_keys=True).encode() + Path(__file__).read_bytes()
                            + Path(tiny_model.__file__).read_bytes()).hexdigest()[:16]
    stamp = out / "quick_start_build.json"
    card = card_info() if device.startswith("cuda") else {}
    if stamp.is_file() and json.loads(stamp.read_text()).get("recipe") == recipe:
        return {**json.loads(stamp.read_text()), "reused": True, "card": card}
    t0 = time.monotonic()
    rig = tiny_model.build(out.parent / "rig-tokenizer")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tokenizer_json = json.loads((rig / "tokenizer.json").read_text())
    first_dummy = pad_vocabulary(tokenizer_json, fields["vocab_size"])
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(rig / name, out / name)
    checks = check_tokenizer(out, rig, fields["vocab_size"])
    # Qwen3's bos is its <|endoftext|>, the rig's pad; its eos <|im_end|>.
    fields |= {"bos_token_id": checks["pad"], "eos_token_id": checks["eos"], "pad_token_id": checks["pad"]}
    for key in ("torch_dtype", "transformers_version"):
        fields.pop(key, None)
    config = Qwen3Config.from_dict({**fields, "dtype": "bfloat16"})
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    model = model.to(torch.bfloat16).eval()
    params = sum(p.numel() for p in model.parameters())
    # No sampling defaults: vLLM would adopt them as the server's default temperature/top_p/top_k.
    model.generation_config = GenerationConfig(bos_token_id=checks["pad"], eos_token_id=[checks["eos"]],
                                               pad_token_id=checks["pad"])
    model.save_pretrained(out)
    del model
    result = {"recipe": recipe, "tiny": tiny, "parameters": params, "first_dummy_id": first_dummy,
              "tokenizer": checks, "tied_embeddings": config.tie_word_embeddings,
              "bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
              "seconds": round(time.monotonic() - t0, 1)}
    stamp.write_text(json.dumps(result))
    return {**result, "card": card}


def card_info() -> dict:
    import torch

    props = torch.cuda.get_device_properties(0)
    info = {"name": torch.cuda.get_device_name(0), "total_gib": gib(props.total_memory),
            "total_bytes": props.total_memory, "torch": torch.__version__}
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def check_tiny_model(out: Path) -> dict:
    """CPU: the saved build loads in transformers and samples ids that decode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                        tokenize=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    with torch.no_grad():
        sampled = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                                 max_new_tokens=16)[0, ids.shape[1]:].tolist()
    return {"logits": model.config.vocab_size, "sampled": sampled, "decoded": tokenizer.decode(sampled)}


# ---- the run ------------------------------------------------------------------------------------------------------

class Service:
    """A child process in its own session with its log in a file (as tests/conftest.py's, without pytest)."""

    def __init__(self, name: str, cmd: list[str], log: Path, ready_url: str, env: dict, cwd: Path):
        self.name, self.log, self.ready_url = name, log, ready_url
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                get_json(self.ready_url, timeout=5)
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not come up in {timeout:.0f}s (exit {self.proc.poll()}):\n"
                           + self.log.read_text()[-3000:])

    def stop(self) -> None:
        stop_group(self.proc, 20)


def stop_group(proc: subprocess.Popen, grace: float) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def get_json(url: str, timeout: float = 10.0):
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read())


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, **NCCL_SAFE, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_NO_USAGE_STATS": "1", "VLLM_HOST_IP": "127.0.0.1", "CUDA_VISIBLE_DEVICES": "0", **extra}
    if os.environ.get("AGH_GPU_OFFLINE_ATTENTION") == "1":
        env |= {"PYTHONPATH": os.pathsep.join(filter(None, [str(RIG / "sitecustomize"), env.get("PYTHONPATH")])),
                "AGH_CPU_RIG": "attention", "HF_HUB_OFFLINE": "1"}
    return env


def script_env(rehearse: bool, **extra: str) -> dict[str, str]:
    env = base_env(**extra)
    if rehearse:  # every CPU stand-in of the rig (tests/rig/cpu_trainer.py), as the CPU tests run the script
        env |= {"PYTHONPATH": os.pathsep.join(filter(None, [str(RIG / "sitecustomize"), env.get("PYTHONPATH")])),
                "AGH_CPU_RIG": "1", "HF_HUB_OFFLINE": "1"}
    return env


class GpuSampler:
    """nvidia-smi's compute processes every `every` seconds, split into vLLM's (its process group), the trainer's and
    the rest; and the GPU's memory.used."""

    def __init__(self, every: float = 2.0):
        self.every, self.samples, self.groups = every, [], {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def read(self) -> dict:
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout
        used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout.split()
        sample = {"t": round(time.time(), 1), "gpu_used_mib": float(used[0]) if used else None,
                  **{name: 0.0 for name in self.groups}, "other": 0.0, "apps": []}
        for line in apps.splitlines():
            pid, _, mib = line.partition(",")
            if not pid.strip().isdigit():
                continue
            try:
                group = os.getpgid(int(pid))
            except OSError:  # another PID namespace, or gone
                group = None
            name = next((n for n, g in self.groups.items() if g == group), "other")
            sample[name] += float(mib)
            sample["apps"].append([int(pid), float(mib)])
        return sample

    def loop(self) -> None:
        while not self.stop.wait(self.every):
            try:
                self.samples.append(self.read())
            except (OSError, subprocess.SubprocessError, ValueError, IndexError):
                continue


def plan_run(qs: dict, model: Path, vllm_port: int, work: Path, run_name: str, harbor_url: str, split: str,
             steps: int, rehearse: bool = False) -> tuple[list[str], list[str], dict]:
    """The serve flags and the script flags of this run, and each override with its reason."""
    serve = with_flags(qs["serve_flags"], {"--port": [str(vllm_port)]})
    vllm_url = f"http://{flag_value(serve, '--host') or '127.0.0.1'}:{vllm_port}"
    substituted = {"--model": ([str(model)], "the random-weight build of the quick start's model's own config "
                                              "(no hub on the machine)"),
                   "--vllm-url": ([vllm_url], "the vLLM started here, on a free port")}
    overrides = {
        "--harbor-url": ([harbor_url], "the rig's Harbor server with the local sandbox (no E2B on the machine); "
                                       "the README's run starts its own"),
        "--dataset": ([split], "the split of that server (tests/gpu/tasks; no hub)"),
        "--sandbox": (["local"], "the rig's sandbox: namespaced local processes"),
        "--tasks": ([TASK], "its verifier flips a coin, so a random model's groups still have rewards that vary"),
        "--report-to": (["none"], "no tracker on the machine"),
        "--max-steps": ([str(steps)], "the proof's optimizer steps"),
        "--save-steps": ([str(steps)], "one checkpoint, whose trainer_state.json holds the per-step log"),
        "--output-dir": ([str(work / "out")], "scratch"),
        "--run-name": ([run_name], "scratch"),
        "--agent-step-limit": (["1"], "a random 4B writes --max-completion-length tokens every turn and never a "
                                      "valid tool call, so a rollout never submits: one turn per rollout keeps "
                                      "rollouts ~1.1k shared prompt + one full turn, which TRL packs to within one "
                                      "rollout of vLLM's max_model_len per row, in the time of one device call"),
        "--micro-batches-per-step": (["1"], "a step then trains one packed max_model_len row instead of 4 (4x the "
                                            "rollouts would not fit one device call); gradient accumulation over "
                                            "micro-batches adds no memory, each frees its activations in backward"),
        "--max-inflight": (["32"], "twice the default, to sample the ~100 rollouts of 3 steps in time (rollouts "
                                   "live in vLLM and the sandboxes, not in the trainer's memory)"),
    }
    if rehearse:  # the rig's engine on CPU: its context is the rig's 1,600 tokens
        overrides["--max-completion-length"] = (["256"], "CPU rehearsal only")
    script = with_flags(qs["script_flags"], {f: v for f, (v, _) in {**substituted, **overrides}.items()})
    why = {f: {"value": " ".join(v), "why": w} for f, (v, w) in overrides.items()}
    return serve, script, {"substituted": {f: {"value": " ".join(v), "why": w} for f, (v, w) in substituted.items()},
                           "overrides": why}


def run(args: argparse.Namespace, log) -> dict:
    """Build, serve, train; returns the record's raw parts (finished by `finish`)."""
    t0 = time.monotonic()
    deadline = t0 + args.deadline_s
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    for stale in ("out", "memory.jsonl", "script.log", "sandboxes", "trials"):
        path = work / stale
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    qs = quick_start()
    rec: dict = {"readme": {"serve": qs["serve_line"], "script": qs["script_line"]}, "times": {}}
    log(f"README quick start: {qs['serve_line']}")
    log(f"README quick start: {qs['script_line']}")
    model = work / "model"
    vllm_port, harbor_port = free_port(), free_port()
    harbor_url = f"http://127.0.0.1:{harbor_port}"
    serve, script_flags, flags = plan_run(qs, model, vllm_port, work, args.run_name, harbor_url, "<split>", args.steps,
                                          args.rehearse)
    # What the script's own Harbor server would cap every agent turn at.
    max_completion = flag_value(script_flags, "--max-completion-length") or script_default("max_completion_length")
    inflight = int(flag_value(script_flags, "--max-inflight") or script_default("max_inflight"))
    vllm_url = flags["substituted"]["--vllm-url"]["value"]
    sampler = GpuSampler()
    services: list[Service] = []
    proc = None
    rec["flags"] = {"serve_readme": qs["serve_flags"], "serve_env_readme": qs["serve_env"], "serve_run": serve,
                    "script_readme": qs["script_flags"], "script_env_readme_names": qs["script_env_names"], **flags}
    try:
        # In a child: its CUDA context and the model's memory are gone before vLLM sizes itself to the card.
        built = subprocess.run([sys.executable, __file__, "--build-only", "--device", args.device, "--work", str(work),
                                *(["--tiny"] if args.rehearse else [])],
                               capture_output=True, text=True, timeout=max(60.0, deadline - time.monotonic()))
        log(f"build: exit {built.returncode}\n{built.stdout.strip()[-3000:]}\n{built.stderr.strip()[-3000:]}")
        line = next((x for x in reversed(built.stdout.splitlines()) if x.startswith("BUILD ")), None)
        if built.returncode != 0 or line is None:
            raise RuntimeError(f"model build failed (exit {built.returncode})")
        rec["build"] = json.loads(line.removeprefix("BUILD "))
        rec["card"] = rec["build"].pop("card", {})
        rec["times"]["build_s"] = round(time.monotonic() - t0, 1)

        vllm_env = base_env(**qs["serve_env"])
        if os.environ.get("AGH_VLLM_PYTHONPATH"):
            vllm_env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ["AGH_VLLM_PYTHONPATH"],
                                                                   vllm_env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), *serve]
        if args.rehearse:
            cmd = [sys.executable, str(RIG / "engine.py"), "--model-dir", str(model), "--port", str(vllm_port),
                   "--served-name", str(model), "--max-model-len", "1600", "--weight-transfer-config",
                   flag_value(serve, "--weight-transfer-config")]
        for attempt in ("as written", "--enforce-eager"):
            log("$ " + shlex.join(cmd))
            vllm = Service("vllm", cmd, work / "vllm.log", f"{vllm_url}/v1/models", vllm_env, work)
            services.append(vllm)
            sampler.groups["vllm"] = vllm.proc.pid
            if sampler.thread.ident is None:
                sampler.thread.start()
            try:
                vllm.wait_ready(timeout=max(30.0, min(args.vllm_wait_s, deadline - time.monotonic())))
                break
            except RuntimeError:
                # The kit's other GPU programs all serve with --enforce-eager; the quick start's flags compile and
                # capture CUDA graphs. Should that fail to start here, one retry without them still measures the
                # trainer beside vLLM's same share, and says so in the record.
                exited = vllm.proc.poll()  # None: still starting at the deadline, which a retry cannot help
                vllm.stop()
                if exited is None or attempt != "as written" or args.rehearse:
                    raise
                (work / "vllm.log").rename(work / "vllm-as-written.log")
                rec["vllm_as_written_failed"] = (work / "vllm-as-written.log").read_text(errors="replace")[-6000:]
                log(f"vLLM as written exited {exited}; retrying with --enforce-eager")
                serve = [*serve, "--enforce-eager"]
                rec["flags"]["serve_run"] = serve
                rec["flags"]["serve_fallback"] = {"--enforce-eager": "vLLM 0.26 did not start with the README's "
                                                                     "flags alone (vllm_as_written_failed)"}
                cmd = [*cmd, "--enforce-eager"]
        rec["times"]["vllm_ready_s"] = round(time.monotonic() - t0, 1)
        log(f"vLLM ready ({rec['times']['vllm_ready_s']}s)")
        try:
            rec["vllm_alone"] = sampler.read()
        except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
            rec["vllm_alone"] = {"error": str(exc)}

        harbor_cmd = [os.environ.get("AGH_SERVER_PYTHON", sys.executable), str(RIG / "harbor_server.py"),
                      "--dataset", str(TASKS), "--llm-url", f"{vllm_url}/v1", "--model", str(model),
                      "--max-output-tokens", str(max_completion), "--host", "127.0.0.1", "--port", str(harbor_port),
                      "--capture-port", str(free_port()), "--expose", "direct"]
        harbor = Service("harbor server", harbor_cmd, work / "harbor.log", f"{harbor_url}/harbor_env/splits",
                         {**os.environ, **NCCL_SAFE, "MAX_CONCURRENT_ENVS": str(2 * inflight),
                          "RIG_SANDBOX_DIR": str(work / "sandboxes"),
                          "OPENENV_HARBOR_TRIALS_DIR": str(work / "trials")}, work)
        services.append(harbor)
        harbor.wait_ready(timeout=max(30.0, min(300.0, deadline - time.monotonic())))
        split = get_json(f"{harbor_url}/harbor_env/splits")[0]["name"]
        rec["times"]["harbor_ready_s"] = round(time.monotonic() - t0, 1)
        serve, script_flags, flags = plan_run(qs, model, vllm_port, work, args.run_name, harbor_url, split,
                                              args.steps, args.rehearse)
        rec["flags"].update(script_run=script_flags, **flags)
        cmd = [sys.executable, str(ROOT / "bench" / "memory_main.py"), *script_flags]
        log("$ " + shlex.join(cmd))
        started = time.monotonic()
        with open(work / "script.log", "w") as out:
            proc = subprocess.Popen(cmd, cwd=work, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=script_env(args.rehearse, AGH_BENCH_MEMORY_FILE=str(work / "memory.jsonl")))
        sampler.groups["trainer"] = proc.pid
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        if proc.poll() is None:  # out of time: the script saves a checkpoint on SIGTERM and exits 75
            log(f"deadline ({args.deadline_s:.0f}s): SIGTERM to the script")
            rec["stopped_at_deadline"] = True
            stop_group(proc, 40)
        rec["exit"] = proc.returncode
        rec["times"]["script_s"] = round(time.monotonic() - started, 1)
        log(f"script exit {proc.returncode} after {rec['times']['script_s']}s")
    except Exception as exc:  # a run that broke is still recorded
        rec["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        log(f"error: {rec['error']}")
    finally:
        if proc is not None and proc.poll() is None:
            stop_group(proc, 10)
        sampler.stop.set()
        # Together: each may take its grace period, and the device call's limit is near.
        stops = [threading.Thread(target=service.stop) for service in services]
        for t in stops:
            t.start()
        for t in stops:
            t.join()
        rec["gpu_samples"] = sampler.samples
        rec["times"]["total_s"] = round(time.monotonic() - t0, 1)
    return rec


# ---- the record ---------------------------------------------------------------------------------------------------

def parse_projection(stdout: str) -> dict | None:
    """The preflight's `trainer memory` row: its status, the projected peak and its parts, in GiB."""
    rows = {name.strip(): (status, detail) for status, name, detail in ROW.findall(stdout)}
    if "trainer memory" not in rows:
        return None
    status, detail = rows["trainer memory"]
    out: dict = {"status": status, "row": detail}
    match = re.search(r"projected peak ([\d,.]+ [GM]iB) for (.+?), ((?:LoRA|full fine-tune).*?): (.+?)(?:; | > |"
                      r", within |$)", detail)
    if match:
        out["projected_gib"] = to_gib(match[1])
        out["rounding_gib"] = 0.05 if match[1].endswith("GiB") else round(0.05 / 1024, 6)  # the row prints 0.1
        out["for"], out["what"] = match[2], match[3]
        out["parts_gib"] = {name.strip(): to_gib(value)
                            for name, value in re.findall(r"([^,]+?) ([\d,.]+ [GM]iB)", match[4])}
        fraction = re.search(r"memory fraction ([\d.]+)", detail)
        if fraction:
            out["cap_fraction"] = float(fraction[1])
    return out


def to_gib(text: str) -> float:
    number, unit = text.split()
    return round(float(number.replace(",", "")) / (1024 if unit == "MiB" else 1), 3)


def read_work(work: Path) -> dict:
    """What the script left in `work`: its stdout, the memory lines, the last checkpoint's per-step log."""
    stdout = (work / "script.log").read_text(errors="replace") if (work / "script.log").is_file() else ""
    memory = [json.loads(line) for line in (work / "memory.jsonl").read_text().splitlines() if line.strip()] \
        if (work / "memory.jsonl").is_file() else []
    out = work / "out"
    checkpoints = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])) if out.is_dir() else []
    history = []
    if checkpoints and (checkpoints[-1] / "trainer_state.json").is_file():
        history = json.loads((checkpoints[-1] / "trainer_state.json").read_text())["log_history"]
    return {"stdout": stdout, "memory": memory, "history": history,
            "checkpoints": [p.name for p in checkpoints]}


def finish(rec: dict, found: dict) -> dict:
    """The record: per step, the peaks, the projection and the verdict."""
    steps_log = [e for e in found["history"] if "loss" in e]
    memory_steps = {m["step"]: m for m in found["memory"] if not m.get("end")}
    steps = []
    for entry in steps_log:
        m = memory_steps.get(entry["step"], {})
        steps.append({"step": entry["step"], **{k: entry.get(k) for k in STEP_KEYS},
                      "longest_row_tokens": max(m["rows"]) if m.get("rows") else None,
                      "rows_tokens": m.get("rows"), "trainer_reserved_gib": gib(m.get("max_reserved")),
                      "trainer_allocated_gib": gib(m.get("max_allocated"))})
    done = {e["step"] for e in steps_log} | set(memory_steps)
    reserved = [m["max_reserved"] for m in found["memory"] if "max_reserved" in m]
    allocated = [m["max_allocated"] for m in found["memory"] if "max_allocated" in m]
    samples = rec.get("gpu_samples", [])
    vllm_mib = [s.get("vllm", 0.0) for s in samples]
    if any(vllm_mib):
        vllm = {"gib": round(max(vllm_mib) / 1024, 2), "source": "nvidia-smi compute apps in vLLM's process group"}
    else:  # nvidia-smi's PIDs of another namespace: the card's use with vLLM alone on it
        alone = (rec.get("vllm_alone") or {}).get("gpu_used_mib")
        vllm = {"gib": round(alone / 1024, 2) if alone else None,
                "source": "nvidia-smi memory.used once vLLM was ready, before the trainer (no PID matched)"}
    projection = parse_projection(found["stdout"])
    measured = gib(max(reserved)) if reserved else None
    projected = (projection or {}).get("projected_gib")
    verdict = {"measured_peak_reserved_gib": measured, "projected_gib": projected}
    if measured and projected:
        # Judged on the least and the most the unrounded projection can be, so no record passes by the rounding.
        half = projection.get("rounding_gib", 0.05)
        low, high = projected - half, projected + half
        ok = low >= measured and high <= measured * (1 + TOLERANCE)
        verdict |= {"pass": ok, "projection_over_measured": round(projected / measured, 3),
                    "line": f"projection {projected} GiB (unrounded {low:.2f}-{high:.2f}) "
                            f"{'>=' if low >= measured else '<'} measured peak {measured} GiB (reserved), "
                            f"{projected / measured - 1:+.1%}: {'PASS' if ok else 'FAIL'} (projection >= measured and "
                            f"within {TOLERANCE:.0%})"}
        # For reading the gap: the row sums every part, though the push's copies and the step's activations are
        # not held at once (tests/test_trainer_memory.py compares the step without the push staging).
        parts = projection.get("parts_gib") or {}
        push = parts.get("push staging", 0.0) + parts.get("vLLM's push copies", 0.0)
        verdict["projected_without_push_gib"] = round(projected - push, 3)
        verdict["projected_push_only_gib"] = round(parts.get("frozen base", 0.0) + parts.get("adapters + AdamW", 0.0)
                                                   + parts.get("weights + AdamW", 0.0) + parts.get("push staging", 0.0),
                                                   3)
    else:
        verdict |= {"pass": False, "line": "no verdict: " + ("no measured peak" if not measured else "no projection")}
    pushes = [s["perf/weight_sync_s"] for s in steps if s.get("perf/weight_sync_s") is not None]
    rows = [s["longest_row_tokens"] for s in steps if s.get("longest_row_tokens")]
    preflight = {name.strip(): [status, detail] for status, name, detail in ROW.findall(found["stdout"])}
    return {"card": rec.get("card"), "flags": rec.get("flags"), "readme": rec.get("readme"),
            "steps": len(done), "steps_planned": rec.get("steps_planned"), "exit": rec.get("exit"),
            "stopped_at_deadline": rec.get("stopped_at_deadline", False), "error": rec.get("error"),
            "trainer_peak_gib": {"reserved": measured, "allocated": gib(max(allocated)) if allocated else None},
            "vllm_gib": vllm, "projected_gib": projection, "verdict": verdict,
            "push_s_per_step": pushes, "ratio_per_step": [s.get("ratio") for s in steps],
            "longest_row_per_step": rows, "per_step": steps, "checkpoints": found["checkpoints"],
            "times": rec.get("times", {}), "build": rec.get("build"),
            "vllm_alone": {k: v for k, v in (rec.get("vllm_alone") or {}).items() if k != "apps"},
            "vllm_log_memory": rec.get("vllm_log_memory"), "preflight": preflight,
            "vllm_as_written_failed": rec.get("vllm_as_written_failed"),
            "gpu_samples": [{k: v for k, v in s.items() if k != "apps"} for s in samples]}


def summary_line(record: dict) -> str:
    v = record["verdict"]
    return (f"quick-start: pass={v.get('pass')} steps={record['steps']}/{record.get('steps_planned')} "
            f"exit={record['exit']} trainer_peak={record['trainer_peak_gib']['reserved']}GiB "
            f"(alloc {record['trainer_peak_gib']['allocated']}) projected={v.get('projected_gib')}GiB "
            f"vllm={record['vllm_gib']['gib']}GiB rows={record['longest_row_per_step']} "
            f"push_s={[round(p, 2) for p in record['push_s_per_step']]} "
            f"ratio={[None if r is None else round(r, 4) for r in record['ratio_per_step']]} "
            f"card={(record.get('card') or {}).get('name')}")


def record_of(rec: dict, work: Path) -> tuple[dict, str]:
    """The record and the script's output."""
    found = read_work(work)
    vllm_log = (work / "vllm.log").read_text(errors="replace") if (work / "vllm.log").is_file() else ""
    rec["vllm_log_memory"] = [line.strip()[-300:] for line in vllm_log.splitlines()
                              if re.search(r"GiB|KV cache", line)][:20]
    return finish(rec, found), found["stdout"]


def write(record: dict, stdout: str, work: Path, out: Path, log_lines: list[str]) -> None:
    """OUT.json (the record) and OUT.log (this bench's lines, the script's output, vLLM's and Harbor's log tails)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    vllm_log = (work / "vllm.log").read_text(errors="replace") if (work / "vllm.log").is_file() else ""
    harbor_log = (work / "harbor.log").read_text(errors="replace") if (work / "harbor.log").is_file() else ""
    found = {"stdout": stdout}
    with open(out.with_suffix(".log"), "w") as f:
        f.write("".join(log_lines))
        f.write(f"\n===== script output ({len(found['stdout'])} chars; the last 300,000)\n"
                f"{found['stdout'][-300_000:]}\n")
        f.write(f"\n===== vLLM log (the last 30,000 chars)\n{vllm_log[-30_000:]}\n")
        f.write(f"\n===== Harbor server log (the last 15,000 chars)\n{harbor_log[-15_000:]}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "h100-quick-start"),
                        help="path prefix of the .json and .log written")
    parser.add_argument("--deadline-s", type=float, default=460.0,
                        help="seconds from start after which the script gets SIGTERM (it saves a checkpoint)")
    parser.add_argument("--vllm-wait-s", type=float, default=300.0, help="most seconds to wait for vLLM")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--work", default="/tmp/quick-start", help="scratch directory (the model, ~8 GB)")
    parser.add_argument("--device", default="cuda", help="where the model is built")
    parser.add_argument("--run-name", default="quick-start")
    parser.add_argument("--build-only", action="store_true", help="build (and check) the model, print it, stop")
    parser.add_argument("--tiny", action="store_true", help="with --build-only: a scaled-down decoder, same tokenizer")
    parser.add_argument("--plan", action="store_true", help="print the commands read from the README and stop")
    parser.add_argument("--record-only", metavar="WORK", help="write the record of a finished work directory")
    parser.add_argument("--rehearse", action="store_true",
                        help="CPU rehearsal of the whole run: the --tiny build, the rig's engine (tests/rig/engine.py) "
                             "for vLLM, the rig's CPU stand-ins in the script, 256-token turns")
    args = parser.parse_args()
    work = Path(args.work)
    if args.build_only:
        result = build(work / "model", args.device, args.tiny)
        if args.tiny:
            result["tiny_model"] = check_tiny_model(work / "model")
        print("BUILD " + json.dumps(result), flush=True)
        return 0
    if args.plan:
        qs = quick_start()
        serve, script, flags = plan_run(qs, work / "model", 8000, work, args.run_name, "http://127.0.0.1:<port>",
                                        "<split>", args.steps)
        print(json.dumps({"readme": qs, "serve_run": serve, "script_run": script, **flags}, indent=1))
        return 0
    t0 = time.monotonic()
    log_lines: list[str] = []

    def log(message: str) -> None:
        line = f"[{time.monotonic() - t0:6.1f}s] {message}"
        print(line, flush=True)
        log_lines.append(line + "\n")

    if args.record_only:
        work = Path(args.record_only)
        rec = json.loads((work / "rec.json").read_text()) if (work / "rec.json").is_file() else {}
    else:
        rec = run(args, log)
        rec["steps_planned"] = args.steps
        (work / "rec.json").write_text(json.dumps(rec))
    record, stdout = record_of(rec, work)
    for s in record["per_step"]:
        log(f"step {s['step']}: " + ", ".join(f"{k} {v}" for k, v in s.items() if k not in ("step", "rows_tokens")))
    log(f"verdict: {record['verdict']['line']}")
    write(record, stdout, work, Path(args.out), log_lines)
    print(summary_line(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
