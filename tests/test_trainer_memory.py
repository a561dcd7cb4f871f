"""The preflight's `trainer memory` row: the trainer's peak GPU memory, projected from --model's config before any
weights load, against what the trainer may use on its GPU (on a GPU vLLM shares: what vLLM's
--gpu-memory-utilization leaves); FAIL with the flags that make it fit, before any paid rollout. Without a GPU the
projection is still printed. The GPU here is the driver's answer stood in for (tests/rig/cpu_trainer.py, (e))."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys

import pytest
from conftest import ROOT, RIG, free_port, load_script, run_main
from test_check import refused_with, table

sys.path.insert(0, str(RIG))
import cpu_trainer  # noqa: E402

cpu_trainer.install_gpu_memory()

GIB = 2**30
RECORDS = ROOT / "bench" / "results"
# Every trainer peak bench/gpu_capacity.py recorded on one H200 (torch.cuda.max_memory_allocated, GiB; TRL's loss
# path: gradient checkpointing, fused chunked LM head, bf16 autocast, fused AdamW), beside the projection for the same
# shape and row, less the push staging the bench does not do. Left out: bfloat16 at 8,192, the bench's first row
# after its float32 model, which its fused head's reference cycle kept alive (45.3 GiB; its 16k row is 33.4).
# (shape, what was trained, row tokens, measured GiB, projected GiB)
MEASURED = [
    ("4b", "float32", 8192, 62.1, 61.8),
    ("4b", "float32", 16384, 64.0, 63.7),
    ("4b", "float32", 32768, 67.7, 67.4),
    ("4b", "bfloat16", 16384, 33.4, 33.7),
    ("4b", "bfloat16", 32768, 36.8, 37.5),
    ("8b", "r16-default", 8192, 19.6, 19.6),
    ("8b", "r16-default", 16384, 23.8, 23.8),
    ("8b", "r16-default", 32768, 32.2, 32.3),
    ("8b", "r16-all-linear", 8192, 21.3, 21.3),
    ("8b", "r16-all-linear", 16384, 26.8, 26.9),
    ("8b", "r16-all-linear", 32768, 37.7, 38.0),
    ("8b", "r64-all-linear", 8192, 22.8, 22.8),
    ("8b", "r64-all-linear", 16384, 28.3, 28.3),
    ("8b", "r64-all-linear", 32768, 39.3, 39.5),
    ("14b", "r16-default", 8192, 33.4, 33.5),
    ("14b", "r16-default", 16384, 39.1, 39.3),
    ("14b", "r16-default", 32768, 50.6, 50.9),
    ("32b", "r16-default", 8192, 69.9, 69.8),
    ("32b", "r16-default", 16384, 78.4, 78.3),
    ("32b", "r16-default", 32768, 95.5, 95.3),
    ("32b", "r16-all-linear", 8192, 73.4, 73.3),
    ("32b", "r16-all-linear", 16384, 84.1, 84.1),
    ("32b", "r16-all-linear", 32768, 105.6, 105.6),
]
TOLERANCE = 0.02  # the constants' comment in the script promises this
FLAGS = {"float32": [], "bfloat16": ["--dtype", "bfloat16"], "r16-default": ["--use-peft"],
         "r16-all-linear": ["--use-peft", "--lora-target-modules", "all-linear"],
         "r64-all-linear": ["--use-peft", "--lora-r", "64", "--lora-target-modules", "all-linear"]}


@pytest.fixture(scope="module")
def script():
    return load_script()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """Config-only model dirs of the Qwen3 shapes bench/gpu_capacity.py measured (no weights: nothing reads them)."""
    from transformers import Qwen3Config

    spec = importlib.util.spec_from_file_location("gpu_capacity", ROOT / "bench" / "gpu_capacity.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    dirs = {}
    for name, config in {"4b": bench.QWEN3_4B, **bench.QWEN3_LARGE}.items():
        dirs[name] = tmp_path_factory.mktemp(f"qwen3-{name}")
        Qwen3Config(**config, dtype="bfloat16").save_pretrained(dirs[name])
    return dirs


def recorded(shape: str, what: str, row: int, memory: str = "allocated") -> float:
    if shape == "4b":
        record = json.loads((RECORDS / "2026-11-30-h200-capacity.json").read_text())[f"memory/{what}/{row}"]
    else:
        record = json.loads((RECORDS / f"2026-12-02-h200-lora-{shape}.json").read_text())[f"lora/{shape}/{what}/{row}"]
    return record[f"peak_{memory}_gib"]


@pytest.mark.parametrize("shape, what", sorted({(s, w) for s, w, *_ in MEASURED}))
def test_the_projection_lands_within_2_percent_of_every_peak_measured_on_an_h200(script, qwen3, shape, what):
    trainer = script.trainer_shape(script.parse_args(["--model", str(qwen3[shape]), *FLAGS[what]]))
    side_by_side = []
    for _, _, row, measured, projected in [m for m in MEASURED if m[:2] == (shape, what)]:
        parts = script.trainer_peak(trainer, row)
        peak = (sum(parts.values()) - parts["push staging"] - parts["allocator reserve"]) / GIB
        side_by_side.append((row, recorded(shape, what, row), measured, round(peak, 1), projected))
    for row, record, measured, peak, projected in side_by_side:
        assert record == measured, f"MEASURED misquotes the record at {row}: {side_by_side}"
        assert peak == projected, f"the projection moved at {row}: {side_by_side}"
        assert abs(peak - measured) <= TOLERANCE * measured, f"off by more than {TOLERANCE:.0%}: {side_by_side}"


def reserved_records() -> list[tuple[str, str, int, float]]:
    """Every peak of torch's reserved memory bench/gpu_capacity.py recorded on one H200 (shape, what, row, GiB), but
    the bfloat16 row MEASURED leaves out (its fused head's reference cycle)."""
    records = [("4b", *key.split("/")[1:], peak) for key, peak in
               json.loads((RECORDS / "2026-11-30-h200-capacity.json").read_text()).items()
               if key.startswith("memory/") and key != "memory/bfloat16/8192"]
    for shape in ("8b", "14b", "32b"):
        records += [(shape, *key.split("/")[2:], peak) for key, peak in
                    json.loads((RECORDS / f"2026-12-02-h200-lora-{shape}.json").read_text()).items()
                    if key.split("/")[-1].isdigit()]
    return [(shape, what, int(row), peak["peak_reserved_gib"]) for shape, what, row, peak in records]


def test_with_the_allocators_reserve_the_projection_holds_every_reserved_peak_on_record(script, qwen3):
    """Running out of memory, and the cap on a shared card, act on what torch's caching allocator reserves, which
    exceeds what it hands out: the projection, its `allocator reserve` included, is not below any reserved peak on
    record, and that share is the least whole percent that holds them all (a record sets it, no padding)."""
    records = reserved_records()
    assert len(records) == 32 and {w for _, w, _, _ in records} == {*FLAGS}, records
    shapes = {(shape, what): script.trainer_shape(script.parse_args(["--model", str(qwen3[shape]), *FLAGS[what]]))
              for shape, what, _, _ in records}
    side_by_side = []
    for shape, what, row, reserved in records:
        parts = script.trainer_peak(shapes[shape, what], row)
        unpushed = sum(n for part, n in parts.items() if part not in ("push staging", "allocator reserve")) / GIB
        side_by_side.append((shape, what, row, reserved, round(unpushed, 2)))  # bench/gpu_capacity.py pushes nothing
    reserve = script.ALLOCATOR_RESERVE
    assert all(reserved <= unpushed * (1 + reserve) for *_, reserved, unpushed in side_by_side), side_by_side
    assert any(reserved > unpushed * (1 + reserve - 0.01) for *_, reserved, unpushed in side_by_side), \
        f"a smaller reserve than {reserve:.0%} holds every record: {side_by_side}"


def memory_row(script, argv: list[str], max_model_len: int | None, engine: tuple, free_gib: float, total_gib: float,
               monkeypatch) -> tuple[str, str, str, dict]:
    """The row, for a GPU with this much free of this total, as the driver would say."""
    monkeypatch.setenv(cpu_trainer.GPU_MEMORY_ENV, f"{free_gib},{total_gib}")
    pf = script.Preflight(script.parse_args(argv))
    pf.served = {"max_model_len": max_model_len, "weight_transfer": engine[0], "gpu_memory_utilization": engine[1]}
    script.check_trainer_memory(pf)
    (check, status, detail, fix), = pf.rows
    assert check == "trainer memory"
    return status, detail, fix, {k: v for k, v in pf.plan.items() if k != "resume"}


def test_a_trainer_too_large_for_its_gpu_is_refused_before_any_rollout_with_the_flags_that_fit(make_rig, tmp_path):
    # A 65,536-token context: TRL packs rows up to it, so that is the row the trainer must hold (~0.3 GiB for the tiny
    # model), on a GPU with 0.6 GiB free, 0.5 of which the row keeps outside torch's allocator.
    engine = make_rig("--max-model-len", "65536", harbor=False)
    proc = run_main([*engine.base_args(), "--harbor-url", f"http://127.0.0.1:{free_port()}", "--tasks", "coin",
                     "--check"], cwd=tmp_path, AGH_RIG_GPU_MEMORY="0.6,80")
    refused_with(proc, "trainer memory", "error: projected peak", "serve vLLM with --max-model-len",
                 "--agent-step-limit 30")
    status, detail = table(proc.stdout)["trainer memory"]
    assert re.match(r"projected peak 0\.\d GiB for a 65,536-token row .*> \d+\.\d MiB the trainer may use on "
                    r"cuda:0 \(0\.6 GiB free of 80\.0 GiB, less 0\.5 GiB\)$", detail), detail
    tokens = int(re.search(r"serve vLLM with --max-model-len (\d+) and --agent-step-limit 30 \(256-token turns\)",
                           proc.stderr)[1])
    assert tokens % 1024 == 0 and 1500 + 256 <= tokens < 65536, tokens
    assert "--gpu-memory-utilization" not in proc.stdout, "vLLM has its own GPU here: its share is not the cause"
    # This row's memory is activations: LoRA would not fit it either, so it is not offered.
    assert "--use-peft" not in proc.stderr


def test_a_trainer_that_fits_passes_and_without_a_gpu_the_projection_is_still_printed(rig, tmp_path):
    args = [*rig.base_args(), "--tasks", "coin", "--output-dir", "out", "--check"]
    proc = run_main(args, cwd=tmp_path, AGH_RIG_GPU_MEMORY="70,80")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    status, detail = table(proc.stdout)["trainer memory"]
    assert status == "PASS" and re.search(
        r"^projected peak \d+\.\d MiB for a 1,600-token row \(vLLM's max_model_len\), full fine-tune, float32 "
        r"weights: .*; fits 69\.5 GiB the trainer may use on cuda:0 \(70\.0 GiB free of 80\.0 GiB, less 0\.5 GiB\)$",
        detail), detail
    assert "capped" not in detail, "vLLM does not share this GPU: nothing to cap"
    proc = run_main(args, cwd=tmp_path)
    status, detail = table(proc.stdout)["trainer memory"]
    assert status == "SKIP" and detail.startswith("projected peak ") and detail.endswith(
        "; no GPU to compare against (the trainer runs on CPU)"), detail


def test_on_a_gpu_vllm_shares_the_trainer_may_use_only_what_vllm_leaves_and_is_capped_there(script, qwen3,
                                                                                          monkeypatch):
    # Qwen3-4B, float32 full fine-tune, 32k rows (81.5 GiB with the push) on one H200 beside vLLM. vLLM sized itself
    # to 0.35 of the card, but holds less right now: the trainer still may not take vLLM's share.
    model = ["--model", str(qwen3["4b"])]
    status, detail, _, facts = memory_row(script, model, 32768, ("ipc", 0.35), 100, 140, monkeypatch)
    assert status == "PASS", detail
    assert ("fits 90.5 GiB the trainer may use on cuda:0 (100.0 GiB free of 140.0 GiB; vLLM's share 0.35 x 140.0 GiB "
            "= 49.0 GiB, less 0.5 GiB)") in detail, detail
    # ... less what vLLM allocates beside its share to load a push: the trainer must leave that free too.
    assert "vLLM's push copies 1.4 GiB" in detail, detail
    assert facts == {"gpu_memory_fraction": pytest.approx((90.5 - QWEN3_4B_VLLM_COPIES_GIB) / 140)}
    assert "capped at train start (memory fraction 0.636)" in detail, detail
    # vLLM at 0.6: 55.5 GiB left, less than the static 71 GiB; no row length helps, LoRA does, and applied passes.
    status, detail, fix, facts = memory_row(script, model, 32768, ("ipc", 0.6), 55, 140, monkeypatch)
    assert status == "FAIL" and facts == {}, detail
    assert "serve vLLM with --max-model-len" not in fix and "--use-peft (LoRA r 16 on a bfloat16 base)" in fix, fix
    assert memory_row(script, [*model, "--use-peft"], 32768, ("ipc", 0.6), 55, 140, monkeypatch)[0] == "PASS"
    status, detail, fix, _ = memory_row(script, model, 16384, ("ipc", 0.35), 51.3, 79.6, monkeypatch)
    assert status == "FAIL" and "--use-peft" in fix, fix


@pytest.mark.parametrize("budget", [[], ["--token-budget", "32768"]])
def test_the_row_length_it_names_passes_when_applied(script, qwen3, monkeypatch, budget):
    # Qwen3-32B LoRA at 32k rows (121.0 GiB) beside vLLM at 0.35 of an H200: only a shorter row fits.
    model = ["--model", str(qwen3["32b"]), "--use-peft", *budget]
    status, detail, fix, _ = memory_row(script, model, 32768, ("ipc", 0.35), 90, 140.4, monkeypatch)
    assert status == "FAIL", detail
    flag = "--token-budget" if budget else "serve vLLM with --max-model-len"
    tokens, steps = map(int, re.search(rf"{flag} (\d+) and --agent-step-limit (\d+) \(1024-token turns\)",
                                       fix).groups())
    assert steps * 1024 + script.PROMPT_TOKENS <= tokens < 32768
    shorter = ["--model", str(qwen3["32b"]), "--use-peft", *(["--token-budget", str(tokens)] if budget else [])]
    assert memory_row(script, shorter, tokens if not budget else 32768, ("ipc", 0.35), 90, 140.4,
                      monkeypatch)[0] == "PASS"


def test_until_vllm_answers_the_static_part_alone_is_judged(script, qwen3, monkeypatch):
    model = ["--model", str(qwen3["4b"])]
    status, detail, _, _ = memory_row(script, model, None, (None, None), 139, 140, monkeypatch)
    assert status == "SKIP" and "the static part alone" in detail and "once vLLM answers" in detail, detail
    status, detail, fix, _ = memory_row(script, model, None, (None, None), 40, 80, monkeypatch)
    assert status == "FAIL" and "--use-peft" in fix, (detail, fix)


@pytest.mark.parametrize("model, max_model_len", [("4b", None), ("missing", 32768)])
def test_on_a_shared_card_the_trainer_is_capped_even_where_its_peak_is_not_projected(script, qwen3, monkeypatch,
                                                                                     tmp_path, model, max_model_len):
    # Before vLLM reports its context (no row yet), or with a --model whose config cannot be read here: the row
    # skips the projection, but vLLM's share of the card is known, so the trainer still may not grow into it.
    path = str(qwen3[model]) if model in qwen3 else str(tmp_path / "no-such-model")
    status, detail, _, facts = memory_row(script, ["--model", path], max_model_len, ("ipc", 0.35), 100, 140,
                                          monkeypatch)
    assert status == "SKIP", detail
    copies = QWEN3_4B_VLLM_COPIES_GIB if model in qwen3 else 0  # unknown without --model's config
    assert facts == {"gpu_memory_fraction": pytest.approx((90.5 - copies) / 140)}, detail
    assert "90.5 GiB the trainer may use on cuda:0" in detail and "capped at train start" in detail, detail


def test_a_push_on_a_shared_card_counts_vllms_copies_and_every_merged_weight(script, qwen3):
    # vLLM casts and loads each pushed tensor beside its own share: up to two copies of the largest at its dtype.
    full = script.trainer_shape(script.parse_args(["--model", str(qwen3["4b"])]))
    shared, alone = script.trainer_peak(full, 32768, backend="ipc"), script.trainer_peak(full, 32768, backend="nccl")
    assert shared["vLLM's push copies"] == 2 * 151936 * 2560 * 2
    assert script.trainer_peak(full, 32768, backend="ipc", served_width=4)["vLLM's push copies"] == 2 * 151936 * 2560 * 4
    assert "vLLM's push copies" not in alone, "vLLM on a GPU of its own: its copies take none of the trainer's"
    assert shared["push staging"] == alone["push staging"] == GIB  # float32 parameters go zero-copy or in 1 GiB
    # A merged LoRA push over CUDA IPC keeps every merged copy until vLLM finishes the update.
    lora = script.trainer_shape(script.parse_args(["--model", str(qwen3["8b"]), "--use-peft", "--lora-target-modules",
                                                   "all-linear"]))
    per_layer = 4096 * (32 * 128 + 2 * 8 * 128 + 32 * 128) + 3 * 4096 * 12288  # q k v o, gate up down
    assert lora.merged == 36 * per_layer
    assert script.trainer_peak(lora, 8192, backend="ipc")["push staging"] == 36 * per_layer * 2
    assert script.trainer_peak(lora, 8192, backend="nccl")["push staging"] == GIB


# docs/capacity.md's table, cell by cell: what the row says for those flags on that card beside vLLM.
TRAINING = {"full, float32": ([], "float32"), "LoRA r16, PEFT's default modules (q_proj v_proj)": (["--use-peft"],
            "r16-default"), "LoRA r16, all-linear": (["--use-peft", "--lora-target-modules", "all-linear"],
                                                     "r16-all-linear")}
CARDS_MIB = {"H200": 143771, "H100 80GB": 81559}  # nvidia-smi's total memory
CUDA_CONTEXT_GIB = 0.5  # the trainer's own, taken before the row reads free memory
# What vLLM allocates beside its share loading a push of Qwen3-4B: two bfloat16 copies of its largest tensor, the
# 151,936 x 2,560 embeddings.
QWEN3_4B_VLLM_COPIES_GIB = 2 * 151936 * 2560 * 2 / GIB


QUICK_START = json.loads((RECORDS / "2026-12-06-h100-quick-start.json").read_text())


def test_the_quick_starts_projection_holds_the_peak_measured_on_one_h100(script, tmp_path):
    """The README's first quick start ran on one 80 GB H100 (bench/gpu_quick_start.py: Qwen3-4B's own config, random
    weights, the README's vLLM and script flags, 3 steps with CUDA-IPC pushes of the merged LoRA, 31,830-token rows):
    the projection for those flags, recomputed by today's script, is not below the trainer's measured peak (torch's
    reserved memory, the push included) and within 25 % of it."""
    model = tmp_path / "Qwen3-4B-Instruct-2507"
    model.mkdir()
    (model / "config.json").write_text((ROOT / "bench" / "configs" / "Qwen3-4B-Instruct-2507.json").read_text())
    flags = QUICK_START["flags"]["script_readme"]
    args = script.parse_args(["--model", str(model), *flags[flags.index("--vllm-url"):], "--run-name", "r"])
    parts = script.trainer_peak(script.trainer_shape(args), 32768, backend="ipc")
    projected = sum(parts.values()) / GIB  # what the row prints and judges
    measured = QUICK_START["trainer_peak_gib"]["reserved"]
    assert QUICK_START["card"]["name"] == "NVIDIA H100 80GB HBM3" and QUICK_START["steps"] >= 3, QUICK_START["card"]
    assert max(QUICK_START["longest_row_per_step"]) > 0.95 * 32768, QUICK_START["longest_row_per_step"]
    assert measured <= projected <= 1.25 * measured, (projected, measured)
    # vLLM's copies live in vLLM's process: the trainer's own parts, its allocator's reserve included, hold its peak
    # alone. Without that reserve they would not (the merged copies of a CUDA-IPC push take new blocks beside the
    # step's cached ones).
    own = projected - parts["vLLM's push copies"] / GIB
    assert own >= measured > own - parts["allocator reserve"] / GIB, (own, measured, parts)


def test_the_capacity_table_of_what_fits_one_card_is_what_the_row_says(script, qwen3, monkeypatch):
    doc = (ROOT / "docs" / "capacity.md").read_text()
    section = doc.split("### What fits on one card", 1)[1]
    grid = section[section.index("\n| model |"):].split("\n\n", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in grid.splitlines()
            if line.startswith("| Qwen3-")]
    assert len(rows) >= 8, section
    statuses = set()
    for model, training, tokens, card, may_use, projected, status, measured, tok_s, steps_h in rows:
        flags, what = TRAINING[training]
        name, share = card.rsplit(", ", 1)
        total = CARDS_MIB[name] / 1024
        row, utilisation = int(tokens.replace(",", "")), float(share)
        shape = model.removeprefix("Qwen3-").lower()
        got, detail, _, _ = memory_row(script, ["--model", str(qwen3[shape]), *flags], row, ("ipc", utilisation),
                                       (1 - utilisation) * total - CUDA_CONTEXT_GIB, total, monkeypatch)
        parts = script.trainer_peak(script.trainer_shape(script.parse_args(["--model", str(qwen3[shape]), *flags])),
                                    row, backend="ipc")
        peak, push = sum(parts.values()) / GIB, (parts["push staging"] + parts["vLLM's push copies"]) / GIB
        cells = f"{peak:.1f} ({peak - push:.1f} + {push:.1f} push)"
        assert (projected, status) == (cells, got), (model, training, tokens, card, detail)
        assert f"{may_use} GiB the trainer may use" in detail, (model, training, tokens, card, detail)
        if measured.endswith("(shared card, with push)"):  # the quick start's own run, trainer and vLLM on one card
            assert (what, row, card) == ("r16-all-linear", 32768, "H100 80GB, 0.40"), (model, training, tokens, card)
            assert measured == f"{QUICK_START['trainer_peak_gib']['reserved']:.1f} (shared card, with push)", measured
        else:
            assert measured == ("not measured" if measured == "not measured"
                                else f"{recorded(shape, what, row, 'reserved')}"), (model, training, tokens, measured)
        statuses.add(got)
    assert statuses == {"PASS", "WARN", "FAIL"}, "the table shows each verdict"
