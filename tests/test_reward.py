"""The reward in advantage space: what TRL trains on is the advantage its own code computes from a group's rewards,
(r - mean) / (std + 1e-8). Each case scores a group through the script's rollout loop, whose `_score_group` shapes
the rewards and hands them to TRL's `_score_group`, and reads the advantages off the samples TRL builds."""

from __future__ import annotations

import asyncio
import json
import queue
import re
import threading
from collections import defaultdict
from types import SimpleNamespace

import pytest
from conftest import load_script

agh = load_script()

pytest.importorskip("trl.experimental.async_grpo.openenv_harness")
from accelerate import PartialState  # noqa: E402
from trl.experimental.async_grpo.async_rollout_worker import RolloutGroup, TrainingSequence  # noqa: E402

W, LIMIT = 0.1, 10


@pytest.fixture(autouse=True)
def accelerate_state():
    # TRL's scoring logs through accelerate, which needs its state (TRL's rollout child makes it too); an in-process
    # test that built a TrainingArguments resets it.
    PartialState()


def scoring_loop(max_zero_variance_groups: int = 100):
    """The script's loop class with the state its scoring reads (TRL's counters and rates it counts the group into,
    and the factory that prints a zero-variance group); the rest of its __init__ (engine session, dataset, queues,
    thread pools) is not on the scoring path."""
    loop = object.__new__(agh.HarborRolloutLoop)
    loop.reward_funcs, loop._env_reward_types, loop.reward_func_names = [], [], ["harness_reward"]
    loop.efficiency_weight, loop.max_zero_variance_groups, loop.flat_run = W, max_zero_variance_groups, []
    loop.solved_any = False
    loop.stop_event = threading.Event()
    loop.failures, loop.failed_event = queue.Queue(), threading.Event()  # TRL's failure channel to the trainer
    loop._counters, loop._rates = defaultdict(float), defaultdict(lambda: [0.0, 0.0])
    loop.factory = SimpleNamespace(split_by_harness=False, _say=print)
    loop.groups_path = ""  # groups.jsonl: test_each_scored_group_is_settled_once_as_a_resume_reads_it writes one
    return loop


def rollout(reward: float | None, turns: int = 5):
    """(what TRL's rollout reward hook returns for it, its training rows); an unscorable rollout has no rows."""
    outcome = SimpleNamespace(env_reward=reward, trace=[{}] * turns, tool_call_count=turns)
    rows = [] if reward is None else [TrainingSequence([1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, -0.5, -0.5], "r")]
    return agh.harbor_reward(outcome, step_limit=LIMIT), rows


def advantages(rollouts: list, loop=None) -> list[float | None] | None:
    """Each rollout's advantage as TRL builds its samples (None: no sample); None when the group was kept out."""
    prompt = [{"role": "user", "content": "", "harbor_task_name": "coin", "harbor_harness": "mini-swe-agent"}]
    group = RolloutGroup(prompts=[prompt] * len(rollouts), reward_kwargs={}, completions=[[]] * len(rollouts),
                         completions_ids=[[]] * len(rollouts), completions_sequences=[rows for _, rows in rollouts],
                         tool_call_counts=[0] * len(rollouts), tool_failure_counts=[0] * len(rollouts),
                         model_version=0, group_id=7, env_rewards=[None] * len(rollouts),
                         rollout_rewards=[score for score, _ in rollouts])
    samples = asyncio.run((loop or scoring_loop())._score_group(group))
    if not samples:
        return None
    found = iter(s.advantage for s in samples)
    return [next(found) if rows else None for _, rows in rollouts]


def test_a_mixed_group_orders_solved_rollouts_by_turns_within_a_bounded_share_of_a_correctness_step():
    fast, slow, failed, failed_fast = advantages([rollout(1.0, 2), rollout(1.0, 8), rollout(0.0, 9),
                                                  rollout(0.0, 1)])
    assert fast > slow > 0 > failed == failed_fast  # failing quickly earns nothing
    # Efficiency moves an advantage by at most W of what solving moves it, whatever the group's std.
    assert fast - slow <= W * (slow - failed)
    assert failed == pytest.approx(-1.0, abs=0.1) and fast == pytest.approx(1.0, abs=0.1)


def test_an_all_solved_group_is_kept_out_however_its_turns_differ():
    # Turn counts alone would be the whole signal here: normalised, 1.08 vs 1.02 becomes advantages of about +-1.3,
    # larger than a pass/fail split. The group carries no correctness signal, so it carries none at all.
    assert advantages([rollout(1.0, 2), rollout(1.0, 4), rollout(1.0, 6), rollout(1.0, 8)]) is None
    # Trained anyway (--max-zero-variance-groups 0, TRL's behaviour): every advantage is exactly 0.
    assert advantages([rollout(1.0, 2), rollout(1.0, 8)], scoring_loop(0)) == [0.0, 0.0]


def test_an_all_failed_group_is_kept_out():
    assert advantages([rollout(0.0, 1), rollout(0.0, 6), rollout(0.0, 3)]) is None
    assert advantages([rollout(0.0, 1), rollout(0.0, 6)], scoring_loop(0)) == [0.0, 0.0]


