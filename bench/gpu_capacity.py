"""What the README's Capacity section needs, measured on two GPUs with a random-weight model of Qwen3-4B's shape.

    python bench/gpu_capacity.py --json bench/results/<date>-gpu-capacity.json      # GPU 0: vLLM, GPU 1: trainer

No hub: the model is built locally from Qwen3-4B's configuration (random weights, the rig's tiny tokenizer), so the
numbers are about shapes and bytes, not about what the model says. Sections, side by side in one run:

- memory: peak trainer memory (torch.cuda.max_memory_allocated, steady state over 3 optimizer steps) for one packed row
  of 8k / 16k / 32k tokens, with the trainer's settings: float32 master weights under bf16 autocast (TRL's default
  dtype, the script's `--dtype float32`) or bfloat16 weights, gradient checkpointing (non-reentrant), TRL's fused
  chunked LM head (`add_fused_lm_head`, `fused_lm_head=True`), SDPA attention over one causal row, fused AdamW.
- update: the fraction of one weight matrix that one AdamW step at lr 1e-6 changes, with float32 and with bfloat16
  weights (an update below bf16's resolution rounds away).
- vllm: `vllm serve` start-up to /health with the README's flags (no --enforce-eager: CUDA graphs and compile included),
  for the 4B shape.
- sync: NCCL weight pushes with TRL's own WeightTransferClient (pause, stream, resume, as AsyncGRPOTrainer does after
  every step), from float32 and from bfloat16 weights; median of 3 each.
- lora (one GPU, `--sections lora`): peak trainer memory under `--use-peft` for Qwen3-8B / 14B / 32B shapes: base
  weights in bfloat16 (the serving dtype), LoRA adapters and their AdamW state in float32 (PEFT's autocast of adapter
  dtype, as AsyncGRPOTrainer's get_peft_model call leaves it), dropout 0.05, r=16 and r=64 on all linear layers and
  r=16 on PEFT's default targets (q_proj, v_proj: what TRL's --lora-target-modules default gives), the same loss path
  as `memory` (enable_input_require_grads as the trainer adds it under PEFT); 2 optimizer steps per row length. Also the
  time of one merge_adapter + unmerge_adapter (the merged push folds the adapter in and out around every push).

    for s in 8b 14b 32b; do python bench/gpu_capacity.py --sections lora --shapes $s --json lora-$s.json; done  # 1 GPU

  One process per shape: a shape built after another in the same process measured the first one's leftovers too.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
# Qwen3-8B / 14B / 32B config.json (architecture fields; untied heads)
QWEN3_LARGE = {
    "8b": dict(QWEN3_4B, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               tie_word_embeddings=False),
    "14b": dict(QWEN3_4B, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                tie_word_embeddings=False),
    "32b": dict(QWEN3_4B, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                tie_word_embeddings=False),
}
NCCL_SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def build_model(dtype, device):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_4B, dtype=str(dtype).removeprefix("torch.")))
    model.config._attn_implementation = "sdpa"
    return model.to(dtype)


def trainer_model(dtype, device):
    """The trainer's loss path on Qwen3-4B's shape: gradient checkpointing, TRL's fused LM head, fused AdamW."""
    import torch
    from trl.trainer.utils import add_fused_lm_head

    model = build_model(dtype, device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))  # as AsyncGRPOTrainer adds it
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)


def micro_batch(model, length: int, dtype, device) -> None:
    """Forward and backward of one packed row of `length` random tokens (float32 weights run under bf16 autocast)."""
    import torch

    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, length), device=device)
    positions = torch.arange(length, device=device).unsqueeze(0)
    labels = torch.randint(0, vocab, (1, length), device=device)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.float32):
        out = model(input_ids=ids, position_ids=positions, shift_labels=labels, fused_lm_head=True)
        loss = -(out.log_probs.float() * torch.randn_like(out.log_probs.float())).mean()
    loss.backward()


def train_step(model, optimizer, length: int, dtype, device, micro_batches: int = 1) -> None:
    """One optimizer step over `micro_batches` rows (gradient accumulation, as --micro-batches-per-step)."""
    for _ in range(micro_batches):
        micro_batch(model, length, dtype, device)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_memory(lengths: list[int], device: str) -> dict:
    import torch

    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, optimizer = trainer_model(dtype, device)
        name = str(dtype).removeprefix("torch.")
        params = sum(p.numel() for p in model.parameters())
        # update: the share of a weight matrix one AdamW step at lr 1e-6 changes
        probe = model.model.layers[0].self_attn.q_proj.weight
        before = probe.detach().clone()
        for length in lengths:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            try:
                for step in range(3):
                    train_step(model, optimizer, length, dtype, device)
                    if step == 0 and length == lengths[0]:
                        changed = (probe.detach() != before).float().mean().item()
                        results[f"update/{name}/frac_changed_lr1e-6"] = changed
                torch.cuda.synchronize(device)
                peak = torch.cuda.max_memory_allocated(device) / 2**30
                reserved = torch.cuda.max_memory_reserved(device) / 2**30
                results[f"memory/{name}/{length}"] = {"peak_allocated_gib": round(peak, 1),
                                                      "peak_reserved_gib": round(reserved, 1)}
            except torch.OutOfMemoryError:
                results[f"memory/{name}/{length}"] = "out of memory"
                optimizer.zero_grad(set_to_none=True)
            print(name, length, results[f"memory/{name}/{length}"], flush=True)
        results[f"params/{name}"] = params
        del model, optimizer
        torch.cuda.empty_cache()
    return results


