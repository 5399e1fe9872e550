"""How long ``memfit plan`` takes, and what it chooses: a matrix of models x device profiles.

Each plan runs in a fresh planner (no traces shared between plans) after one untimed warm-up plan that pays
for the process's lazy imports. The target is a full plan for BERT-base (1080 Ti, seq 128, effective batch
32) in at most 30 s on 2 CPU cores. All of it runs on the CPU: the predicted peaks are the estimator's for
each card, the speeds the planner's cost model; only a GPU can confirm either.

    .venv/bin/python benchmarks/plan_speed.py --json benchmarks/results/plan_speed_cpu.json
    .venv/bin/python benchmarks/plan_speed.py --quick   # BERT-base on the 1080 Ti only
    .venv/bin/python benchmarks/plan_speed.py --llm llama-3.2-1b llama-3.1-8b --one-worker-too \
        --json benchmarks/results/plan_speed_llm_cpu.json

``--llm``: LLM presets planned as a user would (``memfit plan --task causal-lm --seq-len 1024 --effective-batch 16
--device 1080ti --allow-lora --allow-qlora``), target 15 s each; ``--exact-too`` also plans each with
``exact_trace=True`` (every block and micro-step traced, as before shortened traces) for the ratio;
``--one-worker-too`` with one trace process (``MEMFIT_TRACE_WORKERS=1``), for the ratio of tracing side by side.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from typing import Any

import torch

from memfit import TrainConfig, plan
from memfit.report import format_bytes

TARGET_SECONDS = 30.0
LARGE_TARGET_SECONDS = 5.0
"""BERT-large at 512 tokens on the 1080 Ti: its plan traces the most expensive steps of the matrix."""
MODELS: dict[str, dict[str, Any]] = {
    "bert-base S128": {"model": "bert-base", "seq_len": 128},
    "bert-large S512": {"model": "bert-large", "seq_len": 512},
    "vit-base 224px": {"model": "vit-base", "seq_len": None},
}
DEVICES = ("1080ti", "t4", "a100-40gb")
LLM_TARGET_SECONDS = 15.0
"""Every LLM preset, 1024 tokens, effective batch 16, the 1080 Ti, LoRA and QLoRA allowed."""
TIGHT_BUDGET = "3GiB"


def one(name: str, device: str, *, effective_batch: int, budget: str | None = None) -> dict[str, Any]:
    setup = MODELS[name]
    started = time.perf_counter()
    result = plan(TrainConfig(model=setup["model"], effective_batch=effective_batch), device=device,
                  seq_len=setup["seq_len"], budget=budget)
    seconds = time.perf_counter() - started
    chosen = result.chosen.to_dict() if result.chosen else None
    where = device if budget is None else f"{device}, budget {budget}"
    return {"model": name, "device": where, "seconds": seconds, "traces": result.traces, "chosen": chosen,
            "budget_bytes": result.budget_bytes, "usable_bytes": result.usable_bytes, "verdict": result.verdict}


def llm(model: str, *, exact_trace: bool, workers: int | None = None) -> dict[str, Any]:
    """One LLM plan; ``workers``: the planner's trace processes (``None``: its default, one per core)."""
    from memfit.planner.allowed import Allowed
    from memfit.planner.workers import WORKERS_ENV, worker_count

    before = os.environ.get(WORKERS_ENV)
    if workers is not None:
        os.environ[WORKERS_ENV] = str(workers)
    try:
        used = worker_count()
        started = time.perf_counter()
        result = plan(TrainConfig(model=model, task="causal-lm", max_length=1024, effective_batch=16),
                      device="1080ti", seq_len=1024, allow=Allowed(lora=True, qlora=True), exact_trace=exact_trace)
        seconds = round(time.perf_counter() - started, 1)
    finally:
        os.environ.pop(WORKERS_ENV, None)
        if before is not None:
            os.environ[WORKERS_ENV] = before
    return {"model": model, "exact_trace": exact_trace, "workers": used, "seconds": seconds,
            "traces": result.traces, "verdict": result.verdict,
            "chosen": result.chosen.to_dict() if result.chosen else None}


