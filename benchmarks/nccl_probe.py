"""What NCCL takes on a card outside PyTorch's caching allocator, measured with one process.

memfit's estimate counts what PyTorch allocates. NCCL allocates its own device buffers (cudaMalloc, unseen by
``torch.cuda.memory_allocated``) when a communicator is made and when a kind of collective first runs. This
measures, on one card, the device memory in use outside PyTorch's reserve (``cudaMemGetInfo``'s used bytes less
``torch.cuda.memory_reserved()``) after the CUDA context, after the NCCL communicator (world size 1), and after an
all-reduce, an all-gather and a reduce-scatter of 64 MiB. One card measures only a one-rank communicator: with
more ranks NCCL adds buffers per peer and channel, which needs several cards. Without a CUDA device it says so
and measures nothing.

    python benchmarks/nccl_probe.py --json results/nccl_probe.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ELEMENTS = 16 * 1024 * 1024
"""64 MiB of fp32 per collective."""


def outside_pytorch() -> int:
    """Device bytes in use that PyTorch's caching allocator has not reserved (the context, NCCL's buffers)."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def probe() -> dict[str, Any]:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.ones(1, device=device)  # the CUDA context
    steps = [("CUDA context", outside_pytorch())]
    from torch.distributed import HashStore  # type: ignore[attr-defined]

    dist.init_process_group("nccl", store=HashStore(), rank=0, world_size=1, device_id=device)
    try:
        steps.append(("NCCL communicator (1 rank)", outside_pytorch()))
        tensor = torch.ones(ELEMENTS, device=device)
        dist.all_reduce(tensor)
        steps.append(("after an all-reduce of 64 MiB", outside_pytorch()))
        gathered = torch.empty(ELEMENTS, device=device)
        dist.all_gather_into_tensor(gathered, tensor)
        steps.append(("after an all-gather of 64 MiB", outside_pytorch()))
        dist.reduce_scatter_tensor(torch.empty(ELEMENTS, device=device), gathered)
        steps.append(("after a reduce-scatter of 64 MiB", outside_pytorch()))
    finally:
        dist.destroy_process_group()
    context = steps[0][1]
    return {"cuda": True, "device": torch.cuda.get_device_name(device),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "steps": [{"step": name, "outside_pytorch_bytes": value, "beyond_context_bytes": value - context}
                      for name, value in steps],
            "nccl_bytes": steps[-1][1] - context}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        result: dict[str, Any] = {"cuda": False, "note": "no CUDA device with NCCL: nothing measured"}
        print(result["note"])
    else:
        result = probe()
        print(f"{result['device']}, NCCL {result['nccl']}")
        print("| step | outside PyTorch | beyond the CUDA context |\n|---|---|---|")
        for row in result["steps"]:
            print(f"| {row['step']} | {row['outside_pytorch_bytes'] / 2**20:.1f} MiB | "
                  f"{row['beyond_context_bytes'] / 2**20:.1f} MiB |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
