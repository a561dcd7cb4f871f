"""A tiny random Qwen3 causal LM and a locally trained tokenizer, built without the hub.

    python tests/rig/tiny_model.py OUT_DIR [--interchangeable cat,dog,fox,tag]
                                               # no-op when OUT_DIR already holds this exact build

--interchangeable W1,W2,...: the tokens " W1", " W2", ... get one input embedding and one output row, so the model
cannot tell them apart until training does: any completions that differ only in which of them they hold have
exactly equal probabilities under the initial weights, whatever the prompt. The learning test's choice starts at
chance that way: mini-swe-agent's system prompt carries the machine's `uname`, which moves a random model's sequence
logprobs by nats from one machine to the next, so no fixed set of ordinary tokens starts near equal everywhere.

The chat template is TRL's own `qwen3_instruct_2507` string, byte for byte: TRL recognises templates by string
equality (`add_response_schema`, `get_training_chat_template`), so a look-alike would be rejected. The no-think
variant is used because it renders a past assistant turn exactly as the model emitted it, which is what lets the
stand-in engine's turn k+1 prompt ids extend turn k's prompt + completion ids.

Token roles follow Qwen3: `<|im_start|>`, `<|im_end|>` (eos) and `<|endoftext|>` (pad) are special;
`<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>`, `<think>`, `</think>` are added but NOT special,
because vLLM detokenises with `skip_special_tokens=True` and the hermes tool parser must still see `<tool_call>`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
EOS, PAD = "<|im_end|>", "<|endoftext|>"
BPE_VOCAB = 1024
SEED = 0
LOGIT_SCALE = 5.0
WARM_STEPS, WARM_LR = 150, 1e-2  # --warm: enough for the action's format to be near-certain (_warm_up prints it)
# Hashed into the stamp, so editing this file invalidates old builds instead of silently reusing them.
RECIPE = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
STAMP = "rig_build.json"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# What the rig's conversations are made of: mini-swe-agent prompts, shell, JSON tool calls, the template's
# scaffolding. Merges learnt here keep the sequences short; anything else still encodes, byte by byte.
CORPUS = r"""
You are a helpful assistant that can interact with a computer.
Please solve this issue: write the answer to /app/answer.txt and then submit.
You can execute bash commands and edit files to implement the necessary changes.
Each response should include reasoning text and at least one bash tool call with your command.
Submit your changes and finish your work by issuing the following command: `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`.
Do not combine it with any other command. After this command, you cannot continue working on this task.
Directory or environment variable changes are not persistent. Every action is executed in a new subshell.
However, you can prefix any action with `MY_ENV_VAR=MY_VALUE cd /path/to/working/dir && ...` or write/load
environment variables from files.
## Recommended Workflow
This workflow should be done step-by-step so that you can iterate on your changes and any possible problems.
1. Analyze the codebase by finding and reading relevant files
2. Create a script to reproduce the issue
3. Edit the source code to resolve the issue
4. Verify your fix works by running your script again
5. Test edge cases to ensure your fix is robust
## Command Execution Rules
You are operating in an environment where you issue at least one command, the system executes the command(s)
in a subshell, you see the result(s), and you write your next command(s).
**CRITICAL REQUIREMENTS:** Your response SHOULD include reasoning text explaining what you're doing.
Your response MUST include AT LEAST ONE bash tool call.
Example of a CORRECT response: [Makes bash tool call with {"command": "ls -la"} as arguments]
<system_information> Linux 6.8.0 x86_64 </system_information>
## Useful command examples
### Create a new file:
### Edit files with sed:
# Replace all occurrences
# Replace only first occurrence on line 1
# Replace all occurrences in lines 1-10
sed -i '1s/old_string/new_string/' filename.py; sed -i '1,10s/old_string/new_string/g' filename.py
### View file content:
# View specific lines with numbers
### Any other command you want to run
anything
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "bash", "description": "Execute a bash command", "parameters": {"type": "object", "properties": {"command": {"type": "string", "description": "The bash command to execute"}}, "required": ["command"]}}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": "bash", "arguments": {"command": "ls -la /app"}}
</tool_call>
<tool_call>
{"name": "bash", "arguments": {"command": "mkdir -p /app && printf '%s\n' hello > /app/answer.txt"}}
</tool_call>
<tool_call>
{"name": "bash", "arguments": {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}}
</tool_call>
<tool_response>
{
  "returncode": 0,
  "output": "hello\n"
}
</tool_response>
{"returncode": 1, "output": "cat: /app/answer.txt: No such file or directory\n"}
cat /app/answer.txt; ls -la /app; cd /app && git status && git diff
grep -rn "def main" src/ | head -20; sed -i 's/old_string/new_string/g' main.py
python3 -c "print('hello world')"; echo $HOME; export PATH="$HOME/.local/bin:$PATH"
nl -ba filename.py | sed -n '10,20p'; cat <<'EOF' > newfile.py
import numpy as np
hello = "world"
print(hello)
EOF
The quick brown fox jumps over the lazy dog. The answer is correct, the task is done, the test passed.
I need to understand the structure of the repository first. Let me check what files are in the directory.
Reply with the single word: ok
Use the bash tool to list the files in /tmp.
rig-task: echo-hello rig-task: coin rig-task: never
0 1 2 3 4 5 6 7 8 9 10 42 100 true false null [] {} "" ''
"""


def _train_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS] * 4, trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tokenizer


def _chat_template() -> str:
    from trl.chat_template_utils import qwen3_instruct_2507_chat_template

    return qwen3_instruct_2507_chat_template


def is_built(out_dir, interchangeable: tuple[str, ...] = (), warm: bool = False) -> bool:
    out = Path(out_dir)
    try:
        stamp = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return (stamp.get("recipe") == RECIPE and stamp.get("interchangeable", []) == list(interchangeable)
            and stamp.get("warm", False) == warm and all((out / name).is_file() for name in FILES))


def build(out_dir, interchangeable: tuple[str, ...] = (), warm: bool = False) -> Path:
    """Build into `out_dir` unless it already holds this recipe's build; returns the directory.

    Several processes may ask for one directory at once (the suite's xdist workers share AGH_CACHE_DIR, and so do
    checkouts on one machine): builders take turns on a lock beside it, and each build is written to a private
    directory and renamed into place, so a reader sees either no build or a whole one, never files being written."""
    out = Path(out_dir)
    if is_built(out, interchangeable, warm):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built(out, interchangeable, warm):  # built by the holder we waited for
            return out
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        staging.chmod(0o755)  # as a plain mkdir would make it, not mkdtemp's private 0700
        try:
            _write(staging, interchangeable, warm)
            if out.exists():  # a build of another recipe, or one left unfinished by a crash
                shutil.rmtree(out)
            staging.rename(out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return out


def _write(out: Path, interchangeable: tuple[str, ...], warm: bool = False) -> None:
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(),
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
        chat_template=_chat_template(),
    )
    eos_id, pad_id = tokenizer.convert_tokens_to_ids([EOS, PAD])

    torch.manual_seed(SEED)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=32768,
        # At the default 0.02 every logit is ~0 and the next-token distribution is flat, hence the same at every
        # temperature: a test that an engine scoring at the wrong temperature shifts the importance ratio would
        # see nothing. 0.2 spreads the logits (logprobs span a few nats) while keeping them finite and trainable.
        initializer_range=0.2,
        # Untied: TRL streams `named_parameters()`, which drops a tied lm_head, and the engine loads strictly.
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        # Peaked next-token distributions (top-two gaps of a nat or more), as a trained model has: OpenEnv's probe
        # tells processed from raw logprobs by how that gap scales with temperature, and reads a flat model as
        # "unknown".
        model.lm_head.weight.mul_(LOGIT_SCALE)
        ids = []
        for word in interchangeable:
            encoded = tokenizer.encode(f" {word}", add_special_tokens=False)
            if len(encoded) != 1:
                raise SystemExit(f"error: ' {word}' is {len(encoded)} tokens in this vocabulary; pick single tokens")
            ids += encoded
        for weight in (model.model.embed_tokens.weight, model.lm_head.weight) if ids else ():
            weight[ids] = weight[ids[0]].clone()
    if warm:
        _warm_up(model, tokenizer, interchangeable, ids)
    # No sampling defaults: vLLM would adopt them as the server's default temperature/top_p/top_k.
    model.generation_config = GenerationConfig(eos_token_id=[eos_id], pad_token_id=pad_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / STAMP).write_text(json.dumps({"recipe": RECIPE, "vocab_size": len(tokenizer),
                                         "interchangeable": list(interchangeable), "warm": warm}))


def _warm_up(model, tokenizer, answers: tuple[str, ...], answer_ids: list[int]) -> None:
    """A supervised pass to the rig engine's scripted action (tests/rig/engine.py): turn 0 writes each answer to
    /app/answer.txt, turn 1 submits, each after a mini-swe-agent-like conversation, the loss on the action's tokens
    only. Unwarmed, those tokens are ones a random model almost never writes: their logprobs, which the engine reports
    as the model's own, are tiny, so the first updates move them by orders of magnitude and every later sample is far
    off-policy (importance ratios of 1e3-1e8). Warmed, the format is near-certain and only the answer is the model's
    choice. The answers' rows are averaged at the end, so the model still cannot tell them apart."""
    import random

    import torch
    from engine import SUBMIT, _tool_call_text, _write_command

    bash = {"type": "function", "function": {
        "name": "bash", "description": "Execute a bash command", "parameters": {"type": "object", "properties": {
            "command": {"type": "string", "description": "The bash command to execute"}}, "required": ["command"]}}}
    lines = [line for line in CORPUS.splitlines() if line.strip()]
    instruction = (f"Task choose: exactly one of the words {', '.join(answers[:-1])} and {answers[-1]} is right. "
                   "Write the right one to the file /app/answer.txt.\n\nrig-task: choose")
    rng = random.Random(SEED)

    def conversation() -> list[dict]:  # mini-swe-agent's shape; its wording and the machine's uname vary
        body = rng.sample(lines, rng.randint(len(lines) // 2, len(lines)))
        uname = f"Linux {rng.randint(4, 7)}.{rng.randint(0, 20)}.{rng.randint(0, 99)} x86_64"
        return [{"role": "system", "content": "You are a helpful assistant that can interact with a computer."},
                {"role": "user", "content": f"Please solve this issue: {instruction}\n\n" + "\n".join(body)
                 + f"\n<system_information>\n{uname}\n</system_information>"}]

    def sequence(messages: list[dict], action: str) -> tuple[list[int], int]:
        prompt = tokenizer.apply_chat_template(messages, tools=[bash], add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        return ids + tokenizer.encode(action, add_special_tokens=False) + [tokenizer.eos_token_id], len(ids)

    def batch() -> list[tuple[list[int], int]]:
        messages, write = conversation(), _write_command(rng.choice(answers), "/app/answer.txt")
        turn = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "bash", "arguments": {"command": write}}}]}
        result = {"role": "tool", "content": '{\n  "returncode": 0,\n  "output": ""\n}'}
        return [sequence(messages, _tool_call_text(write)),
                sequence([*messages, turn, result], _tool_call_text(SUBMIT))]

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARM_LR, weight_decay=0.0)
    for _ in range(WARM_STEPS):
        rows = batch()
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        labels = torch.full((len(rows), width), -100)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (seq, start) in enumerate(rows):
            ids[i, :len(seq)], labels[i, start:len(seq)], mask[i, :len(seq)] = (
                torch.tensor(seq), torch.tensor(seq[start:]), 1)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():  # the answers' rows, trained alike, equal again to the last bit
        for weight in (model.model.embed_tokens.weight, model.lm_head.weight):
            weight[answer_ids] = weight[answer_ids].mean(0)
        worst = 0.0
        for seq, start in batch():
            logp = model(torch.tensor([seq])).logits[0].log_softmax(-1)
            token = logp[start - 1:len(seq) - 1].gather(1, torch.tensor(seq[start:])[:, None])[:, 0]
            worst = min(worst, float(token[[i for i, t in enumerate(seq[start:]) if t not in answer_ids]].sum()))
    print(f"warm-up: {WARM_STEPS} steps; the action's format tokens, on a held-out conversation: logprob sum >= "
          f"{worst:.3f}", file=sys.stderr)


if __name__ == "__main__":
    argv = sys.argv[1:]
    warm = "--warm" in argv
    argv = [a for a in argv if a != "--warm"]
    if len(argv) not in (1, 3) or len(argv) == 3 and argv[1] != "--interchangeable" or warm and len(argv) != 3:
        sys.exit("usage: python tests/rig/tiny_model.py OUT_DIR [--interchangeable W1,W2,... [--warm]]")
    print(build(argv[0], tuple(argv[2].split(",")) if len(argv) == 3 else (), warm))
