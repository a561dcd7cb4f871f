"""Loopback stand-in for `vllm serve` (0.29) on CPU, speaking the wire contract the rig depends on.

    python tests/rig/engine.py --model-dir DIR --port P --served-name NAME [--policy policy.json] [--dtype D]
                               [--logprobs-mode M] [--no-token-ids] [--weight-transfer-config JSON]

Impersonates `vllm serve DIR --served-model-name NAME --logprobs-mode processed_logprobs
--return-tokens-as-token-ids --enable-auto-tool-choice --tool-call-parser hermes
--weight-transfer-config '{"backend":"nccl"}'` with VLLM_SERVER_DEV_MODE=1:

* `/v1/chat/completions` (non-streaming; OpenEnv's capture proxy always forces `stream: false`): the prompt is the
  chat template rendering of `messages` + `tools`, tokenised locally; the completion is SCRIPTED text (a random
  tiny model cannot act) encoded + `<|im_end|>`, and its logprobs are what the tiny model really assigns to those ids:
  log_softmax(logits / T) at the request temperature (processed logprobs; T absent or ~0 scores at 1.0, as vLLM's
  greedy path does); the policy's `score_temperature_offset` X scores at T + X, a deliberately mismatched engine.
  `--no-token-ids` answers like a plain OpenAI server: no ids, no logprobs (OpenEnv grades it `eval`).
  The model runs in vLLM's `--dtype` (default auto: a float32 checkpoint is served in bfloat16, as vLLM does on a
  GPU), so logprobs carry the serving precision and pushed weights are rounded to it.
  Each launch flag the trainer needs can be left out, as a user might: `--logprobs-mode raw_logprobs` (vLLM's
  default: scored at T=1 whatever the request asks; `*_logits` return unnormalised logits), `--no-tool-parser` (no
  `--enable-auto-tool-choice`: vLLM's 400 for a tool request), `--no-dev-mode` (no VLLM_SERVER_DEV_MODE: the dev
  routes, /server_info and the weight sync ones, are 404), `--no-weight-transfer` (no `--weight-transfer-config`).
  `--enable-lora` only reports what vLLM's `--enable-lora --max-lora-rank 16` reports (a `lora_config` in
  /server_info; null otherwise, as vLLM's); it serves no adapter.
* The TRL control plane (`/health`, `/v1/models`, `/server_info`, `/get_world_size`, `/pause`, `/resume`, the weight
  update calls) answers as vLLM's does (`/server_info?config_format=json`: the resolved config's JSON dump, with
  `model_config.dtype` as `torch.<dtype>` and `model_config.logprobs_mode`, and `vllm_env`); the NCCL receive is
  replaced by `POST /stand_in/load_weights`, whose body is `safetensors.torch.save(state_dict)` under HF parameter
  names.
* `--weight-transfer-config '{"backend":"ipc"}'` serves vLLM's ipc backend instead (the intersection of 0.26's and
  0.29's): `/init_weight_transfer_engine` takes an empty `init_info`; between `/start_weight_update` and
  `/finish_weight_update` each `/update_weights` is decoded as vLLM's `parse_update_info` decodes it (base64 ->
  pickle, refused unless the engine's environment has VLLM_ALLOW_INSECURE_SERIALIZATION=1, as vLLM's) into one
  {gpu uuid: reduce_tensor args} per tensor, each rebuilt as vLLM's receive path does (its device index replaced)
  and loaded into the model (with `--lazy-load`: only at `/finish_weight_update`, as vLLM's layerwise reload may read
  what a layer not yet complete received); the weight version moves at `/finish_weight_update`. A handle is the rig's CPU stand-in
  for CUDA IPC (tests/rig/cpu_trainer.py, (e)). Failures answer as vLLM's collective_rpc does: 500, "Call to
  collective_rpc method failed: ..."; with `--bare-errors`, as vLLM 0.26's does: a bare 500, "Internal Server
  Error". `/stand_in/stats` lists every weight-sync call in order (`weight_sync`, the
  query kept: `pause?mode=keep`) and each push's chunks as decoded (`pushes`).
* `GET /stand_in/weights`: the model's state dict, `safetensors.torch.save`d, for tests to compare with the trainer's.
* `GET /stand_in/stats`: every chat request's sampling params and served token counts, for tests to assert on.
  `POST /stand_in/policy` replaces the policy below without a restart.

Policy (`--policy`, JSON; every key optional):

    {"tasks":   {"echo-hello": 1.0, "never": 0.0, "coin": 0.5},  # solve rate per task
     "default": 0.5,                                             # solve rate for a task not listed (or unmarked)
     "answers": {"echo-hello": "hello"},                         # what solving writes; default: the task name
     "answer_file": "/app/answer.txt",                           # where both scripts write
     "wrong_answer": "wrong",                                    # what failing writes
     "score_temperature_offset": 0.3,  # logprobs scored at T + 0.3: an engine that reports another policy than
                                       # the one it sampled from
     "hold_from_weight_version": 3,  # from the 3rd weight load on, chat requests wait until a policy without
                                     # this key is set: rollouts stall, so the trainer waits for them (`held` in
                                     # /stand_in/stats counts the requests waiting)
     "agent_end": {"coin": "hang", "coin2": "exit"},  # after turn 0, instead of submitting: "hang" runs `sleep`
                                     # until Harbor's agent timeout, "exit" kills the agent (a non-zero agent exit);
                                     # Harbor's verifier still scores the answer turn 0 wrote; "die" is the
                                     # engine's own failure: it answers turn 1 with vLLM's 500 of a dead engine
                                     # core and exits, as vLLM's server does (later calls find no server)
     "choices": {"choose": ["cat", "dog", "fox", "tag"]},  # the MODEL decides these tasks' answers (below)
     "seed": 0}                                             # of the engine's sampling of those choices

A conversation names its task with a `rig-task: NAME` marker anywhere in a user message (put it in the Harbor
task's instruction; mini-swe-agent embeds the instruction in its first user message). With tools offered, the
script is what mini-swe-agent 2.4.6 acts on, a Qwen3/hermes `bash` tool call per turn:
    turn 0: `mkdir -p DIR && printf '%s\\n' ANSWER > FILE`  (ANSWER when this rollout solves, else wrong_answer)
    turn 1+: `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`   (mini-swe-agent's submit command, which ends the run)
Without tools the reply is the text `ok`. Solves come in the exact proportion of the task's rate: the n-th turn-0
call of a task this engine answers (counted from 0, across every run it serves) solves when floor((n + 1) p) >
floor(n p). At p = 0.5 that alternates, so any 2m consecutive turn-0 calls of a task hold exactly m solves: an eval's
k rollouts of a task (run alone on its engine) give an exact pass rate, and a GRPO group of 2 or 4 gets exactly half
when no other first call of the task lands between its own.

A task listed under `choices` is decided by the model itself, under the weights the trainer last pushed: its turn-0
candidates are the same call writing each listed answer, each scored by its sequence logprob under the served model
at the request's temperature; one is sampled from those probabilities renormalised over the candidates (the argmax
when the request is greedy), and its ids come back with the model's per-token logprobs, like any other reply. The
engine never knows which answer is right; the task's verifier does. Later turns stay scripted (submit).
`/stand_in/stats` records each such call's candidate probabilities (`choice`), so a test can read what the policy
would choose under each weight version without sampling noise.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import pickle
import random
import re
import shlex
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import PurePosixPath
from urllib.parse import urlsplit

import torch
from cpu_trainer import RIG_GPU_UUID
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
TASK_MARKER = re.compile(r"rig-task:\s*([\w.-]+)")
GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: below it a request is greedy
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "logprobs",
                 "top_logprobs", "return_token_ids", "seed", "stop", "n", "frequency_penalty", "presence_penalty",
                 "repetition_penalty", "tool_choice", "stream")


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class EngineDead(HTTPError):
    """vLLM's EngineDeadError: answered as a 500, then its API server shuts down."""


