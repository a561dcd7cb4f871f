"""One GPU: vLLM serves `--weight-transfer-config '{"backend":"ipc"}'` on the trainer's own card and the trainer pushes
its weights as CUDA-IPC handles over HTTP. The script follows the backend vLLM's /server_info announces; the
preflight refuses what would break or expose that (an unknown backend, pickle refused, a server reachable beyond this
host, several trainer ranks); every push hands each parameter over exactly once, in bounded chunks, as vLLM's
`parse_update_info` decodes it, and the engine ends up holding exactly the trainer's weights. On CPU the handles are
the rig's stand-in for CUDA IPC (tests/rig/cpu_trainer.py, (e)); the engine stand-in decodes them as vLLM does."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

import pytest
import torch
from conftest import (SCRIPT, Rig, default_filter, free_port, get_json, load_script, run_main, run_script, script_env,
                      train_args)
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file
from test_check import refused_with, table

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "rig"))
import cpu_trainer  # noqa: E402

cpu_trainer.install()  # this process drives the script's IPC client itself in the push tests

IPC = ["--weight-transfer-config", '{"backend":"ipc"}']
ALLOW_PICKLE = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
SYNC_ORDER = ["pause?mode=keep", "start_weight_update", "update_weights", "finish_weight_update", "resume"]


@pytest.fixture(scope="module")
def ipc_rig(tmp_path_factory, tiny_model):
    """`VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1 vllm serve ... --host 127.0.0.1
    --weight-transfer-config '{"backend":"ipc"}'`, and a Harbor server sampling from it."""
    rig = Rig(tmp_path_factory.mktemp("ipc-rig"), tiny_model, IPC, engine_env=ALLOW_PICKLE)
    yield rig
    rig.stop()


def engine_weights(rig) -> dict[str, torch.Tensor]:
    with urllib.request.urlopen(f"{rig.engine_url}/stand_in/weights", timeout=60) as reply:
        return load_safetensors(reply.read())


def syncs(stats: dict, since: int = 0) -> list[list[str]]:
    """The weight-sync calls after the first `since`, one list per push (a pause opens each)."""
    pushes = []
    for call in stats["weight_sync"][since:]:
        if call.startswith("pause") or not pushes:
            pushes.append([])
        pushes[-1].append(call)
    return pushes


def assert_whole_push(push: dict, params: dict[str, torch.Tensor], chunk_bytes: int) -> None:
    """As vLLM decoded it: every parameter once, announced as what arrived, no chunk over the bound but a lone
    tensor larger than it."""
    names = [n for chunk in push["chunks"] for n in chunk["names"]]
    assert sorted(names) == sorted(params) and len(names) == len(set(names)), names
    for chunk in push["chunks"]:
        announced = [[d, s] for d, s in zip(chunk["dtype_names"], chunk["shapes"])]
        assert announced == chunk["received"], chunk["names"]
        assert announced == [[str(params[n].dtype).removeprefix("torch."), list(params[n].shape)]
                             for n in chunk["names"]]
        assert chunk["bytes"] <= chunk_bytes or len(chunk["names"]) == 1, (chunk["bytes"], chunk["names"])


# ---- the preflight
def test_a_shared_card_engine_passes_the_check_and_says_so(ipc_rig, tmp_path):
    proc = run_main([*ipc_rig.base_args(), "--tasks", "coin", "--output-dir", "out", "--check"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = table(proc.stdout)
    assert rows["weight transfer"] == ("PASS", "enabled (ipc)")
    port = ipc_rig.engine_url.rsplit(":", 1)[1]
    assert rows["vLLM on loopback"] == ("PASS", f"vLLM listens on 127.0.0.1 port {port} only")
    assert rows["same GPU"][0] == "SKIP" and rows["trainer GPU"][0] == "SKIP"  # no CUDA here
    assert "trainer ranks" not in rows


def test_an_unknown_backend_is_refused_naming_the_two_it_takes(make_rig, tmp_path):
    engine = make_rig("--weight-transfer-config", '{"backend":"sharded_rdt"}', harbor=False)
    proc = run_main([*engine.base_args(), "--harbor-url", f"http://127.0.0.1:{free_port()}", "--tasks", "coin",
                     "--check"], cwd=tmp_path)
    refused_with(proc, "weight transfer", "'sharded_rdt'", '{"backend":"nccl"}', '{"backend":"ipc"}')


def test_a_server_that_would_unpickle_for_the_network_or_refuse_to_is_refused(make_rig, tmp_path):
    # vLLM's default --host binds every interface; without VLLM_ALLOW_INSECURE_SERIALIZATION it refuses every push.
    engine = make_rig(*IPC, "--host", "0.0.0.0", harbor=False)
    proc = run_main([*engine.base_args(), "--harbor-url", f"http://127.0.0.1:{free_port()}", "--tasks", "coin",
                     "--check"], cwd=tmp_path)
    refused_with(proc, "weight transfer", "VLLM_ALLOW_INSECURE_SERIALIZATION=1")
    port = engine.engine_url.rsplit(":", 1)[1]
    assert table(proc.stdout)["vLLM on loopback"] == (
        "FAIL", f"vLLM listens on 0.0.0.0 port {port}, beyond this host: with ipc vLLM unpickles every weight push, "
                "so whoever reaches it can run code as vLLM's user")
    assert "fix: restart vLLM with --host 127.0.0.1" in proc.stdout


def test_a_vllm_url_beyond_loopback_is_refused(ipc_rig, tmp_path):
    # What vLLM's start-up line prints: on Linux 0.0.0.0 reaches this host's own sockets.
    url = ipc_rig.engine_url.replace("127.0.0.1", "0.0.0.0")
    args = [*ipc_rig.base_args(), "--tasks", "coin", "--output-dir", "out", "--check"]
    args[args.index("--vllm-url") + 1] = url
    refused_with(run_main(args, cwd=tmp_path), "vLLM on loopback", f"--vllm-url {url} is not a loopback address",
                 "--host 127.0.0.1")


def test_two_trainer_ranks_are_refused_on_every_rank(ipc_rig, tmp_path):
    args = [*ipc_rig.base_args(), "--tasks", "coin", "--check"]
    dist = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=script_env(**dist, RANK=str(rank), LOCAL_RANK=str(rank)))
             for rank in (0, 1)]
    (stdout, stderr), _ = [proc.communicate(timeout=600) for proc in ranks]
    assert [proc.returncode for proc in ranks] == [2, 2], (stdout, stderr)
    assert table(stdout)["trainer ranks"][0] == "FAIL", stdout
    # Rank 0's last line (accelerate warns about thread counts before it).
    error = stderr.strip().splitlines()[-1]
    assert error.startswith("error: 2 trainer processes (WORLD_SIZE)") and "launch one trainer process" in error
    assert "Traceback" not in stdout + stderr


def test_on_a_shared_host_a_loopback_vllm_is_still_flagged(ipc_rig, tmp_path):
    # A SLURM node runs other users' jobs: each of them reaches 127.0.0.1, and so vLLM's unpickling.
    proc = run_main([*ipc_rig.base_args(), "--tasks", "coin", "--output-dir", "out", "--check"], cwd=tmp_path,
                    SLURM_JOB_ID="4242")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    status, detail = table(proc.stdout)["vLLM on loopback"]
    assert status == "WARN" and "this host is shared (SLURM_JOB_ID=4242" in detail, detail
    assert "every local user reaches its loopback" in detail and "can run code as vLLM's user" in detail, detail
    assert "fix: run the job on a node of its own (SLURM: --exclusive)" in proc.stdout


def test_a_cpu_trainer_beside_an_ipc_vllm_is_refused(monkeypatch):
    # This test process stands in for CUDA IPC (tests/rig/cpu_trainer.py, (f)); a CPU trainer without it shares no
    # CUDA memory at all.
    from torch.multiprocessing import reductions

    monkeypatch.setattr(reductions, "reduce_tensor", reductions.reduce_tensor._agh_original)
    script = load_script()
    pf = script.Preflight(script.parse_args(["--vllm-url", "http://127.0.0.1:8000"]))
    pf.served = {"weight_transfer": "ipc"}
    script.check_trainer_gpu(pf)
    script.check_same_gpu(pf)
    rows = {check: (status, detail, fix) for check, status, detail, fix in pf.rows}
    status, detail, fix = rows["trainer GPU"]
    assert status == "FAIL" and "CUDA IPC cannot push weights from a CPU trainer" in detail, detail
    assert "run this script on vLLM's GPU" in fix, fix
    assert rows["same GPU"][0] == "SKIP"


@pytest.mark.parametrize("trainer, listed, name", [
    ("MIG-6f2a0000-0000-4000-8000-000000000001", "0e1de000-0000-4000-8000-0000000000b2", "NVIDIA H200"),
    ("0e1de000-0000-4000-8000-0000000000b2", "mig-6f2a0000-0000-4000-8000-000000000002", "NVIDIA H200"),
    ("6f2a0000-0000-4000-8000-000000000001", "0e1de000-0000-4000-8000-0000000000b2", "NVIDIA H200 MIG 3g.71gb")])
def test_under_mig_the_same_gpu_row_says_it_could_not_verify_instead_of_failing(monkeypatch, trainer, listed, name):
    # A MIG instance's UUID is not its parent GPU's; nvidia-smi may list vLLM under either.
    from types import SimpleNamespace

    script = load_script()
    pf = script.Preflight(script.parse_args(["--vllm-url", "http://127.0.0.1:8000"]))
    monkeypatch.setattr(script.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(script.torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(uuid=trainer, name=name))
    pf.gpu_apps = {listed: [(999999, "VLLM::EngineCore", 40.0)]}  # what nvidia-smi lists
    script.check_same_gpu(pf)
    (check, status, detail, fix), = pf.rows
    assert (check, status) == ("same GPU", "WARN"), (status, detail)
    assert "could not be verified" in detail and "MIG-<UUID" in fix, (detail, fix)


@pytest.mark.parametrize("launch", ["another job", "this run's other rank"])
def test_under_nccl_another_jobs_process_on_the_trainers_gpu_is_a_warning(monkeypatch, launch):
    """On a shared node another job's process on the trainer's card may grow into the memory the trainer needs; this
    run's other ranks, started by the same launcher, hold their GPUs on purpose."""
    from types import SimpleNamespace

    script = load_script()
    pf = script.Preflight(script.parse_args(["--vllm-url", "http://127.0.0.1:8000"]))
    pf.served = {"weight_transfer": "nccl"}
    monkeypatch.setattr(script.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(script.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(script.torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(uuid="0e1de000-0000-4000-8000-0000000000a1",
                                                            name="NVIDIA H100 80GB HBM3"))
    other = subprocess.Popen(["sleep", "60"])  # its parent is this process: the launcher, for the rank case
    if launch == "this run's other rank":
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setattr(os, "getppid", os.getpid)
    pf.gpu_apps = {"0e1de000-0000-4000-8000-0000000000a1": [(other.pid, "python train.py", 40.0)]}
    try:
        script.check_trainer_gpu(pf)
    finally:
        other.kill()
        other.wait()
    (check, status, detail, fix), = pf.rows
    if launch == "another job":
        assert (check, status) == ("trainer GPU", "WARN"), (status, detail)
        assert detail == ("cuda:0 (NVIDIA H100 80GB HBM3): 1 other process(es) hold 40.0 GiB, which may grow into the "
                          "trainer's memory") and "CUDA_VISIBLE_DEVICES" in fix, (detail, fix)
    else:
        assert (check, status, detail) == ("trainer GPU", "PASS", "cuda:0 (NVIDIA H100 80GB HBM3): no other process on "
                                                                  "it"), (status, detail)


@pytest.mark.parametrize("backend, vllm_on, trainer_gpu, same_gpu", [
    ("nccl", "mine", "FAIL", None), ("ipc", "mine", "PASS", "PASS"), ("ipc", "other", "PASS", "FAIL")])
def test_the_gpu_rows_find_vllm_by_its_process_title_on_the_gpus_nvidia_smi_lists(monkeypatch, tmp_path, backend,
                                                                                 vllm_on, trainer_gpu, same_gpu):
    # vLLM titles its GPU processes VLLM::EngineCore; nvidia-smi lists them by GPU UUID, under whatever name it sees.
    from types import SimpleNamespace

    mine, other = "0e1de000-0000-4000-8000-0000000000a1", "0e1de000-0000-4000-8000-0000000000b2"
    engine = subprocess.Popen(["bash", "-c", 'exec -a "VLLM::EngineCore" sleep 60'])
    smi = tmp_path / "nvidia-smi"
    uuid = mine if vllm_on == "mine" else other
    smi.write_text(f"#!/bin/sh\n[ \"$1\" = --query-compute-apps=gpu_uuid,pid,used_memory,process_name ] && "
                   f"echo 'GPU-{uuid}, {engine.pid}, 40960, python'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    script = load_script()
    pf = script.Preflight(script.parse_args(["--vllm-url", "http://127.0.0.1:8000"]))
    pf.served = {"weight_transfer": backend}
    monkeypatch.setattr(script.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(script.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(script.torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(uuid=mine, name="NVIDIA H100 80GB HBM3"))
    try:
        script.check_trainer_gpu(pf)
        if pf.ipc:
            script.check_same_gpu(pf)
    finally:
        engine.kill()
        engine.wait()
    rows = {check: (status, detail, fix) for check, status, detail, fix in pf.rows}
    status, detail, fix = rows["trainer GPU"]
    assert status == trainer_gpu, rows
    if vllm_on == "mine":
        assert f"cuda:0 (NVIDIA H100 80GB HBM3) is vLLM's: pid {engine.pid} holds 40.0 GiB" in detail, detail
    if backend == "nccl":
        assert "give vLLM and the trainer different GPUs" in fix and "same GPU" not in rows, rows
    elif same_gpu == "PASS":
        assert rows["same GPU"][:2] == ("PASS", f"cuda:0 (NVIDIA H100 80GB HBM3, GPU-{mine}) is vLLM's GPU (pid "
                                                f"{engine.pid})"), rows
    else:
        status, detail, fix = rows["same GPU"]
        assert status == "FAIL" and detail.startswith(f"vLLM runs on GPU-{other} (pid {engine.pid})"), detail
        assert fix == f"start this script with CUDA_VISIBLE_DEVICES=GPU-{other}", fix


# ---- the pushes, driven as TRL's trainer drives a WeightTransferProtocol
@pytest.fixture(autouse=True)
def accelerate_state():
    from accelerate import PartialState

    PartialState(cpu=True)  # what TRL's VLLMClient logs through; the script's config creates it in a run


def test_pushes_hand_every_parameter_over_once_in_bounded_chunks(ipc_rig, tiny_model):
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    params = dict(_iter_vllm_named_params(model))
    bound = max(t.nbytes for t in params.values()) // 3  # several chunks; the largest tensors go alone
    transfer = load_script().CudaIpcWeightTransfer(ipc_rig.engine_url, 60, chunk_bytes=bound)
    before = get_json(f"{ipc_rig.engine_url}/stand_in/stats")
    transfer.init_weight_transfer()
    for scale in (0.5, 2.0):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)
        transfer.pause()
        # As the LoRA merge streams them: fresh tensors, alive only while the client holds them.
        transfer.send_weights((name, p.detach() + 0) for name, p in _iter_vllm_named_params(model))
        transfer.resume()
        served = engine_weights(ipc_rig)
        assert all(torch.equal(served[n], p) for n, p in model.state_dict().items())
    stats = get_json(f"{ipc_rig.engine_url}/stand_in/stats")
    calls = syncs(stats, len(before["weight_sync"]))
    assert calls[0][0] == "init_weight_transfer_engine" and calls[0][1:] == [], calls
    for push, record in zip(calls[1:], stats["pushes"][len(before["pushes"]):], strict=True):
        assert len(record["chunks"]) > 2
        assert push == [*SYNC_ORDER[:2], *["update_weights"] * len(record["chunks"]), *SYNC_ORDER[3:]], push
        assert_whole_push(record, params, bound)
    assert stats["weight_version"] == before["weight_version"] + 2


def test_merged_weights_stay_readable_until_vllm_finishes_the_update(make_rig, tiny_model):
    # TRL starts each update in checkpoint format, so vLLM's layerwise reload may read what a chunk handed over only
    # once its layer is complete, as late as /finish_weight_update: a copy (a merged LoRA weight, alive only while
    # the client holds it) must last that long. The stand-in reads every chunk there.
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    engine = make_rig(*IPC, "--lazy-load", harbor=False, engine_env=ALLOW_PICKLE)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    params = dict(_iter_vllm_named_params(model))
    transfer = load_script().CudaIpcWeightTransfer(engine.engine_url, 60,
                                                   chunk_bytes=max(t.nbytes for t in params.values()) // 3)
    transfer.init_weight_transfer()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    transfer.pause()
    transfer.send_weights((name, p.detach() + 0) for name, p in _iter_vllm_named_params(model))
    transfer.resume()
    assert len(engine.engine_stats()["pushes"][-1]["chunks"]) > 2
    served = engine_weights(engine)
    assert all(torch.equal(served[n], p) for n, p in model.state_dict().items())
    assert transfer.sent == [], "the copies outlived the update"


def test_parameters_go_zero_copy_in_their_own_dtype(ipc_rig, tiny_model):
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    params = dict(_iter_vllm_named_params(model))
    shared: list[int] = []
    original = cpu_trainer._share_cpu_tensor

    def share(tensor):
        shared.append(tensor.untyped_storage().data_ptr())
        return original(tensor)

    cpu_trainer._share_cpu_tensor = share
    try:
        transfer = load_script().CudaIpcWeightTransfer(ipc_rig.engine_url, 60)
        transfer.pause()
        transfer.send_weights((name, p.detach()) for name, p in params.items())
        transfer.resume()
    finally:
        cpu_trainer._share_cpu_tensor = original
    assert shared == [p.untyped_storage().data_ptr() for p in params.values()], "a parameter was copied"
    push = get_json(f"{ipc_rig.engine_url}/stand_in/stats")["pushes"][-1]
    assert len(push["chunks"]) == 1  # 0.4 MB: one chunk of the default 1 GiB
    assert_whole_push(push, params, 1 << 30)
    served = engine_weights(ipc_rig)  # the engine's float32 parameters, from bfloat16 pushes: vLLM's loaders cast
    assert all(torch.equal(served[n], p.float()) for n, p in params.items())


def refused_push(engine, tiny_model) -> str:
    """The one line a push that `engine` refuses ends in (WeightTransferRefused)."""
    from transformers import AutoModelForCausalLM

    script = load_script()
    transfer = script.CudaIpcWeightTransfer(engine.engine_url, 60)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    transfer.init_weight_transfer()
    transfer.pause()
    with pytest.raises(script.WeightTransferRefused) as refused:
        transfer.send_weights((n, p.detach()) for n, p in model.named_parameters())
    return str(refused.value)


def test_a_push_refused_for_pickle_names_the_variable_and_the_restart(make_rig, tiny_model):
    # A row of the preflight too (vLLM's /server_info says it); this is what the push says where it could not tell.
    engine = make_rig(*IPC, harbor=False)  # VLLM_ALLOW_INSECURE_SERIALIZATION unset, as vLLM's default
    message = refused_push(engine, tiny_model)
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION=1 vllm serve" in message
    assert "--weight-transfer-config '{\"backend\":\"ipc\"}'" in message
    stats = engine.engine_stats()
    assert stats["weight_sync"][-1] == "finish_weight_update" and stats["weight_version"] == 0


def test_a_push_vllm_refuses_without_a_message_names_its_log_and_the_likely_causes(make_rig, tiny_model):
    # vLLM 0.26 answers a push its workers refused with a bare 500: the cause is only in vLLM's own log.
    engine = make_rig(*IPC, "--bare-errors", harbor=False)  # VLLM_ALLOW_INSECURE_SERIALIZATION unset
    message = refused_push(engine, tiny_model)
    assert "\n" not in message and "Internal Server Error" in message, message
    for needle in ("vLLM's server log", "VLLM_ALLOW_INSECURE_SERIALIZATION=1", "on another GPU than the trainer"):
        assert needle in message, message


# ---- training
def test_training_over_ipc_leaves_the_engine_holding_the_trainers_weights(ipc_rig, tmp_path):
    before = ipc_rig.engine_stats()
    out = tmp_path / "out"
    # Groups of the coin tasks always vary (tests/rig/engine.py), so the step has a gradient to take.
    proc = run_script(default_filter(train_args(ipc_rig, out, "--max-steps", "1", tasks="coin,coin2")), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = ipc_rig.engine_stats()
    calls = syncs(stats, len(before["weight_sync"]))
    # Init once; the cold push at train begin, then one after the step, as TRL pauses and resumes around a push.
    assert calls[0] == ["init_weight_transfer_engine"] and calls[1:] == [SYNC_ORDER] * 2, calls
    trained = load_file(out / "model.safetensors")
    for push in stats["pushes"][len(before["pushes"]):]:
        assert_whole_push(push, trained, 1 << 30)
    served = engine_weights(ipc_rig)
    initial = load_file(ipc_rig.model_dir / "model.safetensors")
    assert all(torch.equal(served[n], w) for n, w in trained.items())
    assert [n for n, w in initial.items() if torch.equal(trained[n], w)] == []


def test_lora_training_over_ipc_pushes_the_merged_model(ipc_rig, tmp_path):
    before = ipc_rig.engine_stats()
    out = tmp_path / "out"
    proc = run_script(default_filter(train_args(ipc_rig, out, "--max-steps", "1", "--use-peft", "--lora-r", "8",
                                                "--lora-target-modules", "all-linear", "--learning-rate", "1e-2",
                                                tasks="coin,coin2")), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = ipc_rig.engine_stats()
    assert syncs(stats, len(before["weight_sync"]))[1:] == [SYNC_ORDER] * 2
    merged = load_file(out / "merged" / "model.safetensors")
    for push in stats["pushes"][len(before["pushes"]):]:
        assert_whole_push(push, merged, 1 << 30)
    served = engine_weights(ipc_rig)
    initial = load_file(ipc_rig.model_dir / "model.safetensors")
    assert all(torch.equal(served[n], w) for n, w in merged.items())
    assert any(not torch.equal(merged[n], w) for n, w in initial.items())


def test_a_push_to_another_gpu_ends_the_run_in_one_line_before_any_rollout(make_rig, tmp_path):
    # Without nvidia-smi's view (here: no CUDA) the preflight cannot compare GPUs; vLLM's answer to the first push,
    # at train begin, names its own.
    other = "0e1de000-0000-4000-8000-0000000000b2"
    rig = make_rig(*IPC, "--gpu-uuid", other, engine_env=ALLOW_PICKLE)
    proc = run_script(train_args(rig, tmp_path / "out", "--max-steps", "1"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: vLLM runs on another GPU than the trainer (IPC handle not found for GPU UUID "
                            f"{other})") and f"CUDA_VISIBLE_DEVICES=GPU-{other}" in error, error
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not [c for c in rig.engine_stats()["chat"] if c["script"] != "reply" and "unknown" not in c["script"]]
