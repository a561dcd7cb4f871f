"""One real GPU shared by `vllm serve` and the script's own trainer, weights pushed as CUDA-IPC handles.

Check your set-up with one command, on a machine with a CUDA GPU, as root (the rig's sandbox runs each rollout in
private mount namespaces):

    uv run --no-project --python 3.12 --with-requirements async_grpo_harbor.py --with pytest \
        --with mini-swe-agent==2.4.6 pytest tests/gpu/test_one_gpu.py -v -s

It builds a tiny random-weight Qwen3 locally (no hub) and serves it FIRST, as the README's one-GPU quick start does:
bound to 127.0.0.1, `--weight-transfer-config '{"backend":"ipc"}'`, on 0.3 of the card's total memory (vLLM sizes its
share from the total and refuses to start short of it; the trainer lives in the rest). Then the script's `--check`
must PASS the rows a shared card depends on (the backend the server announces, the trainer on vLLM's own GPU, vLLM
reachable on loopback only, the trainer's projected memory within what vLLM left), and 3 optimizer steps through the
real Harbor server, capture proxy and mini-swe-agent (the CPU rig's local sandbox, a task whose verifier flips a
coin) must land in the serving engine: step 1's importance ratio is 1, and vLLM's logprobs afterwards are those of
the saved checkpoint, as a fresh vLLM loading it gives them. Skipped without a CUDA GPU or without vLLM.

Offline (no hub, as on the lent GPU machines): `AGH_GPU_OFFLINE_ATTENTION=1` replaces TRL's hub-fetched tree-attention
kernel with the rig's SDPA implementation of the same function; nothing else is stood in. AGH_SERVER_PYTHON runs the
Harbor server with another interpreter (default: this one). AGH_VLLM_PYTHONPATH is put first on vLLM's own path
(the lent machine's vLLM 0.26.0 imports Ray at the top of its IPC engine module, uses none of it, and has no Ray: a
two-line stand-in module goes there).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import RIG, SCRIPT, Service, free_port, get_json, post_json

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

TASKS = Path(__file__).resolve().parent / "tasks"
# Keep NVLink multicast off: on shared hosts a program using it can take the GPUs out of service.
NCCL_SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
README_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--logprobs-mode", "processed_logprobs",
                "--return-tokens-as-token-ids", "--weight-transfer-config", '{"backend":"ipc"}']
# The ipc backend unpickles what it is sent: both variables are the README's, on the server only.
IPC_SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
MAX_MODEL_LEN = 4096
VLLM_SHARE = 0.3
PROMPT_IDS = list(range(10, 42))
ROW = re.compile(r"^  (PASS|WARN|FAIL|SKIP)  (.+?)  +(.*)$", re.M)
# What a shared card depends on; each must PASS, by name.
SHARED_CARD_ROWS = ("weight transfer", "same GPU", "vLLM on loopback", "trainer memory", "trainer GPU")
ENGINE_ROWS = ("vLLM reachable", "served model", "capture tier", "dtype", "context")


def base_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, **NCCL_SAFE, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_NO_USAGE_STATS": "1", "VLLM_HOST_IP": "127.0.0.1", "CUDA_VISIBLE_DEVICES": "0", **extra}
    if os.environ.get("AGH_GPU_OFFLINE_ATTENTION") == "1":
        env |= {"PYTHONPATH": os.pathsep.join(filter(None, [str(RIG / "sitecustomize"), env.get("PYTHONPATH")])),
                "AGH_CPU_RIG": "attention", "HF_HUB_OFFLINE": "1"}
    return env


def start_vllm(model: Path, log: Path, memory: float = VLLM_SHARE) -> tuple[Service, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--host", "127.0.0.1", "--port",
           str(port), "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN), "--gpu-memory-utilization",
           str(memory), "--enforce-eager", *README_FLAGS]
    env = base_env(**IPC_SERVER_ENV)
    if os.environ.get("AGH_VLLM_PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ["AGH_VLLM_PYTHONPATH"], env.get("PYTHONPATH")]))
    service = Service(f"vllm ({log.name})", cmd, log, f"http://127.0.0.1:{port}/v1/models", env=env)
    return service, f"http://127.0.0.1:{port}"


def run_script(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=base_env(), text=True,
                          capture_output=True, timeout=timeout)
    print(f"$ async_grpo_harbor.py {' '.join(args)}  ({time.monotonic() - t0:.0f}s, exit {proc.returncode})\n"
          f"--- stdout\n{proc.stdout[-15000:]}\n--- stderr\n{proc.stderr[-8000:]}", flush=True)
    return proc


def rows(stdout: str) -> dict[str, tuple[str, str]]:
    return {name.strip(): (status, detail) for status, name, detail in ROW.findall(stdout)}


def engine_logprobs(vllm_url: str, model: str, n: int = 64) -> tuple[list[int], list[float]]:
    reply = post_json(f"{vllm_url}/v1/completions", {
        "model": model, "prompt": PROMPT_IDS, "max_tokens": n, "temperature": 0.0, "logprobs": 0,
        "return_token_ids": True, "ignore_eos": True}, timeout=120)["choices"][0]
    return reply["token_ids"], reply["logprobs"]["token_logprobs"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    work = tmp_path_factory.mktemp("gpu1")
    model = work / "tiny-qwen3"
    subprocess.run([sys.executable, str(RIG / "tiny_model.py"), str(model)], check=True)
    t0 = time.monotonic()
    # vLLM first: it takes its share of the card's total memory at start, the trainer what is left.
    vllm, vllm_url = start_vllm(model, work / "vllm.log")
    harbor = None
    try:
        vllm.wait_ready(timeout=600)
        print(f"vLLM ready in {time.monotonic() - t0:.0f}s", flush=True)
        harbor_port = free_port()
        harbor = Service("harbor server", [os.environ.get("AGH_SERVER_PYTHON", sys.executable), str(RIG / "harbor_server.py"),
                                           "--dataset", str(TASKS), "--llm-url", f"{vllm_url}/v1", "--model", str(model),
                                           "--max-output-tokens", "64", "--host", "127.0.0.1",
                                           "--port", str(harbor_port), "--capture-port", str(free_port()), "--expose",
                                           "direct"],
                         work / "harbor.log", f"http://127.0.0.1:{harbor_port}/harbor_env/splits",
                         env={**NCCL_SAFE, "MAX_CONCURRENT_ENVS": "16", "RIG_SANDBOX_DIR": str(work / "sandboxes"),
                              "OPENENV_HARBOR_TRIALS_DIR": str(work / "trials")}, cwd=work)
        harbor.wait_ready(timeout=300)
        harbor_url = f"http://127.0.0.1:{harbor_port}"
        split = get_json(f"{harbor_url}/harbor_env/splits")[0]["name"]
        base = ["--model", str(model), "--vllm-url", vllm_url, "--harbor-url", harbor_url, "--dataset", split,
                "--harness", "mini-swe-agent", "--sandbox", "local", "--tasks", "coinflip", "--report-to", "none",
                "--agent-step-limit", "3", "--max-completion-length", "64", "--agent-timeout", "120"]
        yield {"work": work, "model": model, "vllm_url": vllm_url, "base": base}
    finally:
        if harbor is not None:
            harbor.stop()
        vllm.stop()


def test_check_passes_the_shared_card_rows(stack):
    proc = run_script([*stack["base"], "--check", "--output-dir", str(stack["work"] / "check")], stack["work"], 600)
    found = rows(proc.stdout)
    for row in (*SHARED_CARD_ROWS, *ENGINE_ROWS):
        assert found.get(row, ("missing",))[0] == "PASS", (row, found.get(row))
    # The backend is the one the server announced, not a flag of ours.
    assert "ipc" in found["weight transfer"][1], found["weight transfer"]
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_trains_three_steps_with_ipc_pushes_into_the_same_gpu(stack):
    work, vllm_url = stack["work"], stack["vllm_url"]
    out = work / "train"
    served = get_json(f"{vllm_url}/v1/models")["data"][0]["id"]
    ids_before, lp_before = engine_logprobs(vllm_url, served)
    proc = run_script([*stack["base"], "--num-generations", "4", "--max-inflight", "8", "--micro-batches-per-step",
                       "1", "--max-steps", "3", "--save-steps", "3", "--learning-rate", "1e-3", "--temperature",
                       "1.0", "--output-dir", str(out), "--run-name", "gpu1-smoke"], work, 1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    steps = [e for e in state["log_history"] if "loss" in e]
    print("log_history:", json.dumps(steps, indent=1), flush=True)
    print("push seconds per step:", [e.get("perf/weight_sync_s") for e in steps], flush=True)
    assert [e["step"] for e in steps] == [1, 2, 3]
    assert all(math.isfinite(e["loss"]) for e in steps)
    # Step 1 trains on what the engine sampled with the weights it started with: the importance ratio is 1 up to the
    # bf16 (engine) vs bf16-autocast (trainer) difference.
    assert steps[0]["ratio"] == pytest.approx(1.0, abs=0.02), steps[0]
    assert all(e.get("perf/weight_sync_s", 0) > 0 for e in steps), "a step without a weight push"

    # After the pushes the engine scores with the trained weights: its logprobs moved, towards the saved model's.
    ids_after, lp_after = engine_logprobs(vllm_url, served)
    moved = max(abs(a - b) for a, b in zip(lp_before, lp_after)) if ids_before == ids_after else math.inf
    from transformers import AutoModelForCausalLM

    def reference(path: Path) -> list[float]:
        """What the model at `path`, in the engine's bf16, gives the engine's own tokens."""
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda:0")
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT_IDS + ids_after], device="cuda:0")).logits.float().log_softmax(-1)[0]
        del model
        return [logits[len(PROMPT_IDS) - 1 + i, t].item() for i, t in enumerate(ids_after)]

    def mean_gap(ref: list[float]) -> float:
        return sum(abs(a - b) for a, b in zip(lp_after, ref)) / len(ref)

    # vLLM's kernels and transformers' differ in bf16, so the engine must be nearer the trained model than the model
    # it started with, not equal to it.
    to_trained, to_initial = mean_gap(reference(out)), mean_gap(reference(stack["model"]))
    print(f"engine logprobs moved by up to {moved:.4f}; after training, mean |vllm - model| per token: trained "
          f"{to_trained:.4f}, initial {to_initial:.4f}", flush=True)
    assert moved > 0.01
    assert to_trained < to_initial
    # Decisive: a fresh vLLM that loads the saved checkpoint (beside the first, on the same card) runs the same
    # kernels on the same bf16 weights, so it must give the pushed engine's logprobs; a partial or misnamed push, or
    # one that landed in a copy vLLM does not serve from, would not.
    fresh, fresh_url = start_vllm(out, work / "vllm-fresh.log", memory=0.15)
    try:
        fresh.wait_ready(timeout=600)
        ids_fresh, lp_fresh = engine_logprobs(fresh_url, get_json(f"{fresh_url}/v1/models")["data"][0]["id"])
    finally:
        fresh.stop()
    gap = mean_gap(lp_fresh)
    print(f"pushed engine vs a fresh vLLM of the saved checkpoint: mean gap {gap:.5f}, same tokens: "
          f"{ids_fresh == ids_after}", flush=True)
    assert ids_fresh == ids_after and gap < 0.005
