"""--use-peft: LoRA adapters trained on a frozen base in the serving dtype, merged weights pushed to the engine.

Two launches on one bfloat16 engine: two steps, then a resume for a third. What a user relies on: the engine samples
from exactly the merged model (base + adapter, rounded once to bfloat16), the base itself never moves, checkpoints
hold the adapter and resume, the run ends with a merged model any server loads, and an --enable-lora vLLM (where TRL
would sync the adapter under names the capture proxy never asks for) is refused before any weights load.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch
from conftest import SERVED_NAME, free_port, load_script, run_main, run_script, train_args

LORA = ["--use-peft", "--lora-r", "8", "--lora-target-modules", "all-linear", "--learning-rate", "1e-2"]


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, tiny_model):
    from conftest import Rig

    work = tmp_path_factory.mktemp("lora")
    rig = Rig(work / "rig", tiny_model, ["--dtype", "bfloat16"])  # vLLM's default for this float32 checkpoint
    try:
        out = work / "out"
        first = run_script(train_args(rig, out, *LORA, "--max-steps", "2", "--save-steps", "1"), cwd=work)
        engine_first = engine_logprobs(rig)
        after_first = rig.engine_stats()  # the probe request included: the resumed run's requests come after it
        adapter_first = load_adapter(out)
        merged_first = {k: v.clone() for k, v in load_dir(out / "merged").items()}
        resumed = run_script(train_args(rig, out, *LORA, "--max-steps", "3", "--save-steps", "1", "--resume"),
                             cwd=work)
        yield dict(work=work, out=out, rig=rig, first=first, resumed=resumed, after_first=after_first,
                   engine_first=engine_first, adapter_first=adapter_first, merged_first=merged_first,
                   tiny_model=tiny_model, after_resumed=rig.engine_stats(), engine_resumed=engine_logprobs(rig))
    finally:
        rig.stop()


PROBE = [{"role": "user", "content": "Say ok."}]


def engine_logprobs(rig) -> list[float]:
    """The engine's logprobs of its scripted reply (`ok`, no tools) to one fixed prompt, at T = 1."""
    body = {"model": SERVED_NAME, "messages": PROBE, "logprobs": True, "top_logprobs": 0, "temperature": 1.0}
    request = urllib.request.Request(f"{rig.engine_url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return [entry["logprob"] for entry in json.loads(reply.read())["choices"][0]["logprobs"]["content"]]


def model_logprobs(model, tiny_model) -> list[float]:
    """What the engine computes (tests/rig/engine.py), for a local model."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    text = tokenizer.apply_chat_template(PROBE, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    completion = tokenizer.encode("ok", add_special_tokens=False) + [tokenizer.eos_token_id]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1: -1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return [float(logprobs[i, t]) for i, t in enumerate(completion)]


def load_dir(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def load_adapter(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "adapter_model.safetensors")


def merged_reference(tiny_model, adapter_dir):
    """The base checkpoint in the serving dtype with the saved adapter folded in by PEFT itself."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


def test_lora_trains_adapters_and_checkpoints_only_them(lora_runs):
    first, out = lora_runs["first"], lora_runs["out"]
    assert first.returncode == 0, first.stderr[-3000:]
    assert "LoRA" in first.stdout and "merged sync" in first.stdout
    assert "LoRA: float32 adapters on a frozen bfloat16 base" in first.stdout  # the precision row
    assert "each (float32 adapter + 2 AdamW moments)" in first.stdout  # the checkpoints row
    for step in (2, 3):  # the first run's checkpoint-2 and the resumed run's checkpoint-3 (checkpoint-1 rotated out)
        checkpoint = out / f"checkpoint-{step}"
        names = {p.name for p in checkpoint.iterdir()}
        assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt"} <= names, names
        assert "model.safetensors" not in names
    adapter = lora_runs["adapter_first"]
    assert adapter and all("lora_" in name for name in adapter), sorted(adapter)[:5]
    # lora_B starts at zero: a trained adapter has moved it
    assert any(t.abs().max() > 0 for name, t in adapter.items() if "lora_B" in name)
    # the adapter and its AdamW state are float32, whatever the base's dtype
    assert {t.dtype for t in adapter.values()} == {torch.float32}
    optimizer = torch.load(out / "checkpoint-2" / "optimizer.pt", weights_only=True)
    moments = [s["exp_avg"] for s in optimizer["state"].values()]
    assert len(moments) == len(adapter) and {m.dtype for m in moments} == {torch.float32}


def test_lora_pushes_and_writes_exactly_the_merged_model(lora_runs):
    """The engine serves base + adapter rounded once to bfloat16, and the trainer's base never moved: a push that
    merged the adapter in place and subtracted it again would leave the base a rounding step off at every push, and
    then neither the written merged model nor the engine would equal PEFT's merge of the saved adapter onto the
    untouched base checkpoint."""
    from transformers import AutoModelForCausalLM

    tiny_model, out = lora_runs["tiny_model"], lora_runs["out"]
    reference = merged_reference(tiny_model, out / "checkpoint-2")
    expected = reference.state_dict()
    merged = lora_runs["merged_first"]
    assert set(merged) <= set(expected) and len(merged) >= len(expected) - 1  # tied head: saved once
    assert all(merged[k].dtype == torch.bfloat16 for k in merged)
    different = [k for k in merged if not torch.equal(merged[k], expected[k])]
    assert not different, different[:5]
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16).eval()
    assert any(not torch.equal(merged[k], v) for k, v in base.state_dict().items() if k in merged)

    served, wanted, untrained = (lora_runs["engine_first"], model_logprobs(reference, tiny_model),
                                 model_logprobs(base, tiny_model))
    gap = max(abs(a - b) for a, b in zip(served, wanted))
    assert gap < 1e-3, (served, wanted)  # the same bfloat16 weights on the same CPU kernels
    assert max(abs(a - b) for a, b in zip(served, untrained)) > 100 * max(gap, 1e-4), (served, untrained)


