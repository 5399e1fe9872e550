"""memfit's training loop against a minimal hand-written PyTorch loop on the same work: step time, peak
memory and the weights after N steps.

Both train the pretrained MiniLM on Rotten Tomatoes in fp32 (effective batch 32, max length 64, seed 0) for
``--steps`` optimizer steps, from the same initial weights, on the same samples in the same order. The plain
loop is the textbook one, written here without memfit's step code: tokenise the window, forward, summed
cross-entropy over the window size, backward, clip to norm 1, AdamW, schedule, zero the gradients. It uses
the recipe memfit documents (no weight decay on biases and norms, linear warm-up then decay), so that with
dropout's RNG consumed in the same order the weights must come out equal, bit for bit.

The runs alternate in one process (plain then memfit, memfit then plain, ...). Step time: the median over
all rounds of the steps after two warm-up steps. Each step is also split into the work inside memfit's
phases (forward, backward, optimizer: the same ops in both loops) and the loop's own work around them
(encoding the batch, bookkeeping, logging), which is what a training loop adds. Memory: live tensor bytes
during training, counted by memfit's storage tracker, which the plain loop also runs under (so both pay its
per-op cost); the plain loop is also timed without the tracker, which measures the tracker's own overhead.
Everything here runs on the CPU.

    .venv/bin/python benchmarks/parity_plain_loop.py --json benchmarks/results/parity_plain_loop_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import io
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from rich.console import Console
from safetensors.torch import load_file

from memfit import TrainConfig, train
from memfit.build import prepare
from memfit.data import TextExamples
from memfit.data.batches import window_order
from memfit.memory.monitor import Monitor
from memfit.memory.tracker import StorageTracker
from memfit.report import format_bytes

WARMUP = 2


def plain_loop(config: TrainConfig, *, track: bool) -> dict[str, Any]:
    """The hand-written loop: (step seconds, peak live bytes, final weights)."""
    prepared = prepare(config)  # the same examples, split and tokenizer as memfit's run
    examples = prepared.train_examples
    assert isinstance(examples, TextExamples), "the parity task is a text task"
    texts, labels = examples.texts, examples.labels
    tokenizer = prepared.tokenizer
    torch.manual_seed(config.seed)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(prepared.spec.weights_dir), num_labels=2, id2label=dict(enumerate(prepared.label_names)),
        label2id={name: index for index, name in enumerate(prepared.label_names)})
    tracker = StorageTracker()
    with tracker if track else contextlib.nullcontext():
        tracker.track_module(model)
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n.lower()]
        no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "norm" in n.lower()]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=config.lr,
                                      fused=True)  # memfit's default AdamW: the same arithmetic on both sides
        steps = config.max_steps or 1
        warmup = int(steps * config.warmup_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / (warmup + 1)
                                                      if step < warmup else max(0.0, (steps - step) /
                                                                                max(1, steps - warmup)))
        order = window_order(len(texts), seed=config.seed, epoch=1)
        model.train()
        seconds: list[float] = []
        outside: list[float] = []
        for step in range(steps):
            started = time.perf_counter()
            window = order[step * config.effective_batch:(step + 1) * config.effective_batch]
            batch = tokenizer([texts[i] for i in window], padding=True, truncation=True,
                              max_length=config.max_length, return_tensors="pt", return_token_type_ids=False)
            target = torch.tensor([labels[i] for i in window])
            inside = 0.0
            with timed(tracker, "forward", track) as clock:
                logits = model(**batch).logits
                loss = F.cross_entropy(logits.float(), target, reduction="sum") / len(window)
            inside += clock()
            with timed(tracker, "backward", track) as clock:
                loss.backward()
            inside += clock()
            with timed(tracker, "optimizer", track) as clock:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm or float("inf"))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                float(loss.detach())  # what a loop that logs its loss reads each step
            inside += clock()
            seconds.append(time.perf_counter() - started)
            outside.append(seconds[-1] - inside)
    return {"seconds": seconds, "outside": outside, "peak_bytes": tracker.peak_bytes if track else None,
            "weights": {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}}


@contextlib.contextmanager
def timed(tracker: StorageTracker, name: str, track: bool) -> Iterator[Callable[[], float]]:
    """The block as the tracker's phase ``name`` (as memfit's loop runs it); yields its duration."""
    started, ended = time.perf_counter(), [0.0]
    with tracker.phase(name) if track else contextlib.nullcontext():
        yield lambda: ended[0] - started
    ended[0] = time.perf_counter()


def memfit_loop(config: TrainConfig) -> dict[str, Any]:
    """memfit's own loop; its monitor's phases are timed from outside, to split each step into the model's
    forward/backward/optimizer work and the loop's own work around it."""
    durations: list[tuple[str, float]] = []
    original = Monitor.phase

    @contextlib.contextmanager
    def phase(monitor: Monitor, name: str) -> Iterator[None]:
        started = time.perf_counter()
        with original(monitor, name):
            yield
        durations.append((name, time.perf_counter() - started))

    Monitor.phase = phase  # type: ignore[method-assign,assignment]
    try:
        with tempfile.TemporaryDirectory() as directory:
            summary = train(dataclasses.replace(config, output_dir=directory), console=Console(file=io.StringIO()))
            records = [json.loads(line) for line in (Path(directory) / "metrics.jsonl").read_text().splitlines()]
            weights = load_file(str(Path(directory) / "model" / "model.safetensors"))
    finally:
        Monitor.phase = original  # type: ignore[method-assign]
    seconds = [r["step_seconds"] for r in records if r["type"] == "train"]
    inside, current = [], 0.0
    for name, duration in durations:
        if name in ("forward", "backward", "optimizer"):
            current += duration
        if name == "optimizer":  # the last phase of a step
            inside.append(current)
            current = 0.0
    training_peak = max(summary.peak_memory_by_phase[name] for name in ("forward", "backward", "optimizer"))
    return {"seconds": seconds, "outside": [total - work for total, work in zip(seconds, inside, strict=True)],
            "peak_bytes": training_peak, "weights": weights}


