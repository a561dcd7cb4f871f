"""Capacity estimates for the GPUs this project cannot reach: every figure is a formula over labelled inputs.

    python bench/capacity.py [--tokens-per-turn 1000] [--trainer-tok-s-4b ...]

Prints the estimates of docs/capacity.md. Nothing here is measured except what the flags say was measured
on the CPU rig (bench/perf.py); change an input and every row follows.
"""

from __future__ import annotations

import argparse

GIB = 2**30
# From each model's config.json (hidden, layers, MLP width, KV heads x head dim) and its parameter count.
MODELS = {
    "Qwen3-4B": dict(d=2560, layers=36, ffn=9728, kv=8 * 128, params=4.02e9),
    "Qwen3-8B": dict(d=4096, layers=36, ffn=12288, kv=8 * 128, params=8.19e9),
}


def forwarded_tokens(steps: int, prompt: int, per_turn: int) -> int:
    """Tokens the proxy forwards to vLLM in one rollout: turn t re-sends the prompt and the t-1 earlier turns."""
    return steps * prompt + per_turn * steps * (steps - 1) // 2


def row_tokens(steps: int, prompt: int, per_turn: int) -> int:
    """The rollout's packed row: one conversation (TRL counts a prefix shared by forked sequences once)."""
    return prompt + steps * per_turn


def activation_bytes(tokens: int, m: dict) -> float:
    """bf16, gradient checkpointing, flash/SDPA attention (no tokens^2 term), chunked LM head (no full logits):
    each layer's saved input, plus one layer's recomputed activations and their gradients during backward."""
    checkpoints = m["layers"] * m["d"] * 2
    one_layer = 2 * (6 * m["d"] + 2 * m["kv"] + 4 * m["ffn"])
    return tokens * (checkpoints + 2 * one_layer)


def static_bytes(m: dict, overhead_gib: float) -> float:
    """AdamW full fine-tune: 16 bytes/parameter (fp32 weights or master copy, gradients, two moments)."""
    return 16 * m["params"] + overhead_gib * GIB


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=1500,
                   help="system prompt + task instruction (estimate: the rig's mini-swe-agent prompt is ~1.2k)")
    p.add_argument("--tokens-per-turn", type=int, nargs="+", default=[500, 1000, 2000],
                   help="assistant reply + tool observation appended per turn (estimates)")
    p.add_argument("--steps", type=int, nargs="+", default=[10, 20, 30, 40, 58])
    p.add_argument("--max-model-len", type=int, default=32768, help="vLLM context = TRL token budget (docs/capacity.md)")
    p.add_argument("--card-gib", type=float, default=80.0)
    p.add_argument("--overhead-gib", type=float, default=3.0, help="CUDA context, allocator slack, NCCL (estimate)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="H100 SXM dense bf16")
    p.add_argument("--mfu", type=float, default=0.4, help="assumption: no TRL-published AsyncGRPO tokens/s found")
    p.add_argument("--setup-s", type=float, default=4.6,
                   help="a 2-turn rig rollout with an instant engine: sandbox, harness start-up, verifier (measured)")
    p.add_argument("--turn-overhead-s", type=float, default=1.0,
                   help="tool execution + proxy per turn in a cloud sandbox, engine excluded (estimate)")
    p.add_argument("--reply-tokens", type=int, default=250, help="generated tokens per turn (estimate)")
    p.add_argument("--decode-tok-s", type=float, default=50.0, help="per-sequence decode speed under load (estimate)")
    p.add_argument("--default-steps", type=int, default=30)
    p.add_argument("--typical-per-turn", type=int, default=1000)
    a = p.parse_args()

    print("### Forwarded tokens per rollout and the packed row (estimates)\n")
    print("F(T) = T*P + k*T*(T-1)/2 tokens forwarded to vLLM; row(T) = P + T*k; "
          f"P = {a.prompt_tokens} prompt tokens, k = tokens per turn, T = step limit\n")
    print("| T | " + " | ".join(f"F, k={k}" for k in a.tokens_per_turn) + " | "
          + " | ".join(f"row, k={k}" for k in a.tokens_per_turn) + " |")
    print("|---" * (1 + 2 * len(a.tokens_per_turn)) + "|")
    for t in a.steps:
        f = [forwarded_tokens(t, a.prompt_tokens, k) for k in a.tokens_per_turn]
        r = [row_tokens(t, a.prompt_tokens, k) for k in a.tokens_per_turn]
        print(f"| {t} | " + " | ".join(f"{x:,}" for x in f) + " | "
              + " | ".join(f"{x:,}{' > ctx' if x > a.max_model_len else ''}" for x in r) + " |")
    longest = (a.max_model_len - a.prompt_tokens) // a.typical_per_turn
    print(f"\nLongest step limit whose row fits --max-model-len {a.max_model_len:,} at k = {a.typical_per_turn}: "
          f"floor(({a.max_model_len} - {a.prompt_tokens}) / {a.typical_per_turn}) = {longest}")

    print("\n### Activation memory of the longest row, bf16 + gradient checkpointing, vs an 80 GiB card "
          "(estimates)\n")
    print("act(L) = L * (layers*d*2 + 2*2*(6d + 2kv + 4ffn)) bytes; static = 16 B/param + "
          f"{a.overhead_gib:g} GiB\n")
    print("| model | static GiB | act GiB/1k tokens | act GiB at row(T=" f"{a.default_steps}, k={a.typical_per_turn})"
          f" | act GiB at {a.max_model_len:,} | act GiB at row(58, k={a.typical_per_turn}) | longest row that fits |")
    print("|---|---|---|---|---|---|---|")
    for name, m in MODELS.items():
        static = static_bytes(m, a.overhead_gib)
        per_tok = activation_bytes(1, m)
        fit = int((a.card_gib * GIB - static) / per_tok) if static < a.card_gib * GIB else 0
        cells = [activation_bytes(row_tokens(a.default_steps, a.prompt_tokens, a.typical_per_turn), m),
                 activation_bytes(a.max_model_len, m), activation_bytes(row_tokens(58, a.prompt_tokens,
                                                                                   a.typical_per_turn), m)]
        print(f"| {name} | {static / GIB:.1f} | {per_tok * 1000 / GIB:.2f} | "
              + " | ".join(f"{c / GIB:.1f}" for c in cells)
              + f" | {f'{fit:,} tokens' if fit else 'none: static memory alone exceeds the card (shard it)'} |")

    print("\n### Rollouts in flight to keep one trainer GPU busy (estimates)\n")
    wall = a.setup_s + a.default_steps * (a.turn_overhead_s + a.reply_tokens / a.decode_tok_s)
    row = row_tokens(a.default_steps, a.prompt_tokens, a.typical_per_turn)
    print(f"trainer tok/s R = MFU * peak / (8 * params) (6N forward+backward + 2N recompute), MFU {a.mfu}, peak "
          f"{a.peak_tflops:g} TFLOP/s; rollout wall W = setup {a.setup_s} s + T * (turn overhead "
          f"{a.turn_overhead_s} s + {a.reply_tokens} reply tokens / {a.decode_tok_s:g} tok/s) = {wall:.0f} s at "
          f"T = {a.default_steps}; in flight = R * W / row ({row:,} tokens)\n")
    print("| model | R (tok/s) | W (s) | row tokens | rollouts in flight |")
    print("|---|---|---|---|---|")
    for name, m in MODELS.items():
        rate = a.mfu * a.peak_tflops * 1e12 / (8 * m["params"])
        print(f"| {name} | {rate:,.0f} | {wall:.0f} | {row:,} | {rate * wall / row:.0f} |")


if __name__ == "__main__":
    main()
