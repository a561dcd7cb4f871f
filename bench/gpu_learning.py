"""Benchmark (not a test): the script learns on ONE GPU, against a real `vllm serve` that samples every token itself.

What runs: a small Qwen3 built here (no hub), served by vLLM on the trainer's own GPU (`ipc` weight transfer, bound
to 127.0.0.1), the real Harbor server + capture proxy, mini-swe-agent in the CPU rig's `local` sandbox, Harbor's
verifier, the script's trainer. Task `choose` (tests/rig/tasks/choose): write one of cat, dog, fox, tag to
/app/answer.txt; the verifier rewards `fox` only. Nothing tells the model which: the four answer tokens are
interchangeable in its weights (tests/rig/tiny_model.py --interchangeable: one embedding, one output row), so before
any RL step every candidate is exactly equally likely, whatever the prompt.

Warm-up: mini-swe-agent needs one well-formed bash tool call, which a random model never writes. A supervised pass
teaches the model ONE action on any prompt ending in the assistant's turn,
    <tool_call>{"name": "bash", "arguments": {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; mkdir -p /app;
    echo >/app/answer.txt W"}}</tool_call>            (W the candidate: the only free token, written last)
with each batch holding every context once with each candidate, so the candidates' rows get equal gradients and
stay interchangeable. It runs until every format token is near-certain on held-out contexts (the whole action's
format log-probability above log(1 - FORMAT_SLACK)), so an RL update that drifts the weights a little leaves a wide
margin before an action breaks; it then samples 64 first turns of the warmed model (temperature 1, full vocabulary)
and reports how many are well formed and which candidates they chose. vLLM starts on the initial weights while the
warm-up runs: TRL pushes the trainer's weights (the warmed ones) before any rollout, so step 1's rollouts are vLLM's
own samples of the warmed policy, and their malformed count is the check on the engine's side.

Seeds: one warmed model (the fixed starting checkpoint, as an SFT model would be), then one learning run per RL seed
(`--seeds`: the script's --seed and vLLM's sampling seed) and an lr-0 control per seed (`--control-seeds`), all side
by side on the card, each with its own vLLM and Harbor server. Each vLLM is given its KV cache size
(`--kv-cache-memory-bytes`) instead of sizing it by profiling the card: a vLLM that profiles while another allocates
counts the other's memory as its own (on an 80 GB card two started at once failed with `No available memory for the
cache blocks`), and starting them one after another costs ~100 s each.

Bound, stated before the run (printed first and kept in the JSON): chance is 1/4; PASS when the solve rate of the
last LAST_STEPS optimizer steps' rollouts (and any finished after the last step) is >= PASS_RATE, whose probability
for a policy still at chance is printed for the planned number of rollouts and recomputed for the actual one. The
control is the same run at learning rate 0, side by side on the same GPU (its own vLLM and Harbor server): it must
stay at chance (its last window's solve count no more surprising at chance than CONTROL_TAIL). The JSON's summary:
`first` (step 1's solve rate, mean over seeds), `last` (the last window's, the lowest seed's), `control_last` (the
highest control's), `pass` (every seed passes its bound and every control stays at chance), and `by_seed`.

Per optimizer step (from the last checkpoint's log history and rollouts.jsonl): solve rate, malformed actions (a
rollout whose agent did not submit on its one turn), TRL's importance ratio mean (after the script's dual clip)
and the script's own max/min and share beyond the bound (before it, `harbor/ratio_*`),
the clipped fraction, KL, grad norm, and the weight push's seconds (`perf/weight_sync_s`). The probability the model
gives `fox` (the served weights, read from vLLM every few seconds at the candidate position of a fixed prompt) is
drawn beside them.

    python bench/gpu_learning.py [--steps 40] [--lr 1e-4] [--seeds 1,2] [--control-seeds 1,2] [--deadline-s 480] \
        [--out $OUT/<date>-<card>-one-gpu-learning]
    python bench/gpu_learning.py --warmup-only --device cpu   # the warm-up alone, sampled with transformers
    python bench/gpu_learning.py --report OUT.json            # redraw OUT.png from a finished run's JSON

Environment: AGH_SERVER_PYTHON (the Harbor server's interpreter), AGH_VLLM_PYTHONPATH (put first on vLLM's path),
AGH_GPU_OFFLINE_ATTENTION=1 (no hub: the rig's SDPA tree attention), as in tests/gpu/test_one_gpu.py.
Writes OUT.json (every figure), OUT.log (the runs' output) and OUT.png; the last line printed is
`gpu-learn: first=<step 1 solve rate> last=<last window> control_last=<c> pass=<bool> p_chance=<tail> ...`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RIG = ROOT / "tests" / "rig"
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(RIG))

from conftest import Service, free_port, get_json, post_json  # noqa: E402

TASKS = RIG / "tasks"
TASK = "choose"
ANSWERS = ["cat", "dog", "fox", "tag"]
RIGHT = "fox"  # what tests/rig/tasks/choose/tests/test.sh rewards
CHANCE = 1 / len(ANSWERS)
PASS_RATE = 0.6
# Each vLLM's KV cache: ~1M tokens of this model, far more than 16 one-turn rollouts hold.
KV_CACHE_BYTES = 2 * 2**30
# A control whose last window is less likely than this at chance has moved: it fails.
CONTROL_TAIL = 1e-3
LAST_STEPS = 3
GROUP = 8
GROUPS_PER_STEP = 2
FORMAT_SLACK = 1e-3
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; mkdir -p /app; echo >/app/answer.txt"
ACTION = re.compile(r"^" + re.escape(SUBMIT) + r" (\w+)$")
NCCL_SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
BASH_TOOL = {"type": "function", "function": {
    "name": "bash", "description": "Execute a bash command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string",
                                                                "description": "The bash command to execute"}},
                   "required": ["command"]}}}
INSTRUCTION = (TASKS / TASK / "instruction.md").read_text()
PREFLIGHT_ROW = re.compile(r"^  (PASS|WARN|FAIL|SKIP)  (.+?)  +(.*)$", re.M)
STEP_METRICS = ("ratio", "harbor/ratio_min", "harbor/ratio_max", "harbor/ratio_beyond_bound_frac",
                "clip_ratio/region_mean", "kl", "grad_norm", "perf/weight_sync_s")
# A small Qwen3 (~3M parameters with the rig's 1k vocabulary): big enough to hold the action on any prompt.
SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)


def action_text(answer: str) -> str:
    # The hermes layout the Qwen3 template renders for a content-less tool call (tests/rig/engine.py).
    return '<tool_call>\n{"name": "bash", "arguments": ' + json.dumps({"command": f"{SUBMIT} {answer}"}) + \
        "}\n</tool_call>"


def binomial_tail(n: int, k: int, p: float = CHANCE) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))


def bound(n: int) -> dict:
    k = math.ceil(PASS_RATE * n)
    return {"chance": CHANCE, "pass_rate": PASS_RATE, "rollouts": n, "solves_needed": k,
            "p_at_chance": binomial_tail(n, k)}


# ---- the model and its warm-up -------------------------------------------------------------------------------

def build_model(work: Path) -> Path:
    """The rig's tokenizer and template with a wider Qwen3, the candidates interchangeable (one embedding, one row)."""
    import tiny_model
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    base = tiny_model.build(work / "base", tuple(ANSWERS))
    tokenizer = AutoTokenizer.from_pretrained(base)
    rig = Qwen3Config.from_pretrained(base)
    config = Qwen3Config(vocab_size=rig.vocab_size, max_position_embeddings=rig.max_position_embeddings,
                         tie_word_embeddings=False, eos_token_id=rig.eos_token_id, pad_token_id=rig.pad_token_id,
                         initializer_range=0.02, dtype="float32", **SHAPE)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    ids = candidate_ids(tokenizer)
    with torch.no_grad():
        for weight in (model.model.embed_tokens.weight, model.lm_head.weight):
            weight[ids] = weight[ids[0]].clone()
    model.generation_config = GenerationConfig(eos_token_id=[tokenizer.eos_token_id],
                                               pad_token_id=tokenizer.pad_token_id)
    out = work / "init"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def candidate_ids(tokenizer) -> list[int]:
    ids = [tokenizer.encode(f" {a}", add_special_tokens=False) for a in ANSWERS]
    if any(len(i) != 1 for i in ids):
        raise SystemExit(f"error: the candidates are not single tokens: {ids}")
    return [i[0] for i in ids]


