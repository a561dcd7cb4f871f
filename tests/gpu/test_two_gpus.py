"""Two real GPUs: a real `vllm serve` on GPU 0, the script's own trainer on GPU 1, real NCCL weight pushes.

Check your set-up with one command, on a machine with two CUDA GPUs, as root (the rig's sandbox runs each rollout in
private mount namespaces):

    uv run --no-project --python 3.12 --with-requirements async_grpo_harbor.py --with pytest \
        --with mini-swe-agent==2.4.6 pytest tests/gpu -v -s

It builds a tiny random-weight Qwen3 locally (no hub), serves it with the README's vLLM flags, runs the script's
`--check` (every engine row must PASS, and each vLLM flag left out but `--return-tokens-as-token-ids` must fail its own
row with its fix: MISSING_FLAG below), then trains 3 optimizer steps through the real Harbor server, capture proxy and
mini-swe-agent, with the CPU rig's local sandbox and a task whose verifier flips a coin (a random model solves
nothing, and only groups whose rewards differ train).
Skipped without two GPUs or without vLLM.

Offline (no hub, as on the lent GPU machines): `AGH_GPU_OFFLINE_ATTENTION=1` replaces TRL's hub-fetched tree-attention
kernel (`kernels-community/flash-attn3`) with the rig's SDPA implementation of the same function; nothing else is
stood in. AGH_SERVER_PYTHON runs the Harbor server with another interpreter (default: this one).
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
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)
pytest.importorskip("vllm")

TASKS = Path(__file__).resolve().parent / "tasks"
# Keep NVLink multicast off: on shared hosts a program using it can take the GPUs out of service.
NCCL_SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
README_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--logprobs-mode", "processed_logprobs",
                "--return-tokens-as-token-ids", "--weight-transfer-config", '{"backend":"nccl"}']
MAX_MODEL_LEN = 4096
PROMPT_IDS = list(range(10, 42))
ROW = re.compile(r"^  (PASS|WARN|FAIL|SKIP)  (.+?)  +(.*)$", re.M)


def base_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, **NCCL_SAFE, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_NO_USAGE_STATS": "1", "VLLM_HOST_IP": "127.0.0.1", **extra}
    if os.environ.get("AGH_GPU_OFFLINE_ATTENTION") == "1":
        env |= {"PYTHONPATH": os.pathsep.join(filter(None, [str(RIG / "sitecustomize"), env.get("PYTHONPATH")])),
                "AGH_CPU_RIG": "attention", "HF_HUB_OFFLINE": "1"}
    return env


def start_vllm(model: Path, log: Path, gpu: str, *, flags=README_FLAGS, dev_mode: bool = True,
               memory: float = 0.3) -> tuple[Service, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--host", "127.0.0.1", "--port",
           str(port), "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN), "--gpu-memory-utilization",
           str(memory), "--enforce-eager", *flags]
    env = {"CUDA_VISIBLE_DEVICES": gpu, **({"VLLM_SERVER_DEV_MODE": "1"} if dev_mode else {})}
    service = Service(f"vllm ({log.name})", cmd, log, f"http://127.0.0.1:{port}/v1/models", env=base_env(**env))
    return service, f"http://127.0.0.1:{port}"


def run_script(args: list[str], cwd: Path, timeout: float, **env: str) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=base_env(**env), text=True,
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
    work = tmp_path_factory.mktemp("gpu")
    model = work / "tiny-qwen3"
    subprocess.run([sys.executable, str(RIG / "tiny_model.py"), str(model)], check=True)
    t0 = time.monotonic()
    vllm, vllm_url = start_vllm(model, work / "vllm.log", "0")
    harbor = None
    try:
        vllm.wait_ready(timeout=600)
        print(f"vLLM ready in {time.monotonic() - t0:.0f}s", flush=True)
        # The Harbor server probes its engine once, at start.
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


def test_check_passes_every_engine_row(stack):
    proc = run_script([*stack["base"], "--check", "--output-dir", str(stack["work"] / "check")], stack["work"], 600,
                      CUDA_VISIBLE_DEVICES="1")
    found = rows(proc.stdout)
    for row in ("vLLM reachable", "served model", "capture tier", "weight transfer", "dtype", "context"):
        assert found.get(row, ("missing",))[0] == "PASS", (row, found.get(row))
    # A random-weight model answers a tool request in prose, or in nothing the parser can read: the row cannot PASS.
    assert found["tool calls"][0] in ("PASS", "WARN"), found["tool calls"]
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_trains_three_steps_with_nccl_pushes_into_vllm(stack):
    work, vllm_url = stack["work"], stack["vllm_url"]
    out = work / "train"
    served = get_json(f"{vllm_url}/v1/models")["data"][0]["id"]
    ids_before, lp_before = engine_logprobs(vllm_url, served)
    proc = run_script([*stack["base"], "--num-generations", "4", "--max-inflight", "8", "--micro-batches-per-step",
                       "1", "--max-steps", "3", "--save-steps", "3", "--learning-rate", "1e-3", "--temperature",
                       "1.0", "--output-dir", str(out), "--run-name", "gpu-smoke"], work, 1200,
                      CUDA_VISIBLE_DEVICES="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    steps = [e for e in state["log_history"] if "loss" in e]
    print("log_history:", json.dumps(steps, indent=1), flush=True)
    assert [e["step"] for e in steps] == [1, 2, 3]
    assert all(math.isfinite(e["loss"]) for e in steps)
    # Step 1 trains on what the engine sampled with the weights it started with: the importance ratio is 1 up to the
    # bf16 (engine) vs bf16-autocast (trainer) difference.
    assert steps[0]["ratio"] == pytest.approx(1.0, abs=0.02), steps[0]
    assert all(e.get("perf/weight_sync_s", 0) > 0 for e in steps), "a step without a weight push"

    # After the pushes the engine scores with the trained weights: its logprobs moved, towards the saved model's.
    # (Run on 2 x H200 up to the `to_trained < to_initial` check: 0.050 vs 0.291; the fresh-vLLM comparison below
    # is newer than that run.)
    ids_after, lp_after = engine_logprobs(vllm_url, served)
    moved = max(abs(a - b) for a, b in zip(lp_before, lp_after)) if ids_before == ids_after else math.inf
    from transformers import AutoModelForCausalLM

    def reference(path: Path) -> list[float]:
        """What the model at `path`, in the engine's bf16, gives the engine's own tokens."""
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda:1")
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT_IDS + ids_after], device="cuda:1")).logits.float().log_softmax(-1)[0]
        return [logits[len(PROMPT_IDS) - 1 + i, t].item() for i, t in enumerate(ids_after)]

    def mean_gap(ref: list[float]) -> float:
        return sum(abs(a - b) for a, b in zip(lp_after, ref)) / len(ref)

    # vLLM's kernels and transformers' differ in bf16 (the tiny model's logits are scaled x5: seen up to 0.17 per
    # token, 0.012-0.015 on average), so the engine must be nearer the trained model than the model it started with,
    # not equal to it; at lr 1e-4 three steps moved these logprobs less than that noise, hence 1e-3 here.
    to_trained, to_initial = mean_gap(reference(out)), mean_gap(reference(stack["model"]))
    print(f"engine logprobs moved by up to {moved:.4f}; after training, mean |vllm - model| per token: trained "
          f"{to_trained:.4f}, initial {to_initial:.4f}", flush=True)
    assert moved > 0.01
    assert to_trained < to_initial
    # Decisive: a fresh vLLM that loads the saved checkpoint runs the same kernels on the same bf16 weights, so it
    # must give the pushed engine's logprobs; a partial or misnamed push would not.
    fresh, fresh_url = start_vllm(out, work / "vllm-fresh.log", "1")
    try:
        fresh.wait_ready(timeout=600)
        ids_fresh, lp_fresh = engine_logprobs(fresh_url, get_json(f"{fresh_url}/v1/models")["data"][0]["id"])
    finally:
        fresh.stop()
    gap = mean_gap(lp_fresh)
    print(f"pushed engine vs a fresh vLLM of the saved checkpoint: mean gap {gap:.5f}, same tokens: "
          f"{ids_fresh == ids_after}", flush=True)
    assert ids_fresh == ids_after and gap < 0.005


# Each vLLM started without one of the README's flags must fail the row that flag feeds, naming the flag as the fix.
# Seen on vLLM 0.26.0: without --return-tokens-as-token-ids the proxy still gets token ids (it asks for them per
# request), so that flag has no row of its own to fail.
MISSING_FLAG = {
    "processed logprobs": (dict(flags=[f for f in README_FLAGS if f not in ("--logprobs-mode", "processed_logprobs")]),
                           "capture tier", "processed_logprobs"),
    "tool parser": (dict(flags=[f for f in README_FLAGS if f not in ("--enable-auto-tool-choice", "--tool-call-parser",
                                                                       "hermes")]), "tool calls", "--tool-call-parser"),
    "dev mode": (dict(dev_mode=False), "weight transfer", "VLLM_SERVER_DEV_MODE=1"),
    "weight transfer": (dict(flags=README_FLAGS[:-2]), "weight transfer", "--weight-transfer-config"),
}


def test_each_missing_vllm_flag_fails_its_row_with_its_fix(stack):
    work = stack["work"]
    servers = {}
    try:
        for i, (name, (kwargs, _, _)) in enumerate(MISSING_FLAG.items()):
            # Side by side on both GPUs: five sequential starts would cost minutes.
            servers[name] = start_vllm(stack["model"], work / f"vllm-no-{name.replace(' ', '-')}.log", str(i % 2),
                                       memory=0.08, **kwargs)
        failures = {}
        for name, (service, url) in servers.items():
            service.wait_ready(timeout=600)
            args = [a if a != stack["vllm_url"] else url for a in stack["base"]]
            proc = run_script([*args, "--check", "--output-dir", str(work / f"check-no-{name.replace(' ', '-')}")],
                              work, 600, CUDA_VISIBLE_DEVICES="1")
            _, row, fix = MISSING_FLAG[name]
            status, _ = rows(proc.stdout).get(row, ("missing", ""))
            fixes = [line for line in proc.stdout.splitlines() if "fix:" in line]
            if proc.returncode != 2 or status != "FAIL" or not any(fix in line for line in fixes):
                failures[name] = (proc.returncode, row, status, fixes)
        assert not failures, failures
    finally:
        for service, _ in servers.values():
            service.stop()
