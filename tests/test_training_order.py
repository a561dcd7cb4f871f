"""Which scored group an optimizer step trains when several wait: the freshest one with a signal, within TRL's
staleness rule. Through the script's trainer on the rig's tiny model in this process: TRL's own dataset over the
rollout queue, its batcher, its collator, accelerate's dataloader, transformers' `training_step` and the step's log.

TRL 1.16 takes scored samples oldest first and drops one only past --max-staleness: whenever rollouts finish faster
than the trainer steps (a loaded machine, many rollouts in flight), it trains groups up to --max-staleness versions
old, and zero-variance groups (advantage 0 everywhere, no gradient) while fresher groups with a signal wait. The test
queues, in the order the rollout child scored them: a group past --max-staleness, a zero-variance group of the
current version, a group with a signal one version old and one of the current version, whose last samples are still
crossing the pipe when the trainer reads. A step must train the newest group with a signal first, then the older
one, the zero-variance group last; the stale group is dropped and counted, as TRL's order does; and a group's samples
stay together in one micro-batch.
"""

from __future__ import annotations

import os
import queue
import sys

import numpy as np
import pytest
from conftest import RIG, load_script, trainer_without_rollouts

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # as the script does: it imports trl.experimental
sys.path.insert(0, str(RIG))
import cpu_trainer  # noqa: E402

cpu_trainer.install()  # TRL's packed forward on SDPA: this process runs TRL's loss itself

from trl.experimental.async_grpo.async_rollout_worker import RolloutSample  # noqa: E402

GROUP_SAMPLES = load_script().GROUP_SAMPLES  # the key the rollout child adds to each sample's metrics

GROUP = 4  # samples per group, and per micro-batch: one group a step
VERSION = 6  # the trainer's policy version when the queue is read
MAX_STALENESS = 2
SIGNAL, FLAT = [1.0, -1.0, 1.0, -1.0], [0.0] * GROUP  # advantages of a group with reward variance, and without


class InTransit(queue.Queue):
    """The rollout child's queue as the trainer reads it: the child puts a group's samples in one go, but they cross
    the pipe one by one, so a read may see the first ones only. Those put with `later` show up to a read that waits,
    never to one that does not."""

    def __init__(self):
        super().__init__()
        self.later: list = []

    def get(self, block: bool = True, timeout: float | None = None):
        if block and self.empty():
            for item in self.later:
                self.put(item)
            self.later = []
        return super().get(block, timeout)


class IdleWorker:
    """Stands in for TRL's rollout worker, which this test never starts: the samples it would have scored are put
    on its queue here."""

    def __init__(self):
        self._loop_kwargs, self.rollout_buffer, self.metrics_queue = {}, InTransit(), queue.Queue()

    def check_health(self, _stale_after_s):
        raise AssertionError("the trainer waited for a sample the test did not queue")


@pytest.fixture
def trainer(tiny_model, tmp_path):
    trainer = trainer_without_rollouts(tiny_model, tmp_path, IdleWorker(), max_staleness=MAX_STALENESS,
                                       token_budget=0, per_device_train_batch_size=GROUP, micro_batches_per_step=1,
                                       learning_rate=0.0)
    trainer.model_version = VERSION
    return trainer


def score(trainer, group: int, version: int, advantages: list[float], arrived: int | None = None) -> None:
    """A group of rollouts the child scored under policy `version`, put on the trainer's rollout queue as the child
    puts them (each carrying its group's size); only the first `arrived` of them are across the pipe yet."""
    tokenizer = trainer.processing_class
    prompt = tokenizer.encode(f"Task {group}: write the answer to /app/answer.txt and then submit.")
    for i, advantage in enumerate(advantages):
        completion = tokenizer.encode(f"echo {i} > /app/answer.txt") + [tokenizer.eos_token_id]
        sample = RolloutSample(
            prompt=[], completion=[], input_ids=np.array(prompt + completion, dtype=np.int64),
            completion_mask=np.array([0] * len(prompt) + [1] * len(completion), dtype=np.int64),
            old_log_probs=np.full(len(prompt) + len(completion), -1.0, dtype=np.float32), advantage=advantage,
            model_version=version, group_id=group, metrics={"reward": advantage, GROUP_SAMPLES: len(advantages)})
        child = trainer.rollout_worker.rollout_buffer
        if arrived is None or i < arrived:
            child.put(sample)
        else:
            child.later.append(sample)


def train_steps(trainer, steps: int) -> tuple[list[dict], list[list[int]]]:
    """`steps` optimizer steps of one micro-batch each, as transformers' loop takes them: each step's log, and the
    groups it trained."""
    batches, logs, trained = iter(trainer.get_train_dataloader()), [], []
    for step in range(1, steps + 1):
        before = set(trainer.trained_groups)
        trainer.training_step(trainer.model, next(batches))
        trainer.state.global_step = step
        trainer.log({"loss": 0.0})
        logs.append(trainer.state.log_history[-1])
        trained.append(sorted(trainer.trained_groups - before))
    return logs, trained


def test_a_step_trains_the_freshest_group_with_a_signal_first(trainer):
    score(trainer, 0, VERSION - MAX_STALENESS - 1, SIGNAL)  # past --max-staleness: TRL drops it
    score(trainer, 1, VERSION, FLAT)
    score(trainer, 2, VERSION - 1, SIGNAL)
    score(trainer, 3, VERSION, SIGNAL, arrived=2)  # its last two samples still on their way
    # Two steps: accelerate collates one micro-batch ahead, so the last group is taken while the second step trains.
    logs, trained = train_steps(trainer, 2)
    print("groups trained per step:", trained)
    assert trained == [[3], [2]], (f"the steps trained groups {trained}; the freshest group with a signal (3, "
                                   f"version {VERSION}) must go first, then the older one (2), and the zero-variance "
                                   "group (1) last")
    assert [log["harbor/trained/samples"] for log in logs] == [GROUP, GROUP], "a group's samples stay together"
    assert not any(GROUP_SAMPLES in log for log in logs), "the group's size is the script's, not a metric"
    assert logs[0]["sample/dropped_stale_total"] == GROUP, "the stale group is dropped and counted, as in TRL's order"
    assert [dict(groups) for groups in trainer.collated] == [{1: GROUP}], "collated ahead: group 1"