def measure_lora(shapes: list[str], lengths: list[int], device: str, sink: Path | None) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    results: dict = {}
    variants = [("all-linear", 16), ("all-linear", 64), ("default", 16)]
    for shape in shapes:
        cfg = QWEN3_LARGE[shape]
        t0 = time.monotonic()
        torch.manual_seed(0)
        # Built in bfloat16 directly: a float32 32B shape (128 GB) would not fit before the cast.
        torch.set_default_dtype(torch.bfloat16)
        with torch.device(device):
            base = Qwen3ForCausalLM(Qwen3Config(**cfg, dtype="bfloat16"))
        torch.set_default_dtype(torch.float32)
        base.config._attn_implementation = "sdpa"
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.config.use_cache = False
        add_fused_lm_head(base, outputs=("log_probs", "entropy"))
        results[f"lora/{shape}/params"] = sum(p.numel() for p in base.parameters())
        results[f"lora/{shape}/base_gib"] = round(torch.cuda.memory_allocated(device) / 2**30, 1)
        print(shape, "built in", round(time.monotonic() - t0), "s,", results[f"lora/{shape}/base_gib"], "GiB", flush=True)
        for targets, r in variants:
            peft_config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.05, task_type="CAUSAL_LM",
                                     target_modules="all-linear" if targets == "all-linear" else None)
            gc.collect()  # the previous variant's PEFT wrapper and fused-head closure sit in reference cycles
            torch.cuda.empty_cache()
            results[f"lora/{shape}/r{r}-{targets}/before_gib"] = round(torch.cuda.memory_allocated(device) / 2**30, 1)
            model = get_peft_model(base, peft_config)
            model.enable_input_require_grads()
            model.train()
            trainable = [p for p in model.parameters() if p.requires_grad]
            key = f"lora/{shape}/r{r}-{targets}"
            results[f"{key}/trainable_params"] = sum(p.numel() for p in trainable)
            results[f"{key}/adapter_dtype"] = str(trainable[0].dtype).removeprefix("torch.")
            optimizer = torch.optim.AdamW(trainable, lr=1e-5, fused=True)
            for length in lengths:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                t0 = time.monotonic()
                try:
                    for _ in range(2):
                        ids = torch.randint(0, cfg["vocab_size"], (1, length), device=device)
                        positions = torch.arange(length, device=device).unsqueeze(0)
                        labels = torch.randint(0, cfg["vocab_size"], (1, length), device=device)
                        with torch.autocast("cuda", dtype=torch.bfloat16):
                            out = model(input_ids=ids, position_ids=positions, shift_labels=labels,
                                        fused_lm_head=True)
                            loss = -(out.log_probs.float() * torch.randn_like(out.log_probs.float())).mean()
                        loss.backward()
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                        del out, loss
                    torch.cuda.synchronize(device)
                    results[f"{key}/{length}"] = {
                        "peak_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 1),
                        "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 1),
                        "step_s": round((time.monotonic() - t0) / 2, 1)}
                except torch.OutOfMemoryError:
                    results[f"{key}/{length}"] = "out of memory"
                    optimizer.zero_grad(set_to_none=True)
                print(key, length, results[f"{key}/{length}"], flush=True)
                if sink is not None:
                    sink.write_text(json.dumps(results, indent=1))
            torch.cuda.synchronize(device)
            t0 = time.monotonic()
            with torch.no_grad():
                model.merge_adapter()
                model.unmerge_adapter()
            torch.cuda.synchronize(device)
            results[f"{key}/merge_unmerge_s"] = round(time.monotonic() - t0, 2)
            del optimizer, trainable
            base = model.unload()
            del model
            torch.cuda.empty_cache()
        del base
        gc.collect()
        torch.cuda.empty_cache()
    return results