class BareServerError(HTTPError):
    """vLLM 0.26's answer to a weight-sync call that failed in its workers: a 500 whose body says nothing more."""


# vLLM 0.29's IPCWeightTransferUpdateInfo fields (0.26 adds `packed`, which 0.29 refuses).
IPC_UPDATE_FIELDS = {"names", "dtype_names", "shapes", "ipc_handles", "ipc_handles_pickled", "tensor_sizes"}


class Engine:
    def __init__(self, model_dir, served_name, policy, token_ids=True, max_model_len=32768,
                 logprobs_mode="processed_logprobs", tool_parser=True, weight_transfer=None, dtype="auto",
                 enable_lora=False, gpu_uuid=RIG_GPU_UUID, bare_errors=False, lazy_load=False):
        self.model_dir, self.served_name = str(model_dir), served_name
        self.bare_errors, self.lazy_load = bare_errors, lazy_load
        self.logprobs_mode, self.tool_parser, self.weight_transfer = logprobs_mode, tool_parser, weight_transfer
        # vLLM's context length: the trainer's default token budget per micro-batch, so it decides samples per step.
        self.max_model_len = max_model_len
        self.enable_lora = enable_lora
        self.policy, self.token_ids = policy, token_ids
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.dtype = resolve_dtype(dtype, AutoConfig.from_pretrained(model_dir).dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype).eval()
        self.eos_id = self.tokenizer.eos_token_id
        self.model_lock = threading.Lock()  # forward passes vs weight loads
        self.state_lock = threading.Lock()  # counters and the stats log
        self.running = threading.Event()  # cleared by /pause: new and in-flight requests wait, as vLLM's mode=keep
        self.running.set()
        self.weight_version = 0
        self.n_requests = 0
        self.held = 0  # requests waiting for a policy without `hold_from_weight_version`
        self.rollouts_by_task: dict[str, int] = {}
        self.rng = random.Random(policy.get("seed", 0))  # samples the model's own choices (`choices`)
        self.requests: list[dict] = []
        self.control_calls: dict[str, int] = {}
        self.weight_sync: list[str] = []  # every weight-sync call, in order
        self.pushes: list[dict] = []  # ipc: each finished push's chunks, as decoded
        self.push: dict | None = None  # ipc: the push between /start_weight_update and /finish_weight_update
        self.gpu_uuid = gpu_uuid  # str(torch.cuda.get_device_properties(its device).uuid), as vLLM reads it
        self.allow_pickle = bool(int(os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")))  # as vLLM reads it

    # ---- chat completions --------------------------------------------------------------------------------------
    def chat(self, body: dict) -> dict:
        if body.get("model") not in (self.served_name, None):
            raise HTTPError(404, f"The model `{body.get('model')}` does not exist.")
        if body.get("stream"):
            raise HTTPError(400, "stand-in engine does not stream (the capture proxy always sends stream=false)")
        if body.get("n", 1) != 1:
            raise HTTPError(400, "stand-in engine supports n=1 only")
        if self.weight_version >= self.policy.get("hold_from_weight_version", math.inf):
            with self.state_lock:
                self.held += 1
            while self.weight_version >= self.policy.get("hold_from_weight_version", math.inf):
                time.sleep(0.2)
            with self.state_lock:
                self.held -= 1
        with self.state_lock:
            index = self.n_requests
            self.n_requests += 1
        messages, tools = _vllm_messages(body.get("messages") or []), body.get("tools") or None
        if tools and not self.tool_parser and body.get("tool_choice", "auto") == "auto":
            raise HTTPError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
        prompt_text = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=body.get("add_generation_prompt", True), tokenize=False,
            **(body.get("chat_template_kwargs") or {}))
        prompt_ids = self.tokenizer.encode(prompt_text, add_special_tokens=False)

        caps = [c for c in (body.get("max_completion_tokens"), body.get("max_tokens")) if c is not None]
        room = self.max_model_len - len(prompt_ids)
        if caps and min(caps) > room:
            # vLLM refuses rather than clamps (seen on 0.26 on H200: every call of a rollout, when the Harbor server's
            # --max-output-tokens did not fit the context); the capture proxy reads this text as a budget stop.
            raise HTTPError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {min(caps)}. This model's "
                                 f"maximum context length is {self.max_model_len} tokens and your request has "
                                 f"{len(prompt_ids)} input tokens ({min(caps)} > {self.max_model_len} - "
                                 f"{len(prompt_ids)}).")
        # After the refusal: a refused call solves nothing. More than one reply: the candidates the model chooses from.
        decision, replies = self._script(messages, tools, index)
        full = [self.tokenizer.encode(reply, add_special_tokens=False) + [self.eos_id] for reply in replies]
        cap = min(caps + [room])
        candidates = [ids[:cap] for ids in full]

        temperature = body.get("temperature")
        greedy = temperature is None or temperature < GREEDY_EPS
        score_t = (1.0 if greedy or self.logprobs_mode.startswith("raw")
                   else float(temperature)) + self.policy.get("score_temperature_offset", 0.0)
        # vLLM fills logprobs.content only when top_logprobs is set (SamplingParams.logprobs = top_logprobs).
        want_logprobs = self.token_ids and body.get("logprobs") and body.get("top_logprobs") is not None
        self.running.wait()
        pick, chosen = 0, None
        with self.model_lock:
            version = self.weight_version
            scored = len(candidates) > 1 or want_logprobs
            logits = [self._logits(prompt_ids, ids) for ids in candidates] if scored else []
            if len(candidates) > 1:
                # The model decides, as vLLM's sampler would at the request's temperature, by the candidates' sequence
                # probabilities renormalised over them.
                t = 1.0 if greedy else float(temperature)
                sequence = torch.tensor([
                    float(torch.log_softmax(rows / t, dim=-1).gather(1, torch.tensor(ids)[:, None]).sum())
                    for rows, ids in zip(logits, candidates)])
                probs = torch.softmax(sequence, 0).tolist()
                pick = int(sequence.argmax()) if greedy else self.rng.choices(range(len(probs)), weights=probs)[0]
                chosen = {"task": decision[0], "answers": decision[1], "probs": probs, "pick": pick}
                decision = f"choice:{decision[0]}"
            completion_ids = candidates[pick]
            logprobs = (self._logprobs(logits[pick], completion_ids, score_t, body["top_logprobs"])
                        if want_logprobs else None)
        truncated = len(full[pick]) > cap
        text = self.tokenizer.decode(completion_ids, skip_special_tokens=True)

        content, tool_calls = _hermes(text, index) if tools else (text, [])
        finish = "length" if truncated else ("tool_calls" if tool_calls else "stop")
        choice = {"index": 0, "message": {"role": "assistant", "content": content, "tool_calls": tool_calls,
                                          "reasoning": None},
                  "logprobs": logprobs, "finish_reason": finish, "stop_reason": None}
        response = {"id": f"chatcmpl-{index:08x}", "object": "chat.completion", "created": int(time.time()),
                    "model": self.served_name, "choices": [choice],
                    "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion_ids),
                              "total_tokens": len(prompt_ids) + len(completion_ids), "prompt_tokens_details": None},
                    "prompt_logprobs": None}
        if self.token_ids and body.get("return_token_ids"):
            response["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = completion_ids
        with self.state_lock:
            self.requests.append({
                "index": index, "sampling": {k: body[k] for k in SAMPLING_KEYS if k in body},
                "score_temperature": score_t, "weight_version": version, "script": decision, "choice": chosen,
                "prompt_tokens": len(prompt_ids), "completion_tokens": len(completion_ids), "finish_reason": finish})
        return response

    def _script(self, messages, tools, index) -> tuple[str | tuple, list[str]]:
        """(decision, completion texts): one text, or for a task in `choices` the candidates the model chooses from
        (decision: (task, answers)). Only turn 0 decides, so one rollout never mixes solve and fail."""
        if not tools:
            return "reply", ["ok"]
        policy = self.policy
        user_text = "\n".join(m["content"] for m in messages if m.get("role") == "user"
                              and isinstance(m.get("content"), str))
        match = TASK_MARKER.search(user_text)
        task = match.group(1) if match else "unknown"
        if any(m.get("role") == "assistant" for m in messages):
            end = policy.get("agent_end", {}).get(task)
            if end == "die":
                raise EngineDead(500, "EngineCore encountered an issue. See stack trace (above) for the root cause.")
            # mini-swe-agent runs each command in a shell it spawns: $PPID is the agent itself.
            command = {"hang": "sleep 3600", "exit": "kill -9 $PPID"}.get(end, SUBMIT)
            return end or "submit", [_tool_call_text(command)]
        path = policy.get("answer_file", "/app/answer.txt")
        if task in policy.get("choices", {}):
            answers = policy["choices"][task]
            return (task, answers), [_tool_call_text(_write_command(answer, path)) for answer in answers]
        p_solve = policy.get("tasks", {}).get(task, policy.get("default", 0.5))
        with self.state_lock:
            n = self.rollouts_by_task.get(task, 0)
            self.rollouts_by_task[task] = n + 1
        solve = math.floor((n + 1) * p_solve) > math.floor(n * p_solve)
        answer = policy.get("answers", {}).get(task, task) if solve else policy.get("wrong_answer", "wrong")
        return f"{'solve' if solve else 'fail'}:{task}", [_tool_call_text(_write_command(answer, path))]

    def _logits(self, prompt_ids, completion_ids):
        """The model's logits at each completion position, in float32: vLLM's sampler works in float32 on logits the
        model computed in its serving dtype."""
        with torch.no_grad():
            return self.model(torch.tensor([prompt_ids + completion_ids])).logits[0, len(prompt_ids) - 1: -1].float()

    def _logprobs(self, logits, completion_ids, temperature, top_k) -> dict:
        logprobs = logits / temperature
        if self.logprobs_mode.endswith("logprobs"):
            logprobs = torch.log_softmax(logprobs, dim=-1)
        k = logprobs.shape[-1] if top_k == -1 else min(int(top_k), logprobs.shape[-1])
        top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
        content = []
        for pos, token_id in enumerate(completion_ids):
            # vLLM builds {sampled, rank 1..k} in that order and lists the first k entries, so a sampled token outside
            # the top k displaces the k-th; reproduced rather than "fixed", since clients see exactly this.
            ranked = {token_id: float(logprobs[pos, token_id])}
            if k:
                for value, tid in zip(top_values[pos].tolist(), top_ids[pos].tolist()):
                    ranked.setdefault(tid, value)
            top = [_lp_entry(tid, lp) for tid, lp in list(ranked.items())[:k]]
            content.append({**_lp_entry(token_id, ranked[token_id]), "top_logprobs": top})
        return {"content": content}

    # ---- control plane -------------------------------------------------------------------------------------------
    def load_weights(self, payload: bytes) -> dict:
        state_dict = load_safetensors(payload)
        expected = {name: tuple(t.shape) for name, t in self.model.state_dict().items()}
        received = {name: tuple(t.shape) for name, t in state_dict.items()}
        if received != expected:
            # Checked up front because load_state_dict(strict=True) copies the matching tensors before raising,
            # which would leave a half-updated model serving under the old version number.
            raise HTTPError(400, f"state dict mismatch: missing {sorted(expected.keys() - received.keys())}, "
                                 f"unexpected {sorted(received.keys() - expected.keys())}, shapes differ for "
                                 f"{sorted(n for n in expected.keys() & received.keys() if expected[n] != received[n])}")
        with self.model_lock:
            self.model.load_state_dict(state_dict, strict=True)
            self.weight_version += 1
            return {"weight_version": self.weight_version, "tensors": len(state_dict)}

    def set_policy(self, policy: dict) -> dict:
        self.policy = policy  # read once per request, so a swap never splits one request across two policies
        return {"status": "ok"}

    def control(self, name: str, query: str = "", body: bytes = b"") -> dict:
        with self.state_lock:
            self.control_calls[name] = self.control_calls.get(name, 0) + 1
            self.weight_sync.append(f"{name}?{query}" if query else name)
        if name == "pause":
            self.running.clear()
        elif name == "resume":
            self.running.set()
        elif (self.weight_transfer or {}).get("backend") == "ipc":
            try:
                getattr(self, f"ipc_{name}")(json.loads(body or b"{}"))
            except HTTPError:
                raise
            except Exception as exc:  # what vLLM's engine core answers for any worker-side failure
                if self.bare_errors:
                    raise BareServerError(500, "Internal Server Error") from exc
                raise HTTPError(500, f"Call to collective_rpc method failed: {exc}") from exc
        return {"status": "ok"}

    # ---- vLLM's ipc backend ----------------------------------------------------------------------------------------
    def ipc_init_weight_transfer_engine(self, body: dict) -> None:
        if body.get("init_info") is None:
            raise HTTPError(400, "Missing 'init_info' in request body")
        if body["init_info"]:  # 0.26's IPCWeightTransferInitInfo has no fields
            raise ValueError(f"Invalid init_info for IPCWeightTransferEngine: unexpected {sorted(body['init_info'])}")

    def ipc_start_weight_update(self, body: dict) -> None:
        if self.push is not None:
            raise RuntimeError("start_weight_update called while a weight update is already active. Call "
                               "finish_weight_update first.")
        self.push = {"chunks": []}

    def ipc_update_weights(self, body: dict) -> None:
        if body.get("update_info") is None:
            raise HTTPError(400, "Missing 'update_info' in request body")
        if self.push is None:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        if self.lazy_load:  # as vLLM's layerwise reload may: kept, and read once the update finishes
            self.push.setdefault("deferred", []).append(dict(body["update_info"]))
            return
        self._load_update(dict(body["update_info"]))

    def _load_update(self, update: dict) -> None:
        try:
            names, weights = self._parse_update_info(update)
            with self.model_lock:  # vLLM's load_weights: each parameter's loader copies (and casts) into it
                params = dict(self.model.named_parameters())
                for name, weight in zip(names, weights):
                    if params[name].shape != weight.shape:
                        raise ValueError(f"{name}: shape {list(weight.shape)} for a parameter of "
                                         f"{list(params[name].shape)}")
                    params[name].data.copy_(weight)
        except BaseException:
            self.push = None  # as vLLM's worker: a failed chunk ends the update
            raise

    def _parse_update_info(self, update: dict) -> tuple[list[str], list[torch.Tensor]]:
        """vLLM's IPCWeightTransferEngine.parse_update_info, then its receive_weights (unpacked: one handle each)."""
        if unknown := set(update) - IPC_UPDATE_FIELDS:
            raise ValueError(f"Invalid update_info for IPCWeightTransferEngine: unexpected keyword arguments "
                             f"{sorted(unknown)}")
        if missing := {"names", "dtype_names", "shapes"} - set(update):
            raise ValueError(f"Invalid update_info for IPCWeightTransferEngine: missing {sorted(missing)}")
        if update.get("ipc_handles_pickled") is not None:
            if update.get("ipc_handles") is not None:
                raise ValueError("Cannot specify both `ipc_handles` and `ipc_handles_pickled`")
            if not self.allow_pickle:
                raise ValueError("Refusing to deserialize `ipc_handles_pickled` without "
                                 "VLLM_ALLOW_INSECURE_SERIALIZATION=1")
            update["ipc_handles"] = pickle.loads(base64.b64decode(update.pop("ipc_handles_pickled")))
        handles, names = update.get("ipc_handles"), update["names"]
        if handles is None:
            raise ValueError("Either `ipc_handles` or `ipc_handles_pickled` must be provided")
        for key in ("dtype_names", "shapes"):
            if len(update[key]) != len(names):
                raise ValueError(f"`{key}` should be of the same size as `names`: got {len(update[key])} and "
                                 f"{len(names)}")
        if not isinstance(handles, list):  # a packed buffer: never announced at init here
            raise ValueError("packed ipc_handles without packed=True at init")
        if len(handles) != len(names):
            raise ValueError(f"`ipc_handles` should be of the same size as `names`: got {len(handles)} and "
                             f"{len(names)}")
        weights = []
        for handle in handles:
            if self.gpu_uuid not in handle:
                raise ValueError(f"IPC handle not found for GPU UUID {self.gpu_uuid}. Available UUIDs: "
                                 f"{list(handle.keys())}")
            args = list(handle[self.gpu_uuid])
            args[6] = 0  # the receiver's device index, as vLLM overwrites it
            weights.append(rebuild_shared_tensor(*args))
        self.push["chunks"].append({
            "names": names, "dtype_names": update["dtype_names"], "shapes": update["shapes"],
            "received": [[str(w.dtype).removeprefix("torch."), list(w.shape)] for w in weights],
            "bytes": sum(w.nbytes for w in weights)})
        return names, weights

    def ipc_finish_weight_update(self, body: dict) -> None:
        if self.push is None:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        for update in self.push.pop("deferred", []):
            self._load_update(update)
        with self.model_lock:
            self.weight_version += 1
        with self.state_lock:
            self.pushes.append({**self.push, "weight_version": self.weight_version})
        self.push = None

    def weights(self) -> bytes:
        with self.model_lock:
            return save_safetensors({k: v.detach().clone() for k, v in self.model.state_dict().items()})

    def stats(self) -> dict:
        with self.state_lock:
            return {"requests": self.n_requests, "held": self.held, "weight_version": self.weight_version,
                    "paused": not self.running.is_set(), "control_calls": dict(self.control_calls),
                    "weight_sync": list(self.weight_sync), "pushes": list(self.pushes), "chat": list(self.requests)}

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.served_name, "object": "model", "created": 0, "owned_by": "vllm", "root": self.model_dir,
            "parent": None, "max_model_len": self.max_model_len}]}

    def server_info(self, query: str = "") -> dict:
        # vLLM 0.29's /server_info: `PydanticVllmConfig.dump_python(vllm_config, mode="json", fallback=str)` for
        # config_format=json (a torch.dtype becomes "torch.bfloat16"), else `str(vllm_config)`; plus its VLLM_*
        # settings and the collected system info.
        config = {"model_config": {
            "model": self.model_dir, "served_model_name": self.served_name, "dtype": str(self.dtype),
            "max_model_len": self.max_model_len, "logprobs_mode": self.logprobs_mode},
            "weight_transfer_config": self.weight_transfer,
            "lora_config": {"max_lora_rank": 16, "max_loras": 1, "max_cpu_loras": None, "lora_dtype": "auto",
                            "fully_sharded_loras": False} if self.enable_lora else None}
        json_format = "config_format=json" in query
        return {"vllm_config": config if json_format else repr(config),
                "vllm_env": {"VLLM_SERVER_DEV_MODE": True, "VLLM_ALLOW_INSECURE_SERIALIZATION": self.allow_pickle},
                "system_env": {"torch_version": torch.__version__}}