def completions(tokenizer) -> tuple[list[list[int]], int]:
    """Each candidate's completion ids (the action and the end of turn) and the one position where they differ."""
    rows = [tokenizer.encode(action_text(a) + tokenizer.eos_token, add_special_tokens=False) for a in ANSWERS]
    differ = [i for i in range(len(rows[0])) if len({r[i] for r in rows}) > 1]
    if len({len(r) for r in rows}) != 1 or len(differ) != 1 or rows[0][differ[0]] != candidate_ids(tokenizer)[0]:
        raise SystemExit("error: the candidates' actions must differ in exactly one token, the candidate's")
    return rows, differ[0]


def context_messages(rng: random.Random) -> list[dict]:
    """A prompt like mini-swe-agent's: a system prompt and the task in the user turn, with varied filler, so the
    action does not hang on any one wording (the real one carries the machine's uname and paths)."""
    import tiny_model

    lines = [line for line in tiny_model.CORPUS.splitlines() if line.strip()]
    system = "\n".join(rng.choices(lines, k=rng.randint(3, 90)))
    filler = rng.sample(lines, rng.randint(0, 12))
    uname = f"<system_information> Linux {rng.randint(4, 7)}.{rng.randint(0, 19)}.{rng.randint(0, 99)} x86_64 " \
            "</system_information>"
    user = filler[: len(filler) // 2] + [INSTRUCTION.strip(), uname] + filler[len(filler) // 2:]
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n".join(user)}]


PROBE_MESSAGES = context_messages(random.Random(20_000))


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=[BASH_TOOL], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def warm_up(init: Path, out: Path, device: str, max_steps: int, contexts_per_batch: int, max_s: float,
            log) -> dict:
    """Supervised pass to the action: every context with each candidate, loss on the completion only, until the
    action's format is near-certain on held-out contexts while the candidates stay equal."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(init)
    torch.backends.cuda.matmul.allow_tf32 = True  # the warm-up only needs the format learnt, not bit-exactness
    model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32).to(device)
    rows, at = completions(tokenizer)
    cands = candidate_ids(tokenizer)
    rng = random.Random(0)
    held_out = [prompt_ids(tokenizer, context_messages(random.Random(10_000 + i))) for i in range(8)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    pad = tokenizer.pad_token_id
    t0 = time.monotonic()

    def batch(prompts: list[list[int]]):
        seqs = [(p, r) for p in prompts for r in rows]
        width = max(len(p) + len(r) for p, r in seqs)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        labels = torch.full((len(seqs), width), -100, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, (p, r) in enumerate(seqs):
            ids[i, :len(p) + len(r)] = torch.tensor(p + r)
            labels[i, len(p):len(p) + len(r)] = torch.tensor(r)
            mask[i, :len(p) + len(r)] = 1
        return ids.to(device), labels.to(device), mask.to(device)

    def measure() -> dict:
        """Over the held-out contexts: the worst format log-probability of the action and the candidates' shares."""
        model.eval()
        worst, shares, mass = 0.0, [], []
        with torch.no_grad():
            for p in held_out:
                ids, labels, mask = batch([p])
                logp = model(input_ids=ids[:1], attention_mask=mask[:1]).logits.float().log_softmax(-1)[0]
                r = rows[0]
                token_lp = [logp[len(p) - 1 + j, r[j]].item() for j in range(len(r))]
                worst = min(worst, sum(lp for j, lp in enumerate(token_lp) if j != at))
                at_logp = logp[len(p) - 1 + at, cands].exp()
                mass.append(at_logp.sum().item())
                shares.append((at_logp / at_logp.sum()).tolist())
        model.train()
        spread = max(max(s) - min(s) for s in shares)
        return {"format_logprob_worst": worst, "candidate_mass_min": min(mass), "candidate_share_spread": spread}

    step, loss, stats = 0, float("nan"), {}
    for step in range(1, max_steps + 1):
        prompts = [prompt_ids(tokenizer, context_messages(rng)) for _ in range(contexts_per_batch)]
        ids, labels, mask = batch(prompts)
        out_ = model(input_ids=ids, attention_mask=mask, labels=labels)
        out_.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = out_.loss.item()
        if step % 25 == 0 or step == max_steps or time.monotonic() - t0 > max_s:
            stats = measure()
            log(f"warm-up step {step}: loss {loss:.5f}, worst format logprob {stats['format_logprob_worst']:.2e}, "
                f"candidate mass {stats['candidate_mass_min']:.5f}, share spread {stats['candidate_share_spread']:.2e}")
            if stats["format_logprob_worst"] > math.log(1 - FORMAT_SLACK) and stats["candidate_mass_min"] > 0.999:
                break
            if time.monotonic() - t0 > max_s:
                log(f"warm-up stopped at its time limit ({max_s:.0f}s) before the format margin was reached")
                break
    model.eval()
    try:
        sampled = sample_with(model, tokenizer, device)
    except Exception as exc:  # the check is a report; the run's own rollouts still count the malformed actions
        sampled = {"samples": 0, "malformed": None, "chosen": {}, "error": f"{type(exc).__name__}: {exc}"[:500]}
    log(f"warm-up: {sampled['samples']} samples of the warmed model at temperature 1: {sampled['malformed']} "
        f"malformed, chosen {sampled['chosen']}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"steps": step, "sampled": sampled, "loss": loss, "seconds": round(time.monotonic() - t0, 1), "contexts_per_batch":
            contexts_per_batch, "format_slack": FORMAT_SLACK, **stats,
            "format_ok": stats.get("format_logprob_worst", -1) > math.log(1 - FORMAT_SLACK)}


def parse_action(text: str) -> str | None:
    """The candidate a completion's one tool call writes, as the hermes parser and mini-swe-agent read it; None:
    malformed."""
    calls = re.findall(r"<tool_call>(.*?)</tool_call>", text, flags=re.DOTALL)
    if len(calls) != 1 or text[: text.index("<tool_call>")].strip():
        return None
    try:
        call = json.loads(calls[0])
        match = ACTION.match(call["arguments"]["command"]) if call.get("name") == "bash" else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return match[1] if match and match[1] in ANSWERS else None


def sample_with(model, tokenizer, device: str, n: int = 64) -> dict:
    """n free samples of the first turn (temperature 1, full vocabulary) of the warmed model, before any RL step."""
    import torch

    rows, _ = completions(tokenizer)
    prompt = torch.tensor([prompt_ids(tokenizer, PROBE_MESSAGES)] * n, device=device)
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=len(rows[0]) + 8)
    chosen, malformed = {a: 0 for a in ANSWERS}, 0
    for seq in out[:, prompt.shape[1]:].tolist():
        answer = parse_action(tokenizer.decode(seq, skip_special_tokens=True))
        if answer is None:
            malformed += 1
        else:
            chosen[answer] += 1
    return {"samples": n, "malformed": malformed, "chosen": chosen}


