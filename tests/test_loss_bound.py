"""A far-off-policy sample cannot dominate an update: the script's trainer, through TRL's own loss (its collator, its
packed forward, its `compute_loss` and transformers' `training_step`), on the rig's tiny model in this process.

A rollout the engine sampled long ago (stale), or one whose tokens the engine's logprobs put far below where the
trainer now has them, reaches the loss with an importance ratio r = p_trainer / p_engine far above 1. TRL 1.16's
AsyncGRPO loss clips r on one side only, where it helps the advantage's sign: with a negative advantage, r x |A| is
in the loss unbounded, and its gradient grows with r (measured on the CPU rig: r 1.9e8, grad norm 6e9). The script's
dual clip (--delta, default 3) caps r there: such a token adds delta x |A| to the loss and no gradient.

The test scores one negative-advantage sample twice: on-policy (the engine's logprobs are the trainer's own, r = 1)
and stale (the engine's logprobs STALE nats below them, r = e^STALE ~ 2e4). On-policy it moves the weights as GRPO
does; stale, it must move them no more than on-policy, and its loss stay within delta x |A|. Without the bound the
stale update is e^STALE times the on-policy one. The step's log carries the ratio's range and the share of tokens
beyond the bound, before it.
"""

from __future__ import annotations

import math
import os
import queue
import sys

import pytest
import torch
from conftest import RIG, trainer_without_rollouts

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # as the script does: it imports trl.experimental
sys.path.insert(0, str(RIG))
import cpu_trainer  # noqa: E402

cpu_trainer.install()  # TRL's packed forward on SDPA: this process runs TRL's loss itself

from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout  # noqa: E402
from trl.experimental.async_grpo.packing import TreeRow  # noqa: E402

STALE = 10.0  # nats the engine's logprobs lag the trainer's: r = e^10 ~ 2.2e4
ADVANTAGE = -1.0


class IdleWorker:
    """Stands in for TRL's rollout worker, which this test never starts: it scores a batch built here."""

    def __init__(self):
        self._loop_kwargs, self.rollout_buffer = {}, queue.Queue()


@pytest.fixture(scope="module")
def trainer(tiny_model, tmp_path_factory):
    return trainer_without_rollouts(tiny_model, tmp_path_factory.mktemp("bound"), IdleWorker())


def batch(trainer, old_log_probs: list[float]) -> dict:
    """One rollout (a prompt and a completion) as TRL's collator packs it for the loss."""
    tokenizer = trainer.processing_class
    prompt = tokenizer.encode("Please solve this issue: write the answer to /app/answer.txt and then submit.")
    completion = tokenizer.encode('<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la /app"}}\n'
                                  "</tool_call>") + [tokenizer.eos_token_id]
    ids = prompt + completion
    old = [0.0] * len(prompt) + old_log_probs if old_log_probs else [0.0] * len(ids)
    row = TreeRow()
    row.add({"input_ids": torch.tensor(ids), "completion_mask": torch.tensor([0] * len(prompt) + [1] * len(completion)),
             "old_log_probs": torch.tensor(old), "advantage": ADVANTAGE, "group_id": 0, "metrics": {}})
    return DataCollatorForRollout(tokenizer.pad_token_id, 1).torch_call([[row]])


def trainer_log_probs(trainer) -> list[float]:
    """The trainer's own logprobs of the completion's tokens, as its forward computes them in the loss."""
    inputs = batch(trainer, [])
    seen = []
    hook = trainer.model.register_forward_hook(lambda _m, _a, out: seen.append(out.log_probs.detach().flatten()))
    with torch.no_grad():
        trainer.compute_loss(trainer.model, inputs)
    hook.remove()
    return seen[0][inputs["token_index"][inputs["token_index"] >= 0]].tolist()


def update(trainer, old_log_probs: list[float]) -> tuple[float, float]:
    """(loss, gradient norm) of one training step on the rollout scored against these engine logprobs."""
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.training_step(trainer.model, batch(trainer, old_log_probs))
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in trainer.model.parameters() if p.grad is not None))
    return float(loss), norm


def test_a_stale_negative_advantage_sample_moves_the_weights_no_more_than_on_policy(trainer):
    own = trainer_log_probs(trainer)
    on_policy_loss, on_policy = update(trainer, own)
    stale_loss, stale = update(trainer, [lp - STALE for lp in own])
    print(f"on-policy: loss {on_policy_loss:.3g}, grad norm {on_policy:.3g}; stale (ratio e^{STALE:g}): loss "
          f"{stale_loss:.3g}, grad norm {stale:.3g}")
    assert on_policy > 0, "the on-policy sample moved nothing: the loss does not reach the weights"
    assert on_policy_loss == pytest.approx(-ADVANTAGE, rel=1e-4)  # r = 1: the loss is |A|
    assert stale <= on_policy, (f"the stale sample moved the weights {stale / on_policy:.3g}x as far as on-policy "
                                f"(ratio e^{STALE:g}): the update is unbounded")
    delta = trainer.args.delta
    assert stale_loss <= delta * abs(ADVANTAGE) * (1 + 1e-5), f"the stale sample's loss exceeds {delta} x |A|"


def test_the_steps_log_carries_the_ratios_range_and_the_share_beyond_the_bound(trainer):
    own = trainer_log_probs(trainer)
    trainer.step_line(0, {})  # the step before: what the forwards above measured
    update(trainer, own[:1] + [lp - STALE for lp in own[1:]])  # every token but the first far off-policy
    logs: dict = {}
    trainer.step_line(1, logs)
    assert logs["harbor/ratio_max"] == pytest.approx(math.exp(STALE), rel=1e-3)
    assert logs["harbor/ratio_min"] == pytest.approx(1.0, abs=1e-4)
    assert logs["harbor/ratio_beyond_bound_frac"] == pytest.approx((len(own) - 1) / len(own))