def rebuild_shared_tensor(tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, storage_bytes,
                          storage_offset_bytes, requires_grad, *_ref_counter_and_event):
    """torch's rebuild_cuda_tensor, argument for argument, for the rig's CPU stand-in of a CUDA-IPC handle: the path
    of a file holding the producer's storage, removed once the producer freed it."""
    try:
        with open(handle.decode(), "rb") as f:
            data = bytearray(f.read())[storage_offset_bytes: storage_offset_bytes + storage_bytes]
    except FileNotFoundError:
        raise ValueError("a tensor's IPC handle names memory the trainer has already freed") from None
    storage = torch.UntypedStorage.from_buffer(data, dtype=torch.uint8) if data else torch.UntypedStorage(0)
    tensor = torch._utils._rebuild_tensor(torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype,
                                                                     _internal=True), offset, size, stride)
    tensor.requires_grad = requires_grad
    return tensor


def resolve_dtype(flag: str, config_dtype) -> torch.dtype:
    """vLLM's `--dtype` (`_resolve_auto_dtype` on a bfloat16-capable GPU): auto keeps a half-precision checkpoint's
    dtype and serves a float32 one in bfloat16."""
    if flag != "auto":
        return getattr(torch, flag)
    config_dtype = getattr(torch, str(config_dtype).removeprefix("torch."), None) or torch.float32
    return torch.bfloat16 if config_dtype == torch.float32 else config_dtype