def median_after_warmup(runs: list[list[float]]) -> float:
    return statistics.median(value for seconds in runs for value in seconds[WARMUP:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run [10]")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds [4]")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    config = TrainConfig(precision="fp32", max_steps=args.steps, val_samples=64, log_every=1, seed=0,
                         eval_batch_size=64)
    plain: list[dict[str, Any]] = []
    ours: list[dict[str, Any]] = []
    for round_index in range(args.rounds):  # the order flips each round: neither always runs first
        if round_index % 2 == 0:
            plain.append(plain_loop(config, track=True))
            ours.append(memfit_loop(config))
        else:
            ours.append(memfit_loop(config))
            plain.append(plain_loop(config, track=True))
        print(f"round {round_index + 1}: plain {statistics.median(plain[-1]['seconds'][WARMUP:]):.3f} s/step, "
              f"memfit {statistics.median(ours[-1]['seconds'][WARMUP:]):.3f} s/step", flush=True)
    untracked = plain_loop(config, track=False)
    plain_step = median_after_warmup([run["seconds"] for run in plain])
    memfit_step = median_after_warmup([run["seconds"] for run in ours])
    untracked_step = median_after_warmup([untracked["seconds"]])
    plain_outside = median_after_warmup([run["outside"] for run in plain])
    memfit_outside = median_after_warmup([run["outside"] for run in ours])
    reference, final = plain[0]["weights"], ours[0]["weights"]
    names = [name for name in reference if name in final]
    equal = all(torch.equal(reference[name], final[name]) for name in names)
    max_diff = max(float((reference[name] - final[name]).abs().max()) for name in names)
    result = {
        "steps": args.steps, "rounds": args.rounds, "config": "MiniLM, Rotten Tomatoes, fp32, 32 x 1, max length 64",
        "plain_step_seconds": plain_step, "memfit_step_seconds": memfit_step,
        "step_time_ratio": memfit_step / plain_step, "plain_untracked_step_seconds": untracked_step,
        "plain_outside_phases_seconds": plain_outside, "memfit_outside_phases_seconds": memfit_outside,
        "loop_overhead_vs_plain_step": (memfit_outside - plain_outside) / plain_step,
        "per_round_step_seconds": {"plain": [statistics.median(run["seconds"][WARMUP:]) for run in plain],
                                   "memfit": [statistics.median(run["seconds"][WARMUP:]) for run in ours]},
        "tracker_overhead": plain_step / untracked_step - 1,
        "plain_peak_bytes": plain[0]["peak_bytes"], "memfit_peak_bytes": ours[0]["peak_bytes"],
        "peak_ratio": ours[0]["peak_bytes"] / plain[0]["peak_bytes"],
        "weights_equal": equal, "weights_max_abs_diff": max_diff, "tensors_compared": len(names),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")},
        "command": f"python benchmarks/parity_plain_loop.py --steps {args.steps} --rounds {args.rounds}",
    }
    print("| | plain loop | memfit | memfit / plain |")
    print("|---|---|---|---|")
    print(f"| step time (median after warm-up) | {plain_step:.3f} s | {memfit_step:.3f} s | "
          f"{result['step_time_ratio']:.3f}x |")
    print(f"| the loop's own time per step (outside forward, backward, optimizer) | {1000 * plain_outside:.1f} ms | "
          f"{1000 * memfit_outside:.1f} ms | +{100 * result['loop_overhead_vs_plain_step']:.2f} % of a step |")
    print(f"| peak live tensor bytes (training) | {format_bytes(result['plain_peak_bytes'])} | "
          f"{format_bytes(result['memfit_peak_bytes'])} | {result['peak_ratio']:.3f}x |")
    print(f"| fp32 weights after {args.steps} steps | | | {'equal' if equal else 'differ'} "
          f"(max abs diff {max_diff:.2e}, {len(names)} tensors) |")
    print(f"plain loop without the tracker: {untracked_step:.3f} s/step (tracker overhead "
          f"{100 * result['tracker_overhead']:+.1f} %)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
