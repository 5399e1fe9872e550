"""The least memory an LLM fine-tune needs, memfit's trace beside published tables and a calculator.

For each model and technique: ``memfit estimate`` of its leanest setup (micro-batch 1, every layer
checkpointed, bf16, AdamW, 512 tokens, the RTX 4090 profile: a card where bf16 and bitsandbytes run), the
whole reserve a card needs (allocator reserve plus CUDA context). Beside it: Unsloth's "absolute minimum"
table (QLoRA 4-bit and LoRA 16-bit, by parameter count), LLaMA-Factory's rule of thumb (full mixed precision
18 GB per billion parameters, LoRA 2 GB, QLoRA 4-bit 0.5 GB) and ``fitcheck-llm`` 0.3.1 for the same setup
(when installed: ``.venv/bin/pip install --no-deps fitcheck-llm==0.3.1``).

    .venv/bin/python benchmarks/llm_minimum.py --json benchmarks/results/llm_minimum.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from memfit import TrainConfig
from memfit.memory.estimate import estimate
from memfit.report import format_bytes

MODELS = {"qwen2.5-0.5b": 0.49, "llama-3.2-1b": 1.24, "llama-3.2-3b": 3.21, "qwen2.5-7b": 7.62, "llama-3.1-8b": 8.03}
"""Presets and their parameter counts in billions (for the published per-billion rules)."""
UNSLOTH_GB: dict[str, dict[str, float]] = {
    "llama-3.2-3b": {"qlora": 3.5, "lora": 8}, "qwen2.5-7b": {"qlora": 5, "lora": 19},
    "llama-3.1-8b": {"qlora": 6, "lora": 22}}
"""Unsloth's requirements page: "QLoRA (4-bit) VRAM" and "LoRA (16-bit) VRAM" for 3B, 7B and 8B models,
"the absolute minimum"."""
LLAMA_FACTORY_GB_PER_BILLION = {"full": 18, "lora": 2, "qlora": 0.5}
TECHNIQUES: dict[str, dict[str, Any]] = {"full": {}, "lora": {"lora_rank": 16},
                                         "qlora": {"lora_rank": 16, "quantize_base": "nf4"}}
LENGTH = 512
GB = 1e9


def fitcheck_gib(model: str, technique: str) -> float | None:
    """fitcheck-llm's total for the same leanest setup, or ``None`` when it is not installed."""
    try:
        from compare_fitcheck import fitcheck_total
    except ImportError:
        return None
    try:
        import fitcheck  # noqa: F401
    except ImportError:
        return None
    row = {"model": model, "technique": technique, "seq_len": LENGTH, "profile": "4090",
           "budget_bytes": 24 * 1024**3, "usable_bytes": 23 * 1024**3,
           "chosen": {"precision": "bf16", "micro_batch_size": 1, "checkpointing": "full", "accumulation_steps": 16}}
    return fitcheck_total(row) / 1024**3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    lines = ["| model | technique | memfit (4090 profile) | Unsloth's minimum | LLaMA-Factory's rule | fitcheck |",
             "|---|---|---|---|---|---|"]
    for model, billions in MODELS.items():
        for technique, options in TECHNIQUES.items():
            config = TrainConfig(model=model, task="causal-lm", max_length=LENGTH, micro_batch_size=1,
                                 effective_batch=16, precision="bf16", checkpointing="full", **options)
            started = time.perf_counter()
            result = estimate(config, device="4090", seq_len=LENGTH)
            unsloth = UNSLOTH_GB.get(model, {}).get(technique)
            factory = LLAMA_FACTORY_GB_PER_BILLION[technique] * billions
            theirs = fitcheck_gib(model, technique)
            rows.append({"model": model, "technique": technique, "memfit_bytes": result.total_bytes,
                         "memfit_allocated_bytes": result.peak_bytes, "breakdown": result.breakdown,
                         "unsloth_gb": unsloth, "llama_factory_gb": round(factory, 2), "fitcheck_gib": theirs,
                         "seconds": round(time.perf_counter() - started, 1)})
            lines.append(f"| {model} | {technique} | {format_bytes(result.total_bytes)} "
                         f"({result.total_bytes / GB:.1f} GB) | {f'{unsloth} GB' if unsloth else '-'} | "
                         f"{factory:.1f} GB | {f'{theirs:.1f} GiB' if theirs is not None else '-'} |")
            print(lines[-1], flush=True)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"sequence_length": LENGTH, "device": "4090", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
