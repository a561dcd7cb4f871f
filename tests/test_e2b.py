"""E2B as Harbor runs it: the Harbor server this script starts shares e2b templates and pins the harness it installs;
the capture proxy is reached through the URL the sandboxes are given, before the first paid rollout and before each
one after; a plan or quota that refuses Harbor's sandboxes is named by `--check --probe-rollout`. On the rig, `e2b`
runs in the local sandbox (RIG_E2B_STANDIN) and gradio's tunnel is a TCP forwarder a test can kill (RIG_TUNNEL_DIR):
tests/rig/harbor_server.py."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import ROOT, SCRIPT, SECRETS, embedded, load_script, rollouts, run_main, script_env, train_args
from test_check import refused_with, table

# What the script's own Harbor server was started with, as a stand-in server writes it down before it exits.
RECORD = ("import json, os, sys; json.dump({'argv': sys.argv[1:], 'env': dict(os.environ)}, open({path!r}, 'w')); "
          "raise SystemExit(3)")
PINNED = dict(line.split("==") for line in (ROOT / "tests" / "requirements-server.txt").read_text().splitlines()
              if "==" in line and not line.startswith("#"))


def recorded_server(rig, tmp_path, **env: str) -> tuple[dict, object]:
    path = tmp_path / "server.json"
    args, rig_env = embedded([*rig.base_args(), "--sandbox", "e2b", "--tasks", "coin", "--output-dir", "out"],
                             tmp_path)
    args[-1] = shlex.join([sys.executable, "-c", RECORD.replace("{path!r}", repr(str(path)))])
    proc = run_main(args, cwd=tmp_path, **SECRETS, **rig_env, **env)
    return (json.loads(path.read_text()) if path.exists() else {}), proc


def openenv_reads(env: dict[str, str]) -> dict:
    """What openenv 0.10 itself makes of the server's environment: the harness version Harbor is told to install,
    and whether e2b templates are shared (its own parser and switch, in the Harbor server's interpreter)."""
    code = ("import json; from openenv.harbor import rollout, shared_template as st; "
            "c = rollout.build_trial_config(task_dir='t', harness='mini-swe-agent', sandbox='e2b', intercept_url='u', "
            "session_id='s', model='m', trial_name='n', trials_dir='d'); "
            "print(json.dumps({'version': c.agent.kwargs.get('version'), 'shared': st.enable_shared_templates()}))")
    keep = {k: v for k, v in env.items() if k in ("OPENENV_HARBOR_AGENT_VERSIONS", "HARBOR_SHARED_ENV_NAME", "PATH",
                                                 "HOME", "LITELLM_LOCAL_MODEL_COST_MAP")}
    out = subprocess.run([os.environ["AGH_SERVER_PYTHON"], "-c", code], env=keep, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_its_own_harbor_server_shares_e2b_templates_and_installs_the_tested_harness(rig, tmp_path):
    record, _ = recorded_server(rig, tmp_path)
    env = record["env"]
    # One template per distinct environment: Harbor's per-task templates race their own build on a task's first visit.
    assert env["HARBOR_SHARED_ENV_NAME"] == "async-grpo-harbor"
    # The harness the tests run, installed in every sandbox, not whatever is newest on the day.
    assert json.loads(env["OPENENV_HARBOR_AGENT_VERSIONS"]) == {"mini-swe-agent": PINNED["mini-swe-agent"]}
    assert openenv_reads(env) == {"version": PINNED["mini-swe-agent"], "shared": True}
    assert "--expose" in record["argv"]


def test_the_user_can_pin_another_harness_version_and_template_name(rig, tmp_path):
    record, _ = recorded_server(rig, tmp_path, OPENENV_HARBOR_AGENT_VERSIONS='{"mini-swe-agent": "2.4.5"}',
                                HARBOR_SHARED_ENV_NAME="my-suite")
    assert record["env"]["HARBOR_SHARED_ENV_NAME"] == "my-suite"
    assert openenv_reads(record["env"]) == {"version": "2.4.5", "shared": True}


def test_a_harness_version_openenv_would_refuse_is_one_line_before_the_server_starts(rig, tmp_path):
    record, proc = recorded_server(rig, tmp_path, OPENENV_HARBOR_AGENT_VERSIONS='{"mini-swe-agent": "latest"}')
    assert record == {}
    refused_with(proc, "Harbor server", "OPENENV_HARBOR_AGENT_VERSIONS=", "exact version")


def test_a_server_of_your_own_is_told_what_it_needs_for_e2b(rig, tmp_path):
    proc = run_main([*rig.base_args(), "--sandbox", "e2b", "--tasks", "coin", "--output-dir", "out", "--check"],
                    cwd=tmp_path, **SECRETS)
    status, detail = table(proc.stdout)["Harbor server"]
    assert status == "PASS" and "HARBOR_SHARED_ENV_NAME" in detail and "OPENENV_HARBOR_AGENT_VERSIONS" in detail


# ---- a training run on e2b, its capture proxy behind a tunnel that dies mid-run
RETRY_WINDOW = 5


@pytest.fixture(scope="module")
def e2b_run(rig, tmp_path_factory):
    """Trains on `e2b` (the rig's local sandbox) with --harbor-expose auto, which picks gradio's tunnel (the rig's
    forwarder); once a checkpoint is saved the tunnel is killed. Returns (exit code, console, output dir)."""
    work = tmp_path_factory.mktemp("e2b")
    out = work / "out"
    args, env = embedded(train_args(rig, out, "--sandbox", "e2b", "--max-steps", "50", "--save-steps", "1",
                                    "--harbor-retry-window", str(RETRY_WINDOW)), work)
    env |= {"RIG_E2B_STANDIN": "1", "RIG_TUNNEL_DIR": str(work)}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=work, env=script_env(**SECRETS, **env),
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: [lines.append(line) for line in proc.stdout], daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 900
        while not (out / "checkpoint-1").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-5000:]
            time.sleep(0.5)
        os.kill(int((work / "tunnel.pid").read_text()), signal.SIGKILL)
        code = proc.wait(timeout=600)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    console = "".join(lines)
    print(console[-20000:])
    return code, console, out


def test_before_the_first_rollout_the_capture_proxy_answers_through_the_tunnel(e2b_run):
    _, console, _ = e2b_run
    status, detail = table(console)["capture URL"]
    assert status == "PASS", detail
    assert re.search(r"--harbor-expose auto: gradio\..*; (http://127\.0\.0\.1:\d+)/health reached this server's "
                     r"capture proxy from here$", detail), detail
    tunnel = re.search(r"; (http://127\.0\.0\.1:\d+)/health reached", detail)[1]
    assert f" -> {tunnel}" in (e2b_run[2] / "harbor_server.log").read_text()  # the URL the server hands the sandboxes


def test_on_e2b_the_first_rollout_builds_its_template_alone(e2b_run):
    _, _, out = e2b_run
    records = sorted((json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()),
                     key=lambda r: r["started"])
    first, others = records[0], records[1:]
    assert first["error"] is None and others, records
    # No other rollout started before the first one's sandbox was done (its wall time, as the server measured it).
    assert all(r["started"] >= first["started"] + first["wall_s"] for r in others), records[:4]


class HeldHealth(BaseHTTPRequestHandler):
    """A capture proxy whose /health answers only once `release` is set: a rollout asking it stays under way."""

    def do_GET(self):
        self.server.asked.release()
        self.server.release.wait()
        self.send_error(503)

    def log_message(self, *args):
        pass


def test_on_e2b_a_rollout_stopped_while_it_waits_for_the_first_lets_no_other_start():
    """The first rollout is alone until it ends: another, stopped while it waits its turn, opens the way to none."""
    agh = load_script()
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), HeldHealth)
    proxy.asked, proxy.release, proxy.daemon_threads = threading.Semaphore(0), threading.Event(), True
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    factory = agh.HarborSessionFactory(
        harbor_url="http://127.0.0.1:9", harness="mini-swe-agent", sandbox="e2b", reward_key="", agent_step_limit=6,
        agent_timeout_s=60, max_consecutive_failures=3, capture_url=f"http://127.0.0.1:{proxy.server_address[1]}")
    prompt = [{"harbor_task_name": "coin", "harbor_task_index": 0, "harbor_split": "s"}]
    first, waiting, stopped = (factory.create(prompt, n) for n in range(3))
    try:
        threading.Thread(target=first.wait_for_completion, daemon=True).start()
        assert proxy.asked.acquire(timeout=120), "the first rollout never started"  # a guard against a hang
        threading.Thread(target=waiting.wait_for_completion, daemon=True).start()
        stopped.close()
        assert stopped.wait_for_completion() == 1
        # The first rollout is still under way: the way the waiting rollouts watch stays shut.
        assert not agh.FIRST_ROLLOUT_ENDED.is_set()
    finally:
        for session in (waiting, first):
            session.close()
        proxy.release.set()
        proxy.shutdown()


