"""CPU stand-ins for the parts of TRL's async GRPO that cannot run on this machine (no GPU, no vLLM, no hub).

Only five things are replaced; everything else of TRL runs for real:

(a) `packing._flash_attn` -- the tree attention kernel (`kernels` hub download of FA3, CUDA only) -> `SDPA_VARLEN`,
    an SDPA implementation of `flash_attn_varlen_func` with the same semantics (per-segment varlen attention,
    causal mask aligned bottom-right as in FA2/FA3, GQA, sliding window, softcap). `packing.tree_attention` itself
    (the K/V gather along each segment's root-to-segment path) is kept and runs unchanged.
(b) `async_grpo_trainer.get_peak_flops_per_device` -> None when CUDA is absent (it calls
    `torch.cuda.get_device_name`, which raises on a CPU build). MFU metrics are then simply not logged.
(c) the `is_vllm_available` guards in `async_rollout_worker` / `weight_transfer` -> True. They only refuse to build
    `AsyncRolloutWorker` / `WeightTransferClient`; the vLLM imports they gate (NCCL helpers) have already been
    skipped at import time because vLLM is absent, and nothing in the rig uses them.
(d) the NCCL halves of `WeightTransferClient`: `init_weight_transfer` builds no NCCL group, `send_weights` collects
    the (name, tensor) stream and POSTs `safetensors.torch.save(state_dict)` to `{server_url}/stand_in/load_weights`.
    The HTTP control calls (wait_for_server_ready, get_dtype + its dtype-mismatch warning, pause/resume,
    start_weight_update, finish_weight_update) are the real `VLLMClient` ones. `torch.distributed.is_nccl_available`
    answers True, as the stand-in carries what NCCL would (the preflight's `trainer GPU` row asks it of a CPU trainer).
(e) `torch.cuda.mem_get_info` -> the free and total GiB in $AGH_RIG_GPU_MEMORY (`FREE,TOTAL`), only while it is set:
    the preflight's trainer-memory row compares its projection with a GPU this machine does not have. Unset, torch's
    own (which raises without CUDA, so the row says there is no GPU).
(f) CUDA IPC, for the script's `ipc` backend (`CudaIpcWeightTransfer`), on a torch without CUDA: `reduce_tensor` of a
    CPU tensor returns the 15 arguments of torch's `rebuild_cuda_tensor` in their places, its "cudaIpcMemHandle" the
    path of a file holding the storage's bytes, removed when the storage is freed (as CUDA IPC memory is not the
    consumer's to read once the producer frees it); `torch.cuda.get_device_properties` answers one "GPU" of uuid
    `RIG_GPU_UUID`; `torch.cuda.synchronize` and `ipc_collect` have nothing to wait for. The engine stand-in
    (`tests/rig/engine.py --weight-transfer-config '{"backend":"ipc"}'`) rebuilds them as vLLM's receive path does.

`install()` is idempotent. It patches modules already imported and registers an import hook for the others, so it
is cheap to call at interpreter start (see `tests/rig/sitecustomize/sitecustomize.py`, active when AGH_CPU_RIG=1).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import logging
import math
import os
import sys
import tempfile
import time
import uuid
import weakref
from collections import Counter
from types import SimpleNamespace

ENV_FLAG = "AGH_CPU_RIG"
LOAD_WEIGHTS_PATH = "/stand_in/load_weights"

logger = logging.getLogger("agh.cpu_rig")


# --------------------------------------------------------------------------------------------------------------------
# (a) flash_attn_varlen_func on SDPA
# --------------------------------------------------------------------------------------------------------------------
def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    **_unused,
):
    """Same contract as flash-attn's `flash_attn_varlen_func` for what `packing.tree_attention` uses.

    q: (total_q, H, D), k/v: (total_k, Hk, D) with H % Hk == 0. Segment i is q[cu_q[i]:cu_q[i+1]] against
    k[cu_k[i]:cu_k[i+1]]. With `causal`, query j of a segment of lengths (Lq, Lk) sees keys t <= j + Lk - Lq (the
    bottom-right alignment of FA >= 2.1). `window_size=(left, right)` further limits t to
    [j + Lk - Lq - left, j + Lk - Lq + right] (-1 = unbounded). A query row that sees no key outputs 0, as FA does.
    Returns (total_q, H, D) in q's dtype.
    """
    import torch
    import torch.nn.functional as F

    if dropout_p:
        raise NotImplementedError("dropout is not used by tree attention")
    total_q, n_heads, head_dim = q.shape
    n_kv_heads = k.shape[1]
    if n_heads % n_kv_heads:
        raise ValueError(f"{n_heads} query heads are not a multiple of {n_kv_heads} kv heads")
    rep = n_heads // n_kv_heads
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    left, right = window_size if window_size is not None else (-1, -1)
    if causal:
        right = 0
    cu_q = [int(x) for x in cu_seqlens_q.tolist()]
    cu_k = [int(x) for x in cu_seqlens_k.tolist()]
    if len(cu_q) != len(cu_k):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must describe the same number of segments")

    out = q.new_zeros(total_q, n_heads, head_dim)
    chunks = []
    for i in range(len(cu_q) - 1):
        qa, qb, ka, kb = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        lq, lk = qb - qa, kb - ka
        if lq == 0:
            continue
        qs = q[qa:qb].transpose(0, 1)  # (H, Lq, D)
        ks = k[ka:kb].transpose(0, 1)
        vs = v[ka:kb].transpose(0, 1)
        if rep > 1:
            ks = ks.repeat_interleave(rep, dim=0)
            vs = vs.repeat_interleave(rep, dim=0)
        diag = torch.arange(lq, device=q.device)[:, None] + (lk - lq)  # (Lq, 1): key index on query j's diagonal
        key = torch.arange(lk, device=q.device)[None, :]
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if right >= 0:
            allowed &= key <= diag + right
        if left >= 0:
            allowed &= key >= diag - left
        has_key = allowed.any(dim=-1)  # (Lq,)
        if softcap:
            acc = torch.promote_types(q.dtype, torch.float32)  # FA accumulates in fp32
            scores = (qs.to(acc) @ ks.to(acc).transpose(-1, -2)) * scale
            scores = softcap * torch.tanh(scores / softcap)
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
            o = (probs @ vs.to(acc)).to(q.dtype)
        else:
            # An all-False row would give NaN in SDPA: let it attend anywhere, then zero it below.
            mask = allowed | ~has_key[:, None]
            if q.is_cuda:
                # CUDA's fused kernels take 4-D inputs only; 3-D falls back to the math path, which keeps every head's
                # fp32 attention matrix and would overstate a GPU run's memory next to FlashAttention's.
                o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=mask[None, None],
                                                   scale=scale)[0]
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        o = o * has_key[None, :, None].to(o.dtype)
        chunks.append((qa, qb, o.transpose(0, 1)))
    if not chunks:
        return out
    # One index_copy keeps autograd simple and covers the (unused by tree packing) case of gaps between segments.
    index = torch.cat([torch.arange(a, b, device=q.device) for a, b, _ in chunks])
    values = torch.cat([o for _, _, o in chunks])
    return out.index_copy(0, index, values.to(out.dtype))


SDPA_VARLEN = SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)


def _sdpa_kernel():
    return SDPA_VARLEN


def _patch_packing(module) -> None:
    module._flash_attn = _sdpa_kernel


# --------------------------------------------------------------------------------------------------------------------
# (b) peak FLOPs
# --------------------------------------------------------------------------------------------------------------------
def _patch_trainer(module) -> None:
    original = getattr(module.get_peak_flops_per_device, "_agh_original", module.get_peak_flops_per_device)

    def get_peak_flops_per_device(accelerator, dtype):
        import torch

        if accelerator.device.type == "cuda" and torch.cuda.is_available():
            return original(accelerator, dtype)
        return None

    get_peak_flops_per_device._agh_original = original
    module.get_peak_flops_per_device = get_peak_flops_per_device


# --------------------------------------------------------------------------------------------------------------------
# (c) vLLM guards
# --------------------------------------------------------------------------------------------------------------------
def _vllm_guard(min_version=None) -> bool:
    return True


def _patch_rollout_worker(module) -> None:
    module.is_vllm_available = _vllm_guard


# --------------------------------------------------------------------------------------------------------------------
# (d) weight transfer over HTTP
# --------------------------------------------------------------------------------------------------------------------
class _HttpTransferGroup:
    """Stands where the NCCL group would: `send_weights` is a no-op until `init_weight_transfer` set one."""

    transport = "http"


def _init_weight_transfer(self) -> None:
    self.vllm.wait_for_server_ready()
    train_dtype = Counter(self._weight_update_info["dtype_names"]).most_common(1)[0][0]
    vllm_dtype = self.vllm.get_dtype().removeprefix("torch.")
    if vllm_dtype != train_dtype:
        logger.warning(
            f"The vLLM server serves in {vllm_dtype} but the weights sent to it are {train_dtype}. Set `dtype` in "
            f"`AsyncGRPOConfig` to '{vllm_dtype}', or start the server with `--dtype {train_dtype}`."
        )
    self.model_update_group = _HttpTransferGroup()
    logger.info("Weight transfer over HTTP (CPU rig): no NCCL group")


def _send_weights(self, iterator) -> None:
    import requests
    import safetensors.torch

    if self.model_update_group is None:
        return
    t0 = time.time()
    self.vllm.start_weight_update(timeout=self._CONTROL_TIMEOUT)
    try:
        state_dict = {}
        for name, tensor in iterator:
            if name in state_dict:
                raise ValueError(f"parameter {name!r} streamed twice")
            state_dict[name] = tensor.detach().to("cpu").contiguous()
        # The real server sizes its receive buffers from the manifest; a stream that disagrees with it is a bug.
        info = self._weight_update_info
        manifest = list(zip(info["names"], info["dtype_names"], (list(s) for s in info["shapes"]), strict=True))
        streamed = [(n, str(t.dtype).split(".")[-1], list(t.shape)) for n, t in state_dict.items()]
        if streamed != manifest:
            raise ValueError("streamed parameters do not match the weight_update_info manifest")
        response = requests.post(
            f"{self.vllm.server_url}{LOAD_WEIGHTS_PATH}",
            data=safetensors.torch.save(state_dict),
            headers={"Content-Type": "application/octet-stream"},
            timeout=self.weight_sync_timeout,
        )
        if response.status_code != 200:
            raise Exception(f"Request failed: {response.status_code}, {response.text}")
    except Exception as exc:
        with contextlib.suppress(Exception):
            self.vllm.finish_weight_update(timeout=self.weight_sync_timeout)
        raise RuntimeError(f"Weight sync to the stand-in server at {self.vllm.server_url} failed.") from exc
    self.vllm.finish_weight_update(timeout=self.weight_sync_timeout)
    logger.debug(f"[weight_sync] send_weights (http) took {time.time() - t0:.2f}s")


def _destroy(self) -> None:
    self.model_update_group = None


def _patch_nccl_available(module) -> None:
    original = getattr(module.is_nccl_available, "_agh_original", module.is_nccl_available)

    def is_nccl_available() -> bool:
        return True

    is_nccl_available._agh_original = original
    module.is_nccl_available = is_nccl_available


def _patch_weight_transfer(module) -> None:
    module.is_vllm_available = _vllm_guard
    cls = module.WeightTransferClient
    cls.init_weight_transfer = _init_weight_transfer
    cls.send_weights = _send_weights
    cls.destroy = _destroy


# --------------------------------------------------------------------------------------------------------------------
# (e) the GPU's memory, as the driver would report it
# --------------------------------------------------------------------------------------------------------------------
GPU_MEMORY_ENV = "AGH_RIG_GPU_MEMORY"


def _patch_cuda_memory(module) -> None:
    original = getattr(module.mem_get_info, "_agh_original", module.mem_get_info)

    def mem_get_info(device=None):
        spec = os.environ.get(GPU_MEMORY_ENV)
        if not spec:
            return original(device)
        free, total = (int(float(gib) * 2**30) for gib in spec.split(","))
        return free, total

    mem_get_info._agh_original = original
    module.mem_get_info = mem_get_info


def install_gpu_memory() -> None:
    """(e) alone, in a process that imported torch already (a test running `main()` in-process)."""
    import torch.cuda

    _patch_cuda_memory(torch.cuda)


# --------------------------------------------------------------------------------------------------------------------
# (f) CUDA IPC on CPU
# --------------------------------------------------------------------------------------------------------------------
RIG_GPU_UUID = "5a1e0000-0000-4000-8000-00000000c0de"  # the rig's one "physical GPU": the trainer's and the engine's
_RIG_GPU = SimpleNamespace(uuid=RIG_GPU_UUID, name="CPU rig")


def _share_cpu_tensor(tensor):
    """What torch's reduce_tensor returns for a CUDA tensor, for a CPU one: (rebuild_cuda_tensor, its args)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    storage = tensor.untyped_storage()
    path = os.path.join(tempfile.gettempdir(), f"agh-rig-ipc-{os.getpid()}-{uuid.uuid4().hex}")
    with open(path, "wb") as f:
        f.write(bytes(storage))
    weakref.finalize(storage, _unlink, path)
    return (rebuild_cuda_tensor,
            (type(tensor), tensor.size(), tensor.stride(), tensor.storage_offset(), type(tensor._typed_storage()),
             tensor.dtype, 0, path.encode(), storage.nbytes(), 0, tensor.requires_grad, b"", 0, b"", False))


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _patch_reductions(module) -> None:
    # Patched once the package has registered the original with multiprocessing's pickler (init_reductions), so
    # tensors that cross process boundaries through queues (TRL's rollout child) still travel as torch sends them.
    reductions = module.reductions
    original = getattr(reductions.reduce_tensor, "_agh_original", reductions.reduce_tensor)

    def reduce_tensor(tensor):
        return _share_cpu_tensor(tensor) if tensor.device.type == "cpu" else original(tensor)

    reduce_tensor._agh_original = original
    reductions.reduce_tensor = reduce_tensor


