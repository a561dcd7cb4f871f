"""Training end to end on CPU: the real Harbor server, capture proxy, Harbor trial + verifier, mini-swe-agent,
our session factory and TRL's real worker and trainer; only the engine, sandbox and CUDA pieces stand in. The run is
conftest's `trained`: the README's one command, with two harnesses rotated per group: --harness A,B rotates harnesses
from one GRPO group to the next, so every generation of a group runs the same harness (and task), its advantages
compare like with like, and the run's accounting is split per harness."""

from __future__ import annotations

import csv
import json
import math
import re
import urllib.request
from collections import defaultdict
from datetime import datetime

import pytest
from conftest import (E2E_TASKS, EVAL_TASKS, GENERATIONS, HARNESSES, SECRETS, TASKS,
                      assert_all_slots_free, default_filter, log_history, rollouts, run_main, run_script,
                      train_args)
from safetensors.torch import load_file
from test_refusals import assert_refused


def test_trains_three_steps_and_saves_the_model(trained):
    proc, out, rig, _ = trained
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"--max-steps\s+3\n", proc.stdout), "hyper-parameter table"
    steps = log_history(out)
    assert [e["step"] for e in steps] == [1, 2, 3]
    assert all(math.isfinite(e["loss"]) for e in steps)
    initial = load_file(rig.model_dir / "model.safetensors")
    trained_weights = load_file(out / "model.safetensors")
    changed = [name for name, w in initial.items() if not (trained_weights[name] == w).all()]
    assert len(changed) == len(initial), f"unchanged parameters: {set(initial) - set(changed)}"


def test_keeps_the_newest_checkpoints_and_printed_their_size(trained):
    # Three saves (--save-steps 1); --save-total-limit's default keeps the newest two.
    proc, out, _, _ = trained
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-2", "checkpoint-3"]
    estimate = float(re.search(r"checkpoints\s+~([\d.]+) MB each", proc.stdout)[1]) * 1e6
    saved = sum((out / "checkpoint-3" / name).stat().st_size for name in ("model.safetensors", "optimizer.pt"))
    assert abs(estimate - saved) < 0.1 * saved, (estimate, saved)


def test_first_step_scores_exactly_what_the_engine_sampled(trained):
    # The engine scores with the weights the trainer just pushed, at the temperature the proxy enforced: if tokens,
    # logprobs and temperature line up, the first step's importance ratio is 1 and its KL 0.
    proc, out, _, _ = trained
    first = log_history(out)[0]
    assert first["ratio"] == pytest.approx(1.0, abs=1e-4)
    assert abs(first["kl"]) < 1e-5


def test_engine_sampled_at_the_trainers_temperature(trained):
    proc, _, _, (chats, _) = trained
    # Left out: tool-less probes ("reply", the proxy's and the preflight's) and the preflight's tool probe, which names
    # no task: each probes a sampling setting on purpose.
    agent_calls = [c for c in chats if c["script"] != "reply" and not c["script"].endswith(":unknown")]
    assert agent_calls, "no agent call reached the engine"
    assert {c["sampling"].get("temperature") for c in agent_calls} == {0.7}
    assert {c["score_temperature"] for c in agent_calls} == {0.7}


def test_groups_run_one_task_and_rewards_vary_within_a_group(trained):
    proc, _, _, _ = trained
    by_group = defaultdict(list)
    for group, name, reward in rollouts(proc.stdout):
        by_group[group].append((name, reward))
    assert by_group, "no rollout finished"
    assert all(len({name for name, _ in g}) == 1 for g in by_group.values()), by_group
    varied = [g for g in by_group.values() if len({r for _, r in g if r is not None}) > 1]
    assert varied, f"every group scored identically: {dict(by_group)}"


def test_trainable_tokens_reach_the_loss(trained):
    _, out, _, _ = trained
    assert all(e["batch/trained_tokens_per_step"] > 0 for e in log_history(out))


ZERO_VARIANCE = re.compile(r"\[harbor\] group (\d+): zero variance, every scored rollout ([-\d.e]+): kept out of "
                           r"training")
STEP_ACCOUNT = re.compile(r"\[harbor\] step (\d+): (\d+) groups finished, (\d+) zero-variance \((\d+%|-)\)")


