"""`--check`: one table, a PASS/WARN/FAIL/SKIP row per check and the fix under each failure; exit 0 only when nothing
FAILs. The same checks run before every training run. Without --harbor-url the script runs its own Harbor server.
`main()` runs in the test's own process (conftest.run_main), except where the test is about processes."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import HARNESSES, SCRIPT, SECRETS, embedded, free_port, load_script, run_main, script_env

ROW = re.compile(r"^  (PASS|WARN|FAIL|SKIP)  (\S+(?: \S+)*)\s{2,}(.*)$", re.M)


def table(stdout: str) -> dict[str, tuple[str, str]]:
    return {check: (status, detail) for status, check, detail in ROW.findall(stdout)}


def refused_with(proc, check: str, *needles: str) -> None:
    """Exit 2, the failing row in the table, and one line on stderr that says what to do."""
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert table(proc.stdout)[check][0] == "FAIL", proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr


def assert_rows_in_documented_order(rows: dict) -> None:
    """docs/troubleshooting.md lists every row the table may print, in the order --check prints them."""
    doc = (SCRIPT.parent / "docs" / "troubleshooting.md").read_text().split("## Preflight rows", 1)[1]
    cells = [line.split(" | ")[0].removeprefix("| ") for line in doc.splitlines() if line.startswith("| ")][1:]
    documented = iter(row.removesuffix(" (local)") for cell in cells for row in cell.split(", "))
    assert all(row in documented for row in rows), list(rows)


def test_a_healthy_setup_passes_and_an_external_server_is_used_as_is(rig, tmp_path):
    proc = run_main([*rig.base_args(), "--tasks", "coin", "--output-dir", "out", "--check"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = table(proc.stdout)
    assert {status for status, _ in rows.values()} <= {"PASS", "WARN", "SKIP"}, rows
    for check in ("vLLM reachable", "served model", "capture tier", "tool calls", "weight transfer", "dtype",
                  "precision", "checkpoints", "Harbor server", "harness", "sandbox", "server's engine",
                  "session slots", "dataset", "tasks"):
        assert rows[check][0] == "PASS", (check, rows[check])
    assert rows["Harbor server"][1].endswith("(yours)")
    # Decided by vLLM's own config, not by a probe that a near-uniform model leaves undecided.
    assert "/server_info: logprobs_mode processed_logprobs" in rows["capture tier"][1]
    assert rows["dtype"][1] == "vLLM serves float32, the trainer's weights are float32 (--dtype float32)"
    assert re.match(r"~\d+\.\d MB each \(float32 weights \+ 2 AdamW moments\); 2 kept",
                    rows["checkpoints"][1]), rows["checkpoints"]
    # The CPU rig has no GPU: the GPU-only rows say so instead of passing.
    assert rows["trainer GPU"] == ("SKIP", "no CUDA device visible: the trainer runs on CPU")
    assert rows["attention kernel"][0] == "SKIP" and "kernels-community/flash-attn3" in rows["attention kernel"][1]
    assert rows["reward key"][0] == "SKIP" and "--probe-rollout" in rows["reward key"][1]
    assert not (tmp_path / "out" / "harbor_server.log").exists()
    assert "async_grpo_harbor\n" not in proc.stdout, "training set-up started"
    assert_rows_in_documented_order(rows)


def test_a_dev_mode_vllm_beyond_loopback_is_flagged_whatever_its_backend(make_rig, tmp_path):
    # vLLM's default --host binds every interface; dev mode (which the weight push needs) serves /collective_rpc and
    # the weight-transfer routes there. With nccl nothing is unpickled, and a multi-node run must reach vLLM from
    # another node, so it warns rather than refuses.
    engine = make_rig("--host", "0.0.0.0", harbor=False)  # the nccl backend, as the README's two-GPU command
    port = engine.engine_url.rsplit(":", 1)[1]
    dead = ["--harbor-url", f"http://127.0.0.1:{free_port()}", "--tasks", "coin", "--check"]
    proc = run_main([*engine.base_args(), *dead], cwd=tmp_path)
    status, detail = table(proc.stdout)["vLLM on loopback"]
    assert status == "WARN" and detail == (f"vLLM listens on 0.0.0.0 port {port}, beyond this host: in dev mode "
                                           "whoever reaches vLLM can pause it or load other weights into it"), detail
    assert "fix: restart vLLM with --host 127.0.0.1, or (multi-node) keep its port private" in proc.stdout
    # Reached by another address than loopback (vLLM on another node), the same.
    url = engine.engine_url.replace("127.0.0.1", "0.0.0.0")
    args = [*engine.base_args(), *dead]
    args[args.index("--vllm-url") + 1] = url
    status, detail = table(run_main(args, cwd=tmp_path).stdout)["vLLM on loopback"]
    assert status == "WARN" and detail.startswith(f"--vllm-url {url} is not a loopback address: in dev mode"), detail


def trainer_gpu_row(script, backend: str) -> tuple[str, str, str]:
    pf = script.Preflight(script.parse_args(["--vllm-url", "http://127.0.0.1:8000"]))
    pf.served = {"weight_transfer": backend}
    script.check_trainer_gpu(pf)
    (_, status, detail, fix), = pf.rows
    return status, detail, fix


def test_a_cpu_trainer_for_an_nccl_vllm_is_refused(monkeypatch):
    # The rig stands in for NCCL on CPU (tests/rig/cpu_trainer.py, (d)); a CPU build of torch has none.
    script = load_script()
    monkeypatch.setattr(script.torch.distributed, "is_nccl_available",
                        getattr(script.torch.distributed.is_nccl_available, "_agh_original",
                                script.torch.distributed.is_nccl_available))
    status, detail, fix = trainer_gpu_row(script, "nccl")
    assert status == "FAIL" and detail.startswith(f"no CUDA device visible to the trainer (torch "
                                                  f"{script.torch.__version__}, a CPU build; "), detail
    assert detail.endswith("NCCL moves GPU memory only"), detail
    assert fix.startswith("run this script on a GPU of its own with the CUDA torch") and \
        "NVIDIA driver >= 580" in fix, fix


@pytest.mark.parametrize("driver, found, fix", [
    ("550.54.15", "550.54.15", "install NVIDIA driver >= 580 (Linux)"),
    (None, "none (nvidia-smi fails)", "install NVIDIA driver >= 580 (Linux)"),
    ("580.65.06", "580.65.06", "make the trainer's GPU visible: CUDA_VISIBLE_DEVICES="),
])
def test_a_cuda_build_of_torch_that_sees_no_gpu_names_the_driver(monkeypatch, tmp_path, driver, found, fix):
    # torch 2.13's wheels are built for CUDA 13.0; with a driver older than that, torch sees no device at all.
    script = load_script()
    monkeypatch.setattr(script.torch.version, "cuda", "13.0")
    if driver:  # nvidia-smi as it answers the query
        smi = tmp_path / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\n[ \"$1\" = --query-gpu=driver_version ] && echo {driver}\n")
        smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}" if driver else str(tmp_path))
    for backend in ("nccl", "ipc"):
        status, detail, row_fix = trainer_gpu_row(script, backend)
        assert status == "FAIL" and detail == (f"torch {script.torch.__version__} is built for CUDA 13.0 but sees no "
                                               f"CUDA device (CUDA_VISIBLE_DEVICES="
                                               f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}; NVIDIA driver: "
                                               f"{found})"), detail
        assert row_fix.startswith(fix), row_fix


def test_probe_rollout_on_its_own_server_confirms_the_reward_key_then_stops_the_server(rig, tmp_path):
    # With a list of harnesses, the probe runs the first.
    args, env = embedded([*rig.base_args(), "--tasks", "coin2", "--reward-key", "correct", "--output-dir", "out",
                          "--check", "--probe-rollout", "--agent-step-limit", "6", "--harness", ",".join(HARNESSES)],
                         tmp_path)
    proc = run_main(args, cwd=tmp_path, **env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = table(proc.stdout)
    assert_rows_in_documented_order(rows)
    started = re.match(r"started (http://127\.0\.0\.1:\d+) in \d+s \(log: out/harbor_server\.log\)",
                       rows["Harbor server"][1])
    assert started, rows["Harbor server"]
    assert rows["probe rollout"][0] == "PASS" and "train tier" in rows["probe rollout"][1]
    assert rows["reward key"][0] == "PASS" and "correct, format emitted" in rows["reward key"][1]
    # The rule cannot know whether the rig's `local` sandbox reaches this host's loopback; the probe rollout did.
    assert rows["capture URL"][0] == "PASS", rows["capture URL"]
    assert re.match(r"--harbor-expose auto: direct\. .*not known here; http://127\.0\.0\.1:\d+/health reached this "
                    r"server's capture proxy from here; the probe rollout's harness reached it \(\d+ model calls\)$",
                    rows["capture URL"][1]), rows["capture URL"]
    assert "openenv" in (tmp_path / "out" / "harbor_server.log").read_text().lower()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{started[1]}/harbor_env/splits", timeout=5)


def test_a_reward_key_the_tasks_do_not_emit_names_the_ones_they_do(rig, tmp_path):
    proc = run_main([*rig.base_args(), "--tasks", "coin2", "--reward-key", "score", "--check", "--probe-rollout",
                     "--agent-step-limit", "6"], cwd=tmp_path)
    refused_with(proc, "reward key", "--reward-key 'score' is not emitted by coin2; it emits: correct, format")


def test_a_turn_cap_the_context_cannot_hold_is_named_not_blamed_on_the_base_url(rig, tmp_path):
    # The server this script starts caps turns at --max-completion-length; 1024 + the ~1.1k first prompt exceed the
    # rig's 1,600-token context, which vLLM (and the stand-in) refuse with a 400 on every call.
    args, env = embedded([*rig.base_args(), "--tasks", "coin2", "--check", "--probe-rollout", "--agent-step-limit",
                          "2", "--max-completion-length", "1024", "--output-dir", "out"], tmp_path)
    proc = run_main(args, cwd=tmp_path, **env)
    refused_with(proc, "probe rollout", "vLLM refused the agent's first call as too long for its context",
                 "--max-completion-length) plus the task's prompt must fit vLLM's --max-model-len")
    assert "wrong base URL" not in proc.stderr


@pytest.mark.parametrize("engine_flags, failing", [
    # Without dev mode the capture tier is measured (two temperatures); with it, vLLM's config says so.
    (["--logprobs-mode", "raw_logprobs", "--no-tool-parser", "--no-dev-mode"],
     {"capture tier": "--logprobs-mode processed_logprobs", "tool calls": "--enable-auto-tool-choice --tool-call-parser",
      "weight transfer": "VLLM_SERVER_DEV_MODE=1"}),
    (["--logprobs-mode", "raw_logprobs", "--no-weight-transfer"],
     {"capture tier": "/server_info: logprobs_mode raw_logprobs", "weight transfer": "--weight-transfer-config"}),
])
def test_a_vllm_launched_without_a_flag_the_trainer_needs_is_refused_naming_it(make_rig, tmp_path, engine_flags,
                                                                                 failing):
    engine = make_rig(*engine_flags, harbor=False)
    proc = run_main([*engine.base_args(), "--harbor-url", f"http://127.0.0.1:{free_port()}", "--tasks", "coin",
                     "--check"], cwd=tmp_path)
    first_check, first_fix = next(iter(failing.items()))
    refused_with(proc, first_check, first_fix)
    for check, fix in failing.items():
        assert table(proc.stdout)[check][0] == "FAIL", proc.stdout
        assert fix in proc.stdout, (check, fix)


def test_missing_sandbox_credentials_name_the_variable(rig, tmp_path):
    args, env = embedded([*rig.base_args(), "--sandbox", "e2b", "--tasks", "coin", "--output-dir", "out"], tmp_path)
    proc = run_main(args, cwd=tmp_path, **env, E2B_API_KEY="")
    refused_with(proc, "credentials", "E2B_API_KEY is not set")
    assert not (tmp_path / "out" / "harbor_server.log").exists(), "the server was started anyway"


def test_a_served_bfloat16_is_compared_with_the_trainers_weights_as_trl_compares_them(make_rig, tmp_path):
    # vLLM serves this float32 checkpoint in bfloat16 (its --dtype auto), as the stand-in does by default.
    engine = make_rig("--dtype", "auto", harbor=False)
    dead = ["--harbor-url", f"http://127.0.0.1:{free_port()}", "--tasks", "coin", "--check"]
    fp32 = table(run_main([*engine.base_args(), *dead], cwd=tmp_path).stdout)
    # On CPU the trainer scores in its weights' dtype: float32 against a bf16 engine is a real gap.
    assert fp32["dtype"][0] == "WARN" and fp32["dtype"][1].startswith(
        "vLLM serves bfloat16, the trainer's weights are float32 (--dtype float32); TRL warns about this"), fp32
    assert fp32["precision"][0] == "PASS"
    bf16 = table(run_main([*engine.base_args(), *dead, "--dtype", "bfloat16"], cwd=tmp_path).stdout)
    assert bf16["dtype"] == ("PASS", "vLLM serves bfloat16, the trainer's weights are bfloat16 (--dtype bfloat16)")
    # ... and at the default learning rate (1e-6) its updates would not land.
    assert bf16["precision"][0] == "WARN" and "below half the bfloat16 spacing at |w| = 0.02 (6.1e-05)" in \
        bf16["precision"][1], bf16["precision"]
    assert "~1.2 MB each (bfloat16 weights" in bf16["checkpoints"][1], bf16["checkpoints"]


def test_a_low_precision_trainer_under_fsdp_is_refused_before_its_pushes_mismatch(rig, tmp_path):
    # accelerate launch with slurm/fsdp2.yaml sets this; FSDP2 upcasts the weights after TRL announced their dtype.
    proc = run_main([*rig.base_args(), "--tasks", "coin", "--dtype", "bfloat16", "--learning-rate", "1e-3",
                     "--check"], cwd=tmp_path, ACCELERATE_USE_FSDP="true")
    refused_with(proc, "precision", "--dtype bfloat16 under FSDP", "--dtype float32 (FSDP keeps float32 weights")


def test_on_a_gpu_the_served_dtype_is_judged_against_bf16_autocast_whatever_the_weights(tiny_model):
    # accelerate runs the trainer's forward under bf16 autocast on CUDA (build_trainer's bf16=True), so the engine
    # must serve bfloat16 whatever --dtype is; TRL's own warning compares weight dtypes only.
    script = load_script()
    rows = {}
    for served, dtype in [("bfloat16", "float32"), ("bfloat16", "bfloat16"), ("float32", "float32"),
                          ("float16", "float16")]:
        args = script.parse_args(["--model", str(tiny_model), "--dtype", dtype])
        args.bf16 = True  # what the config says on a GPU
        pf = script.Preflight(args)
        pf.served, pf.vllm_config = {"dtype": served}, {}  # vLLM's /server_info answered
        script.check_dtype(pf)
        rows[served, dtype] = pf.rows[0]
    assert rows["bfloat16", "float32"][1:3] == ("PASS", "vLLM serves bfloat16 and the trainer scores under bfloat16 "
                                                "autocast, the trainer's weights are float32 (--dtype float32)")
    assert rows["bfloat16", "bfloat16"][1] == "PASS"
    for served, dtype in [("float32", "float32"), ("float16", "float16")]:
        check, status, detail, fix = rows[served, dtype]
        assert status == "WARN" and detail.startswith(f"vLLM serves {served}, the trainer scores under bfloat16 "
                                                      "autocast on GPU"), detail
        assert fix == "serve with vLLM's --dtype bfloat16"


def context_row(script, max_model_len: int, *flags: str) -> tuple[str, str]:
    pf = script.Preflight(script.parse_args(["--vllm-url", "http://127.0.0.1:8000", *flags]))
    pf.served = {"max_model_len": max_model_len}
    script.check_context(pf)
    (_, status, detail, _), = pf.rows
    return status, detail


def test_the_context_row_counts_the_prompt_and_names_the_command_output_it_cannot_count():
    # Each turn re-sends the conversation: the task's prompt, every completion, and the output of every command the
    # harness ran, which the policy decides. The defaults leave 548 tokens of a 32k context for all of that output.
    script = load_script()
    assert context_row(script, 32_768) == (
        "PASS", "~1,500-token prompt + 30 turns x 1024 tokens = 32,220 fit max_model_len 32,768, leaving 548 tokens "
                "for command output (mini-swe-agent shows up to 10,000 characters of each)")
    # The completions alone fit, the prompt with them does not.
    status, detail = context_row(script, 31_000)
    assert status == "WARN" and detail == "~1,500-token prompt + 30 turns x 1024 tokens = 32,220 > vLLM's " \
                                          "max_model_len 31,000", detail
    assert "the harness shows back" in context_row(script, 32_768, "--harness", "claude-code")[1]


def test_the_command_output_the_context_row_names_is_what_the_installed_mini_swe_agent_shows():
    # Harbor runs mini-swe-agent with `-c mini`: its packaged config/mini.yaml renders each command's output.
    # Found without importing it (its import prints a banner).
    where = subprocess.run([os.environ["AGH_SERVER_PYTHON"], "-c", "import importlib.util; print(importlib.util."
                            "find_spec('minisweagent').submodule_search_locations[0])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    template = open(os.path.join(where, "config", "mini.yaml")).read().split("observation_template:", 1)[1].split("format_error_template:", 1)[0]
    chars = load_script().MINI_SWE_AGENT_OUTPUT_CHARS
    assert f"output.output | length < {chars}" in template, template
    assert f"output.output[:{chars // 2}]" in template and f"output.output[-{chars // 2}:]" in template, template


def test_the_precision_row_is_what_adamw_does():
    # What the row (and docs/flags.md under --dtype) says, measured with torch's own AdamW on CPU: at the default
    # learning rate a bfloat16 weight of Qwen3's initializer scale does not move; a float32 one does.
    import torch

    weights = torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * 0.02
    moved = {}
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.nn.Parameter(weights.to(dtype))
        before = w.detach().clone()
        w.grad = torch.randn(w.shape).to(dtype)
        torch.optim.AdamW([w], lr=1e-6, weight_decay=0.0).step()
        moved[dtype] = (w.detach() != before).float().mean().item()
    assert moved[torch.float32] > 0.999
    assert moved[torch.bfloat16] < 0.05, moved  # only weights far smaller than 0.02 (measured: 2 %)


# What auto picks when a tunnel is needed: cloudflared where it is installed, else gradio's (it ships with openenv).
TUNNEL = "cloudflare" if shutil.which("cloudflared") else "gradio"


@pytest.mark.parametrize("flags, status, needles", [
    # cloud sandbox, harness inside it: a tunnel, named with the reason
    (["--sandbox", "e2b"], "PASS",
     [f"--harbor-expose auto: {TUNNEL}. mini-swe-agent runs inside the e2b sandbox, which runs off this host"]),
    # a host-side harness reaches loopback even with a cloud sandbox
    (["--sandbox", "e2b", "--harness", "terminus-2"], "PASS",
     ["--harbor-expose auto: direct. terminus-2 runs host-side", "HOST_SIDE_AGENTS"]),
    # docker's bridge network: the container's 127.0.0.1 is its own
    (["--sandbox", "docker", "--harbor-expose", "direct"], "FAIL",
     ["advertises 127.0.0.1, which the harness cannot reach", "docker's bridge network",
      f"--harbor-expose {TUNNEL}"]),
    # a sandbox the rule cannot judge: a warning that names the ground truth
    (["--sandbox", "local"], "WARN",
     ["--harbor-expose auto: direct. mini-swe-agent runs inside the local sandbox; whether that reaches this host's "
      "127.0.0.1 is not known here", "fix: confirm with --check --probe-rollout"]),
])
def test_the_capture_url_is_picked_for_where_the_harness_runs(tmp_path, flags, status, needles):
    # vLLM is down, so no Harbor server (nor a tunnel) starts: the row is judged from flags and environment alone.
    proc = run_main(["--vllm-url", f"http://127.0.0.1:{free_port()}", "--check", *flags], cwd=tmp_path, **SECRETS)
    rows = table(proc.stdout)
    assert rows["capture URL"][0] == status, proc.stdout
    assert rows["credentials"][0] == "PASS" and rows["Harbor server"][0] == "SKIP", proc.stdout
    for needle in needles:
        assert needle in proc.stdout, needle
    assert SECRETS["E2B_API_KEY"] not in proc.stdout + proc.stderr


@pytest.mark.parametrize("tasks, problem", [
    ("@missing.txt", "--tasks @missing.txt: cannot read missing.txt"),
    ("0-3,9-4", "--tasks: range '9-4' is backwards; write 4-9"),
])
def test_with_vllm_down_every_check_that_needs_no_server_still_reports(tmp_path, tasks, problem):
    url = f"http://127.0.0.1:{free_port()}"
    proc = run_main(["--vllm-url", url, "--tasks", tasks, "--sandbox", "e2b", "--output-dir", "/proc/agh-out",
                       "--check"], cwd=tmp_path, E2B_API_KEY="")
    rows = table(proc.stdout)
    assert {check: rows[check][0] for check in ("vLLM reachable", "tasks", "output dir", "credentials",
                                                "Harbor server")} == \
        {"vLLM reachable": "FAIL", "tasks": "FAIL", "output dir": "FAIL", "credentials": "FAIL",
         "Harbor server": "SKIP"}, proc.stdout
    assert rows["tasks"][1].startswith(problem), rows["tasks"]
    assert rows["vLLM reachable"][1].startswith(f"vLLM is not reachable at {url}")
    # One error line: the first failure, and how many more the table holds.
    refused_with(proc, "output dir", "error: cannot write to /proc/agh-out", "(and 3 more failed checks above)")


def test_a_harbor_server_that_dies_at_start_shows_its_log(rig, tmp_path):
    args, env = embedded([*rig.base_args(), "--tasks", "coin", "--output-dir", "out"], tmp_path)
    args[-1] = f"{sys.executable} -c 'print(\"no such dataset, says the server\"); raise SystemExit(3)'"
    proc = run_main(args, cwd=tmp_path, **env)
    refused_with(proc, "Harbor server", "the Harbor server exited with code 3 while starting (log: "
                                        "out/harbor_server.log)")
    assert "no such dataset, says the server" in proc.stdout


@pytest.mark.parametrize("how", ["ctrl-c", "sigkill"])
def test_its_own_harbor_server_never_outlives_it(rig, tmp_path, how):
    # Ctrl-C reaches the whole process group (the server runs in its own session, so the script must stop it);
    # SIGKILL runs no cleanup of ours at all. SIGTERM takes the same way out as a normal exit (tests/test_preemption.py).
    args, env = embedded([*rig.base_args(), "--tasks", "coin", "--output-dir", "out", "--check", "--probe-rollout",
                          "--agent-step-limit", "6"], tmp_path)
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=tmp_path, env=script_env(**env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    log = tmp_path / "out" / "harbor_server.log"
    url = None
    deadline = time.monotonic() + 300
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        port = re.search(r" --port (\d+) ", log.read_text()) if log.exists() else None
        try:
            if port:
                urllib.request.urlopen(f"http://127.0.0.1:{port[1]}/harbor_env/splits", timeout=5)
                url = f"http://127.0.0.1:{port[1]}"
        except OSError:
            pass
        time.sleep(0.5)
    assert url, proc.communicate()[0][-3000:]
    {"ctrl-c": lambda: os.killpg(proc.pid, signal.SIGINT), "sigkill": lambda: proc.send_signal(signal.SIGKILL)}[how]()
    output = proc.communicate(timeout=120)[0]
    assert "Traceback" not in output, output[-3000:]
    deadline = time.monotonic() + 60  # a bound on the test, not a measurement: the server winds its sessions down
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{url}/harbor_env/splits", timeout=5)
        except OSError:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the Harbor server at {url} outlived the script ({how})")


def test_under_a_multi_process_launch_rank_0_alone_checks_and_starts_the_server(rig, tmp_path):
    # What `accelerate launch` / torchrun give each process. No --run-name: each rank would draw its own.
    args, env = embedded([*rig.base_args(), "--tasks", "coin", "--check"], tmp_path)
    dist = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              env=script_env(**env, **dist, RANK=str(rank), LOCAL_RANK=str(rank)))
             for rank in (0, 1)]
    outputs = [proc.communicate(timeout=600)[0] for proc in ranks]
    assert [proc.returncode for proc in ranks] == [0, 0], outputs
    assert "PASS  Harbor server" in outputs[0] and "preflight" not in outputs[1], outputs
    assert len(list(tmp_path.glob("runs/*/harbor_server.log"))) == 1


def test_a_server_sampling_from_another_engine_fails_unless_allowed(rig, tmp_path):
    # Weights pushed into a vLLM no rollout uses would train nothing: the same engine under another name (localhost
    # for 127.0.0.1) is indistinguishable from another engine, so it takes an explicit flag.
    args = [*rig.base_args(), "--tasks", "coin", "--output-dir", "out", "--check"]
    args[args.index("--vllm-url") + 1] = rig.engine_url.replace("127.0.0.1", "localhost")
    refused_with(run_main(args, cwd=tmp_path), "server's engine", "--allow-engine-mismatch")
    proc = run_main([*args, "--allow-engine-mismatch"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert table(proc.stdout)["server's engine"][0] == "WARN"
