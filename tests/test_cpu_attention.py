"""The CPU rig's SDPA stand-in for TRL's tree-FA3 attention computes what the kernel computes.

`packing.tree_attention` gathers, for every trie segment, the K/V of its root-to-segment path and calls
`flash_attn_varlen_func(..., causal=True)` with each segment's queries against its path (FA's bottom-right causal
alignment): every token attends to itself and its ancestors in the trie, i.e. to exactly the prefix each sample
through it saw. These tests check the stand-in kernel against a dense reference, then the real `tree_attention` +
`TreeRow.pack()` (shared prompts, forks, several groups) against per-sample causal attention, then a tiny Qwen3 with
`attn_implementation="tree_fa3"` against the same weights run per sample with SDPA, values and gradients.
"""

import math
import os
import random
import sys
import types

import pytest


torch = pytest.importorskip("torch")
pytest.importorskip("trl.experimental.async_grpo.packing")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "rig"))
import cpu_trainer  # noqa: E402

from trl.experimental.async_grpo import packing  # noqa: E402


cpu_trainer.install()


# ---------------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------------
def dense_varlen_reference(q, k, v, cu_q, cu_k, scale, causal=True, window=(-1, -1), softcap=0.0):
    """Straight loops over segments, heads and query rows: the FA varlen contract written out."""
    total_q, n_heads, head_dim = q.shape
    rep = n_heads // k.shape[1]
    out = torch.zeros_like(q)
    for s in range(len(cu_q) - 1):
        qa, qb, ka, kb = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        lq, lk = qb - qa, kb - ka
        for h in range(n_heads):
            for j in range(lq):
                diag = j + lk - lq
                lo = 0 if window[0] < 0 else max(0, diag - window[0])
                hi = diag if causal else (lk - 1 if window[1] < 0 else min(lk - 1, diag + window[1]))
                if hi < lo:
                    continue  # no visible key: FA returns zeros
                keys = k[ka + lo : ka + hi + 1, h // rep]
                scores = keys @ q[qa + j, h] * scale
                if softcap:
                    scores = softcap * torch.tanh(scores / softcap)
                out[qa + j, h] = torch.softmax(scores, dim=0) @ v[ka + lo : ka + hi + 1, h // rep]
    return out


def make_samples(rng, vocab=50):
    """Groups with shared prompts, completions that fork at various depths, an exact duplicate, a lone sample."""
    samples = []

    def add(ids, prompt_len, group):
        mask = [0] * prompt_len + [1] * (len(ids) - prompt_len)
        samples.append(
            {
                "input_ids": torch.tensor(ids),
                "completion_mask": torch.tensor(mask),
                "old_log_probs": torch.tensor([-rng.random() if m else 0.0 for m in mask]),
                "advantage": rng.uniform(-1, 1),
                "group_id": group,
                "metrics": {},
            }
        )

    system = [rng.randrange(vocab) for _ in range(4)]  # shared by every sample, across groups
    for group in range(3):
        prompt = system + [rng.randrange(vocab) for _ in range(rng.randrange(2, 6))]
        base = [rng.randrange(vocab) for _ in range(6)]
        for g in range(4):
            fork = rng.randrange(0, len(base))
            completion = base[:fork] + [rng.randrange(vocab) for _ in range(rng.randrange(1, 7))]
            add(prompt + completion, len(prompt), group)
        add(prompt + base, len(prompt), group)
        add(prompt + base, len(prompt), group)  # identical sample: shares every node, ends on the same leaf
    add([rng.randrange(vocab) for _ in range(9)], 3, 99)  # nothing shared but the trie root set
    return samples


def pack(samples):
    row = packing.TreeRow()
    for sample in samples:
        row.add(sample)
    return row.pack()


def sample_positions(packed, sample):
    """Packed position of each of `sample`'s tokens: the root path of the leaf segment that spells the sample."""
    ids = sample["input_ids"].tolist()
    kv, cu_k = packed["tree_kv_index"], packed["tree_cu_seqlens_k"]
    for s in range(len(cu_k) - 1):
        path = kv[int(cu_k[s]) : int(cu_k[s + 1])]
        if len(path) == len(ids) and packed["input_ids"][path].tolist() == ids:
            return path
    raise AssertionError("sample is not a root-to-leaf path of the packed trie")


class _Module(torch.nn.Module):
    """What `tree_attention` reads off the attention module (`get_target_dtype`)."""

    def __init__(self, dtype):
        super().__init__()
        self.config = types.SimpleNamespace()
        self.proj = torch.nn.Linear(2, 2, dtype=dtype)


# ---------------------------------------------------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n_heads,n_kv_heads,window,softcap",
    [(4, 4, (-1, -1), 0.0), (4, 2, (-1, -1), 0.0), (6, 2, (3, 0), 0.0), (4, 1, (-1, -1), 5.0), (2, 2, (2, 0), 3.0)],
)
def test_varlen_kernel_matches_dense_reference(n_heads, n_kv_heads, window, softcap):
    torch.manual_seed(0)
    lens_q = [1, 3, 5, 2, 7]
    lens_k = [4, 3, 9, 2, 12]  # Lk >= Lq: a segment attends to its whole root path
    cu_q = torch.tensor([0, *itertools_accumulate(lens_q)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools_accumulate(lens_k)], dtype=torch.int32)
    head_dim = 8
    q = torch.randn(sum(lens_q), n_heads, head_dim, dtype=torch.float64)
    k = torch.randn(sum(lens_k), n_kv_heads, head_dim, dtype=torch.float64)
    v = torch.randn(sum(lens_k), n_kv_heads, head_dim, dtype=torch.float64)
    scale = 0.3
    got = cpu_trainer.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), softmax_scale=scale, causal=True,
        window_size=window, **({"softcap": softcap} if softcap else {}),
    )
    want = dense_varlen_reference(q, k, v, cu_q, cu_k, scale, window=window, softcap=softcap)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_varlen_kernel_default_scale_and_dtype():
    torch.manual_seed(1)
    q = torch.randn(5, 2, 16)
    k = torch.randn(7, 2, 16)
    v = torch.randn(7, 2, 16)
    cu_q = torch.tensor([0, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 7], dtype=torch.int32)
    got = cpu_trainer.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, causal=True)
    want = dense_varlen_reference(q.double(), k.double(), v.double(), cu_q, cu_k, 1 / math.sqrt(16)).float()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def itertools_accumulate(values):
    total, out = 0, []
    for value in values:
        total += value
        out.append(total)
    return out