# ---- the served model, read through vLLM --------------------------------------------------------------------------

def sample_actions(vllm_url: str, served: str, n: int = 64) -> dict:
    """n free samples of the first turn from vLLM (temperature 1): well-formed actions and the candidates chosen."""
    reply = post_json(f"{vllm_url}/v1/chat/completions", {
        "model": served, "messages": [{"role": "system", "content": PROBE_MESSAGES[0]["content"]},
                                      {"role": "user", "content": INSTRUCTION}],
        "tools": [BASH_TOOL], "temperature": 1.0, "n": n, "max_tokens": 96}, timeout=20)
    chosen, malformed = {a: 0 for a in ANSWERS}, 0
    for choice in reply["choices"]:
        calls = choice["message"].get("tool_calls") or []
        command = json.loads(calls[0]["function"]["arguments"]).get("command", "") if len(calls) == 1 else ""
        match = ACTION.match(command)
        if match and match[1] in chosen:
            chosen[match[1]] += 1
        else:
            malformed += 1
    return {"samples": n, "malformed": malformed, "chosen": chosen}


class ProbeRight:
    """The served weights' probability of each candidate at the candidate position of one fixed prompt, read from
    vLLM every `every` seconds (processed logprobs, temperature 1)."""

    def __init__(self, vllm_url: str, served: str, tokenizer, every: float = 2.0):
        rows, at = completions(tokenizer)
        self.prompt = prompt_ids(tokenizer, PROBE_MESSAGES) + rows[0][:at]
        self.ids = candidate_ids(tokenizer)
        self.url, self.served, self.every = vllm_url, served, every
        self.readings: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def read(self) -> dict | None:
        reply = post_json(f"{self.url}/v1/completions", {
            "model": self.served, "prompt": self.prompt, "max_tokens": 1, "temperature": 1.0, "logprobs": 20},
            timeout=30)["choices"][0]
        top = reply["logprobs"]["top_logprobs"][0]
        by_id = {int(k.split(":", 1)[1]) if k.startswith("token_id:") else k: v for k, v in top.items()}
        probs = [math.exp(by_id[i]) if i in by_id else 0.0 for i in self.ids]
        return {"time": time.time(), "probs": probs}

    def loop(self) -> None:
        while not self.stop.wait(self.every):
            try:
                self.readings.append(self.read())
            except Exception:  # paused for a push, or a reply without the candidates' logprobs: the next one
                continue