def test_unscorable_members_get_no_sample_and_stay_out_of_the_baseline():
    solved, lost, failed, lost_too = advantages([rollout(1.0, 3), rollout(None), rollout(0.0, 3), rollout(None)])
    assert lost is None and lost_too is None
    assert solved == pytest.approx(1.0) and failed == pytest.approx(-1.0)  # the baseline of the two scored ones
    # One scorable rollout has nothing to be compared with.
    assert advantages([rollout(1.0, 3), rollout(None), rollout(None)]) is None
    assert advantages([rollout(None), rollout(None)]) is None


def test_partial_credit_keeps_its_order_and_efficiency_stays_within_the_smallest_step():
    full_slow, part_fast, part_slow, zero = advantages([rollout(1.0, 9), rollout(0.5, 1), rollout(0.5, 9),
                                                        rollout(0.0, 1)])
    assert full_slow > part_fast > part_slow > zero
    assert part_fast - part_slow <= W * (part_slow - zero)


def test_a_long_run_of_zero_variance_groups_stops_the_worker_with_the_reason():
    loop = scoring_loop(max_zero_variance_groups=3)
    solved, failed = [rollout(1.0), rollout(1.0)], [rollout(0.0), rollout(0.0)]
    assert advantages(solved, loop) is None and advantages(failed, loop) is None
    assert advantages([rollout(1.0), rollout(0.0)], loop) is not None  # variance: the count starts over
    assert advantages([rollout(None), rollout(None)], loop) is None  # unscorable: the failure counter's business
    assert advantages(solved, loop) is None and advantages(failed, loop) is None
    assert not loop.stop_event.is_set() and not loop.failed_event.is_set()
    assert advantages(failed, loop) is None
    # The worker stops, and the trainer's check_health raises the reason (stop_from_child), in one line.
    assert loop.stop_event.is_set() and loop.failed_event.is_set()
    name, message, trace = loop.failures.get_nowait()
    failed = RuntimeError("Rollout worker child has failed; see chained exception.")
    failed.__cause__ = RuntimeError(f"{name}: {message}\n{trace}")  # as TRL's check_health raises it
    stop = agh.stop_from_child(failed)
    assert isinstance(stop, agh.NoSignal), stop
    assert re.match(r"^the last 3 groups .*\(1 solved by every rollout, 2 by none\).*--eval-only --curate", str(stop))


def test_a_run_that_solved_tasks_and_then_solves_none_is_stopped_as_a_collapse_with_its_fix():
    # Measured on one H100 (bench/results/README.md, 2026-12-07): a seed at 0.6 solved fell to solving nothing, where
    # no group varies and nothing trains again. Curating the suite is not the fix there; an earlier policy is.
    loop = scoring_loop(max_zero_variance_groups=2)
    failed = [rollout(0.0), rollout(0.0)]
    assert advantages([rollout(1.0), rollout(0.0)], loop) is not None
    assert advantages(failed, loop) is None and advantages(failed, loop) is None
    name, message, _ = loop.failures.get_nowait()
    assert name == "NoSignal" and "(0 solved by every rollout, 2 by none)" in message, message
    assert ("Earlier groups of this run solved tasks, so the policy may have collapsed: resume from a checkpoint "
            "before the fall (--resume PATH; the step lines' solve rate shows when) with a lower --learning-rate"
            in message and "--curate" not in message), message
    # A suite this launch never solved is too hard for the model, not a fall: curate it.
    never = scoring_loop(max_zero_variance_groups=2)
    assert advantages(failed, never) is None and advantages(failed, never) is None
    assert "--eval-only --curate" in never.failures.get_nowait()[1]


def test_each_scored_group_is_settled_once_as_a_resume_reads_it(tmp_path):
    # One line per group in groups.jsonl, the outcome decided where the group is scored: a resume runs again only the
    # groups whose samples no optimizer step trained, never one kept out or without a scorable rollout.
    loop = scoring_loop()
    loop.groups_path, loop.dataset = str(tmp_path / "groups.jsonl"), agh.VisitOrder(["row"] * 8, pending=[], start=5)
    groups = {"varied": [rollout(1.0), rollout(0.0)], "all solved": [rollout(1.0), rollout(1.0)],
              "none scorable": [rollout(None), rollout(None)], "one scorable": [rollout(1.0), rollout(None)]}
    for members in groups.values():
        advantages(members, loop)
    trained_anyway = scoring_loop(max_zero_variance_groups=0)
    trained_anyway.groups_path, trained_anyway.dataset = loop.groups_path, loop.dataset
    advantages(groups["all solved"], trained_anyway)
    records = [json.loads(line) for line in (tmp_path / "groups.jsonl").read_text().splitlines()]
    assert [r["outcome"] for r in records] == ["samples", "zero_variance", "no_scorable", "zero_variance", "samples"]
    # TRL's group 7 of this launch is visit 12: the order's start (5) plus 7.
    assert {(r["group"], r["visit"], r["task"], r["harness"]) for r in records} == {(7, 12, "coin", "mini-swe-agent")}


def test_efficiency_weight_must_stay_below_one_correctness_step():
    with pytest.raises(agh.UsageError, match=r"--efficiency-weight must be in \[0, 1\)"):
        agh.parse_args(["--efficiency-weight", "1"])