def test_a_dead_tunnel_mid_run_ends_it_in_one_line_after_its_checkpoint(e2b_run):
    code, console, out = e2b_run
    assert code == 1, console[-3000:]
    assert rollouts(console)
    errors = [line for line in console.splitlines() if line.startswith("error:")]
    assert errors == console.strip().splitlines()[-1:], errors
    assert re.match(rf"error: training stopped: the capture proxy at http://127\.0\.0\.1:\d+ has not answered for "
                    rf"{RETRY_WINDOW}s \(last: .*\)\. Fix the cause, then relaunch with --output-dir .* --resume",
                    errors[0]), errors[0]
    assert re.search(r"\[harbor\] the capture proxy at \S+ is not answering", console)
    assert "Traceback" not in console
    # Stopped with the checkpoints saved so far (every --save-steps), the newest whole: what --resume continues.
    newest = max(out.glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    assert load_script().checkpoint_problem(newest) is None


@pytest.mark.parametrize("refusal, needles, fix", [
    ("concurrency", ["local-refused refused another sandbox (429): the plan's concurrent-sandbox limit",
                     "RateLimitException: 429"], "lower --max-inflight"),
    ("lifetime", ["local-refused refused the sandbox's lifetime (400): Harbor asks 24 h for every e2b sandbox",
                  "SandboxException: 400: Timeout cannot be greater than 1 hours"], "may live 24 h"),
])
def test_a_plan_that_refuses_harbors_sandboxes_is_named_by_the_probe(rig, tmp_path, refusal, needles, fix):
    args, env = embedded([*rig.base_args(), "--sandbox", "local-refused", "--tasks", "coin", "--output-dir", "out",
                          "--check", "--probe-rollout"], tmp_path)
    proc = run_main(args, cwd=tmp_path, RIG_SANDBOX_REFUSAL=refusal, **env)
    refused_with(proc, "probe rollout", *needles, fix)
