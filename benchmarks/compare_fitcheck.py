"""memfit's plans beside an analytic calculator's figure for the very same setup.

For every fitting cell of ``benchmarks/llm_fit.py``'s JSON (card, model, length, technique and the setup
memfit chose: micro-batch, precision, checkpointing), ``fitcheck-llm`` 0.3.1 (PyPI; formulas over the model's
config.json) is asked for the same setup, and both totals are printed side by side. fitcheck reads configs
from the Hugging Face Hub, which this machine cannot reach: it is given memfit's preset configs (the public
config.json values) through its own config parser instead. Not a dependency of memfit:

    .venv/bin/pip install --no-deps fitcheck-llm==0.3.1   # needs click, huggingface-hub, rich (already there)
    .venv/bin/python benchmarks/compare_fitcheck.py --plans benchmarks/results/llm_fit.json \\
        --json benchmarks/results/llm_fit_fitcheck.json

How the setups map: memfit's precision is fitcheck's compute precision; fitcheck has one checkpointing switch
(memfit's every-2 counts as on) and LoRA targets ``full`` (every Linear of the blocks, memfit's default); QLoRA
is NF4 with double quantisation in both. Where the setups still differ (fitcheck's 16-bit full fine-tuning
keeps 16-bit weights and gradients, memfit's autocast keeps fp32 ones) the README says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from memfit.models import resolve_model
from memfit.report import format_bytes

MIB = 1024**2


def fitcheck_total(row: dict[str, Any]) -> int:
    """fitcheck's total (MiB, as bytes) for the setup memfit chose in ``row``."""
    from fitcheck import config_parser, estimator, gpu_db
    from fitcheck.memory.lora import LORA_TARGETS_FULL

    raw = resolve_model(row["model"]).hf_config.to_dict()
    config_parser._reject_unsupported(raw, row["model"])
    fields = config_parser._parse_fields(raw)
    model = config_parser.ModelConfig(
        name=row["model"], num_params=config_parser._count_params(fields), hidden_size=fields.hidden_size,
        num_layers=fields.num_layers, num_attention_heads=fields.num_attention_heads,
        num_kv_heads=fields.num_kv_heads, intermediate_size=fields.intermediate_size,
        vocab_size=fields.vocab_size, head_dim=fields.head_dim, tie_word_embeddings=fields.tie_word_embeddings)
    chosen = row["chosen"]
    lora = row["technique"] != "full"
    training = estimator.TrainingConfig(
        precision=chosen["precision"], quantization="nf4" if row["technique"] == "qlora" else "none",
        double_quant=row["technique"] == "qlora", batch_size=chosen["micro_batch_size"], seq_len=row["seq_len"],
        lora_rank=16 if lora else None, lora_targets=list(LORA_TARGETS_FULL),
        grad_checkpoint=chosen["checkpointing"] != "none", grad_accum_steps=chosen["accumulation_steps"])
    gpu = gpu_db.GpuSpec(row["profile"], row["budget_bytes"] // MIB, row["usable_bytes"] // MIB)
    return int(estimator.estimate(model, training, gpu).total_mib * MIB)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", type=Path, required=True, help="benchmarks/llm_fit.py's JSON")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    try:
        import fitcheck  # noqa: F401
    except ImportError:
        print("compare_fitcheck: needs fitcheck-llm: .venv/bin/pip install --no-deps fitcheck-llm==0.3.1",
              file=sys.stderr)
        return 2
    rows = []
    lines = ["| card | model | tokens | technique | memfit's plan | memfit peak | fitcheck, same setup | "
             "fitcheck / memfit |", "|---|---|---|---|---|---|---|---|"]
    for row in json.loads(args.plans.read_text())["rows"]:
        if not row["fits"]:
            continue
        theirs = fitcheck_total(row)
        ratio = theirs / row["peak_bytes"]
        rows.append({**{k: row[k] for k in ("profile", "model", "seq_len", "technique", "setup", "peak_bytes")},
                     "fitcheck_bytes": theirs, "ratio": round(ratio, 3)})
        lines.append(f"| {row['profile']} | {row['model']} | {row['seq_len']} | {row['technique']} | {row['setup']} | "
                     f"{format_bytes(row['peak_bytes'])} | {format_bytes(theirs)} | {ratio:.2f} |")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"fitcheck": "0.3.1", "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
