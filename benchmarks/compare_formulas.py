"""memfit's estimate beside the two closed-form answers users reach for.

- ``accelerate estimate-memory`` counts model states only: for Adam training it reports 4x the model's size
  (weights, gradients and two Adam moments: 16 bytes per parameter in fp32), whatever the batch or sequence.
- Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") give the
  activations of one transformer layer as ``s*b*h*(34 + 5*a*s/h)`` bytes with 16-bit activations, no
  recomputation and no parallelism (``s`` sequence, ``b`` batch, ``h`` hidden, ``a`` heads); with full
  recomputation only each layer's 16-bit input stays, ``2*s*b*h``. The ``5*a*s/h`` term is the S x S scores,
  softmax output and dropout mask, which fused attention kernels do not keep.

    .venv/bin/python benchmarks/compare_formulas.py --json benchmarks/results/compare_formulas.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from memfit import TrainConfig
from memfit.memory.estimate import estimate
from memfit.models import resolve_model
from memfit.report import format_bytes

SETUPS = [
    ("bert-base", 8, 512, "fp16", "none"),
    ("bert-base", 32, 128, "fp16", "none"),
    ("bert-large", 8, 512, "fp16", "none"),
    ("bert-large", 8, 512, "fp16", "full"),
]


def korthikanti_activations(layers: int, s: int, b: int, h: int, a: int, checkpointing: str) -> int:
    per_layer = 2 * s * b * h if checkpointing == "full" else s * b * h * (34 + 5 * a * s / h)
    return int(layers * per_layer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="1080ti")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for model, batch, length, precision, checkpointing in SETUPS:
        config = TrainConfig(model=model, micro_batch_size=batch, effective_batch=batch, max_length=length,
                             precision=precision, checkpointing=checkpointing)
        result = estimate(config, device=args.device)
        hf = resolve_model(model).hf_config
        parameter_bytes = result.breakdown["parameters"]
        accelerate = 4 * parameter_bytes
        activations = korthikanti_activations(hf.num_hidden_layers, length, batch, hf.hidden_size,
                                              hf.num_attention_heads, checkpointing)
        rows.append({"model": model, "batch": batch, "seq_len": length, "precision": precision,
                     "checkpointing": checkpointing, "memfit_peak_bytes": result.peak_bytes,
                     "memfit_peak_phase": result.peak_phase, "memfit_fits": result.fits,
                     "accelerate_bytes": accelerate, "korthikanti_activation_bytes": activations,
                     "accelerate_plus_korthikanti_bytes": accelerate + activations})
    print(f"| setup ({args.device}) | memfit peak (phase) | accelerate: model states | + Korthikanti activations |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} B{r['batch']} S{r['seq_len']} {r['precision']} ckpt {r['checkpointing']} | "
              f"{format_bytes(r['memfit_peak_bytes'])} ({r['memfit_peak_phase']}) | "
              f"{format_bytes(r['accelerate_bytes'])} | {format_bytes(r['accelerate_plus_korthikanti_bytes'])} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "command": sys.argv}, indent=2))


if __name__ == "__main__":
    main()
