"""--harness A,B rotates harnesses from one GRPO group to the next: every generation of a group runs the same
harness (and task), so its advantages compare like with like, and the run's accounting is split per harness. The
run is conftest's `trained` (the end-to-end training run), which rotates the rig's two harnesses."""

from __future__ import annotations

import re
from collections import defaultdict

from conftest import HARNESSES, TASKS, log_history, run_main
from test_refusals import assert_refused

ROLLOUT_HARNESS = re.compile(r"\[harbor\] group (\d+) task \d+ \(([\w-]+)\): .*\bharness ([\w-]+)")


def test_each_group_runs_one_harness_and_metrics_are_split_per_harness(trained):
    proc, out, _, _ = trained
    assert proc.returncode == 0, proc.stderr[-3000:]
    groups = defaultdict(set)
    count = defaultdict(int)
    for group, task, harness in ROLLOUT_HARNESS.findall(proc.stdout):
        groups[int(group)].add((task, harness))
        count[harness] += 1
    assert groups and all(len(runs) == 1 for runs in groups.values()), dict(groups)
    # The first pass over the tasks alternates harnesses group by group.
    first_pass = [next(iter(groups[g]))[1] for g in sorted(groups) if g < len(TASKS.split(","))]
    assert first_pass == [HARNESSES[g % 2] for g in range(len(first_pass))] and len(first_pass) >= 2
    history = log_history(out)
    for harness in HARNESSES:
        logged = sum(e.get(f"harbor/{harness}/rollouts", 0) for e in history)
        assert 0 < logged <= count[harness], (harness, logged, count[harness])
    assert any(f"harbor/{HARNESSES[0]}/zero_variance_frac_cumulative" in e for e in history)


def test_every_harness_in_the_list_is_checked(rig, tmp_path):
    proc = run_main([*rig.base_args(), "--harness", "mini-swe-agent,mini-swe-agnt", "--tasks", TASKS], cwd=tmp_path)
    assert_refused(proc, "unknown harness 'mini-swe-agnt'")