# ---- one run: vLLM + Harbor server + the script -------------------------------------------------------------------

def base_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, **NCCL_SAFE, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_NO_USAGE_STATS": "1", "VLLM_HOST_IP": "127.0.0.1", **extra}
    if os.environ.get("AGH_GPU_OFFLINE_ATTENTION") == "1":
        env |= {"PYTHONPATH": os.pathsep.join(filter(None, [str(RIG / "sitecustomize"), env.get("PYTHONPATH")])),
                "AGH_CPU_RIG": "attention", "HF_HUB_OFFLINE": "1"}
    return env


def start_vllm(model: Path, log: Path, share: float, seed: int) -> tuple[Service, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--host", "127.0.0.1", "--port",
           str(port), "--seed", str(seed), "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--dtype", "bfloat16",
           "--max-model-len", "4096", "--gpu-memory-utilization", str(share),
           "--enforce-eager", "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--logprobs-mode",
           "processed_logprobs", "--return-tokens-as-token-ids", "--weight-transfer-config", '{"backend":"ipc"}']
    env = base_env(VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    if os.environ.get("AGH_VLLM_PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ["AGH_VLLM_PYTHONPATH"], env.get("PYTHONPATH")]))
    return Service(f"vllm ({log.name})", cmd, log, f"http://127.0.0.1:{port}/v1/models", env=env), \
        f"http://127.0.0.1:{port}"


def start_harbor(work: Path, vllm_url: str, model: Path) -> tuple[Service, str]:
    port = free_port()
    service = Service("harbor server", [os.environ.get("AGH_SERVER_PYTHON", sys.executable),
                                        str(RIG / "harbor_server.py"), "--dataset", str(TASKS), "--llm-url",
                                        f"{vllm_url}/v1", "--model", str(model), "--max-output-tokens", "96",
                                        "--host", "127.0.0.1", "--port", str(port), "--capture-port",
                                        str(free_port()), "--expose", "direct"],
                      work / "harbor.log", f"http://127.0.0.1:{port}/harbor_env/splits",
                      env={**NCCL_SAFE, "MAX_CONCURRENT_ENVS": str(4 * GROUP * GROUPS_PER_STEP),
                           "RIG_SANDBOX_DIR": str(work / "sandboxes"), "OPENENV_HARBOR_TRIALS_DIR": str(work / "trials")},
                      cwd=work)
    return service, f"http://127.0.0.1:{port}"


def script_args(model: Path, vllm_url: str, harbor_url: str, split: str, out: Path, lr: str, steps: int,
                seed: int) -> list[str]:
    return ["--model", str(model), "--vllm-url", vllm_url, "--harbor-url", harbor_url, "--dataset", split,
            "--harness", "mini-swe-agent", "--sandbox", "local", "--tasks", TASK, "--report-to", "none",
            "--agent-step-limit", "1", "--max-completion-length", "96", "--agent-timeout", "120",
            "--num-generations", str(GROUP), "--max-inflight", str(GROUP * GROUPS_PER_STEP),
            "--token-budget", "0", "--per-device-train-batch-size", str(GROUP * GROUPS_PER_STEP),
            "--micro-batches-per-step", "1", "--max-zero-variance-groups", "0", "--max-staleness", "0",
            "--temperature", "1.0", "--learning-rate", lr, "--max-steps", str(steps), "--save-steps", "1",
            "--save-total-limit", "2", "--seed", str(seed), "--output-dir", str(out)]


def one_run(name: str, model: Path, work: Path, lr: str, seed: int, steps: int, vllm: Service, vllm_url: str,
            deadline: float, results: dict, tokenizer) -> None:
    """One training run against its own vLLM (already serving `model`'s directory) and its own Harbor server."""
    started = time.monotonic()
    harbor, probe, proc, lines = None, None, None, []
    result = results[name] = {"learning_rate": lr, "seed": seed, "steps_planned": steps}
    try:
        served = get_json(f"{vllm_url}/v1/models")["data"][0]["id"]
        harbor, harbor_url = start_harbor(work, vllm_url, model)
        harbor.wait_ready(timeout=300)
        split = get_json(f"{harbor_url}/harbor_env/splits")[0]["name"]
        probe = ProbeRight(vllm_url, served, tokenizer)
        out = work / "out"
        cmd = [sys.executable, str(ROOT / "async_grpo_harbor.py"),
               *script_args(model, vllm_url, harbor_url, split, out, lr, steps, seed)]
        proc = subprocess.Popen(cmd, cwd=work, env=base_env(), text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        reader = threading.Thread(target=lambda: lines.extend(f"{time.time():.2f} {line}" for line in proc.stdout),
                                  daemon=True)
        reader.start()
        while proc.poll() is None and time.monotonic() < deadline:
            # The first rollout follows TRL's first push (the warmed weights): from then on vLLM serves the policy.
            if probe.thread.ident is None and (out / "rollouts.jsonl").is_file():
                probe.thread.start()
            time.sleep(1)
        if proc.poll() is None:  # out of time: the script saves a checkpoint on SIGTERM and exits 75
            os.killpg(proc.pid, signal.SIGTERM)
            result["stopped_at_deadline"] = True
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        reader.join(timeout=10)
        result["exit"] = proc.returncode
        result["after_rl_samples"] = sample_actions(vllm_url, served)
    except Exception as exc:  # a run that broke is reported, not lost: the other run still counts
        result["error"] = f"{type(exc).__name__}: {exc}"[:3000]
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if probe is not None:
            probe.stop.set()
            result["probe"] = probe.readings
        if harbor is not None:
            harbor.stop()
        vllm.stop()
        result["wall_s"] = round(time.monotonic() - started, 1)
        result["stdout"] = "".join(lines)
        for log in ("vllm.log", "harbor.log"):
            if (work / log).is_file():
                result[f"{log}_tail"] = (work / log).read_text()[-4000:]
        result["preflight"] = {row: (status, detail) for status, row, detail in PREFLIGHT_ROW.findall(
            re.sub(r"^\d+\.\d+ ", "", result["stdout"], flags=re.M))}
    result |= per_step(work / "out", result)


def per_step(out: Path, result: dict) -> dict:
    """The log history of the last checkpoint, with each step's rollouts (those it folded in) from rollouts.jsonl."""
    checkpoints = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])) if out.is_dir() else []
    history = []
    if checkpoints:
        state = json.loads((checkpoints[-1] / "trainer_state.json").read_text())
        history = [e for e in state["log_history"] if "loss" in e]
    records = []
    if (out / "rollouts.jsonl").is_file():
        for line in (out / "rollouts.jsonl").read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:  # a line cut short by the stop
                continue
    steps, start = [], 0
    for entry in history:
        n = int(entry.get("harbor/rollouts_total", 0))
        chunk, start = records[start:start + n], start + n
        steps.append({"step": entry["step"], "rollouts": len(chunk), "solved": solved(chunk),
                      "malformed": sum(r["error"] is None and r["exit"] != "ok" for r in chunk),
                      "errors": sum(r["error"] is not None for r in chunk),
                      **{k: entry.get(k) for k in STEP_METRICS}})
    after = records[start:]
    last = [r for s in range(max(0, len(steps) - LAST_STEPS), len(steps))
            for r in records[sum(x["rollouts"] for x in steps[:s]):sum(x["rollouts"] for x in steps[:s + 1])]] + after
    # The probe's readings, each given the step count the run had logged by then (from the stdout's step lines).
    step_times = [float(m[1]) for m in re.finditer(r"^(\d+\.\d+) \[harbor\] step (\d+):", result.get("stdout", ""),
                                                     re.M)]
    probe = [{"after_steps": sum(t <= r["time"] for t in step_times), "p_right": r["probs"][ANSWERS.index(RIGHT)],
              "probs": r["probs"]} for r in result.get("probe", [])]
    return {"steps": steps, "after_last_step": {"rollouts": len(after), "solved": solved(after)},
            "last": {"rollouts": len(last), "solved": solved(last), **(bound(len(last)) if last else {})},
            "probe": probe, "rollouts": len(records)}