def test_rig_replaces_only_the_kernel():
    assert packing._flash_attn() is cpu_trainer.SDPA_VARLEN
    assert packing.tree_attention.__module__ == packing.__name__  # TRL's own tree_attention still runs


# ---------------------------------------------------------------------------------------------------------------------
# tree_attention on a packed trie
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (4, 2)])
def test_tree_attention_matches_per_sample_causal_attention(n_heads, n_kv_heads):
    rng = random.Random(0)
    samples = make_samples(rng)
    packed = pack(samples)
    n = len(packed["input_ids"])
    assert n < sum(len(s["input_ids"]) for s in samples)  # prefixes really are shared
    assert len(packed["tree_cu_seqlens_q"]) - 1 > len({s["group_id"] for s in samples})  # and the trie forks

    torch.manual_seed(0)
    head_dim = 8
    # (batch=1, heads, seq, dim): the layout HF attention modules hand to the attention interface
    query = torch.randn(1, n_heads, n, head_dim, dtype=torch.float64)
    key = torch.randn(1, n_kv_heads, n, head_dim, dtype=torch.float64)
    value = torch.randn(1, n_kv_heads, n, head_dim, dtype=torch.float64)
    max_q, max_k = packed["tree_max_seqlens"].tolist()
    out, _ = packing.tree_attention(
        _Module(torch.float64), query, key, value, None,
        tree_kv_index=packed["tree_kv_index"], tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
        tree_cu_seqlens_k=packed["tree_cu_seqlens_k"], tree_max_seqlen_q=max_q, tree_max_seqlen_k=max_k,
        scaling=0.25,
    )
    assert out.shape == (1, n, n_heads, head_dim)
    out = out[0]

    # 1. each sample, unpacked, under plain causal attention sees exactly what the packed row gives it
    rep = n_heads // n_kv_heads
    for sample in samples:
        pos = sample_positions(packed, sample)
        q_s = query[0][:, pos]
        k_s = key[0][:, pos].repeat_interleave(rep, 0)
        v_s = value[0][:, pos].repeat_interleave(rep, 0)
        want = torch.nn.functional.scaled_dot_product_attention(q_s, k_s, v_s, is_causal=True, scale=0.25)
        torch.testing.assert_close(out[pos], want.transpose(0, 1), atol=1e-12, rtol=1e-10)

    # 2. the whole row under the mask the trie implies: a position sees itself and its ancestors
    parent = {}
    for sample in samples:
        pos = sample_positions(packed, sample).tolist()
        for a, b in zip(pos[:-1], pos[1:]):
            assert parent.setdefault(b, a) == a
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j is not None:
            mask[i, j] = True
            j = parent.get(j)
    k_all = key[0].repeat_interleave(rep, 0)
    v_all = value[0].repeat_interleave(rep, 0)
    want = torch.nn.functional.scaled_dot_product_attention(query[0], k_all, v_all, attn_mask=mask, scale=0.25)
    torch.testing.assert_close(out, want.transpose(0, 1), atol=1e-12, rtol=1e-10)