def llm_main(models: list[str], *, exact_too: bool, one_worker_too: bool, output: str | None) -> None:
    plan(TrainConfig(model="bert-base", effective_batch=8), device="1080ti", seq_len=16)  # warm-up, untimed
    records = []
    runs = [(False, None), *([(False, 1)] if one_worker_too else []), *([(True, None)] if exact_too else [])]
    for model in models:
        for exact, workers in runs:
            records.append(llm(model, exact_trace=exact, workers=workers))
            record = records[-1]
            how = f"{'full' if exact else 'shortened'} traces, {record['workers']} process(es)"
            print(f"| {model} | {how} | {record['seconds']:.1f} s | {record['traces']} | {record['verdict'][:90]} |",
                  flush=True)
    for record in records:
        if not record["exact_trace"] and record["workers"] > 1:
            alone = next((r for r in records if r["model"] == record["model"] and r["workers"] == 1
                          and not r["exact_trace"]), None)
            if alone is not None:
                assert alone["verdict"] == record["verdict"], "traced side by side, the plan must be the same"
                print(f"{record['model']}: {alone['seconds'] / record['seconds']:.2f}x faster with "
                      f"{record['workers']} processes than one")
    for record in records:
        if not record["exact_trace"]:
            verdict = "meets" if record["seconds"] <= LLM_TARGET_SECONDS else "MISSES"
            print(f"{record['model']}: {record['seconds']:.1f} s ({verdict} the {LLM_TARGET_SECONDS:.0f} s target)")
    if output:
        payload = {"records": records, "target_seconds": LLM_TARGET_SECONDS,
                   "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                               "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
                   "date": datetime.date.today().isoformat(),
                   "command": "python benchmarks/plan_speed.py --llm " + " ".join(models)
                   + (" --exact-too" if exact_too else "") + (" --one-worker-too" if one_worker_too else "")}
        with open(output, "w") as file:
            json.dump(payload, file, indent=1)


def row(record: dict[str, Any]) -> str:
    chosen = record["chosen"]
    if chosen is None:
        return f"| {record['model']} | {record['device']} | nothing fits | - | - | {record['seconds']:.1f} s |"
    setup = (f"{chosen['micro_batch_size']} x {chosen['accumulation_steps']}, {chosen['precision']}, "
             f"ckpt {chosen['checkpointing']}, {chosen['optimizer']}")
    return (f"| {record['model']} | {record['device']} | {setup} | {format_bytes(chosen['predicted_peak_bytes'])} | "
            f"{chosen['predicted_samples_per_second']:.1f} | {record['seconds']:.1f} s ({record['traces']} traces) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only BERT-base on the 1080 Ti")
    parser.add_argument("--effective-batch", type=int, default=32)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--llm", nargs="+", metavar="PRESET", help="plan these LLM presets instead (see above)")
    parser.add_argument("--exact-too", action="store_true", help="with --llm: also plan with full traces")
    parser.add_argument("--one-worker-too", action="store_true",
                        help="with --llm: also plan with one trace process (MEMFIT_TRACE_WORKERS=1), for the ratio")
    args = parser.parse_args()
    if args.llm:
        llm_main(args.llm, exact_too=args.exact_too, one_worker_too=args.one_worker_too, output=args.json)
        return
    plan(TrainConfig(model="bert-base", effective_batch=8), device="1080ti", seq_len=16)  # warm-up, untimed
    pairs = [("bert-base S128", "1080ti")] if args.quick else [(m, d) for m in MODELS for d in DEVICES]
    records = [one(name, device, effective_batch=args.effective_batch) for name, device in pairs]
    # a tight budget: no family can be ruled out early, so every one is traced (the planner's worst case)
    records.append(one("bert-base S128", "1080ti", effective_batch=args.effective_batch, budget=TIGHT_BUDGET))
    print(f"memfit plan, effective batch {args.effective_batch}, {torch.get_num_threads()} CPU threads")
    print("| model | device | chosen | predicted peak | predicted samples/s | planning time |")
    print("|---|---|---|---|---|---|")
    for record in records:
        print(row(record))
    for record in (r for r in records if r["model"] == "bert-base S128" and r["device"].startswith("1080ti")):
        verdict = "meets" if record["seconds"] <= TARGET_SECONDS else "MISSES"
        print(f"BERT-base plan, {record['device']}: {record['seconds']:.1f} s ({verdict} the "
              f"{TARGET_SECONDS:.0f} s target)")
    for record in (r for r in records if r["model"] == "bert-large S512" and r["device"] == "1080ti"):
        verdict = "meets" if record["seconds"] <= LARGE_TARGET_SECONDS else "MISSES"
        print(f"BERT-large S512 plan, 1080ti: {record['seconds']:.1f} s ({verdict} the {LARGE_TARGET_SECONDS:.0f} s "
              "target)")
    if args.json:
        payload = {"records": records, "target_seconds": TARGET_SECONDS, "large_target_seconds": LARGE_TARGET_SECONDS,
                   "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                               "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
                   "date": datetime.date.today().isoformat(),
                   "command": "python benchmarks/plan_speed.py" + (" --quick" if args.quick else "")}
        with open(args.json, "w") as file:
            json.dump(payload, file, indent=1)


if __name__ == "__main__":
    main()