def test_lora_resumes_from_an_adapter_checkpoint_and_pushes_it_first(lora_runs):
    resumed, out, tiny_model = lora_runs["resumed"], lora_runs["out"], lora_runs["tiny_model"]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{out}/checkpoint-2" in resumed.stdout
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    assert not (out / "checkpoint-1").exists()  # rotated: --save-total-limit 2
    # The adapter went on from the checkpoint's, not from zero: its step-3 value is one AdamW step (lr 1e-2) away.
    before, after = load_adapter(out / "checkpoint-2"), load_adapter(out / "checkpoint-3")
    step = max((after[k] - before[k]).abs().max().item() for k in after)
    assert 0 < step < 0.05, step
    # Before its first rollout the resumed run pushed the checkpoint's merged weights: no request of the resumed run
    # was served by the weights the engine held at the end of the first run.
    first_version = lora_runs["after_first"]["weight_version"]
    chats = [c for c in lora_runs["after_resumed"]["chat"][len(lora_runs["after_first"]["chat"]):]
             if "min_p" in c["sampling"]]  # rollouts: the capture proxy's sampling, not the preflight's probes
    assert chats and min(c["weight_version"] for c in chats) == first_version + 1  # its train-begin push
    served = lora_runs["engine_resumed"]
    wanted = model_logprobs(merged_reference(tiny_model, out), tiny_model)
    assert max(abs(a - b) for a, b in zip(served, wanted)) < 1e-3, (served, wanted)


