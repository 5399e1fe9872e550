"""SmolLM2-135M-Instruct fine-tuned on Rotten Tomatoes as instructions, with each low-memory technique beside
mixed precision: accuracy, time, throughput, and the measured peak beside memfit's estimate.

Every run trains the packaged pretrained model on the same first ``--train-samples`` training reviews (one
epoch, effective batch 32, lr 1e-4, max length 128) and scores the same validation reviews (which answer is the
more probable). The runs differ only in the technique (and what it requires: the step in backward computes the
whole window in one micro-batch and does not clip; packing counts rows, not reviews, in a batch):

- ``mixed``: ``--precision bf16`` (autocast over fp32 weights), micro-batch 8 x 4;
- ``bf16-true``: the weights, gradients and AdamW state in bf16, Kahan-summed updates;
- ``bf16-true-plain``: the same without Kahan summation (bf16 rounding of every update);
- ``in-backward``: bf16-true with Kahan, each parameter updated in backward (micro-batch 32, no clipping);
- ``packing``: mixed precision on packed rows of 128 tokens.

Runs one after another in this process, each with the torch threads given (1 by default, so that timings do
not depend on what else the machine does on its other core).

    .venv/bin/python benchmarks/smollm2_lowmem.py --json benchmarks/results/smollm2_lowmem_cpu.json
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
from rich.console import Console

from memfit import TrainConfig
from memfit.engine import train
from memfit.memory.estimate import estimate

RUNS: dict[str, dict[str, Any]] = {
    "mixed": {"precision": "bf16"},
    "bf16-true": {"precision": "bf16-true"},
    "bf16-true-plain": {"precision": "bf16-true", "kahan": False},
    "in-backward": {"precision": "bf16-true", "optimizer_in_backward": True, "max_grad_norm": None,
                    "micro_batch_size": 32},
    "packing": {"precision": "bf16", "packing": True},
}


def base(train_samples: int, val_samples: int, output: Path) -> TrainConfig:
    return TrainConfig(model="smollm2-135m", data="rotten-tomatoes-sft", max_length=128, effective_batch=32,
                       micro_batch_size=8, lr=1e-4, train_samples=train_samples, val_samples=val_samples,
                       output_dir=str(output), overwrite=True, log_every=5)


def run(name: str, config: TrainConfig) -> dict[str, Any]:
    started = time.perf_counter()
    summary = train(config, console=Console(stderr=True, quiet=True))
    predicted = estimate(config, device="cpu", seq_len=config.max_length, padded=not config.packing)
    training_peak = max(summary.peak_memory_by_phase.get(phase, 0) for phase in ("forward", "backward", "optimizer"))
    return {"run": name, "options": RUNS[name], "val_accuracy": summary.val_accuracy, "val_loss": summary.val_loss,
            "train_seconds": round(summary.train_seconds, 1), "samples_per_second": summary.samples_per_second,
            "examples_per_second": summary.examples_per_second or summary.samples_per_second,
            "optimizer_steps": summary.optimizer_steps, "packed_rows": summary.packed_rows,
            "measured_training_peak_bytes": training_peak,
            "predicted_peak_bytes": predicted.peak_bytes,
            "predicted_over_measured": round(predicted.peak_bytes / training_peak, 4),
            "skipped_steps": len(summary.skipped_steps), "seconds": round(time.perf_counter() - started, 1)}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| run | val accuracy | train time | reviews/s | measured training peak | estimate (full length) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['val_accuracy']:.4f} | {r['train_seconds']:.0f} s | "
                     f"{r['examples_per_second']:.2f} | {r['measured_training_peak_bytes'] / 2**30:.2f} GiB | "
                     f"{r['predicted_peak_bytes'] / 2**30:.2f} GiB ({r['predicted_over_measured']:.3f}x) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, required=True, help="rows so far (read, then appended to)")
    parser.add_argument("--train-samples", type=int, default=960)
    parser.add_argument("--val-samples", type=int, default=240)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = json.loads(args.json.read_text())["rows"] if args.json.is_file() else []
    done = {r["run"] for r in rows}
    for name in args.runs:
        if name in done:
            continue
        with tempfile.TemporaryDirectory() as directory:
            config = dataclasses.replace(base(args.train_samples, args.val_samples, Path(directory)), **RUNS[name])
            rows.append(run(name, config))
        print(markdown(rows[-1:]).splitlines()[-1], flush=True)
        args.json.write_text(json.dumps({
            "command": f"python benchmarks/smollm2_lowmem.py --train-samples {args.train_samples} --val-samples "
                       f"{args.val_samples} --threads {args.threads}",
            "machine": f"{platform.machine()}, {args.threads} torch thread(s), torch {torch.__version__}",
            "rows": rows}, indent=1))
    print(markdown(rows))


if __name__ == "__main__":
    main()
