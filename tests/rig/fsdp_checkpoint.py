"""Writes the files a multi-GPU (FSDP2) checkpoint holds, with the functions transformers' Trainer calls to write them.

    python tests/rig/fsdp_checkpoint.py MODEL_DIR OUT_DIR

Two gloo processes on CPU shard MODEL_DIR with FSDP2's `fully_shard` and take one AdamW step, then save it as
transformers' `_save_checkpoint` does under FSDP: accelerate's `save_fsdp_model` + `save_fsdp_optimizer`, into
OUT_DIR/full (FULL_STATE_DICT, as slurm/fsdp2.yaml sets) and OUT_DIR/sharded (SHARDED_STATE_DICT: per-rank
torch.distributed.checkpoint shards). Each is then loaded back with
`load_fsdp_model` + `load_fsdp_optimizer`, what a resume runs, so the files are known to be what a resume reads.
accelerate runs FSDP only on GPUs (its MULTI_CPU mode is DDP), so the model is sharded here directly.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from accelerate import Accelerator, PartialState
    from accelerate.utils import (FullyShardedDataParallelPlugin, load_fsdp_model, load_fsdp_optimizer,
                                  save_fsdp_model, save_fsdp_optimizer)
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    PartialState(cpu=True, timeout=timedelta(minutes=5))

    class FSDP2OnCPU(Accelerator):
        is_fsdp2 = True  # what the save/load functions branch on; accelerate sets it only with GPUs

    accelerator = FSDP2OnCPU(cpu=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.arange(16).unsqueeze(0)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    for layout, state_dict_type in (("full", "FULL_STATE_DICT"), ("sharded", "SHARDED_STATE_DICT")):
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=state_dict_type)
        directory = os.path.join(out, layout)
        save_fsdp_model(plugin, accelerator, model, directory, adapter_only=True)  # transformers' get_fsdp_ckpt_kwargs
        save_fsdp_optimizer(plugin, accelerator, optimizer, model, directory)
        dist.barrier()
        load_fsdp_model(plugin, accelerator, model, directory, adapter_only=True)
        load_fsdp_optimizer(plugin, accelerator, optimizer, model, directory, adapter_only=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    model_dir, out = sys.argv[1:3]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(2, port, model_dir, out), nprocs=2)


if __name__ == "__main__":
    main()