def test_zero_variance_accounting_matches_the_rewards_produced(trained):
    # A group whose rewards are all equal is named as it finishes, checked against the rewards its rollouts printed;
    # each step counts the groups it logs, and the run's end line adds them up with those that finished later.
    proc, out, _, _ = trained
    whole = whole_groups(proc.stdout)
    flat = {int(g): float(r) for g, r in ZERO_VARIANCE.findall(proc.stdout)}
    assert flat, "echo-hello scores alike in every group"
    assert all(whole.get(g) == {r} for g, r in flat.items()), (flat, whole)
    history = {e["step"]: e for e in log_history(out)}
    steps = STEP_ACCOUNT.findall(proc.stdout)
    assert [int(s[0]) for s in steps] == [1, 2, 3], proc.stdout[-3000:]
    for step, groups, zero, share in steps:
        logged = history[int(step)]
        assert logged.get("harbor/groups_total", 0) == int(groups)
        assert logged.get("harbor/zero_variance_groups_total", 0) == int(zero)
        assert logged.get("harbor/zero_variance_frac") == (int(zero) / int(groups) if int(groups) else None)
        assert share == (f"{int(zero) / int(groups):.0%}" if int(groups) else "-")
    summary = SUMMARY.search(proc.stdout)
    assert summary, proc.stdout[-3000:]
    # Every group that finished, each counted once: the flat ones named, the mixed ones not. A group whose last
    # rollout finished as the run stopped may not have been scored; every one that finished before the last step was.
    before = whole_groups(proc.stdout[:proc.stdout.index("[harbor] step 3:")])
    assert len(before) <= int(summary["groups"]) <= len(whole) and int(summary["kept_out"]) == len(flat)
    assert {g for g in before if len(whole[g]) == 1} <= set(flat)


def whole_groups(stdout: str) -> dict[int, set]:
    """The groups all of whose rollouts printed their reward (None: unscorable), and their rewards."""
    produced = defaultdict(list)
    for group, _, reward in rollouts(stdout):
        produced[group].append(reward)
    return {g: set(rewards) for g, rewards in produced.items() if len(rewards) == GENERATIONS}


TRAINED = re.compile(r"\[harbor\] step (\d+): .*; trained (\d+) groups \(([\d,]+|-)\), (\d+) samples, "
                     r"(\d+) tokens")
SUMMARY = re.compile(r"\[harbor\] rollouts: (?P<finished>\d+) finished, (?P<unscorable>\d+) unscorable; groups: "
                     r"(?P<groups>\d+) finished, (?P<reached>\d+) reached the loss \((?P<tokens>\d+) tokens, "
                     r"100% with a non-zero advantage\); not trained: (?P<kept_out>\d+) zero-variance \(kept out\), "
                     r"(?P<none>\d+) with no scorable rollout, (?P<rest>\d+) dropped as stale or left at the stop")


def test_only_groups_with_reward_variance_reach_the_loss(trained):
    # By default a group whose rewards are all equal (every advantage 0) is kept out of training: every group that
    # reached the loss mixed solved and failed rollouts, and every token in the loss carries a non-zero advantage.
    proc, out, _, _ = trained
    whole = whole_groups(proc.stdout)
    mixed, flat = {g for g, r in whole.items() if len(r) > 1}, {g for g, r in whole.items() if len(r) == 1}
    steps = TRAINED.findall(proc.stdout)
    assert [int(s[0]) for s in steps] == [1, 2, 3], proc.stdout[-3000:]
    trained_groups = [int(g) for s in steps if s[2] != "-" for g in s[2].split(",")]
    assert trained_groups and set(trained_groups) <= mixed, (trained_groups, whole)
    assert flat, "echo-hello scores alike in every group"
    history = {e["step"]: e for e in log_history(out)}
    for step, groups, _, samples, tokens in steps:
        logged = history[int(step)]
        assert logged["harbor/trained/informative_token_frac"] == 1.0
        # Loss tokens as TRL counts them: the micro-batches this step trained on, not the one collated ahead.
        assert logged["batch/trained_tokens_per_step"] == int(tokens) > 0
        assert logged["harbor/trained/groups"] == int(groups) and logged["harbor/trained/samples"] == int(samples)
    # Every rollout and every group counted once, from what the run recorded, after the last step's log too: the
    # groups the rollout child scored (groups.jsonl) = trained + kept out + none scorable + samples never trained.
    summary = SUMMARY.search(proc.stdout)
    assert summary, proc.stdout[-3000:]
    n = {key: int(value) for key, value in summary.groupdict().items()}
    assert n["finished"] == len(rollouts(proc.stdout)) and n["unscorable"] == n["none"] == 0
    assert n["reached"] == len(trained_groups) == len(set(trained_groups))
    assert n["tokens"] == sum(int(s[4]) for s in steps)
    scored = [json.loads(line) for line in (out / "groups.jsonl").read_text().splitlines()]
    with_samples = {r["group"] for r in scored if r["outcome"] == "samples"}
    assert set(trained_groups) <= with_samples and n["rest"] == len(with_samples - set(trained_groups))
    assert n["kept_out"] == len(ZERO_VARIANCE.findall(proc.stdout)) == sum(r["outcome"] == "zero_variance"
                                                                            for r in scored)
    assert n["reached"] + n["kept_out"] + n["none"] + n["rest"] == n["groups"] == len(scored) <= len(whole)
    assert sum(e.get("harbor/rollouts_total", 0) for e in history.values()) <= n["finished"]