def _vllm_messages(messages: list) -> list:
    """The request messages as vLLM hands them to the chat template.

    vLLM parses tool-call `arguments` strings into dicts before rendering, so the template re-serialises them with
    `tojson`; text-part lists are joined with newlines (the "string" content format).
    """
    out = []
    for message in messages:
        message = dict(message)
        if isinstance(message.get("content"), list):
            message["content"] = "\n".join(p.get("text", "") for p in message["content"] if isinstance(p, dict))
        if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call.get("function") or {})
                args = function.get("arguments")
                function["arguments"] = (json.loads(args) if isinstance(args, str) and args else args or {})
                calls.append({**call, "function": function})
            message["tool_calls"] = calls
        out.append(message)
    return out


def _write_command(answer: str, path: str) -> str:
    return (f"mkdir -p {shlex.quote(str(PurePosixPath(path).parent))} && "
            f"printf '%s\\n' {shlex.quote(answer)} > {shlex.quote(path)}")


def _tool_call_text(command: str) -> str:
    # Exactly what the Qwen3 template renders for a content-less assistant turn with this call: a reply with text
    # before `<tool_call>` would come back from the hermes parser as "text\n" and re-render as "text\n\n<tool_call>",
    # breaking the token-prefix extension between turns.
    arguments = json.dumps({"command": command}, ensure_ascii=False)
    return f'<tool_call>\n{{"name": "bash", "arguments": {arguments}}}\n</tool_call>'