# ---------------------------------------------------------------------------------------------------------------------
# a real model: tree_fa3 on the packed row == sdpa per sample, forward and backward
# ---------------------------------------------------------------------------------------------------------------------
def _tiny_qwen3(attn_implementation):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
    )
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to(torch.float64)


def test_tiny_qwen3_tree_forward_and_grads_match_per_sample_sdpa():
    packing.register_tree_attention()
    tree_model = _tiny_qwen3(packing.TREE_ATTENTION)
    ref_model = _tiny_qwen3("sdpa")
    ref_model.load_state_dict(tree_model.state_dict())

    samples = make_samples(random.Random(1), vocab=64)
    packed = pack(samples)
    max_q, max_k = packed["tree_max_seqlens"].tolist()
    out = tree_model.model(
        input_ids=packed["input_ids"][None], position_ids=packed["position_ids"][None], use_cache=False,
        tree_kv_index=packed["tree_kv_index"], tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
        tree_cu_seqlens_k=packed["tree_cu_seqlens_k"], tree_max_seqlen_q=max_q, tree_max_seqlen_k=max_k,
    ).last_hidden_state[0]
    logp = torch.log_softmax(tree_model.lm_head(out), dim=-1)
    # The trainer's loss terms: position token_index[m] predicts shift_labels[token_index[m]]
    index = packed["token_index"]
    tree_terms = logp[index, packed["shift_labels"][index]]
    tree_terms.sum().backward()

    ref_terms = []
    for sample in samples:
        ids = sample["input_ids"]
        hidden = ref_model.model(input_ids=ids[None], use_cache=False).last_hidden_state[0]
        torch.testing.assert_close(out[sample_positions(packed, sample)], hidden, atol=1e-10, rtol=1e-8)
        ref_logp = torch.log_softmax(ref_model.lm_head(hidden), dim=-1)
        for p in range(1, len(ids)):
            if sample["completion_mask"][p]:
                ref_terms.append(ref_logp[p - 1, ids[p]])
    ref_terms = torch.stack(ref_terms)
    ref_terms.sum().backward()

    # Same loss terms in the same order (pack() walks samples, then positions), hence the same gradients. Qwen3's
    # RMSNorm computes in float32 even in a float64 model, so gradients agree to float32 round-off (a wrong mask or a
    # lost gradient path is off by O(1) of the gradient's scale).
    torch.testing.assert_close(tree_terms, ref_terms, atol=1e-10, rtol=1e-8)
    for (name, p_tree), (_, p_ref) in zip(tree_model.named_parameters(), ref_model.named_parameters(), strict=True):
        scale = p_ref.grad.abs().max()
        assert scale > 0, name
        assert (p_tree.grad - p_ref.grad).abs().max() <= 1e-6 * scale, name