def test_a_suite_that_never_varies_stops_with_the_reason(rig, tmp_path):
    # Tasks the model always or never solves: every group is kept out, so no sample ever reaches the trainer. After
    # --max-zero-variance-groups of them in a row the run ends with one line saying why, instead of waiting forever.
    proc = run_script(default_filter(train_args(rig, tmp_path / "out", "--tasks", "echo-hello,never", "--max-steps",
                                                "3", "--max-zero-variance-groups", "2")), cwd=tmp_path, timeout=600)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: training stopped: the last 2 groups each scored all their rollouts alike (1 solved "
                           "by every rollout, 1 by none)") and "--eval-only --curate" in last, last
    assert "Traceback" not in proc.stderr and "[harbor] step" not in proc.stdout  # no optimizer step: nothing trained
    summary = re.search(r"\[harbor\] rollouts: \d+ finished, \d+ unscorable; groups: \d+ finished, 0 reached the "
                        r"loss .*?(\d+) zero-variance \(kept out\)", proc.stdout)
    assert summary and int(summary[1]) >= 2, proc.stdout[-3000:]
    assert_all_slots_free(rig)


def test_rollout_time_is_accounted_per_step(trained):
    proc, out, _, _ = trained
    history = log_history(out)
    assert sum(e.get("harbor/rollouts_total", 0) for e in history) <= len(rollouts(proc.stdout))
    assert all(e.get("harbor/errors_total", 0) == 0 for e in history)
    timed = [e for e in history if e.get("harbor/rollouts_total")]
    assert timed and all(e["harbor/sandbox_s_total"] > 0 and e["harbor/rollouts_per_min"] > 0 for e in timed)
    assert all(e["harbor/turns_mean"] >= 1 for e in timed)
    # The solve rate is TRL's own: the mean verifier reward of the rollouts that have one (pass/fail here).
    scored = [e["rollout/correctness_mean"] for e in history if e.get("rollout/correctness_mean") is not None]
    assert scored and all(0 <= c <= 1 for c in scored), history


def test_concurrent_rollouts_run_side_by_side(trained):
    # One client per session: with --max-inflight 2, Harbor trials of this run overlap in time on the server.
    _, out, _, before = trained
    spans = []
    for result in (out.parent / "trials").glob("*/result.json"):
        r = json.loads(result.read_text())
        start, end = (datetime.fromisoformat(r[k].replace("Z", "+00:00")) for k in ("started_at", "finished_at"))
        if start >= before[1]:
            spans.append((start, end))
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    assert peak >= 2, f"at most {peak} of {len(spans)} trials ran at once"


def test_rollout_child_exits_on_its_own(trained):
    proc, _, _, _ = trained
    assert re.search(r"rollout worker exited on its own in [\d.]+s \(exit code 0\)", proc.stdout), proc.stdout[-2000:]


def test_runs_its_own_harbor_server_and_stops_it(trained):
    proc, out, _, _ = trained
    url = re.search(r"PASS  Harbor server\s+started (http://127\.0\.0\.1:\d+) .*harbor_server\.log", proc.stdout)
    assert url, proc.stdout[:3000]
    assert "PASS  capture tier" in proc.stdout, "the preflight table runs before training"
    assert "sandboxes" in (out / "harbor_server.log").read_text(), "the server's start-up report goes to its log"
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url[1]}/harbor_env/splits", timeout=5)