def _hermes(text: str, index: int) -> tuple[str | None, list]:
    """vLLM's hermes tool parser, non-streaming: content before the first `<tool_call>`, or all text on failure."""
    if "<tool_call>" not in text:
        return text, []
    try:
        calls = [json.loads(a or b) for a, b in
                 re.findall(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", text, flags=re.DOTALL)]
        tool_calls = [{"id": f"chatcmpl-tool-{index:08x}-{i}", "type": "function",
                       "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                      for i, c in enumerate(calls)]
    except (ValueError, KeyError, TypeError):
        return text, []
    return text[: text.index("<tool_call>")] or None, tool_calls


def _lp_entry(token_id: int, logprob: float) -> dict:
    token = f"token_id:{token_id}"  # --return-tokens-as-token-ids; vLLM takes `bytes` from this same string
    return {"token": token, "logprob": max(logprob, -9999.0) if math.isfinite(logprob) else -9999.0,
            "bytes": list(token.encode())}


def _handler(engine: Engine, dev_mode: bool):
    controls = {"/pause", "/resume", "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                "/finish_weight_update"}
    dev_routes = controls | {"/server_info", "/get_world_size", "/stand_in/load_weights"}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            path = urlsplit(self.path).path
            if path in dev_routes and not dev_mode:
                return self._answer(None)
            query = urlsplit(self.path).query
            routes = {"/health": lambda: {}, "/v1/models": engine.models,
                      "/server_info": lambda: engine.server_info(query),
                      "/get_world_size": lambda: {"world_size": 1}, "/version": lambda: {"version": "0.29.0"},
                      "/stand_in/stats": engine.stats, "/stand_in/weights": engine.weights}
            self._answer(routes.get(path))

        def do_POST(self):
            path = urlsplit(self.path).path
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if path in dev_routes and not dev_mode:
                self._answer(None)
            elif path == "/v1/chat/completions":
                self._answer(lambda: engine.chat(json.loads(body or b"{}")))
            elif path == "/stand_in/load_weights":
                self._answer(lambda: engine.load_weights(body))
            elif path == "/stand_in/policy":
                self._answer(lambda: engine.set_policy(json.loads(body)))
            elif path in controls:
                self._answer(lambda: engine.control(path.strip("/"), urlsplit(self.path).query, body))
            else:
                self._answer(None)

        def _answer(self, produce):
            failure = None
            try:
                if produce is None:
                    raise HTTPError(404, f"no route {self.command} {self.path}")
                status, payload = 200, produce()
            except BareServerError as exc:
                status, payload = exc.status, str(exc).encode()
            except HTTPError as exc:
                failure, status, payload = exc, exc.status, _error(exc.status, str(exc))
            except Exception as exc:  # noqa: BLE001 - a bad request must not kill the engine under test
                status, payload = 400, _error(400, f"{type(exc).__name__}: {exc}")
            raw = isinstance(payload, bytes)
            data = payload if raw else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream" if raw else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            if isinstance(failure, EngineDead):
                self.wfile.flush()
                os._exit(1)

        def log_message(self, *args):  # per-request lines would drown test output; /stand_in/stats has the record
            pass

    return Handler


def _error(status: int, message: str) -> dict:
    kind = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}.get(status, "Error")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--served-name", required=True)
    parser.add_argument("--policy", help="policy JSON file (schema in this module's docstring)")
    parser.add_argument("--no-token-ids", action="store_true")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--logprobs-mode", default="processed_logprobs",
                        choices=["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument("--no-tool-parser", action="store_true")
    parser.add_argument("--no-dev-mode", action="store_true")
    parser.add_argument("--no-weight-transfer", action="store_true")
    parser.add_argument("--weight-transfer-config", default='{"backend":"nccl"}', help="as vLLM's: a JSON object")
    parser.add_argument("--gpu-uuid", default=RIG_GPU_UUID, help="the GPU the engine stands on (the trainer's: "
                                                                  "tests/rig/cpu_trainer.py's RIG_GPU_UUID)")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--bare-errors", action="store_true", help="answer a failed weight-sync call as vLLM 0.26 "
                        "does: a 500 with no message (the cause only in the server's log)")
    parser.add_argument("--lazy-load", action="store_true", help="ipc: read what each /update_weights hands over only "
                        "at /finish_weight_update, as vLLM's layerwise reload may for a layer not yet complete")
    args = parser.parse_args(argv)
    policy = json.load(open(args.policy)) if args.policy else {}
    torch.set_num_threads(1)  # the trainer shares this CPU; a tiny model gains nothing from more threads
    engine = Engine(args.model_dir, args.served_name, policy, not args.no_token_ids,
                    args.max_model_len, args.logprobs_mode, not args.no_tool_parser,
                    None if args.no_weight_transfer else json.loads(args.weight_transfer_config), args.dtype,
                    args.enable_lora, args.gpu_uuid, args.bare_errors, args.lazy_load)
    server = ThreadingHTTPServer((args.host, args.port), _handler(engine, not args.no_dev_mode))
    print(f"stand-in engine serving {args.served_name} on http://{args.host}:{server.server_port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
