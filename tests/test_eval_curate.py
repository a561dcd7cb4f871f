"""Measuring before training: --eval-only reproduces the engine's per-task solve rates (conftest.POLICY) on an
eval-tier engine (no token ids, as a hosted model), without loading torch; --curate keeps exactly the tasks solved
sometimes and writes a file --tasks accepts."""

from __future__ import annotations

import csv
import re

import pytest
from conftest import POLICY, TASKS, Rig, rollouts, run_main, run_script

K = 2  # rollouts per task: the engine solves a task in exactly its solve rate of any K in a row (tests/rig/engine.py)
BAND = "0.05,0.95"


def eval_args(rig: Rig, out, *extra: str) -> list[str]:
    return [*rig.base_args(), "--tasks", TASKS, "--eval-only", "--eval-k", str(K), "--band", BAND,
            "--temperature", "0.7", "--agent-step-limit", "6", "--agent-timeout", "60", "--output-dir", str(out), *extra]


@pytest.fixture(scope="module")
def measured(eval_tier_rig, tmp_path_factory):
    work = tmp_path_factory.mktemp("eval")
    proc = run_script(eval_args(eval_tier_rig, work / "out", "--curate"), cwd=work)
    rows = {r["task"]: r for r in csv.DictReader((work / "out" / "pass_rates.csv").open())}
    return proc, rows, work


def test_eval_only_reproduces_the_solve_rates(measured):
    proc, rows, work = measured
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(rows) == set(TASKS.split(","))
    assert all(int(r["k"]) == K and int(r["errors"]) == 0 for r in rows.values()), rows
    for task, rate in POLICY["tasks"].items():
        assert int(rows[task]["solved"]) == K * rate and float(rows[task]["pass_rate"]) == rate, rows[task]
    assert all(float(r["mean_turns"]) >= 1 and float(r["mean_wall_s"]) > 0 for r in rows.values())
    assert {r["harness"] for r in rows.values()} == {"mini-swe-agent"}
    assert {r["sandbox"] for r in rows.values()} == {"local"}
    # One summary line, no per-task table: the CSV holds the rows.
    units, solved = len(TASKS.split(",")), sum(int(r["solved"]) for r in rows.values())
    summary = [line for line in proc.stdout.splitlines() if line.startswith("[eval] ")]
    assert summary == [f"[eval] {units} of {units} tasks measured in full, {solved}/{K * units} solved, 0 errors: "
                       f"{work / 'out' / 'pass_rates.csv'}"], summary


def test_eval_only_counts_every_rollout_it_ran(measured):
    proc, rows, _ = measured
    ran = rollouts(proc.stdout)
    assert len(ran) == K * len(rows)
    for task, row in rows.items():
        rewards = [r for _, name, r in ran if name == task]
        assert int(row["solved"]) == sum(r > 0 for r in rewards), task


def test_curate_keeps_the_tasks_solved_sometimes(measured):
    proc, rows, work = measured
    assert re.search(r"tasks\s+1 below the band, 2 inside \(kept\), 1 above, 0 unmeasured\n", proc.stdout)
    listed = [line for line in (work / "out" / "curated_tasks.txt").read_text().splitlines()
              if line and not line.startswith("#")]
    assert sorted(listed) == ["coin", "coin2"]
    # 1 - p^G - (1-p)^G per task, G = 4: the full list has two tasks that never vary.
    p = {t: float(r["pass_rate"]) for t, r in rows.items()}
    full = sum(1 - q ** 4 - (1 - q) ** 4 for q in p.values()) / 4
    curated = sum(1 - p[t] ** 4 - (1 - p[t]) ** 4 for t in ("coin", "coin2")) / 2
    assert f"(G=4)  {full:.1%} on all measured tasks, {curated:.1%} on the curated\n" in proc.stdout


def test_curated_file_is_a_task_list_the_script_accepts(measured, eval_tier_rig):
    # Through the preflight's task resolution (the same as training's): one rollout per curated task.
    _, _, work = measured
    curated = work / "out" / "curated_tasks.txt"
    args = eval_args(eval_tier_rig, work / "again", "--eval-k", "1")
    args[args.index("--tasks") + 1] = f"@{curated}"
    proc = run_main(args, cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(r["task"] for r in csv.DictReader((work / "again" / "pass_rates.csv").open())) == ["coin", "coin2"]


def test_curate_from_a_csv_needs_no_server(measured, tmp_path):
    _, _, work = measured
    proc = run_main(["--curate", str(work / "out" / "pass_rates.csv"), "--band", "0,0.5", "--num-generations", "4",
                     "--curated-tasks", str(tmp_path / "easy.txt"), "--harbor-url", "http://127.0.0.1:9"],
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    listed = [line for line in (tmp_path / "easy.txt").read_text().splitlines() if line and line[0] != "#"]
    assert "never" in listed and "echo-hello" not in listed
    assert "# Source: " + str(work / "out" / "pass_rates.csv") in (tmp_path / "easy.txt").read_text()


def test_curate_refuses_a_file_that_is_not_pass_rates(tmp_path):
    bad = tmp_path / "tasks.csv"
    bad.write_text("name,score\nx,1\n")
    proc = run_main(["--curate", str(bad)], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: --curate {bad}: not a pass_rates.csv written by --eval-only (no column errors, k, solved, task)"]
