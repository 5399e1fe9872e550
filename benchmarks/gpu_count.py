"""How many GPUs a fine-tune needs: ``memfit plan --max-gpus N`` for large LLMs on 24 and 80 GiB cards.

For each model and device profile: the planner's own plan of one rank on every count of GPUs from 1 to
``--max-gpus`` (DDP, FSDP and FSDP with CPU offload; the memory techniques; full fine-tuning, LoRA r=16 and QLoRA
r=16), at 2048 tokens and an effective batch of 16 over all the GPUs. Each row gives the fewest GPUs each
technique needs and the per-GPU peak of its plan there (allocator reserve plus CUDA context), and how long the
plan took on this machine. Every figure is a fake-tensor trace of one rank's step on a fake process group; none
was measured on a GPU.

    .venv/bin/python benchmarks/gpu_count.py --json benchmarks/results/gpu_count_cpu.json
    .venv/bin/python benchmarks/gpu_count.py --models llama-3.1-8b --profiles 4090 --max-gpus 4

Each technique is planned on 1, 2, ... GPUs until it fits (the table gives the fewest); ``--every-count`` plans
every count up to ``--max-gpus``, as ``memfit plan --max-gpus`` does, the same fewest.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from memfit.planner.allowed import Allowed
from memfit.planner.gpu_count import GpuCount, plan_gpu_count
from memfit.planner.request import PlanRequest
from memfit.report import format_bytes

MODELS = ("llama-3.1-8b", "qwen2.5-32b", "llama-3.1-70b")
PROFILES = ("4090", "a100-80", "h100")
TECHNIQUES = ("full", "lora", "qlora")


def row(model: str, profile: str, result: GpuCount) -> dict[str, Any]:
    """The fewest GPUs of each technique, its setup and per-GPU peak there; where the setup keeps its shards or
    optimizer on the host, the host memory each rank needs (from the chosen setup's exact trace)."""
    out: dict[str, Any] = {"model": model, "profile": profile, "seconds": round(result.seconds, 1),
                           "verdict": result.verdict(), "skipped": result.skipped}
    for technique in TECHNIQUES:
        cell = result.fewest(technique)
        chosen = cell.plan.chosen if cell is not None else None
        if cell is None or chosen is None:
            out[technique] = None
            continue
        out[technique] = {"gpus": cell.gpus, "setup": chosen.describe(), "per_gpu_bytes": chosen.predicted_peak_bytes,
                          "host_bytes_per_gpu": chosen.predicted_host_bytes}
    return out


def cell_text(entry: dict[str, Any] | None, max_gpus: int) -> str:
    if entry is None:
        return f"> {max_gpus}"
    host = f", host {format_bytes(entry['host_bytes_per_gpu'])} each" if entry.get("host_bytes_per_gpu") else ""
    return f"{entry['gpus']} ({format_bytes(entry['per_gpu_bytes'])} each{host})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES))
    parser.add_argument("--max-gpus", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--effective-batch", type=int, default=16)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--every-count", action="store_true",
                        help="plan every count up to --max-gpus (as memfit plan --max-gpus does), not only up to "
                             "the fewest each technique fits on")
    args = parser.parse_args()
    rows = []
    lines = ["| model | profile | full fine-tuning | LoRA r=16 | QLoRA r=16 | plan time |", "|---|---|---|---|---|---|"]
    for model in args.models:
        for profile in args.profiles:
            request = PlanRequest(model=model, task="causal-lm", seq_len=args.seq_len,
                                  effective_batch=args.effective_batch, device=profile,
                                  allow=Allowed(lora=True, qlora=True), lora_rank=16)
            started = time.perf_counter()
            result = plan_gpu_count(request, args.max_gpus, fewest_only=not args.every_count)
            entry = row(model, profile, result)
            entry["seconds"] = round(time.perf_counter() - started, 1)
            rows.append(entry)
            lines.append(f"| {model} | {profile} | " + " | ".join(
                cell_text(entry[t], args.max_gpus) for t in TECHNIQUES) + f" | {entry['seconds']:.0f} s |")
            print(lines[-1], flush=True)
            if args.json:  # after each row: a long run keeps what it finished
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps({"seq_len": args.seq_len, "effective_batch": args.effective_batch,
                                                 "max_gpus": args.max_gpus, "every_count": args.every_count,
                                                 "rows": rows}, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