def solved(records: list[dict]) -> int:
    return sum(r["error"] is None and (r["reward"] or 0) > 0 for r in records)


# ---- report ------------------------------------------------------------------------------------------------------

def rate(k: int, n: int) -> float | None:
    return round(k / n, 3) if n else None


def seed_summary(learning: dict, control: dict | None) -> dict:
    first = learning["steps"][0] if learning.get("steps") else {"solved": 0, "rollouts": 0}
    last = learning.get("last", {"rollouts": 0, "solved": 0})
    ratios = [s["harbor/ratio_max"] for s in learning.get("steps", []) if s.get("harbor/ratio_max") is not None]
    pushes = [s["perf/weight_sync_s"] for s in learning.get("steps", []) if s.get("perf/weight_sync_s")]
    last_rate = rate(last["solved"], last["rollouts"])
    control_last = (control or {}).get("last", {"rollouts": 0, "solved": 0})
    control_tail = binomial_tail(control_last["rollouts"], control_last["solved"]) if control_last["rollouts"] else None
    return {"first": rate(first["solved"], first["rollouts"]), "last": last_rate, "last_n": last["rollouts"],
            "p_chance": last.get("p_at_chance"),
            "control_last": rate(control_last["solved"], control_last["rollouts"]),
            "control_last_n": control_last["rollouts"], "control_p_chance": control_tail,
            "control_at_chance": None if control is None else bool(control_tail is not None
                                                                   and control_tail >= CONTROL_TAIL),
            "pass": bool(last_rate is not None and last_rate >= PASS_RATE),
            "steps": len(learning.get("steps", [])),
            "control_steps": None if control is None else len(control.get("steps", [])),
            "malformed": sum(s["malformed"] for s in learning.get("steps", [])),
            "control_malformed": None if control is None else sum(s["malformed"] for s in control.get("steps", [])),
            "ratio_max": max(ratios) if ratios else None,
            "push_s": f"{min(pushes):.2f}-{max(pushes):.2f}" if pushes else None}