def test_no_secret_reaches_output_logs_or_trackio(trained):
    proc, out, _, _ = trained
    written = [p for p in out.parent.rglob("*") if p.is_file()]
    assert any("trackio" in str(p) for p in written), "trackio wrote nothing"
    for value in SECRETS.values():
        assert value not in proc.stdout + proc.stderr
        assert not [p for p in written if value.encode() in p.read_bytes()]


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
    first_pass = [next(iter(groups[g]))[1] for g in sorted(groups) if g < len(E2E_TASKS.split(","))]
    assert first_pass == [HARNESSES[g % 2] for g in range(len(first_pass))] and len(first_pass) >= 2
    history = log_history(out)
    for harness in HARNESSES:
        logged = sum(e.get(f"harbor/{harness}/rollouts_total", 0) for e in history)
        assert 0 < logged <= count[harness], (harness, logged, count[harness])
    assert any(f"harbor/{HARNESSES[0]}/zero_variance_frac" in e for e in history)


def test_every_harness_in_the_list_is_checked(rig, tmp_path):
    proc = run_main([*rig.base_args(), "--harness", "mini-swe-agent,mini-swe-agnt", "--tasks", TASKS], cwd=tmp_path)
    assert_refused(proc, "unknown harness 'mini-swe-agnt'")


SOLVE_RATE = re.compile(r"\[harbor\] step (\d+): .*, solve rate ([\d.]+|-) \((\d+)/(\d+)\)")


def test_each_step_shows_the_solve_rate_of_the_rollouts_it_scored(trained):
    # Over every scored rollout that finished since the previous step, as rollouts.jsonl holds them.
    proc, out, _, _ = trained
    history = {e["step"]: e for e in log_history(out)}
    steps = SOLVE_RATE.findall(proc.stdout)
    assert [int(s[0]) for s in steps] == [1, 2, 3], proc.stdout[-3000:]
    for step, rate, solved, scored in steps:
        logged = history[int(step)]
        assert int(scored) == logged.get("harbor/rollouts_total", 0) - logged.get("harbor/errors_total", 0)
        assert logged.get("harbor/solve_rate") == (int(solved) / int(scored) if int(scored) else None)
        assert rate == (f"{int(solved) / int(scored):.2f}" if int(scored) else "-")
    records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert sum(int(s[2]) for s in steps) <= sum(r["reward"] > 0 for r in records if r["reward"] is not None)
    # Every rollout names its Harbor trial (the server's own record of it) and how its agent ended.
    assert all((out.parent / "trials" / r["trial"] / "result.json").is_file() and r["exit"] == "ok" for r in records)


def test_held_out_tasks_are_measured_before_training_every_n_steps_and_at_the_end(trained):
    proc, out, _, _ = trained
    rows = list(csv.DictReader((out / "eval.csv").open()))
    assert list(rows[0]) == ["step", "task", "index", "harness", "sandbox", "k", "solved", "pass_rate", "mean_reward",
                             "mean_turns", "mean_wall_s", "errors"]
    # Before the first step and at --eval-steps 3, the last step, which is measured once.
    assert sorted({int(r["step"]) for r in rows}) == [0, 3]
    assert len(rows) == 2 * len(EVAL_TASKS) * len(HARNESSES)  # each task under each harness
    for r in rows:
        assert r["task"] in EVAL_TASKS and r["k"] == "1" and r["errors"] == "0", r
        assert float(r["pass_rate"]) == (1.0 if r["task"] == "echo-hello" else 0.0), r
    evals = [e for e in json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())["log_history"]
             if "eval/pass_rate" in e]
    # Step 3's eval ran at the step's end, before its checkpoint was saved: every --eval-steps, not only at the end.
    assert [e["step"] for e in evals] == [0, 3] and all(e["eval/pass_rate"] == 0.5 for e in evals)
    assert all(e["eval/echo-hello/pass_rate"] == 1.0 and e["eval/never/pass_rate"] == 0.0 for e in evals)
    assert all(e["eval/mean_reward"] == 0.5 for e in evals)
    assert re.search(r"held-out eval\s+2 tasks x 1 rollouts, before training and every 3 steps", proc.stdout)
    assert re.search(r"\[harbor\] eval at step 0: pass rate 0\.50 \(2/4\) on 2 held-out tasks", proc.stdout)
    assert "; held-out pass rate 0.50 (step 0) -> 0.50 (step 3)" in proc.stdout
    # Held-out rollouts never reach training's record.
    records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert not {r["task"] for r in records} & set(EVAL_TASKS) - set(E2E_TASKS.split(","))
