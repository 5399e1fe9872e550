"""memfit against Hugging Face ``transformers.Trainer`` on the same work: peak memory, speed, accuracy.

Both fine-tune the pretrained MiniLM on the same Rotten Tomatoes samples (the first ``--samples`` of memfit's
seeded training split) with the same settings: fp32, effective batch 32 (32 x 1, or ``--micro-batch``
with accumulation), AdamW lr 5e-5, weight decay 0.01, 10 % linear warm-up then linear decay, gradient
clipping at 1.0, max length 64 with per-batch padding, seed 0, one epoch. Each tool keeps its own defaults
otherwise (the Trainer its sampler and its optimizer implementation), which is what a user gets.

The runs alternate in one process (Trainer then memfit, memfit then Trainer, ...):

- memory: live tensor bytes during training, counted by memfit's storage tracker around each tool's training
  (the Trainer runs inside one; memfit's run has its own), on the CPU;
- speed: per optimizer step, median over all rounds after two warm-up steps (Trainer: ``on_step_begin`` to
  ``on_step_end``, which leaves its data loading out; memfit: the whole window, encoding included);
- accuracy: validation accuracy of each final model on the same validation split, by the same function.

    .venv/bin/python benchmarks/parity_hf_trainer.py --json benchmarks/results/parity_hf_trainer_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import io
import json
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from rich.console import Console

from memfit import TrainConfig, train
from memfit.build import Prepared, prepare
from memfit.data import TextExamples
from memfit.integrations import transformers as _quiet  # noqa: F401  (Trainer's libraries, imported quietly)
from memfit.memory.tracker import StorageTracker
from memfit.report import format_bytes
from memfit.techniques.precision import Precision
from memfit.windows import LocalWindows, evaluate

WARMUP = 2


class StepTimes(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._started = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._started = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seconds.append(time.perf_counter() - self._started)


def trainer_run(config: TrainConfig, prepared: Prepared, directory: str, optim: str | None) -> dict[str, Any]:
    tokenizer = prepared.tokenizer
    examples = prepared.train_examples
    assert isinstance(examples, TextExamples), "the parity task is a text task"
    encoded = tokenizer(examples.texts, truncation=True, max_length=config.max_length)
    dataset = [{"input_ids": ids, "attention_mask": mask, "labels": label}
               for ids, mask, label in zip(encoded["input_ids"], encoded["attention_mask"], examples.labels,
                                           strict=True)]
    torch.manual_seed(config.seed)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(prepared.spec.weights_dir), num_labels=len(prepared.label_names))
    micro = config.resolved_micro_batch_size
    arguments = transformers.TrainingArguments(
        output_dir=directory, per_device_train_batch_size=micro,
        gradient_accumulation_steps=config.resolved_accumulation_steps, learning_rate=config.lr,
        weight_decay=config.weight_decay, lr_scheduler_type="linear",
        warmup_steps=int(math.ceil(len(dataset) / config.effective_batch) * config.warmup_ratio),
        max_grad_norm=config.max_grad_norm or 0.0, num_train_epochs=config.epochs, seed=config.seed,
        use_cpu=True, save_strategy="no", eval_strategy="no", logging_steps=10_000, report_to="none",
        disable_tqdm=True, dataloader_num_workers=0)
    if optim:  # another AdamW implementation than the Trainer's default
        arguments = dataclasses.replace(arguments, optim=optim)
    times = StepTimes()
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=dataset,
                                   data_collator=transformers.DataCollatorWithPadding(tokenizer),
                                   callbacks=[times])
    tracker = StorageTracker()
    started = time.perf_counter()
    with tracker:
        tracker.track_module(model)
        trainer.train()
    wall = time.perf_counter() - started
    validation = LocalWindows(model, prepared.encoder(prepared.val_examples), precision=Precision("fp32", "cpu"),
                              scaler=None, device=torch.device("cpu"), phases=tracker, stop_requested=lambda: False)
    accuracy = evaluate(validation, len(prepared.val_examples), config.eval_batch_size)["accuracy"]
    return {"seconds": times.seconds, "peak_bytes": tracker.peak_bytes, "val_accuracy": accuracy,
            "samples_per_second_run": len(dataset) / wall, "optimizer": arguments.optim}


def memfit_run(config: TrainConfig, directory: str) -> dict[str, Any]:
    summary = train(dataclasses.replace(config, output_dir=directory, overwrite=True),
                    console=Console(file=io.StringIO()))
    records = [json.loads(line) for line in (Path(directory) / "metrics.jsonl").read_text().splitlines()]
    return {"seconds": [r["step_seconds"] for r in records if r["type"] == "train"
                        and r["window_samples"] == config.effective_batch],
            "peak_bytes": max(summary.peak_memory_by_phase[name] for name in ("forward", "backward", "optimizer")),
            "val_accuracy": summary.val_accuracy,
            "samples_per_second_run": summary.train_samples / summary.train_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2048, help="training samples per run [2048]")
    parser.add_argument("--micro-batch", type=int, default=32, help="micro-batch (32: no accumulation) [32]")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds [2]")
    parser.add_argument("--trainer-optim", help="the Trainer's optim (e.g. adamw_torch, memfit's for-loop AdamW) "
                                                "[the Trainer's default]")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    config = TrainConfig(precision="fp32", train_samples=args.samples, micro_batch_size=args.micro_batch,
                         log_every=1, seed=0)
    prepared = prepare(config)
    runs: dict[str, list[dict[str, Any]]] = {"trainer": [], "memfit": []}
    with tempfile.TemporaryDirectory() as directory:
        for round_index in range(args.rounds):  # the order flips each round: neither always runs first
            if round_index % 2 == 0:
                runs["trainer"].append(trainer_run(config, prepared, f"{directory}/trainer", args.trainer_optim))
                runs["memfit"].append(memfit_run(config, f"{directory}/memfit"))
            else:
                runs["memfit"].append(memfit_run(config, f"{directory}/memfit"))
                runs["trainer"].append(trainer_run(config, prepared, f"{directory}/trainer", args.trainer_optim))
            print(f"round {round_index + 1}: " + ", ".join(
                f"{name} {statistics.median(rounds[-1]['seconds'][WARMUP:]):.3f} s/step, "
                f"peak {format_bytes(rounds[-1]['peak_bytes'])}, accuracy {rounds[-1]['val_accuracy']:.4f}"
                for name, rounds in runs.items()), flush=True)
    step = {name: statistics.median(s for run in rounds for s in run["seconds"][WARMUP:])
            for name, rounds in runs.items()}
    batch = config.effective_batch
    result: dict[str, Any] = {
        "config": f"MiniLM, Rotten Tomatoes ({args.samples} samples), fp32, {args.micro_batch} x "
                  f"{config.resolved_accumulation_steps}, max length 64, 1 epoch",
        "trainer_optimizer": runs["trainer"][0]["optimizer"],
        "samples_per_second": {name: batch / seconds for name, seconds in step.items()},
        "samples_per_second_ratio": step["trainer"] / step["memfit"],
        "whole_run_samples_per_second": {name: statistics.median(run["samples_per_second_run"] for run in rounds)
                                         for name, rounds in runs.items()},
        "peak_bytes": {name: rounds[0]["peak_bytes"] for name, rounds in runs.items()},
        "peak_ratio": runs["memfit"][0]["peak_bytes"] / runs["trainer"][0]["peak_bytes"],
        "val_accuracy": {name: [run["val_accuracy"] for run in rounds] for name, rounds in runs.items()},
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "threads": torch.get_num_threads(),
                    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")},
        "command": f"python benchmarks/parity_hf_trainer.py --samples {args.samples} --micro-batch "
                   f"{args.micro_batch}" + (f" --trainer-optim {args.trainer_optim}" if args.trainer_optim else ""),
    }
    whole = result["whole_run_samples_per_second"]
    print("| | HF Trainer | memfit | memfit / Trainer |")
    print("|---|---|---|---|")
    print(f"| peak live tensor bytes (training) | {format_bytes(result['peak_bytes']['trainer'])} | "
          f"{format_bytes(result['peak_bytes']['memfit'])} | {result['peak_ratio']:.3f}x |")
    print(f"| samples/s (median step after warm-up) | {result['samples_per_second']['trainer']:.2f} | "
          f"{result['samples_per_second']['memfit']:.2f} | {result['samples_per_second_ratio']:.3f}x |")
    print(f"| samples/s (whole training run) | {whole['trainer']:.2f} | {whole['memfit']:.2f} | "
          f"{whole['memfit'] / whole['trainer']:.3f}x |")
    accuracy = result["val_accuracy"]
    print(f"| val accuracy (per round) | {' / '.join(f'{a:.4f}' for a in accuracy['trainer'])} | "
          f"{' / '.join(f'{a:.4f}' for a in accuracy['memfit'])} | "
          f"{100 * (accuracy['memfit'][0] - accuracy['trainer'][0]):+.2f} points |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