def test_lora_checkpoints_are_resumable_and_refused_without_use_peft(lora_runs, tmp_path):
    # A LoRA run's checkpoints are whole (their resume order written last), as a full one's.
    script, out = load_script(), lora_runs["out"]
    assert script.checkpoint_problem(out / "checkpoint-3") is None
    # a LoRA checkpoint resumed without --use-peft would load no adapter at all
    dead = f"http://127.0.0.1:{free_port()}"
    proc = run_main(["--output-dir", str(out), "--resume", "--vllm-url", dead, "--harbor-url", dead, "--check"],
                    cwd=tmp_path)
    assert proc.returncode == 2 and "holds a LoRA adapter: resume it with --use-peft" in proc.stdout
    # nor with another rank: PEFT would load it into the adapter the flags built (a shape error, or another scaling)
    proc = run_main(["--output-dir", str(out), "--resume", "--vllm-url", dead, "--harbor-url", dead, "--check",
                     "--use-peft", "--lora-r", "4", "--lora-target-modules", "all-linear"], cwd=tmp_path)
    assert proc.returncode == 2 and "holds an adapter of another shape: r 8 (flags: 4)" in proc.stdout


def test_a_resume_whose_lora_targets_resolve_differently_is_refused_before_the_model_loads(lora_runs, tmp_path):
    # The checkpoint's adapter is on every linear layer (all-linear); without --lora-target-modules PEFT takes its
    # default for the architecture (q_proj v_proj). Compared as PEFT resolves both, the resume is refused in the
    # preflight, not by optimizer.load_state_dict once the model has loaded.
    out, dead = lora_runs["out"], f"http://127.0.0.1:{free_port()}"
    proc = run_main(["--model", str(lora_runs["tiny_model"]), "--output-dir", str(out), "--resume", "--vllm-url", dead,
                     "--harbor-url", dead, "--check", "--use-peft", "--lora-r", "8"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[0] == (
        f"error: {out}/checkpoint-3 holds an adapter of another shape: target_modules down_proj gate_proj k_proj "
        "o_proj q_proj up_proj v_proj (flags: q_proj v_proj); resume with the run's --lora-* flags (and 1 more failed "
        "check above)"), proc.stderr  # the other: vLLM is not up


@pytest.mark.parametrize("target", ["embed_tokens", "lm_head"])
def test_a_lora_adapter_on_tied_embeddings_is_refused(tiny_model, tmp_path, target):
    # Qwen3-4B ties its input embeddings to its output head (one tensor): an adapter on either would change one of
    # the two in training, both in the merged push. The rig's model is untied; a config that ties it is enough for
    # the preflight, which reads no weights.
    tied = tmp_path / "tied"
    tied.mkdir()
    config = json.loads((tiny_model / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    dead = f"http://127.0.0.1:{free_port()}"

    def lora_rows(model) -> list[str]:
        proc = run_main(["--model", str(model), "--use-peft", "--lora-target-modules", target, "--vllm-url", dead,
                         "--harbor-url", dead, "--check", "--output-dir", str(tmp_path / "out")], cwd=tmp_path)
        assert proc.returncode == 2  # vLLM is not up either
        return [line for line in proc.stdout.splitlines() if "LoRA targets" in line]

    (row,) = lora_rows(tied)
    assert "FAIL" in row and target in row and "ties between its input embeddings and its output head" in row, row
    assert lora_rows(tiny_model) == []  # the same flags on the untied model


def test_an_enable_lora_engine_is_refused_before_any_weights_load(make_rig, tmp_path):
    rig = make_rig("--dtype", "bfloat16", "--enable-lora", harbor=False)
    dead = f"http://127.0.0.1:{free_port()}"
    args = [*train_args(rig, tmp_path / "out", *LORA, "--max-steps", "1"), "--harbor-url", dead]
    proc = run_main(args, cwd=tmp_path)
    assert proc.returncode == 2
    row = next(line for line in proc.stdout.splitlines() if "LoRA" in line and "FAIL" in line)
    assert "--enable-lora" in row and "untrained base" in proc.stdout
    assert "restart vLLM without --enable-lora" in proc.stdout
    # refused at the preflight: no hyper-parameter table, no trainer, no weights pushed
    assert "\nasync_grpo_harbor\n" not in proc.stdout and rig.engine_stats()["weight_version"] == 0
