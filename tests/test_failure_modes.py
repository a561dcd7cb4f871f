"""What a two-day run meets: a sandbox backend that goes down, a SIGTERM, an engine that scores differently."""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import types
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import (GENERATIONS, POLICY, SCRIPT, assert_all_slots_free, default_filter, load_script, log_history,
                      post_json, rollouts, run_script, script_env, train_args)


def test_all_failing_rollouts_stop_training_with_the_reason(rig, tmp_path):
    proc = run_script(train_args(rig, tmp_path / "out", "--sandbox", "local-down", "--max-steps", "3",
                                 "--max-consecutive-failures", "6"), cwd=tmp_path, timeout=600)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    # Rollouts in flight when the sixth failed may be counted too.
    assert re.match(r"error: training stopped: ([6-9]|\d\d) consecutive rollouts were unscorable", last), last
    assert "sandbox backend unreachable" in last and "--resume" in last
    # One line on the console: the script's rollout loop hands its stop to the trainer without TRL's tracebacks.
    console = proc.stdout + proc.stderr
    assert [line for line in console.splitlines() if line.startswith("error:")] == [last]
    assert "Traceback" not in console
    assert all(reward is None for _, _, reward in rollouts(proc.stdout))
    assert_all_slots_free(rig)


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("how", ["trainer-only", "process-group", "trainer-sigkill"])
def test_a_stop_mid_rollout_leaves_no_child_and_no_session(rig, tmp_path, how):
    # trainer-only: `kill <pid>`, which must not orphan the rollout child (an orphan goes on starting rollouts).
    # process-group: what SLURM and Ctrl-C do; the child must not die before it released its server sessions.
    # trainer-sigkill: the OOM killer; no cleanup of the trainer's runs, the child must still leave and release them.
    # Tasks whose every group scores alike, kept out of training as by default: no sample ever reaches the trainer,
    # so the stop lands before the first optimizer step whenever it lands, however fast the rollouts run.
    out = tmp_path / "out"
    args = default_filter(train_args(rig, out, "--max-steps", "50", tasks="echo-hello,never"))
    pushed = rig.engine_stats()["weight_version"]
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=tmp_path, env=script_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: [lines.append(line) for line in proc.stdout], daemon=True)
    reader.start()

    def in_flight() -> bool:
        # This run's rollouts are in flight once one of its harnesses has called the model under the weights the run
        # pushed at train-begin: TRL starts its rollout child after that push, and the stop is deferred from then on.
        # A new sandbox alone could be another run's, and a SIGTERM then lands before training starts.
        return any(c["weight_version"] > pushed for c in rig.engine_stats()["chat"])

    try:
        deadline = time.monotonic() + 300
        while not in_flight():
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.5)
        family = descendants(proc.pid)
        assert family, "no rollout child"
        if how == "process-group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGKILL if how == "trainer-sigkill" else signal.SIGTERM)
        # Before the first optimizer step there is nothing to save, but a requeue still starts the run.
        assert proc.wait(timeout=120) == (-signal.SIGKILL if how == "trainer-sigkill" else 75)
        reader.join(timeout=10)
        assert not list(out.glob("checkpoint-*")), "a stop before the first optimizer step saved a checkpoint"
        if how != "trainer-sigkill":
            assert "[harbor] stopped by SIGTERM: no optimizer step yet, nothing to save; exit code 75" in "".join(lines)
        if how == "process-group":
            # The child's own exit code (128 + SIGTERM, after releasing its sessions), as the trainer saw it.
            assert re.search(r"rollout worker exited on its own in [\d.]+s \(exit code 143\)", "".join(lines)), \
                "".join(lines)[-3000:]
        # multiprocessing's resource tracker ignores SIGTERM by design and leaves once its last user has gone; an
        # orphaned rollout child first releases its server sessions (a create in flight may take seconds to return).
        deadline = time.monotonic() + 30
        while (survivors := [pid for pid in family if alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not survivors, [Path(f"/proc/{pid}/cmdline").read_bytes()[:200] for pid in survivors]
        assert "Traceback" not in "".join(lines)
        assert_all_slots_free(rig)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


ROLLOUT_THREADS = 4


def keep_starting_rollouts(factory, prompt, started, hold: bool) -> None:
    """One of TRL's session-pool threads: rollout after rollout, each ending at once (a task index the server does
    not have), or, with `hold`, running until the stop closes it (the engine holds its model calls)."""
    if not hold:
        prompt = [{**prompt[0], "harbor_task_index": 10**6}]
    while True:
        session = factory.create(prompt, 0)
        session.wait_for_completion()
        session.close()
        if not hold:
            started.release()


def rollout_child(harbor_url: str, prompt, started) -> None:
    from test_preemption import agh

    factory = agh.HarborSessionFactory(  # built in a child's main thread, as in TRL's rollout child: it guards it
        harbor_url=harbor_url, harness="mini-swe-agent", sandbox="local", reward_key="correct,reward",
        agent_step_limit=6, agent_timeout_s=60, max_consecutive_failures=3,
        sampling=agh.training_sampling({"temperature": 0.7}))
    for n in range(ROLLOUT_THREADS):
        threading.Thread(target=keep_starting_rollouts, args=(factory, prompt, started, n % 2 == 0),
                         daemon=True).start()
    time.sleep(600)  # the main thread, where the SIGTERM lands


def test_a_rollout_child_stopped_while_its_rollouts_keep_starting_leaves_no_server_session(rig):
    """A stopped rollout child (SIGTERM from SLURM or from its trainer, or its trainer gone) releases every server
    session before it exits: those of its running rollouts, those closing as their rollouts end, and those of
    rollouts that start while it stops. A slot left taken on the Harbor server is one the next run cannot have."""
    from test_preemption import agh

    task = next(t for t in agh.fetch_catalogue(rig.harbor_url, rig.split) if t["task_name"] == "echo-hello")
    prompt = agh.task_rows([task], rig.split, ["mini-swe-agent"])[0]["prompt"]
    ctx = multiprocessing.get_context("fork")
    # Every model call waits at the engine, so the held rollouts run until the stop; their sandboxes outlive the
    # child (Harbor's agent timeout ends them) and hold no slot.
    post_json(f"{rig.engine_url}/stand_in/policy", {**POLICY, "hold_from_weight_version": 0})
    try:
        for _ in range(5):  # the next rollout races the child's exit: several stops, each must leave nothing
            held = rig.engine_stats()["held"]
            started = ctx.Semaphore(0)
            child = ctx.Process(target=rollout_child, args=(rig.harbor_url, prompt, started), daemon=True)
            child.start()
            try:
                for _ in range(ROLLOUT_THREADS // 2):
                    assert started.acquire(timeout=120), "the child's quick rollouts never ended"
                deadline = time.monotonic() + 300  # a guard against a hang, not a time limit
                while rig.engine_stats()["held"] < held + ROLLOUT_THREADS // 2:
                    assert time.monotonic() < deadline, "the child's held rollouts never reached the engine"
                    time.sleep(0.2)
                os.kill(child.pid, signal.SIGTERM)
                os.kill(child.pid, signal.SIGTERM)  # a second one, as from a trainer that stops the child too
                child.join(120)  # a guard against a hang, not a time limit
                assert child.exitcode == 128 + signal.SIGTERM
            finally:
                if child.is_alive():
                    child.kill()
            assert_all_slots_free(rig)
    finally:
        post_json(f"{rig.engine_url}/stand_in/policy", POLICY)


def hand_over_a_sample(samples) -> None:
    samples.put(b"x" * (8 << 20))  # far more than a pipe holds: written while the trainer reads it
    time.sleep(600)


def read_as_the_stop_does(worker) -> None:
    from test_preemption import agh

    agh.stop_rollout_worker(worker)
    assert worker._process is None and worker.metrics_queue.empty()


def read_as_trl_does(worker) -> None:
    from test_preemption import agh

    with pytest.raises(queue.Empty):  # as a live child's queue with nothing to give
        agh.ChildQueue(worker.rollout_buffer).get(timeout=0.1)


@pytest.mark.parametrize("read", [read_as_the_stop_does, read_as_trl_does], ids=["the stop", "TRL's dataset"])
def test_a_sample_the_rollout_child_dies_handing_over_reads_as_the_end_of_the_queue(read):
    """TRL's rollout child hands each sample over a pipe, a large one while the trainer reads it. Killed mid-write
    (a SIGTERM to the job's process group, the OOM killer), it leaves a torn item in the pipe: the trainer's stop and
    TRL's own reads take it as the end of the queue, where waiting for the rest of it would hang the job past its
    checkpoint. The worker object stands in for TRL's; its process and queues are real."""
    from test_preemption import agh

    ctx = multiprocessing.get_context("fork")
    samples, metrics = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=hand_over_a_sample, args=(samples,), daemon=True)
    child.start()
    agh.read_only(samples, metrics)  # what the trainer does once the child has started
    assert samples._reader.poll(120), "the child wrote nothing"
    os.kill(child.pid, signal.SIGKILL)  # the sample is torn: the pipe holds its first part only
    child.join()
    worker = types.SimpleNamespace(_process=child, rollout_buffer=samples, metrics_queue=metrics,
                                   _stop_event_mp=ctx.Event())
    errors = []
    reader = threading.Thread(target=lambda: errors.extend(capture(read, worker)), daemon=True)
    reader.start()
    reader.join(120)  # a guard against a hang, not a time limit: the read itself takes milliseconds
    assert not reader.is_alive(), "the read waits forever for the rest of the torn sample"
    assert not errors, errors


def capture(read, worker) -> list[BaseException]:
    try:
        read(worker)
    except BaseException as exc:  # noqa: BLE001 - reported by the test's own thread
        return [exc]
    return []


def wait_on(event) -> None:
    event.wait()


def test_a_stop_event_a_dead_process_waited_on_does_not_hang_the_stop():
    """mp.Event.set() waits until every process waiting on the Event has woken. TRL's rollout child waits on its stop
    Event in a watcher thread that dies unwoken when the child ends on its own, so a set() from then on never returns:
    the trainer's stop must not wait on it, and ends a child that outlives its grace by SIGTERM. Here the dead waiter
    is a process of its own, killed while it waits; the worker object stands in for TRL's, its process is real."""
    from accelerate import PartialState
    from test_preemption import agh

    PartialState()  # as in the trainer: TRL's stop logs through accelerate
    ctx = multiprocessing.get_context("fork")
    stop_event = ctx.Event()
    waiter = ctx.Process(target=wait_on, args=(stop_event,), daemon=True)
    waiter.start()
    deadline = time.monotonic() + 120
    while stop_event._cond._sleeping_count.get_value() == 0:  # the waiter is inside wait()
        assert time.monotonic() < deadline, "the waiter never waited"
        time.sleep(0.01)
    os.kill(waiter.pid, signal.SIGKILL)
    waiter.join()
    child = ctx.Process(target=time.sleep, args=(600,), daemon=True)  # a child that does not exit on its own
    child.start()
    worker = types.SimpleNamespace(_process=child, rollout_buffer=ctx.Queue(), metrics_queue=ctx.Queue(),
                                   _stop_event_mp=stop_event)
    stop = threading.Thread(target=agh.stop_rollout_worker, args=(worker, 0.5), daemon=True)
    stop.start()
    stop.join(120)  # a guard against a hang, not a time limit
    assert not stop.is_alive(), "the stop waits forever in the stop Event's set()"
    assert child.exitcode == -signal.SIGTERM and worker._process is None


@pytest.fixture(scope="module")
def skewed_run(rig, tmp_path_factory):
    """One run read by two tests: an engine that samples at T but reports logprobs at T + 0.3, and a task list whose
    first task never scores."""
    work = tmp_path_factory.mktemp("skewed")
    post_json(f"{rig.engine_url}/stand_in/policy", {**POLICY, "score_temperature_offset": 0.3})
    try:
        proc = run_script(train_args(rig, work / "out", "--tasks", "broken,coin,coin2,echo-hello", "--max-steps", "1",
                                     "--save-steps", "1"), cwd=work)
    finally:
        post_json(f"{rig.engine_url}/stand_in/policy", POLICY)
    assert_all_slots_free(rig)  # the shared rig's later users need them all
    return proc, work / "out"


def test_an_engine_scoring_at_another_temperature_moves_ratio_and_kl(skewed_run):
    # The control for the exact ratio of 1 in the training test: the same run against an engine that samples at
    # T but reports logprobs at T + 0.3 must show it.
    proc, out = skewed_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = log_history(out)[0]
    assert abs(first["ratio"] - 1.0) > 1e-3 or first["kl"] > 1e-4, first


def test_a_task_that_never_scores_does_not_pin_the_resume_position(skewed_run):
    # TRL resumes at the first task group that was never trained; a group whose rollouts all failed never is, so
    # every later resume would restart at the broken task and replay all the tasks after it. The script reruns the
    # groups a stop left untrained, but not one that yielded no sample: it would fail again.
    proc, out = skewed_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    broken = [r for _, name, r in rollouts(proc.stdout) if name == "broken"]
    assert broken and all(r is None for r in broken)
    state = json.loads((out / "checkpoint-1" / "rollout_state.json").read_text())
    assert state["prompt_index"] >= 2 and 0 not in state["pending"], state


# Short, so the dead-server half of the test is short; the rig's restart takes ~3 s on a loaded 2-core machine.
RETRY_WINDOW = 30


def test_a_harbor_server_restart_loses_no_rollout_and_a_dead_one_ends_the_run_in_one_line(make_rig, tmp_path):
    # One run meets both: the Harbor server killed with rollouts in flight and restarted (each of them starts again
    # in a new session, training goes on), then killed for good (one retry window, then one line). Default
    # --max-consecutive-failures throughout: a restart must not count against it.
    from test_preemption import agh
    from transformers import AutoModelForCausalLM

    rig = make_rig()
    successor = rig.start_harbor(successor=True)  # imports now, serves once the first server is gone from the port
    out = tmp_path / "out"
    args = train_args(rig, out, "--max-steps", "50", "--save-steps", "1", "--harbor-retry-window", str(RETRY_WINDOW))
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=tmp_path, env=script_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: [lines.append(line) for line in proc.stdout], daemon=True)
    reader.start()

    def wait_for(condition, what: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert proc.poll() is None and time.monotonic() < deadline, f"{what}:\n{''.join(lines)[-5000:]}"
            time.sleep(0.5)

    def records() -> list[dict]:
        return [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]

    def in_flight_across(t0: float, t1: float) -> list[dict]:
        # Started before t0 and finished after t1: a rollout that finished as the server died is neither, whichever
        # of its reply and the kill came first.
        return [r for r in records() if r["started"] < t0 and r["time"] > t1]

    def steps_saved() -> int:
        return max((int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")), default=0)

    def kill_server() -> None:
        os.killpg(rig.harbor.proc.pid, signal.SIGKILL)  # a crash: no session closed, no reply sent
        rig.harbor.proc.wait()

    try:
        wait_for(lambda: rollouts("".join(lines)), "no rollout finished")  # the next ones are in flight
        wait_for(lambda: "rig: imported" in successor.log.read_text(), "the successor server did not get ready")
        t_kill = time.time()
        kill_server()
        rig.harbor = successor
        successor.wait_ready()
        t_back = time.time()
        wait_for(lambda: "rollouts in flight:" in "".join(lines), "the lost server went unnoticed")
        # Counted when the outage was noticed: a rollout that started just after the kill is among them.
        in_flight = int(re.search(r"is not answering \(.*\) with (\d+) rollouts in flight", "".join(lines))[1])
        wait_for(lambda: len([r for r in records() if r["retries"]]) >= in_flight and steps_saved() >= 1,
                 "rollouts lost with the server did not finish, or training did not go on")
        # Every rollout in flight at the kill started again in a new session, once, and was scored; none failed.
        lost = in_flight_across(t_kill, t_back)
        assert in_flight >= 1 and lost and all(r["retries"] == 1 for r in lost), lost
        assert {r["retries"] for r in records()} <= {0, 1}, records()
        assert all(r["error"] is None for r in records()), records()
        assert re.search(r"\[harbor\] the Harbor server at \S+ answers again after", "".join(lines))

        t_gone, saved = time.monotonic(), steps_saved()
        kill_server()
        code = proc.wait(timeout=RETRY_WINDOW + 300)
        gone_s = time.monotonic() - t_gone
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        successor.stop()
    console = "".join(lines)
    print(f"{console[-20000:]}\ndead server -> exit: {gone_s:.1f}s (retry window {RETRY_WINDOW}s)")
    assert code == 1
    errors = [line for line in console.splitlines() if line.startswith("error:")]
    assert errors == console.strip().splitlines()[-1:], errors
    assert re.match(rf"error: training stopped: the Harbor server at {re.escape(rig.harbor_url)} has not answered for "
                    rf"{RETRY_WINDOW}s \(last: .*\)\. Fix the cause, then relaunch with --output-dir .* --resume",
                    errors[0]), errors[0]
    # Decided once for the run, after the whole window: not per rollout, --max-consecutive-failures (32) rollouts
    # over. The margin is the trainer noticing (it may be mid-step) and the rollout child's exit, on a loaded machine.
    assert RETRY_WINDOW <= gone_s < RETRY_WINDOW + 90
    assert "Traceback" not in console
    last = out / f"checkpoint-{max(saved, steps_saved())}"
    assert agh.checkpoint_problem(last) is None
    assert AutoModelForCausalLM.from_pretrained(last).num_parameters() > 0


def test_an_agent_that_times_out_is_scored_by_its_verifier(rig, tmp_path):
    # Harbor runs the verifier after an agent timeout: the answer the agent wrote on its first turn is scored, and the
    # rollout trains like any other (a policy that loops must not leave the GRPO baseline). The engine answers, then
    # hangs the coin agent. --max-consecutive-failures 1: not one of these rollouts may count as a failure.
    # Two groups in flight and coin2 first: the quick coin2 groups run beside one hanging coin group, so the step
    # waits out one agent timeout, not two in a row. The agent writes its answer within ~10 s of starting; a whole
    # coin2 rollout took 30 s on 2 cores at a load of 10, so the timeout leaves it twice that.
    out = tmp_path / "out"
    post_json(f"{rig.engine_url}/stand_in/policy", {**POLICY, "agent_end": {"coin": "hang"}})
    try:
        proc = run_script(train_args(rig, out, "--tasks", "coin2,coin", "--max-steps", "1", "--agent-timeout", "60",
                                     "--max-inflight", str(2 * GENERATIONS), "--max-consecutive-failures", "1"),
                          cwd=tmp_path, timeout=900)
    finally:
        post_json(f"{rig.engine_url}/stand_in/policy", POLICY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    for task, kind in (("coin", "timeout"), ("coin2", "ok")):
        mine = [r for r in records if r["task"] == task]
        assert mine and all(r["exit"] == kind and r["error"] is None for r in mine), mine
        # Both verdicts of the exact-rate engine: the verifier read what the agent wrote before it hung.
        assert {r["reward"] for r in mine} == {0.0, 1.0}, mine
    # Each rollout names its Harbor trial, whose own record says how the agent ended.
    for r in records:
        result = json.loads((rig.workdir / "trials" / r["trial"] / "result.json").read_text())
        assert (result["exception_info"] or {}).get("exception_type") == (
            "AgentTimeoutError" if r["task"] == "coin" else None), r
    assert re.search(r"\[harbor\] group \d+ task \d+ \(coin\): reward [\d.]+ in \d+ turns, .*, agent timeout",
                     proc.stdout)
    logged = log_history(out)[0]
    assert logged["harbor/errors_total"] == 0 and logged["rollout/correctness_mean"] is not None
    assert_all_slots_free(rig)


def test_an_engine_that_dies_mid_rollout_is_never_trained_and_counts_as_a_failure(make_rig, tmp_path):
    # vLLM's engine core dies: it answers the agent's second call with a 500 and its server exits. The capture proxy
    # retries into no server and answers 502; mini-swe-agent exits on it, which Harbor, matching the agent's output,
    # files as a plain NonZeroAgentExitCodeError, and still verifies the answer turn 0 wrote. That reward is not the
    # policy's: the rollout trains nothing and counts toward --max-consecutive-failures (one group's worth here).
    rig = make_rig()
    post_json(f"{rig.engine_url}/stand_in/policy", {**POLICY, "agent_end": {"coin": "die"}})
    out = tmp_path / "out"
    # An agent timeout the rollouts never reach (they end when the engine dies), whatever the machine's load.
    proc = run_script(train_args(rig, out, "--tasks", "coin", "--max-steps", "1", "--max-consecutive-failures",
                                 str(GENERATIONS), "--agent-timeout", "300"), cwd=tmp_path, timeout=900)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert re.match(rf"error: training stopped: {GENERATIONS} consecutive rollouts were unscorable; the last: "
                    r"NonZeroAgentExitCodeError: the agent's harness or its engine failed", last), last
    records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert records and all(r["error"] == "NonZeroAgentExitCodeError" and r["reward"] is None for r in records), records
    # Harbor verified the rollout whose call met the dying engine: a reward existed, and was not trained on.
    verified = [json.loads((rig.workdir / "trials" / r["trial"] / "result.json").read_text()) for r in records]
    assert any((v.get("verifier_result") or {}).get("rewards") for v in verified), verified
    assert "[harbor] step" not in proc.stdout and not list(out.glob("checkpoint-*"))
    assert re.search(rf"; unscorable: NonZeroAgentExitCodeError {len(records)}\b", proc.stdout), proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr


def harbor_agent_exceptions() -> list[str]:
    """The exceptions after which Harbor still runs the verifier (harbor/trial/single_step.py): AgentTimeoutError and
    NonZeroAgentExitCodeError with every subclass harbor/agents/installed/base.py declares, from the server's own
    harbor."""
    names = ("from harbor.trial.errors import AgentTimeoutError\n"
             "from harbor.agents.installed.base import NonZeroAgentExitCodeError\n"
             "def names(c): return [c.__name__] + [n for s in c.__subclasses__() for n in names(s)]\n"
             "print(*names(AgentTimeoutError), *names(NonZeroAgentExitCodeError))")
    return subprocess.run([os.environ["AGH_SERVER_PYTHON"], "-c", names], capture_output=True, text=True,
                          check=True).stdout.split()


def test_only_the_policys_own_agent_ends_are_trained_at_the_verifiers_reward():
    from test_preemption import agh

    names = harbor_agent_exceptions()
    # The policy's doing: it looped until the timeout, or talked past the context or the output cap.
    own = {"AgentTimeoutError", "ContextWindowExceededError", "OutputTokenExceededError"}
    assert own < set(names) and {"ApiInternalServerError", "NetworkConnectionError", "ModelNotFoundError"} < set(names)
    for name in names:
        # What OpenEnv returns once Harbor verified after the agent's exception: ok=False, its type's name, a reward.
        result = agh.HarborRolloutResult(ok=False, exception_type=name, error="Command failed (exit 1): ...",
                                         reward=1.0, n_turns=2, n_trainable_tokens=40, atif="match")
        failure = agh.judge_rollout(result, "coin", require_tokens=True, reward_key="")
        if name in own:
            assert failure is None, name
        else:  # the harness or the engine failed: unscorable, counted under its own name
            assert failure is not None and failure.kind == name, (name, failure)


class RefusalCountingRelay(ThreadingHTTPServer):
    """Forwards the script's MCP calls to the Harbor server and counts the replies that say it is full, so a test
    knows a rollout was refused before it frees a slot (the server logs no refusal)."""

    daemon_threads = True

    def __init__(self, target: str):
        super().__init__(("127.0.0.1", 0), RelayHandler)
        self.target, self.refusals, self.refused = target, 0, threading.Condition()
        # What befalls the next rollout calls, in turn: "forget" (the server forgets the session, as a restart does),
        # "drop" (the connection closes unanswered, as a server going away does), "" (forwarded as it is)
        self.faults: list[str] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


class RelayHandler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        call = json.loads(body)
        fault = self.server.faults.pop(0) if call["method"] == "tools/call" and self.server.faults else ""
        if fault == "drop":
            return  # no answer: the connection closes
        if fault == "forget":
            post_json(f"{self.server.target}/mcp", {"jsonrpc": "2.0", "id": 1, "method": "openenv/session/close",
                                                    "params": {"session_id": call["params"]["session_id"]}})
        request = urllib.request.Request(self.server.target + self.path, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            answer = reply.read()
        if b"max_sessions" in answer:
            with self.server.refused:
                self.server.refusals += 1
                self.server.refused.notify_all()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


def test_a_full_harbor_server_is_waited_for_within_the_retry_window(rig):
    """A server with no free slot (another run's sessions, or ours still closing) is retried, not failed: the rollout
    starts once a slot frees; one that stays full for --harbor-retry-window fails that rollout alone, with the fix."""
    agh = load_script()
    holders = [agh.HarborServerSession(rig.harbor_url, timeout_s=30) for _ in range(rig.max_concurrent_envs)]
    relay = RefusalCountingRelay(rig.harbor_url)
    sessions = []
    try:
        for holder in holders:
            holder.open()
        task = next(t for t in agh.fetch_catalogue(rig.harbor_url, rig.split) if t["task_name"] == "echo-hello")
        prompt = agh.task_rows([task], rig.split, ["mini-swe-agent"])[0]["prompt"]

        def rollout(window_s: float):
            factory = agh.HarborSessionFactory(
                harbor_url=relay.url, harness="mini-swe-agent", sandbox="local", reward_key="correct,reward",
                agent_step_limit=6, agent_timeout_s=60, max_consecutive_failures=3, retry_window_s=window_s,
                sampling=agh.training_sampling({"temperature": 0.7}))
            sessions.append(factory.create(prompt, len(sessions)))
            return sessions[-1]

        stays_full = rollout(3.0)
        assert stays_full.wait_for_completion() == 1
        assert stays_full.failure.kind == "server_full", stays_full.failure
        assert "MAX_CONCURRENT_ENVS" in stays_full.failure.message, stays_full.failure.message
        assert relay.refusals >= 2, "gave up at the first refusal instead of retrying within the window"

        waits = rollout(600.0)
        outcome = {}
        refused_before = relay.refusals
        runner = threading.Thread(target=lambda: outcome.update(code=waits.wait_for_completion()))
        runner.start()
        with relay.refused:
            assert relay.refused.wait_for(lambda: relay.refusals > refused_before, timeout=120)
        holders.pop().close()  # a slot frees while the rollout waits for one
        runner.join(timeout=600)
        assert outcome == {"code": 0}, waits.failure
        assert waits.result.reward == 1.0 and waits.failure is None
    finally:
        for session in [*sessions, *holders]:
            session.close()
        relay.shutdown()
    assert_all_slots_free(rig)


def rollout_through_relay(rig, faults: list[str], retry_window_s: float = 300.0):
    """echo-hello's rollout through a relay that does `faults` to its rollout calls, in turn: (its session, the faults
    it did not get to)."""
    agh = load_script()
    relay = RefusalCountingRelay(rig.harbor_url)
    relay.faults = list(faults)
    task = next(t for t in agh.fetch_catalogue(rig.harbor_url, rig.split) if t["task_name"] == "echo-hello")
    factory = agh.HarborSessionFactory(
        harbor_url=relay.url, harness="mini-swe-agent", sandbox="local", reward_key="correct,reward",
        agent_step_limit=6, agent_timeout_s=60, max_consecutive_failures=1, retry_window_s=retry_window_s,
        sampling=agh.training_sampling({"temperature": 0.7}))
    session = factory.create(agh.task_rows([task], rig.split, ["mini-swe-agent"])[0]["prompt"], 0)
    try:
        session.wait_for_completion()
    finally:
        session.close()
        relay.shutdown()
    assert_all_slots_free(rig)
    return session, relay.faults


def test_a_server_that_no_longer_knows_the_session_restarts_the_rollout_without_an_outage(rig, capsys):
    """The server answers but has forgotten the rollout's session (restarted between the session's open and the
    rollout's call): the rollout starts again in a new session, and no outage is reported, the server never went."""
    session, left = rollout_through_relay(rig, ["forget"])
    assert session.failure is None and session.result.reward == 1.0 and not left and session.retries == 1
    console = capsys.readouterr().out
    assert "not answering" not in console and "answers again" not in console, console


def test_a_session_forgotten_again_after_an_outage_gets_a_new_window(rig):
    """--harbor-retry-window bounds a server that keeps forgetting sessions, not one that forgets, goes away, comes
    back and forgets again: each time the forgetting starts again, the rollout gets a new window."""
    # 1 s + 2 s + 4 s of waits lie between the two forgets: more than the 5 s window, were it not started again
    session, left = rollout_through_relay(rig, ["forget", "drop", "drop", "forget"], retry_window_s=5.0)
    assert session.failure is None and session.result.reward == 1.0 and not left and session.retries == 4


def test_a_server_whose_answers_keep_changing_fails_the_rollout_after_three_windows_of_retries(rig):
    """Each answer's window starts again when the answer changes, so alternating ones would retry forever: a rollout
    retries for at most 3 x --harbor-retry-window in all, then is unscorable, with the last answer."""
    # Waits of ~1 s each (the 1 s windows): the fourth would pass 3 s.
    session, left = rollout_through_relay(rig, ["forget", "drop"] * 10, retry_window_s=1.0)
    assert session.failure.kind == "retries" and session.retries == 3 and len(left) == 16, (session.failure, left)
    assert session.failure.message.startswith("the rollout kept failing to start through 3s of retries (3 x "
                                              "--harbor-retry-window); the last: the Harbor server at http"), \
        session.failure.message
