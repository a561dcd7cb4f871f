"""Runs the training script's own `main()` with TRL's loss also logging the range of the importance ratio.

TRL 1.16's `AsyncGRPOTrainer.compute_loss` logs the per-token importance ratio's mean (`ratio`), the share of tokens
clipped (`clip_ratio/region_mean`, `clip_ratio/low_mean`, `clip_ratio/high_mean`) and a KL estimate (`kl`), and
transformers logs `grad_norm`; none of them shows the ratio's extremes, and one update that flips a policy gives
ratios in the thousands that the mean and the clipping hide. This logs `bench/ratio_max` and `bench/ratio_min` per
optimizer step (TRL reduces a key with a `max` / `min` word as an extremum over the step's micro-batches), computed
from the tensors `compute_loss` itself reads: the model's log-probabilities of the trained tokens (its forward
output's `log_probs`, picked by `token_index`) against the engine's (`old_log_probs`). Nothing else changes.

    python bench/ratio_main.py <the script's arguments>

The rollout child re-imports this file as `__mp_main__` (spawn) and never computes a loss.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import async_grpo_harbor as script  # noqa: E402
import torch  # noqa: E402

_compute_loss = script.AsyncGRPOTrainer.compute_loss


def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    outputs = []
    hook = model.register_forward_hook(lambda _module, _args, output: outputs.append(output))
    try:
        loss = _compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
    finally:
        hook.remove()
    with torch.no_grad():
        selected = inputs["token_index"] >= 0
        log_probs = outputs[-1].log_probs.flatten()[inputs["token_index"][selected]].float()
        ratio = torch.exp(log_probs - inputs["old_log_probs"][selected].float())
        self._metrics["train"]["bench/ratio_max"].append(ratio.max().item())
        self._metrics["train"]["bench/ratio_min"].append(ratio.min().item())
    return loss


script.AsyncGRPOTrainer.compute_loss = compute_loss

if __name__ == "__main__":
    sys.exit(script.main(sys.argv[1:]))
