"""Under torchrun (gloo): rank 0 builds a tiny Llama with its weights, the other ranks on ``meta``; every rank
receives its shards through :func:`memfit.rank0_load.shard_from_rank_0` under FSDP2's CPU offload policy (as a
``--cpu-offload`` run loads them), and writes to ``OUT/rank<N>.json`` whether each of its shards equals its
slice of the same model built whole from the same seed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import LlamaConfig, LlamaForCausalLM

from memfit import distributed
from memfit.rank0_load import shard_from_rank_0
from tests.conftest import TINY_LLAMA


def build(weights: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if not weights:
        with torch.device("meta"):
            return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = distributed.device_mesh("cpu")
    model = shard_from_rank_0(
        build(rank == 0),
        lambda m: distributed.shard(m, mesh, low_precision=None, cpu_offload=True, pin_memory=False),
        main=rank == 0, device=torch.device("cpu"), offload=True)
    whole = build(True)
    reference, reference_buffers = dict(whole.named_parameters()), dict(whole.named_buffers())
    equal = {}
    for name, parameter in model.named_parameters():
        assert isinstance(parameter, DTensor)
        part = distribute_tensor(reference[name].detach(), parameter.device_mesh, parameter.placements,
                                 src_data_rank=None)
        equal[name] = torch.equal(parameter.to_local(), part.to_local())
    buffers = {name: torch.equal(buffer, reference_buffers[name]) for name, buffer in model.named_buffers()}
    (out / f"rank{rank}.json").write_text(json.dumps({"parameters": equal, "buffers": buffers}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
