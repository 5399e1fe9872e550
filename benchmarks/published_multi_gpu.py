"""memfit's per-rank estimates beside published per-GPU peaks of real two-GPU runs: Answer.AI's FSDP + QLoRA.

Answer.AI's benchmark notes (``benchmarks_03_2024.md`` in github.com/AnswerDotAI/fsdp_qlora, February-March
2024) list the peak memory per GPU they measured training Llama-2 7B, Yi 34B and Llama-2 70B on two RTX 4090s
(and two 3090s) with their ``train.py``: FSDP over 2 GPUs, 2048-token rows of a dummy dataset (every row full
length), gradient checkpointing, LoRA rank 64 (alpha 16) on q/k/v and the MLP, QLoRA's NF4 base stored in bf16,
gradients clipped at 0.3, with and without FSDP's CPU offload of the parameters. This script estimates one rank
of each row with memfit's own step on the RTX 4090 profile (fake-tensor traces on a fake process group of 2
ranks; no GPU) and prints both. The models are directories holding the published ``config.json`` values
(memory depends on sizes, heads and vocabulary only).

What differs by construction, and why the figures need not match:
- their runs use FSDP1 (flat parameters per wrapped layer, the LoRA layers wrapped apart); memfit trains and
  estimates FSDP2 (per-parameter sharding, one group per block);
- their ``bf16`` keeps every weight, adapter and AdamW state in bf16 (no autocast); memfit's bf16 is mixed
  precision (fp32 adapters and optimizer state, bf16 compute), so each row is estimated twice: in mixed
  precision, and with ``--precision bf16-true`` (every weight, adapter, gradient and AdamW state in bf16, as
  theirs; memfit adds its Kahan buffer, which their AdamW has not, so the bf16-true rows run without it);
- the notes call the figure "peak memory" and say elsewhere that it is the peak *reserved*; both memfit's
  reserved and allocated peaks are printed (the CUDA context is not in either).

    .venv/bin/python benchmarks/published_multi_gpu.py --json benchmarks/results/published_multi_gpu_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from memfit import TrainConfig
from memfit.memory.estimate import estimate

GiB = 1024**3
LLAMA: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                         "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False}
MODELS: dict[str, dict[str, Any]] = {  # the published config.json values of meta-llama/Llama-2-7b-hf,
    # 01-ai/Yi-34B and meta-llama/Llama-2-70b-hf
    "Llama-2 7B": {**LLAMA, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000},
    "Yi 34B": {**LLAMA, "hidden_size": 7168, "intermediate_size": 20480, "num_hidden_layers": 60,
               "num_attention_heads": 56, "num_key_value_heads": 8, "vocab_size": 64000, "rope_theta": 5000000.0},
    "Llama-2 70B": {**LLAMA, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000},
}
ROWS: list[tuple[str, str, bool, int, float]] = [  # (model, LoRA or QLoRA, CPU offload, batch per GPU, GiB measured)
    ("Llama-2 7B", "LoRA", False, 6, 21.35),
    ("Llama-2 7B", "LoRA", True, 10, 22.69),
    ("Llama-2 7B", "QLoRA", False, 10, 20.97),
    ("Llama-2 7B", "QLoRA", True, 12, 22.38),
    ("Yi 34B", "QLoRA", False, 2, 23.05),
    ("Yi 34B", "QLoRA", True, 4, 22.98),
    ("Llama-2 70B", "QLoRA", True, 2, 14.92),
]
BASE: dict[str, Any] = {"task": "causal-lm", "max_length": 2048, "world_size": 2, "distributed": "fsdp",
                        "checkpointing": "full", "precision": "bf16", "lora_rank": 64, "lora_alpha": 16.0,
                        "lora_targets": "k_proj,q_proj,v_proj,up_proj,down_proj,gate_proj", "max_grad_norm": 0.3}


def row(directory: Path, model: str, technique: str, offload: bool, batch: int, published: float,
        profile: str) -> dict[str, Any]:
    config = TrainConfig(**BASE, model=str(directory), micro_batch_size=batch, effective_batch=2 * batch,
                         cpu_offload=offload, quantize_base="nf4" if technique == "QLoRA" else "none")
    started = time.perf_counter()
    result = estimate(config, device=profile, seq_len=BASE["max_length"])
    bf16 = estimate(dataclasses.replace(config, precision="bf16-true", kahan=False), device=profile,
                    seq_len=BASE["max_length"])
    return {"model": model, "technique": technique, "cpu_offload": offload, "batch_per_gpu": batch,
            "published_peak_gib": published,
            "memfit_reserved_gib": round(result.peak_reserved_bytes / GiB, 2),
            "memfit_allocated_gib": round(result.peak_bytes / GiB, 2),
            "memfit_host_gib": round(result.host_bytes / GiB, 2), "peak_phase": result.peak_phase,
            "difference": round(result.peak_reserved_bytes / GiB / published - 1, 3),
            "breakdown_gib": {name: round(value / GiB, 2) for name, value in result.breakdown.items() if value},
            "bf16_true_reserved_gib": round(bf16.peak_reserved_bytes / GiB, 2),
            "bf16_true_allocated_gib": round(bf16.peak_bytes / GiB, 2),
            "bf16_true_host_gib": round(bf16.host_bytes / GiB, 2),
            "bf16_true_difference": round(bf16.peak_reserved_bytes / GiB / published - 1, 3),
            "trace": result.trace, "seconds": round(time.perf_counter() - started, 1)}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | technique | CPU offload | batch per GPU | Answer.AI, measured | memfit reserved, mixed | "
             "difference | memfit reserved, all bf16 | difference | memfit allocated, all bf16 | "
             "memfit host per rank, all bf16 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        host = f"{r['bf16_true_host_gib']:.1f} GiB" if r["bf16_true_host_gib"] else "-"
        lines.append(f"| {r['model']} | {r['technique']} | {'yes' if r['cpu_offload'] else 'no'} | "
                     f"{r['batch_per_gpu']} | {r['published_peak_gib']:.2f} GiB | {r['memfit_reserved_gib']:.2f} GiB | "
                     f"{r['difference']:+.0%} | {r['bf16_true_reserved_gib']:.2f} GiB | "
                     f"{r['bf16_true_difference']:+.0%} | {r['bf16_true_allocated_gib']:.2f} GiB | {host} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--device", default="4090", help="the profile to estimate for [4090]")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        directories = {}
        for name, values in MODELS.items():
            directories[name] = Path(root) / name.replace(" ", "-")
            directories[name].mkdir()
            (directories[name] / "config.json").write_text(json.dumps(values))
        for model, technique, offload, batch, published in ROWS:
            rows.append(row(directories[model], model, technique, offload, batch, published, args.device))
            print(f"{model} {technique}{' + offload' if offload else ''}, batch {batch}: "
                  f"{rows[-1]['memfit_reserved_gib']} GiB reserved (published {published}) [{rows[-1]['seconds']} s]",
                  flush=True)
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps({
            "source": "Answer.AI, fsdp_qlora benchmarks_03_2024.md (2 x RTX 4090, 2048 tokens, FSDP + QLoRA/LoRA)",
            "device": args.device, "machine": f"{platform.machine()}, torch {torch.__version__}",
            "command": "python benchmarks/published_multi_gpu.py", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