def save_model(path: Path) -> None:
    import torch

    model = build_model(torch.bfloat16, "cpu")
    model.save_pretrained(path)
    subprocess.run([sys.executable, str(ROOT / "tests" / "rig" / "tiny_model.py"), str(path / "tok")], check=True,
                   capture_output=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (path / name).write_bytes((path / "tok" / name).read_bytes())


def start_vllm(model: Path, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--host", "127.0.0.1", "--port",
           str(port), "--max-model-len", "32768", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
           "--logprobs-mode", "processed_logprobs", "--return-tokens-as-token-ids", "--weight-transfer-config",
           '{"backend":"nccl"}', "--gpu-memory-utilization", "0.85"]
    env = {**os.environ, **NCCL_SAFE, "CUDA_VISIBLE_DEVICES": "0", "VLLM_SERVER_DEV_MODE": "1"}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def wait_health(url: str, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError("vllm exited")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return time.monotonic() - t0
        except OSError:
            time.sleep(1)
    raise TimeoutError("vllm not healthy")


def measure_sync(url: str, model_dir: Path, device: str) -> dict:
    import torch
    from accelerate import PartialState
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params
    from trl.experimental.async_grpo.vllm_client import VLLMClient
    from trl.experimental.async_grpo.weight_transfer import WeightTransferClient

    PartialState()
    results = {}
    model = build_model(torch.float32, device)
    client = VLLMClient(url, server_timeout=600)
    transfer = None
    for dtype in (torch.float32, torch.bfloat16):
        model = model.to(dtype)
        named = list(_iter_vllm_named_params(model))
        info = {"names": [n for n, _ in named], "dtype_names": [str(p.dtype).split(".")[-1] for _, p in named],
                "shapes": [list(p.shape) for _, p in named]}
        init_s = None
        if transfer is None:
            transfer = WeightTransferClient(client, info, weight_sync_timeout=600)
            t0 = time.monotonic()
            transfer.init_weight_transfer()
            init_s = round(time.monotonic() - t0, 2)
        else:
            # One NCCL group serves both: every push names its tensors' dtypes (update_weights' info).
            transfer._weight_update_info = {**transfer._weight_update_info, **info}
        times = []
        for _ in range(3):
            torch.cuda.synchronize(device)
            t0 = time.monotonic()
            transfer.pause()
            transfer.send_weights((n, p.detach()) for n, p in _iter_vllm_named_params(model))
            transfer.resume()
            times.append(time.monotonic() - t0)
        name = str(dtype).removeprefix("torch.")
        gib = sum(p.numel() * p.element_size() for _, p in named) / 2**30
        results[f"sync/{name}"] = {"init_s": init_s, "push_s": [round(t, 2) for t in times],
                                   "median_s": round(statistics.median(times), 2), "bytes_gib": round(gib, 2)}
        print(name, results[f"sync/{name}"], flush=True)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True)
    p.add_argument("--lengths", default="8192,16384,32768")
    p.add_argument("--sections", default="memory,vllm,sync")
    p.add_argument("--work", default="/tmp/gpu-capacity")
    p.add_argument("--shapes", default="8b,14b,32b", help="lora section: Qwen3 shapes")
    args = p.parse_args()
    if args.sections == "lora":
        # One GPU is enough: no vLLM, no push.
        import torch

        results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
        import peft
        import transformers
        import trl

        results |= {"peft": peft.__version__, "trl": trl.__version__, "transformers": transformers.__version__}
        sink = Path(args.json)
        results |= measure_lora(args.shapes.split(","), [int(x) for x in args.lengths.split(",")], "cuda:0", sink)
        sink.write_text(json.dumps(results, indent=1))
        return 0
    # The trainer sees only its own GPU, as in the README's command: with both visible, TRL's NCCL init thread runs on
    # the default device, GPU 0, where vLLM's rank is, and NCCL refuses two ranks on one device ("invalid usage").
    os.environ["CUDA_VISIBLE_DEVICES"] = "1"
    import torch

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    sections = args.sections.split(",")
    results: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "sections": sections}
    try:
        import transformers
        import trl
        import vllm

        results |= {"vllm": vllm.__version__, "trl": trl.__version__, "transformers": transformers.__version__}
    except ImportError:
        pass
    server = None
    model_dir = work / "qwen3-4b-shape"
    url = "http://127.0.0.1:8100"
    if "vllm" in sections or "sync" in sections:
        if not (model_dir / "config.json").exists():
            t0 = time.monotonic()
            save_model(model_dir)
            print(f"saved the 4B-shape model in {time.monotonic() - t0:.0f}s", flush=True)
        server = start_vllm(model_dir, 8100, Path(os.environ.get("OUT", str(work))) / "vllm_4b.log")
        healthy = threading.Thread(target=lambda: results.__setitem__(
            "vllm/startup_s", round(wait_health(url, server, 900), 1)), daemon=True)
        healthy.start()
    try:
        # The trainer GPU works while vLLM starts on the other one.
        if "memory" in sections:
            results |= measure_memory([int(x) for x in args.lengths.split(",")], "cuda:0")
        if server is not None:
            healthy.join(timeout=900)
            print(f"vLLM (4B shape, README flags) healthy after {results.get('vllm/startup_s')}s", flush=True)
        if "sync" in sections:
            results |= measure_sync(url, model_dir, "cuda:0")
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
        Path(args.json).write_text(json.dumps(results, indent=1))
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