def _patch_cuda_ipc(module) -> None:
    if module.is_available():
        return
    module.get_device_properties = lambda device=None: _RIG_GPU
    module.synchronize = lambda device=None: None
    module.ipc_collect = lambda: None


def _patch_cuda(module) -> None:
    _patch_cuda_memory(module)
    _patch_cuda_ipc(module)


# --------------------------------------------------------------------------------------------------------------------
# installation
# --------------------------------------------------------------------------------------------------------------------
_PKG = "trl.experimental.async_grpo"
_PATCHES = {
    f"{_PKG}.packing": _patch_packing,
    f"{_PKG}.async_grpo_trainer": _patch_trainer,
    f"{_PKG}.async_rollout_worker": _patch_rollout_worker,
    f"{_PKG}.weight_transfer": _patch_weight_transfer,
    "torch.multiprocessing": _patch_reductions,
    "torch.distributed": _patch_nccl_available,
    "torch.cuda": _patch_cuda,
}
# Offline GPU runs (tests/gpu, AGH_CPU_RIG=attention) stand in for the hub-fetched kernel alone: vLLM, NCCL and CUDA
# are real there.
ATTENTION_ONLY = (f"{_PKG}.packing",)
_applied: set[str] = set()
_active: set[str] = set(_PATCHES)


def _apply(name: str, module) -> None:
    if name in _applied or name not in _active:
        return
    _PATCHES[name](module)
    _applied.add(name)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, name, loader):
        self._name = name
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _apply(self._name, module)

    def __getattr__(self, attr):  # get_source, is_package, get_filename, ... for inspect/linecache
        return getattr(self._loader, attr)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _active or fullname in _applied:
            return None
        spec = None
        for finder in sys.meta_path:  # whoever would have found it (site-packages, an editable install, ...)
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(fullname, spec.loader)
        return spec


_finder = _PatchingFinder()


def install(names=None) -> None:
    """Apply the CPU stand-ins (all, or those of the modules in `names`) to the TRL modules already imported, and to
    the others when they are imported."""
    _active.intersection_update(names or _PATCHES)
    for name in _active:
        module = sys.modules.get(name)
        if module is not None:
            _apply(name, module)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def installed() -> dict[str, bool]:
    return {name: name in _applied for name in _PATCHES}
