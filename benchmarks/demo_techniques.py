"""What each technique does to memory and speed on the demo job (MiniLM, Rotten Tomatoes, max length 64).

Runs the built-in default for a fixed number of optimizer steps under several setups and prints a markdown
table; ``--json PATH`` also writes the rows. On CPU the memory column is the peak of live tensor bytes
counted by memfit's storage tracker; on CUDA it is the allocator's peak allocated bytes. The estimate column
is ``memfit estimate`` for the same config on this device, with every micro-batch at the full max length
(real batches are padded only to their longest text, so they stay at or below it).

    .venv/bin/python benchmarks/demo_techniques.py --steps 30 --json benchmarks/results/demo_techniques_cpu.json
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from memfit import TrainConfig, estimate, train
from memfit.report import format_bytes

SETUPS: dict[str, dict[str, Any]] = {
    "fp32": {"precision": "fp32"},
    "bf16": {"precision": "bf16"},
    "bf16 + checkpointing": {"precision": "bf16", "checkpointing": "full"},
    "bf16 + micro 8 x 4": {"precision": "bf16", "micro_batch_size": 8},
    "bf16 + top-2 layers": {"precision": "bf16", "train_top_layers": 2},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per setup")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    quiet = Console(file=io.StringIO())  # the runs' own output is not the table
    for name, overrides in SETUPS.items():
        with tempfile.TemporaryDirectory() as directory:
            config = TrainConfig(max_steps=args.steps, val_samples=128, output_dir=directory, **overrides)
            summary = train(config, console=quiet)
            predicted = estimate(config, device="cpu")  # every micro-batch at the full --max-length
        rows.append({"setup": name, "micro_batch_size": summary.micro_batch_size,
                     "accumulation_steps": summary.accumulation_steps,
                     "peak_memory_bytes": summary.peak_memory_bytes,
                     "peak_memory_by_phase": summary.peak_memory_by_phase,
                     "predicted_peak_bytes": predicted.peak_bytes,
                     "samples_per_second": round(summary.samples_per_second, 2),
                     "trainable_parameters": summary.trainable_parameters})
        print(f"done: {name}", file=sys.stderr)
    print("| setup | batch | peak memory | forward / backward / optimizer peak | estimate at full length | "
          "samples/s |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        phases = " / ".join(format_bytes(row["peak_memory_by_phase"][p]) for p in ("forward", "backward",
                                                                                     "optimizer"))
        print(f"| {row['setup']} | {row['micro_batch_size']} x {row['accumulation_steps']} | "
              f"{format_bytes(row['peak_memory_bytes'])} | {phases} | {format_bytes(row['predicted_peak_bytes'])} | "
              f"{row['samples_per_second']:.1f} |")
    if args.json:
        machine = {"platform": platform.platform(), "processor": platform.processor(),
                   "threads": torch.get_num_threads(),
                   "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                   "torch": torch.__version__}
        Path(args.json).write_text(json.dumps({"rows": rows, "machine": machine,
                                               "command": " ".join(sys.argv)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
