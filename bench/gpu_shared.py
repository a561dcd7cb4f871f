"""One GPU shared by vLLM and the trainer, measured side by side: what docs/capacity.md's "What fits on one card"
table needs.

    PYTHONPATH=/tmp/site python3 bench/gpu_shared.py --json $OUT/gpu_shared.json     # one H200 (the GPU kit's vLLM)
    python bench/gpu_shared.py --dry-run                  # no GPU: arguments, model config, the report on fake numbers

No hub: a random-weight model of Qwen3-4B's shape (`gpu_capacity.build_model`) and a locally built word-level
tokenizer that names every one of the model's 151,936 ids (a random model samples all of them; a smaller tokenizer
would leave most of what it generates undecodable). The numbers are about shapes and bytes, not about what it says.

On one card, in this order (vLLM first: it sizes its KV cache from utilisation x total memory):
- vLLM (`vllm serve`, the README's one-GPU flags, `--gpu-memory-utilization 0.30`) up, then a trainer process on the
  same GPU: float32 master weights under bf16 autocast (the script's `--dtype float32`), TRL's loss path from
  `gpu_capacity.train_step` (gradient checkpointing, fused chunked LM head, fused AdamW), one packed row of
  `--lengths` tokens per micro-batch and `--micro-batches-per-step` micro-batches per optimizer step.
- generation alone: `--concurrency` requests at a time through the OpenAI API (`/v1/completions`, random prompt ids,
  `ignore_eos`), tokens/s from vLLM's own `vllm:generation_tokens_total` counter, the trainer idle.
- per row length: the trainer alone (vLLM idle; steps/s, peak torch.cuda.max_memory_allocated), then both at once
  (the same load running through the trainer's timed steps: steps/s and tokens/s while sharing).
- one weight push of the trainer's float32 weights over CUDA IPC, with the script's own `CudaIpcWeightTransfer`
  (pause, start, update_weights chunks, finish, resume), vLLM idle, then once under the generation load.

Ratios are measured side by side in one run (together / alone); steps/h = 3600 x steps/s for a step of
`--micro-batches-per-step` rows. A phase that would overrun `--budget-s` is skipped and says so in the JSON, which is
rewritten after every phase. `python bench/fill_fits_table.py <that JSON>` then fills docs/capacity.md's table from it.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gpu_capacity import NCCL_SAFE, QWEN3_4B  # noqa: E402

SCRIPT = HERE.parent / "async_grpo_harbor.py"
MARK = "@@ "  # trainer protocol lines on its stdout; anything else a library prints there goes to the log
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Named too: the README's flags load the hermes tool parser, which looks them up in the vocabulary.
MARKUP = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="gpu_shared.json")
    p.add_argument("--log-dir", default=os.environ.get("OUT", "/tmp/gpu-shared"), help="vLLM's and the trainer's logs")
    p.add_argument("--work", default="/tmp/gpu-shared", help="where the model is built")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.30)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--lengths", default="16384,32768", help="trainer row tokens, comma separated")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--micro-batches-per-step", type=int, default=4, help="rows per optimizer step (the script's 4)")
    p.add_argument("--steps", type=int, default=2, help="timed optimizer steps per phase (after one warm-up step)")
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--gen-seconds", type=float, default=20.0, help="window of the generation-alone measurement")
    p.add_argument("--ramp-seconds", type=float, default=4.0, help="load running before a window opens")
    p.add_argument("--budget-s", type=float, default=330.0, help="skip what would end later than this after start")
    p.add_argument("--vllm-timeout", type=float, default=200.0)
    p.add_argument("--dry-run", action="store_true", help="no GPU: arguments, config, report on made-up numbers")
    p.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)  # the trainer child
    p.add_argument("--build", help=argparse.SUPPRESS)  # the child that saves the served model there
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    if max(args.lengths) > args.max_model_len:
        p.error(f"--lengths {max(args.lengths)} is longer than --max-model-len {args.max_model_len}")
    if not 0 < args.gpu_memory_utilization < 1 or args.micro_batches_per_step < 1 or args.steps < 1:
        p.error("--gpu-memory-utilization must be in (0, 1), --micro-batches-per-step and --steps at least 1")
    return args


# --- the model vLLM serves ------------------------------------------------------------------------------------------
def build_tokenizer(path: Path, vocab_size: int):
    """A word-level tokenizer over ids 0..vocab_size-1: Qwen3's special tokens first, then `w<id>`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    named = SPECIALS + MARKUP
    vocab = {t: i for i, t in enumerate(named)} | {f"w{i}": i for i in range(len(named), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 unk_token="<|endoftext|>")
    hf.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
    hf.save_pretrained(path)
    return hf


def build_main(args) -> int:
    """The child that saves the served model, so that the parent holds no CUDA context on the shared card."""
    import torch
    from gpu_capacity import build_model

    t0 = time.monotonic()
    model = build_model(torch.bfloat16, "cuda:0")  # on the GPU: a 4B random init takes seconds there, minutes on CPU
    model.config.eos_token_id, model.config.pad_token_id, model.config.bos_token_id = 2, 0, None
    model.save_pretrained(args.build)
    build_tokenizer(Path(args.build), QWEN3_4B["vocab_size"])
    say("built", model_build_s=round(time.monotonic() - t0, 1), device=torch.cuda.get_device_name(0),
        torch=torch.__version__, gpu_total_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    return 0


def vllm_command(args, model: Path) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--host", "127.0.0.1",
            "--port", str(args.port), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
            "--max-model-len", str(args.max_model_len), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--logprobs-mode", "processed_logprobs", "--return-tokens-as-token-ids",
            "--weight-transfer-config", '{"backend":"ipc"}']


def vllm_env() -> dict:
    # vLLM 0.26's IPC engine imports ray at module level; the GPU kit's /tmp/site-ray stands in for it (server only).
    path = ":".join(x for x in ("/tmp/site-ray", os.environ.get("PYTHONPATH", "")) if x)
    return {**os.environ, **NCCL_SAFE, "PYTHONPATH": path, "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}


def post(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw.strip() else {}


def generated_tokens(url: str) -> float:
    """vLLM's own count of generated tokens (Prometheus counter, summed over engines)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


class Load:
    """`concurrency` threads, each sending one /v1/completions request after the other until stopped."""

    def __init__(self, url: str, model: str, args):
        self.url, self.model, self.args = url, model, args
        self.stop_flag, self.threads, self.errors, self.done = threading.Event(), [], [], 0

    def _loop(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop_flag.is_set():
            first = len(SPECIALS + MARKUP)
            prompt = [rng.randrange(first, QWEN3_4B["vocab_size"]) for _ in range(self.args.prompt_tokens)]
            try:
                post(f"{self.url}/v1/completions", {"model": self.model, "prompt": prompt, "temperature": 1.0,
                                                    "max_tokens": self.args.max_tokens, "ignore_eos": True})
                self.done += 1
            except Exception as exc:  # aborted by the stop's /pause?mode=abort, or a real failure: kept for the log
                if not self.stop_flag.is_set():
                    self.errors.append(str(exc)[:200])
                    time.sleep(0.5)

    def start(self) -> None:
        self.stop_flag.clear()
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True)
                        for i in range(self.args.concurrency)]
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self.stop_flag.set()
        # Abort what is in flight rather than wait for it to finish, then serve again; without the dev route the
        # requests in flight finish on their own.
        try:
            post(f"{self.url}/pause?mode=abort", timeout=120)
        except OSError as exc:
            self.errors.append(f"pause?mode=abort: {exc}"[:200])
        for t in self.threads:
            t.join(timeout=120)
        try:
            post(f"{self.url}/resume", timeout=120)
        except OSError as exc:
            self.errors.append(f"resume: {exc}"[:200])


# --- the trainer child ------------------------------------------------------------------------------------------------
def script_ipc_transfer():
    """The script's CudaIpcWeightTransfer. Where the script's own imports are missing (the GPU machine has no
    openenv), its source is taken from the script and run with just what it names."""
    try:
        import async_grpo_harbor as script

        return script.CudaIpcWeightTransfer
    except ImportError:
        pass
    import base64
    import contextlib
    import pickle

    import torch
    from trl.experimental.async_grpo.vllm_client import VLLMClient
    from trl.experimental.async_grpo.weight_transfer import WeightTransferClient

    wanted = {"IPC_CHUNK_BYTES", "WeightTransferRefused", "CudaIpcWeightTransfer"}
    tree = ast.parse(SCRIPT.read_text())
    body = [n for n in tree.body if getattr(n, "name", None) in wanted
            or isinstance(n, ast.Assign) and any(getattr(t, "id", None) in wanted for t in n.targets)]
    namespace = {"__name__": "async_grpo_harbor", "base64": base64, "contextlib": contextlib, "pickle": pickle,
                 "re": re, "torch": torch, "VLLMClient": VLLMClient, "WeightTransferClient": WeightTransferClient}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(SCRIPT), "exec"), namespace)
    return namespace["CudaIpcWeightTransfer"]


def say(event: str, **fields) -> None:
    print(MARK + json.dumps({"event": event, **fields}), flush=True)


def trainer_main(args) -> int:
    """Builds the trainer's model on the GPU, then runs what the parent asks on stdin, one JSON command a line."""
    sys.path.insert(0, str(SCRIPT.parent))
    import torch
    from accelerate import PartialState
    from gpu_capacity import train_step
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    PartialState()  # TRL's VLLMClient logs through accelerate, which wants its state
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    t0 = time.monotonic()
    if device == "cpu":  # --dry-run: the same code on a two-layer model of the same widths, a short row
        import gpu_capacity

        gpu_capacity.QWEN3_4B = dict(QWEN3_4B, num_hidden_layers=2, vocab_size=4096)
    from gpu_capacity import trainer_model

    model, optimizer = trainer_model(dtype, device)
    say("ready", build_s=round(time.monotonic() - t0, 1), params=sum(p.numel() for p in model.parameters()),
        device=torch.cuda.get_device_name(0) if device != "cpu" else "cpu")
    transfer = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        if cmd["cmd"] == "steps":
            if cmd.get("reset_peak") and device != "cpu":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            times, start = [], time.time()
            try:
                for _ in range(cmd["n"]):
                    s = time.monotonic()
                    train_step(model, optimizer, cmd["length"], dtype, device, args.micro_batches_per_step)
                    if device != "cpu":
                        torch.cuda.synchronize(device)
                    times.append(time.monotonic() - s)
            except torch.OutOfMemoryError:
                optimizer.zero_grad(set_to_none=True)
                say("steps", tag=cmd["tag"], length=cmd["length"], error="out of memory")
                continue
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device != "cpu" else 0.0
            say("steps", tag=cmd["tag"], length=cmd["length"], step_s=[round(t, 3) for t in times],
                start=start, end=time.time(), peak_allocated_gib=round(peak, 2))
        elif cmd["cmd"] == "push":
            try:
                init_s = None
                if transfer is None:
                    transfer = script_ipc_transfer()(cmd["url"], 600)
                    s = time.monotonic()
                    transfer.init_weight_transfer()
                    init_s = round(time.monotonic() - s, 2)
                torch.cuda.synchronize(device)
                s = time.monotonic()
                transfer.pause()
                transfer.send_weights((n, p.detach()) for n, p in _iter_vllm_named_params(model))
                transfer.resume()
                gib = sum(p.numel() * p.element_size() for _, p in _iter_vllm_named_params(model)) / 2**30
                say("push", tag=cmd["tag"], push_s=round(time.monotonic() - s, 3), init_s=init_s, gib=round(gib, 2))
            except Exception as exc:  # the push is one figure among several: the others still get measured
                say("push", tag=cmd["tag"], error=f"{type(exc).__name__}: {exc}"[:500])
    return 0


class Trainer:
    """The parent's handle on the trainer child: send a command, read its answer."""

    def __init__(self, args, log: Path):
        argv = [sys.executable, __file__, "--trainer", "--dtype", args.dtype,
                "--micro-batches-per-step", str(args.micro_batches_per_step)]
        self.log = log.open("a")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, **NCCL_SAFE, "PYTHONUNBUFFERED": "1"})

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
            self.log.write(line)
        raise RuntimeError(f"the trainer exited (code {self.proc.wait()}): see {self.log.name}")

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


# --- the report -------------------------------------------------------------------------------------------------------
def summarize(r: dict, args) -> dict:
    """Ratios and steps/h from the raw phases in `r` (also run on made-up numbers by --dry-run)."""
    m = args.micro_batches_per_step
    out = {"steps_per_h_means": f"3600 x steps/s, a step = {m} micro-batch(es) of one packed row each",
           "micro_batches_per_step": m, "gen_alone_tok_s": r.get("gen_alone", {}).get("tok_s")}
    for length in args.lengths:
        alone, both = r.get(f"train/{length}/alone", {}), r.get(f"train/{length}/together", {})
        row = {}
        for tag, phase in (("alone", alone), ("together", both)):
            if phase.get("step_s"):
                sps = 1 / statistics.median(phase["step_s"])
                row[f"steps_per_s_{tag}"] = round(sps, 4)
                row[f"steps_per_h_{tag}"] = round(3600 * sps, 1)
                row[f"row_tokens_per_s_{tag}"] = round(sps * m * length)
        row["peak_allocated_gib"] = alone.get("peak_allocated_gib")
        row["gen_tok_s_together"] = both.get("gen_tok_s")
        if "steps_per_s_alone" in row and "steps_per_s_together" in row:
            row["train_ratio"] = round(row["steps_per_s_together"] / row["steps_per_s_alone"], 3)
        if both.get("gen_tok_s") and out["gen_alone_tok_s"]:
            row["gen_ratio"] = round(both["gen_tok_s"] / out["gen_alone_tok_s"], 3)
        if "train_ratio" in row and "gen_ratio" in row:
            row["sum_of_ratios"] = round(row["train_ratio"] + row["gen_ratio"], 3)
        out[str(length)] = row
    out["push_s"] = {k.removeprefix("push/"): v.get("push_s") for k, v in r.items() if k.startswith("push/")}
    out["skipped"] = r.get("skipped", [])
    return out


def fake_results(args) -> dict:
    r = {"gen_alone": {"tok_s": 6000.0, "window_s": args.gen_seconds}, "skipped": []}
    for length, s in zip(sorted(args.lengths), (6.0, 14.0, 30.0)):
        r[f"train/{length}/alone"] = {"step_s": [s, s * 1.01], "peak_allocated_gib": 60.0 + length / 8192}
        r[f"train/{length}/together"] = {"step_s": [s * 1.8, s * 1.9], "peak_allocated_gib": 60.0 + length / 8192,
                                         "gen_tok_s": 2700.0}
    r["push/idle"] = {"push_s": 0.3, "init_s": 1.9, "gib": 15.0}
    r["push/under_load"] = {"push_s": 0.8, "init_s": None, "gib": 15.0}
    return r


# --- main -------------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.trainer:
        return trainer_main(args)
    if args.build:
        return build_main(args)
    from transformers import Qwen3Config

    config = Qwen3Config(**QWEN3_4B)
    shape = {"params_b": round(estimate_params(config) / 1e9, 2),
             "config": {k: config.to_dict().get(k, v) for k, v in QWEN3_4B.items()}}
    sink = Path(args.json)
    if args.dry_run:
        work = Path(args.work)
        tok = build_tokenizer(work / "tok", QWEN3_4B["vocab_size"])
        ids = [5, 151935, 2]
        print("tokenizer:", len(tok), "ids; decode", ids, "->", repr(tok.decode(ids)), flush=True)
        print("vllm:", shlex.join(vllm_command(args, work / "model")), flush=True)
        log = work / "trainer.log"
        trainer = Trainer(args, log)
        try:
            ready = trainer.read()
            print("trainer child (CPU, 2 layers):", ready, flush=True)
            print("trainer child steps:", trainer.ask(cmd="steps", tag="dry", length=64, n=1, reset_peak=True),
                  flush=True)
        finally:
            trainer.close()
        results = {"dry_run": True, "shape": shape, "args": vars(args), **fake_results(args)}
        results["summary"] = summarize(results, args)
        sink.write_text(json.dumps(results, indent=1))
        print(json.dumps(results["summary"], indent=1))
        return 0
    return measure(args, shape, sink)


def estimate_params(config) -> int:
    h, i, layers, v = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h + 2 * config.head_dim
    return layers * per_layer + v * h * (1 if config.tie_word_embeddings else 2) + h


def gpu_used_gib() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        return round(float(out.split()[0]) / 1024, 1)
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def snapshot(path: Path) -> None:
    """nvidia-smi while both share the card: who holds how much."""
    try:
        path.write_text(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout)
    except (OSError, subprocess.TimeoutExpired):
        pass


def measure(args, shape: dict, sink: Path) -> int:
    t_start = time.monotonic()
    left = lambda: args.budget_s - (time.monotonic() - t_start)  # noqa: E731
    logs, work = Path(args.log_dir), Path(args.work)
    logs.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    r: dict = {"shape": shape, "args": vars(args), "skipped": []}
    for dist in ("vllm", "trl", "transformers"):
        try:
            r[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass

    def save() -> None:
        r["summary"] = summarize(r, args)
        r["elapsed_s"] = round(time.monotonic() - t_start, 1)
        sink.write_text(json.dumps(r, indent=1))

    def note(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:6.1f}s] {msg}", flush=True)

    model_dir = work / "qwen3-4b-shape"
    url, server, trainer, load = f"http://127.0.0.1:{args.port}", None, None, None
    try:
        build = subprocess.run([sys.executable, __file__, "--build", str(model_dir)], capture_output=True, text=True,
                               env={**os.environ, **NCCL_SAFE})
        (logs / "build.log").write_text(build.stdout + build.stderr)
        built = [json.loads(x[len(MARK):]) for x in build.stdout.splitlines() if x.startswith(MARK)]
        if build.returncode or not built:
            raise RuntimeError(f"building the model failed (exit {build.returncode}): {build.stderr[-500:]}")
        r |= {k: v for k, v in built[0].items() if k != "event"}
        note(f"model + tokenizer saved: {built[0]}")
        s = time.monotonic()
        server = subprocess.Popen(vllm_command(args, model_dir), stdout=(logs / "vllm.log").open("w"),
                                  stderr=subprocess.STDOUT, env=vllm_env())
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vLLM exited with code {server.returncode}: see {logs / 'vllm.log'}")
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() - s > args.vllm_timeout:
                    raise RuntimeError(f"vLLM not healthy after {args.vllm_timeout}s: see {logs / 'vllm.log'}")
                time.sleep(1)
        r["vllm_startup_s"] = round(time.monotonic() - s, 1)
        r["gpu_used_gib_vllm_only"] = gpu_used_gib()
        note(f"vLLM healthy in {r['vllm_startup_s']}s, GPU used {r['gpu_used_gib_vllm_only']} GiB")
        save()
        trainer = Trainer(args, logs / "trainer.log")
        r["trainer_ready"] = trainer.read()
        note(f"trainer ready: {r['trainer_ready']}")

        load = Load(url, str(model_dir), args)
        load.start()
        time.sleep(args.ramp_seconds)
        c0, s = generated_tokens(url), time.monotonic()
        time.sleep(args.gen_seconds)
        c1, window = generated_tokens(url), time.monotonic() - s
        load.stop()
        r["gen_alone"] = {"tok_s": round((c1 - c0) / window, 1), "window_s": round(window, 1),
                          "requests_done": load.done, "errors": load.errors[:5]}
        note(f"generation alone: {r['gen_alone']}")
        save()

        for length in args.lengths:
            warm = trainer.ask(cmd="steps", tag="warmup", length=length, n=1, reset_peak=True)
            r[f"train/{length}/warmup"] = warm
            note(f"warm-up {length}: {warm}")
            if "error" in warm:
                continue
            step = warm["step_s"][0]
            # n steps alone and n together, together budgeted at twice the solo step, plus the load's ramp and stop;
            # fewer timed steps rather than none when time is short
            fits = [n for n in range(args.steps, 0, -1) if step * n * 3 + args.ramp_seconds + 25 <= left()]
            if not fits:
                r["skipped"].append(f"train/{length}: {left():.0f}s left, a step takes {step:.1f}s")
                save()
                continue
            n = fits[0]
            if n < args.steps:
                r["skipped"].append(f"train/{length}: {n} timed step(s) per phase instead of {args.steps}")
            r[f"train/{length}/alone"] = trainer.ask(cmd="steps", tag="alone", length=length, n=n)
            note(f"alone {length}: {r[f'train/{length}/alone']}")
            load.start()
            time.sleep(args.ramp_seconds)
            c0 = generated_tokens(url)
            threading.Timer(args.ramp_seconds, snapshot, (logs / "nvidia-smi.txt",)).start()
            both = trainer.ask(cmd="steps", tag="together", length=length, n=n)
            c1 = generated_tokens(url)
            window = both["end"] - both["start"] if "end" in both else None
            if window:
                both["gen_tok_s"] = round((c1 - c0) / window, 1)
            load.stop()
            both["load_errors"] = load.errors[:5]
            r[f"train/{length}/together"] = both
            note(f"together {length}: {both}")
            save()

        if left() > 30:
            r["push/idle"] = trainer.ask(cmd="push", tag="idle", url=url)
            note(f"push, vLLM idle: {r['push/idle']}")
            save()
        else:
            r["skipped"].append("push/idle")
        if left() > 20:
            load.start()
            time.sleep(args.ramp_seconds)
            r["push/under_load"] = trainer.ask(cmd="push", tag="under_load", url=url)
            load.stop()
            note(f"push under load: {r['push/under_load']}")
        else:
            r["skipped"].append("push/under_load")
    except Exception as exc:
        r["error"] = f"{type(exc).__name__}: {exc}"
        note(r["error"])
    finally:
        if load is not None:
            load.stop_flag.set()
        if trainer is not None:
            trainer.close()
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
        save()
        for log in logs.glob("*.log"):  # what comes back from the GPU machine is bounded: keep the tail
            if log.stat().st_size > 4 << 20:
                log.write_bytes(log.read_bytes()[-(4 << 20):])
        print(json.dumps(r["summary"], indent=1))
    return 1 if "error" in r else 0


if __name__ == "__main__":
    sys.exit(main())
