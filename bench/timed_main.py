"""Runs the training script's own `main()` and prints when each phase of a run began and ended (wall clock).

The bench needs instants that only the run itself sees: when the model finished loading, when the last optimizer
step ended, when `train()` returned, and when TRL's rollout child dispatched its first session. Nothing about the
run changes; the script's `build_trainer` and the factory's `create` are wrapped only to read the clock.

    python bench/timed_main.py <the script's arguments>

prints `bench-mark <name> <unix time>` lines. The rollout child re-imports this file as `__mp_main__` (spawn), so
the `create` wrapper below is installed there too.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import async_grpo_harbor as script  # noqa: E402


def mark(name: str) -> None:
    print(f"bench-mark {name} {time.time():.4f}", flush=True)


_create = script.HarborSessionFactory.create
_first_dispatch = []


def create(self, *args, **kwargs):
    if not _first_dispatch:
        _first_dispatch.append(True)
        mark("first_dispatch")
    return _create(self, *args, **kwargs)


script.HarborSessionFactory.create = create
_build_trainer = script.build_trainer


def build_trainer(*args, **kwargs):
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            mark("step_end")

        def on_save(self, args, state, control, **kw):
            mark("save_end")

    mark("build_start")
    trainer = _build_trainer(*args, **kwargs)
    mark("build_end")
    trainer.add_callback(StepClock())
    train = trainer.train

    def timed_train(*a, **k):
        try:
            return train(*a, **k)
        finally:
            mark("train_return")

    trainer.train = timed_train
    return trainer


script.build_trainer = build_trainer
_server_start = getattr(script, "EmbeddedHarborServer", None) and script.EmbeddedHarborServer.start


def server_start(self, *args, **kwargs):
    mark("server_start")
    try:
        return _server_start(self, *args, **kwargs)
    finally:
        mark("server_ready")


if _server_start:
    script.EmbeddedHarborServer.start = server_start

if __name__ == "__main__":
    mark("main_start")
    sys.exit(script.main(sys.argv[1:]))