def summary(results: dict) -> dict:
    """Every seed must pass its bound and every control stay at chance: `last` is the lowest seed's last window,
    `control_last` the highest control's."""
    seeds = sorted({r["seed"] for r in results.values()})
    by_seed = {seed: seed_summary(results.get(f"learning-seed{seed}", {}), results.get(f"control-seed{seed}"))
               for seed in seeds if f"learning-seed{seed}" in results}
    firsts = [s["first"] for s in by_seed.values() if s["first"] is not None]
    lasts = [s["last"] for s in by_seed.values()]
    controls = [s["control_last"] for s in by_seed.values() if s["control_last"] is not None]
    ratios = [s["ratio_max"] for s in by_seed.values() if s["ratio_max"] is not None]
    return {"first": round(sum(firsts) / len(firsts), 3) if firsts else None,
            "last": None if None in lasts or not lasts else min(lasts),
            "control_last": max(controls) if controls else None,
            "pass": bool(by_seed) and all(s["pass"] and s["control_at_chance"] is not False for s in by_seed.values())
            and any(s["control_at_chance"] for s in by_seed.values()),
            "seeds": len(by_seed), "steps": min((s["steps"] for s in by_seed.values()), default=0),
            "ratio_max": max(ratios) if ratios else None, "by_seed": by_seed}


