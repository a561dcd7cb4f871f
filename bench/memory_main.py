"""Runs the training script's own `main()` recording, after each optimizer step, the trainer's peak GPU memory and
the packed rows it trained on (bench/gpu_quick_start.py reads them).

One JSON line per optimizer step is appended to $AGH_BENCH_MEMORY_FILE: `step`, `max_reserved` and `max_allocated`
(bytes, torch's caching allocator in this process, the trainer's) since the previous line, and `rows`, the tokens of
each micro-batch's packed row (one rank: the row is the micro-batch). The peaks are reset after each line, so each
line is that step's peak (the first also covers the model's load and the first weight push); the line is written
after TRL's own step-end push, so it covers that push. A last line (`"end": true`) at train end. Nothing else changes.
TRL's own `batch/row_tokens_max` is counted when its collator runs, which accelerate's prefetch puts one micro-batch
ahead of the step that trains it; `rows` are those each step's loss was taken over.

    AGH_BENCH_MEMORY_FILE=memory.jsonl python bench/memory_main.py <the script's arguments>

The rollout child re-imports this file as `__mp_main__` (spawn) and never computes a loss.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import async_grpo_harbor as script  # noqa: E402
import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

ROWS: list[int] = []
_compute_loss = script.AsyncGRPOTrainer.compute_loss


def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    # The collator pads rows only across ranks; with one rank the mask's sum is the packed row's length.
    ROWS.append(int(inputs["attention_mask"].sum(-1).max()))
    return _compute_loss(self, model, inputs, return_outputs, num_items_in_batch)


class MemoryRecord(TrainerCallback):
    def __init__(self, path: str):
        self.path = path

    def write(self, **entry) -> None:
        if torch.cuda.is_available():
            entry |= {"max_reserved": torch.cuda.max_memory_reserved(), "max_allocated":
                      torch.cuda.max_memory_allocated(), "reserved_now": torch.cuda.memory_reserved()}
            torch.cuda.reset_peak_memory_stats()
        with open(self.path, "a") as f:
            f.write(json.dumps({**entry, "rows": ROWS[:], "time": time.time()}) + "\n")
        ROWS.clear()

    def on_step_end(self, args, state, control, **kwargs):
        self.write(step=state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.write(step=state.global_step, end=True)


_build_trainer = script.build_trainer


def build_trainer(*args, **kwargs):
    trainer = _build_trainer(*args, **kwargs)
    if os.environ.get("AGH_BENCH_MEMORY_FILE"):
        # Added last: TRL's weight push runs in a step-end callback registered at the trainer's init, before this one.
        trainer.add_callback(MemoryRecord(os.environ["AGH_BENCH_MEMORY_FILE"]))
    return trainer


script.AsyncGRPOTrainer.compute_loss = compute_loss
script.build_trainer = build_trainer

if __name__ == "__main__":
    sys.exit(script.main(sys.argv[1:]))
