"""Training end to end on CPU: the real Harbor server, capture proxy, Harbor trial + verifier, mini-swe-agent,
our session factory and TRL's real worker and trainer; only the engine, sandbox and CUDA pieces stand in. The run is
conftest's `trained`: the README's one command, with two harnesses rotated per group (test_rotation reads it too)."""

from __future__ import annotations

import json
import math
import re
import urllib.request
from collections import defaultdict
from datetime import datetime, timezone

import pytest
from conftest import MAX_MODEL_LEN, SECRETS, log_history, rollouts
from safetensors.torch import load_file


def test_trains_three_steps_and_saves_the_model(trained):
    proc, out, rig, _ = trained
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(rf"tokens per micro-batch\s+{MAX_MODEL_LEN} ", proc.stdout), "hyper-parameter table"
    steps = log_history(out)
    assert [e["step"] for e in steps] == [1, 2, 3]
    assert all(math.isfinite(e["loss"]) for e in steps)
    initial = load_file(rig.model_dir / "model.safetensors")
    trained_weights = load_file(out / "model.safetensors")
    changed = [name for name, w in initial.items() if not (trained_weights[name] == w).all()]
    assert len(changed) == len(initial), f"unchanged parameters: {set(initial) - set(changed)}"


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


STEP_ACCOUNT = re.compile(r"\[harbor\] step (\d+): (\d+) groups scored \(([\d,]+|-)\), (\d+) zero-variance "
                          r"\(([\d,]+|-)\)")


def test_zero_variance_accounting_matches_the_rewards_produced(trained):
    # Each step names the groups that finished since the previous one and those whose rewards were all equal; both
    # are checked against the rewards the rollouts printed as they finished, and against the logged fractions.
    proc, out, _, _ = trained
    produced = defaultdict(list)
    for group, _, reward in rollouts(proc.stdout):
        produced[group].append(reward)
    history = {e["step"]: e for e in log_history(out)}
    steps = STEP_ACCOUNT.findall(proc.stdout)
    assert [int(s[0]) for s in steps] == [1, 2, 3], proc.stdout[-3000:]
    groups = zero = 0
    for step, _, scored, _, flat in steps:
        scored, flat = ([int(g) for g in ids.split(",")] if ids != "-" else [] for ids in (scored, flat))
        assert all(len(produced[g]) == 4 for g in scored), "a group counted before all its generations finished"
        assert flat == [g for g in scored if len({r for r in produced[g] if r is not None}) == 1]
        groups, zero = groups + len(scored), zero + len(flat)
        logged = history[int(step)]
        assert logged.get("harbor/zero_variance_frac") == (len(flat) / len(scored) if scored else None)
        assert logged.get("harbor/zero_variance_frac_cumulative") == (zero / groups if groups else None)
        assert logged["harbor/groups_total"] == groups and logged["harbor/zero_variance_groups_total"] == zero
    assert zero > 0, "echo-hello and never score alike in every group"


def test_rollout_time_is_accounted_per_step(trained):
    proc, out, _, _ = trained
    history = log_history(out)
    assert sum(e["harbor/rollouts"] for e in history) <= len(rollouts(proc.stdout))
    assert all(e["harbor/errors"] == 0 for e in history)
    timed = [e for e in history if e["harbor/rollouts"]]
    assert timed and all(e["harbor/sandbox_s_per_step"] > 0 and e["harbor/rollouts_per_min"] > 0 for e in timed)
    assert all(e["harbor/turns_mean"] >= 1 and 0 <= e["harbor/solve_rate"] <= 1 for e in timed)


def test_concurrent_rollouts_run_side_by_side(trained):
    # One client per session: with --max-inflight 4, Harbor trials of this run overlap in time on the server.
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
    assert peak >= 3, f"at most {peak} of {len(spans)} trials ran at once"


def test_rollout_child_exits_on_its_own(trained):
    proc, _, _, _ = trained
    assert re.search(r"rollout worker exited on its own in [\d.]+s \(exit code 0\)", proc.stdout), proc.stdout[-2000:]


def test_runs_its_own_harbor_server_and_stops_it(trained):
    proc, out, _, _ = trained
    assert re.search(r"PASS  Harbor server\s+started http://127\.0\.0\.1:\d+ ", proc.stdout), proc.stdout[:3000]
    assert "PASS  capture tier" in proc.stdout, "the preflight table runs before training"
    url = re.search(r"harbor\s+(http://127\.0\.0\.1:\d+) \(started here, log .*harbor_server\.log\)", proc.stdout)
    assert url, "hyper-parameter table"
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

