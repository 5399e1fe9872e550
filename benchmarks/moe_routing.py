"""MoE decoders on the CPU: the estimate against the real step, under balanced and skewed routing.

For each family, a tiny config from transformers' own defaults (two blocks of width 64, 4 experts, 2 per token:
:func:`memfit.sweep.tiny_config`) is estimated (a fake-tensor trace) and then run for real on the CPU with the
same steps (``estimate(..., execute=True)``): once with the router's own choices (random init: roughly
balanced), once with every token sent to experts 0 and 1 (:func:`memfit.memory.moe.skewed_routing`). Two
optimizer steps, micro-batch 2 x 16 tokens, accumulation 2, bf16 autocast, AdamW.

    .venv/bin/python benchmarks/moe_routing.py --json benchmarks/results/moe_routing_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers

from memfit import TrainConfig
from memfit.memory.estimate import estimate
from memfit.memory.moe import skewed_routing
from memfit.sweep import tiny_config

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "granitemoe", "deepseek_v3")


def measure(family: str, root: Path) -> dict[str, Any]:
    tiny_config(family).save_pretrained(root / family)
    config = TrainConfig(model=str(root / family), task="causal-lm", effective_batch=4, micro_batch_size=2,
                         max_length=16, precision="bf16")
    predicted = estimate(config, seq_len=16).peak_bytes
    balanced = estimate(config, seq_len=16, execute=True).peak_bytes
    with skewed_routing([0, 1]) as calls:
        skewed = estimate(config, seq_len=16, execute=True).peak_bytes
    assert calls, f"{family}: no experts module ran"
    return {"family": family, "estimated_bytes": predicted, "balanced_bytes": balanced, "skewed_bytes": skewed,
            "error_balanced": (predicted - balanced) / balanced, "error_skewed": (predicted - skewed) / skewed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        rows = [measure(family, Path(root)) for family in FAMILIES]
    print("| family | estimated | measured, balanced | measured, skewed | error |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['family']} | {row['estimated_bytes']:,} B | {row['balanced_bytes']:,} B | "
              f"{row['skewed_bytes']:,} B | {max(abs(row['error_balanced']), abs(row['error_skewed'])):.2%} |")
    if args.json is not None:
        machine = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                   "transformers": transformers.__version__, "device": "cpu"}
        command = "python benchmarks/moe_routing.py --json " + str(args.json)
        args.json.write_text(json.dumps({"command": command, "machine": machine, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
