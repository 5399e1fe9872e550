"""Can I fine-tune this LLM on my card, and how? memfit's plan per card, model, length and technique.

For each device profile (GTX 1080 Ti 11 GiB, T4 16 GiB, RTX 4090 24 GiB), each model preset and each sequence
length, at an effective batch of 16: the fastest plan of each technique (full fine-tuning, LoRA r=16 on a
16-bit base, QLoRA r=16 on an NF4 base, and full fine-tuning with every memory technique allowed: the step in
backward, bf16-true weights with Kahan summation, 8-bit and paged states, the optimizer or the activations on the
host), with its predicted peak, or "does not fit" with the least any setup of that technique needs (or the
largest effective batch at which the step in backward would fit). Every number is memfit's planner on this
machine (fake-tensor traces of the real step for that card; no GPU involved); the README sets them beside
published tables.

Rows are appended to the JSON file as they finish, so an interrupted run continues where it stopped:

    .venv/bin/python benchmarks/llm_fit.py --json benchmarks/results/llm_fit.json
    .venv/bin/python benchmarks/llm_fit.py --json ... --models qwen2.5-0.5b --profiles 1080ti --lengths 512
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

from memfit import TrainConfig
from memfit.memory.estimate import Estimate
from memfit.planner import Plan, plan
from memfit.planner.allowed import Allowed
from memfit.report import format_bytes

MODELS = ("qwen2.5-0.5b", "llama-3.2-1b", "llama-3.2-3b", "qwen2.5-7b", "llama-3.1-8b")
PROFILES = ("1080ti", "t4", "4090")
LENGTHS = (512, 2048)
TECHNIQUES: dict[str, dict[str, Any]] = {"full": {}, "full-lowmem": {}, "lora": {"lora_rank": 16},
                                         "qlora": {"lora_rank": 16, "quantize_base": "nf4"}}
LOW_MEMORY = Allowed(optimizer_in_backward=True, bf16_true=True, eight_bit_optimizer=True, offload=True)
"""The fourth column: full fine-tuning with every memory technique allowed (the step in backward, 16-bit weights
with Kahan summation, 8-bit and paged states, the optimizer or activations on the host)."""
WINDOW = re.compile(r"would fit at an effective batch of at most (\d+)")
WEIGHTS = re.compile(r"its weights alone need ([0-9.]+ [KMGT]?i?B)")
"""Opt-ins not traced because the weights alone exceed the card: the cell says so (its least is that bound)."""
EFFECTIVE_BATCH = 16


def fastest(model: str, profile: str, length: int, technique: str, cache: dict[Any, Estimate]) -> dict[str, Any]:
    """The planner's fastest setup of ``technique``, or the least it needs when nothing fits."""
    config = TrainConfig(model=model, task="causal-lm", max_length=length, effective_batch=EFFECTIVE_BATCH,
                         **TECHNIQUES[technique])
    started = time.perf_counter()
    allow = LOW_MEMORY if technique == "full-lowmem" else Allowed()
    result: Plan = plan(config, device=profile, seq_len=length, cache=cache, suggest=False, allow=allow)
    row: dict[str, Any] = {"model": model, "profile": profile, "seq_len": length, "technique": technique,
                           "budget_bytes": result.budget_bytes, "usable_bytes": result.usable_bytes,
                           "seconds": round(time.perf_counter() - started, 1), "verdict": result.verdict}
    if result.chosen is not None:
        chosen = result.chosen.to_dict()
        row.update(fits=True, peak_bytes=chosen["predicted_peak_bytes"], setup=result.chosen.describe(),
                   samples_per_second=chosen["predicted_samples_per_second"], chosen=chosen)
    else:
        least = min(c.predicted_peak_bytes or 0 for c in result.candidates if c.exact and c.family.technique
                    == technique.removesuffix("-lowmem") and c.family.freeze == "none"
                    and (technique == "full-lowmem" or c.family.optimizer == "adamw"))
        window = [int(k) for k in WINDOW.findall(result.verdict)]
        row.update(fits=False, peak_bytes=least, setup=None, samples_per_second=None, chosen=None,
                   fits_at_effective_batch=max(window) if window else None)
    return row


def cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    if row["fits"]:
        chosen = row["chosen"]
        chunks = f", loss/{chosen['loss_chunk']}" if chosen.get("loss_chunk") else ""
        extras = [name for key, name in (("optimizer_in_backward", "step in bwd"), ("kahan", "Kahan"),
                                         ("offload_activations", "act. on host"), ("offload_optimizer", "opt. on host"))
                  if chosen.get(key)]
        extras += [chosen["optimizer"].split(" ")[0]] if "8bit" in chosen.get("optimizer", "") else []
        return (f"{format_bytes(row['peak_bytes'])} ({chosen['micro_batch_size']}x{chosen['accumulation_steps']}, "
                f"{chosen['precision']}, ckpt {chosen['checkpointing']}{chunks}"
                f"{''.join(', ' + extra for extra in extras)})")
    weights = WEIGHTS.search(row["verdict"]) if row["technique"] == "full-lowmem" else None
    if weights and "it needs at least" not in row["verdict"] and not row.get("fits_at_effective_batch"):
        return f"does not fit (its weights alone need {weights.group(1)})"  # no opt-in traced: each keeps them
    if row.get("fits_at_effective_batch"):
        return (f"fits at effective batch ≤ {row['fits_at_effective_batch']} (step in backward); at 16 needs "
                f"{format_bytes(row['peak_bytes'])}")
    return f"does not fit (needs {format_bytes(row['peak_bytes'])})"


def table(rows: list[dict[str, Any]]) -> str:
    index = {(r["profile"], r["model"], r["seq_len"], r["technique"]): r for r in rows}
    lines = ["| card | model | tokens | full fine-tuning | full fine-tuning, memory techniques allowed | LoRA r=16 | "
             "QLoRA r=16 |", "|---|---|---|---|---|---|---|"]
    models = [*MODELS, *dict.fromkeys(r["model"] for r in rows if r["model"] not in MODELS)]  # MoE rows too
    for profile in PROFILES:
        for model in models:
            for length in sorted({r["seq_len"] for r in rows}):
                if not any((profile, model, length, t) in index for t in TECHNIQUES):
                    continue
                cells = [cell(index.get((profile, model, length, t))) for t in TECHNIQUES]
                lines.append(f"| {profile} | {model} | {length} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, required=True, help="rows so far (read, then appended to)")
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--profiles", nargs="+", default=PROFILES)
    parser.add_argument("--lengths", nargs="+", type=int, default=LENGTHS)
    parser.add_argument("--techniques", nargs="+", default=list(TECHNIQUES), choices=list(TECHNIQUES))
    args = parser.parse_args()
    rows: list[dict[str, Any]] = json.loads(args.json.read_text())["rows"] if args.json.is_file() else []
    done = {(r["profile"], r["model"], r["seq_len"], r["technique"]) for r in rows}
    for profile in args.profiles:  # the 1080 Ti first: the reference card
        for model in args.models:
            for length in args.lengths:
                cache: dict[Any, Estimate] = {}  # one card's traces, shared by its three techniques
                for technique in args.techniques:
                    if (profile, model, length, technique) in done:
                        continue
                    rows.append(fastest(model, profile, length, technique, cache))
                    args.json.write_text(json.dumps({"effective_batch": EFFECTIVE_BATCH, "rows": rows}, indent=1))
                    print(f"{profile} {model} {length} {technique}: {cell(rows[-1])} [{rows[-1]['seconds']} s]",
                          flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