def plot(results: dict, path: Path, card: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ratio_ax) = plt.subplots(2, 1, figsize=(8, 9), sharex=True, height_ratios=(3, 2))
    colors = {}
    for name, r in sorted(results.items()):
        learning = name.startswith("learning")
        color = colors.setdefault(r["seed"], f"C{len(colors)}")
        style = "-o" if learning else "--s"
        steps = r.get("steps", [])
        xs = [s["step"] for s in steps]
        ax.plot(xs, [rate(s["solved"], s["rollouts"]) for s in steps], style, color=color, ms=4,
                label=f"{name} (lr {r['learning_rate']}): solve rate of the step's rollouts")
        ax.plot(xs, [rate(s["malformed"], s["rollouts"]) for s in steps], "x", color=color, alpha=0.6,
                label=f"{name}: malformed actions (share)")
        if r.get("probe") and learning:
            ax.plot([p["after_steps"] for p in r["probe"]], [p["p_right"] for p in r["probe"]], ".", color=color,
                    alpha=0.3, ms=3, label=f"{name}: vLLM's probability of {RIGHT!r} (fixed prompt)")
        timed = [s for s in steps if s.get("harbor/ratio_max") is not None]
        if timed and learning:
            ratio_ax.fill_between([s["step"] for s in timed], [s["harbor/ratio_min"] for s in timed],
                                  [s["harbor/ratio_max"] for s in timed], color=color, alpha=0.2)
            ratio_ax.plot([s["step"] for s in timed], [s["ratio"] for s in timed], style, color=color, ms=4,
                          label=f"{name}: importance ratio, mean (line) and range (band)")
    ax.axhline(CHANCE, color="grey", lw=0.8, ls=":", label="chance (1/4)")
    ax.axhline(PASS_RATE, color="green", lw=0.8, ls=":", label=f"pass: last {LAST_STEPS} steps >= {PASS_RATE}")
    ax.set_ylabel("solve rate / probability")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"One {card}, vLLM (ipc) and trainer on one card: choose the right word of 4", fontsize=10)
    ax.legend(fontsize=6, loc="upper left")
    ratio_ax.set_yscale("log")
    ratio_ax.set_xlabel("optimizer step")
    ratio_ax.set_ylabel("pi_new / pi_old per trained token")
    ratio_ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write(results: dict, out: Path, meta: dict) -> dict:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".log"), "w") as log:
        log.write(meta.pop("log_text", ""))
        for name, r in sorted(results.items()):
            log.write(f"===== {name}\n{r.pop('stdout', '')}\n")
            for key in ("vllm.log_tail", "harbor.log_tail"):
                log.write(f"----- {name} {key}\n{r.pop(key, '')}\n")
    line = summary(results)
    out.with_suffix(".json").write_text(json.dumps({"summary": line, **meta, **results}, indent=1) + "\n")
    try:
        plot(results, out.with_suffix(".png"), meta.get("card", "GPU"))
    except Exception as exc:  # the JSON and log are the record; a missing picture must not lose them
        print(f"warning: no picture: {exc}", file=sys.stderr)
    return line


def card_name() -> tuple[str, str]:
    """The card's name and its short form for file names (h100, h200, ...)."""
    import torch

    if not torch.cuda.is_available():
        return "CPU", "cpu"
    name = torch.cuda.get_device_name(0)
    short = next((m.lower() for m in re.findall(r"\b([A-Z]\d{2,4})\b", name)), "gpu")
    return f"{name} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)", short


def start_all(servers: dict, model: Path, work: Path, share: float, deadline: float, log, failed: dict) -> None:
    """Every vLLM at once (each with its own KV cache size, so none profiles another), then each waited for."""
    for name, seed in servers["plan"]:
        servers[name] = start_vllm(model, work / name / "vllm.log", share, seed)
    for name, _ in servers["plan"]:
        try:
            servers[name][0].wait_ready(timeout=max(30.0, deadline - time.monotonic()))
            log(f"vLLM for {name} ready")
        except Exception as exc:  # reported with the run; the others still train
            failed[name] = f"{type(exc).__name__}: {exc}"[:2000]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps planned (the deadline may stop first)")
    parser.add_argument("--lr", default="1e-4", help="learning rate of the learning runs (the controls' is 0)")
    parser.add_argument("--seeds", default="1,2", help="RL seeds, one learning run each (the script's --seed and "
                                                       "vLLM's)")
    parser.add_argument("--control-seeds", default=None, help="seeds whose lr-0 control runs beside (default: all)")
    parser.add_argument("--deadline-s", type=float, default=480.0,
                        help="seconds from start after which every run is stopped (SIGTERM: a checkpoint is saved)")
    parser.add_argument("--warmup-steps", type=int, default=3000, help="most supervised steps of the warm-up")
    parser.add_argument("--warmup-s", type=float, default=75.0, help="most seconds of the warm-up")
    parser.add_argument("--warmup-contexts", type=int, default=8, help="contexts per warm-up batch (x4 candidates)")
    parser.add_argument("--device", default="cuda", help="where the warm-up runs")
    parser.add_argument("--share", type=float, default=0.15, help="each vLLM's --gpu-memory-utilization")
    parser.add_argument("--work", default="/tmp/gpu-learning", help="scratch directory")
    parser.add_argument("--out", default=None, help="path prefix of the .json, .log and .png written (default: "
                                                    "bench/results/<date>-<card>-one-gpu-learning)")
    parser.add_argument("--warmup-only", action="store_true", help="build and warm the model, then stop")
    parser.add_argument("--report", metavar="JSON", help="redraw the picture of a finished run")
    args = parser.parse_args()
    if args.report:
        data = json.loads(Path(args.report).read_text())
        runs = {k: v for k, v in data.items() if isinstance(v, dict) and "seed" in v}
        plot(runs, Path(args.report).with_suffix(".png"), data.get("card", "GPU"))
        print("gpu-learn: " + " ".join(f"{k}={v}" for k, v in summary(runs).items() if k != "by_seed"))
        return 0
    t0 = time.monotonic()
    log_lines: list[str] = []

    def log(message: str) -> None:
        line = f"[{time.monotonic() - t0:6.1f}s] {message}"
        print(line, flush=True)
        log_lines.append(line + "\n")

    card, short = card_name()
    seeds = [int(x) for x in args.seeds.split(",")]
    control_seeds = seeds if args.control_seeds is None else [int(x) for x in args.control_seeds.split(",") if x]
    out_prefix = Path(args.out or ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-{short}-one-gpu-learning")
    planned = LAST_STEPS * GROUP * GROUPS_PER_STEP
    stated = {**bound(planned), "last_steps": LAST_STEPS, "rollouts_per_step": GROUP * GROUPS_PER_STEP,
              "control_tail": CONTROL_TAIL, "seeds": seeds, "control_seeds": control_seeds,
              "learning_rate": args.lr, "steps": args.steps}
    log(f"card: {card}")
    log(f"bound, before the run: chance {CHANCE}; PASS when, for every seed {seeds} at lr {args.lr}, the last "
        f"{LAST_STEPS} steps' rollouts (+ any after) solve >= {PASS_RATE}; for {planned} rollouts that is >= "
        f"{stated['solves_needed']}, which a policy at chance reaches with probability {stated['p_at_chance']:.2e}; "
        f"and every lr-0 control ({control_seeds}) stays at chance (its last window at least {CONTROL_TAIL:g} "
        "likely at chance)")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    init = build_model(work)
    variants = {f"learning-seed{seed}": (args.lr, seed) for seed in seeds}
    variants |= {f"control-seed{seed}": ("0", seed) for seed in control_seeds}
    servers: dict = {"plan": [(name, seed) for name, (_, seed) in variants.items()]}
    failed: dict[str, str] = {}
    starter = None
    if not args.warmup_only:
        # vLLM starts on the initial weights while the warm-up runs: the script's first push, which TRL makes before
        # any rollout, replaces them with the warmed ones (the same directory, rewritten once vLLM has loaded it).
        for name in variants:
            (work / name).mkdir(parents=True, exist_ok=True)
        starter = threading.Thread(target=start_all, daemon=True,
                                   args=(servers, init, work, args.share, t0 + args.deadline_s / 2, log, failed))
        starter.start()
    results: dict = {}
    try:
        warm = warm_up(init, work / "warm", args.device, args.warmup_steps, args.warmup_contexts, args.warmup_s, log)
        log(f"warm-up: {json.dumps(warm)}")
        if args.warmup_only:
            return 0 if warm["format_ok"] else 1
        starter.join()
        log(f"vLLM ready ({len(variants) - len(failed)} of {len(variants)})")
        for f in ("model.safetensors", "config.json"):
            (init / f).write_bytes((work / "warm" / f).read_bytes())
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(init)
        deadline = t0 + args.deadline_s
        for name, error in failed.items():
            results[name] = {"learning_rate": variants[name][0], "seed": variants[name][1], "error": error}
        runs = [threading.Thread(target=one_run, args=(name, init, work / name, lr, seed, args.steps, *servers[name],
                                                       deadline, results, tokenizer))
                for name, (lr, seed) in variants.items() if name not in failed]
        for t in runs:
            t.start()
        for t in runs:
            t.join()
    finally:
        if starter is not None:
            starter.join(timeout=60)
        for name, value in servers.items():
            if name != "plan":
                value[0].stop()
    for name, r in sorted(results.items()):
        log(f"{name}: exit {r.get('exit')}, error {r.get('error')}, vLLM's samples after the run "
            f"{r.get('after_rl_samples')}")
        for s in r.get("steps", []):
            log(f"{name} step {s['step']}: solved {s['solved']}/{s['rollouts']}, malformed {s['malformed']}, "
                + ", ".join(f"{k} {s[k]:.4g}" for k in STEP_METRICS if s.get(k) is not None))
    meta = {"card": card, "bound_stated_before_the_run": stated, "warm_up": warm, "model_shape": SHAPE,
            "group": GROUP, "groups_per_step": GROUPS_PER_STEP, "wall_s": round(time.monotonic() - t0, 1),
            "log_text": "".join(log_lines)}
    line = write(results, out_prefix, meta)
    for seed, row in line["by_seed"].items():
        print(f"gpu-learn seed {seed}: " + " ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    print("gpu-learn: " + " ".join(f"{k}={v}" for k, v in line.items() if k != "by_seed"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
