"""``memfit bench``: the memory/speed/accuracy table of the usual memory-saving setups, measured on this
machine for your model and data, next to what the estimator predicted and what the planner chose.

Every setup trains the same model on the same samples, in the same order, from the same seed, at the same
effective batch, for the same number of samples; only the setup differs:

- **FP32 baseline**: fp32 at the largest micro-batch whose estimate fits the budget;
- **low precision + accumulation x4**: bf16 where the device runs it natively (CPU included), else fp16;
- **low precision + full checkpointing**, at the largest micro-batch that fits;
- **low precision + checkpointing + top-4 layers** (freezing: changes what is learned);
- **int8 inference** of the FP32 baseline's model (:mod:`memfit.quantize`; CPU);
- **memfit plan**: the fastest setup the planner finds for the budget (:mod:`memfit.planner`).

Each training setup runs as its own ``memfit train`` process, so its process RSS is its own. Its peak is
the training step's (forward, backward, optimizer: what the setups change and the estimator predicts); the
evaluation's peak and the whole run's are in ``eval_peak_bytes`` and ``run_peak_bytes``. Speed is the
median over the steps after two warm-up steps (allocator warm-up, optimizer state creation) of the
full windows; samples/s and optimizer steps/s are both reported, since "it/s" can mean either. Memory is
the run's measured peak (CPU: live tensor bytes counted by the storage tracker, and RSS; CUDA: allocated and
reserved), next to the estimator's prediction for the same config at the full ``--max-length``; text
batches are padded only to their longest text, so measured text peaks sit at or below it.

Outputs under ``--output-dir``: ``bench.md`` (the table), ``bench.csv``, ``bench.json`` (``rows``,
``machine``, ``command``), ``bench_memory_speed.png`` and ``bench_timelines.png`` (the memory of one
optimizer step per setup, phases marked), and each setup's run under ``runs/<setup>``.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from memfit.bench_config import HOST_RAM, TOP_LAYERS, BenchConfig
from memfit.build import Prepared, prepare
from memfit.config import TrainConfig
from memfit.devices import DeviceProfile, profile_for, resolve_profile
from memfit.memory.estimate import Estimate, estimate
from memfit.memory.monitor import PHASES
from memfit.planner import micro_batch_sizes, plan
from memfit.report import format_bytes, write_json
from memfit.units import parse_bytes

WARMUP_STEPS = 2
"""Steps left out of the speed median: the first builds the optimizer state, both warm the allocator."""
ACCURACY_POINTS = 2.0
"""The accuracy criterion: accuracy-neutral setups land within this many points of the FP32 baseline."""
ROW_KEYS = ("setup", "key", "kind", "accuracy_neutral", "micro_batch_size", "accumulation_steps", "precision",
            "checkpointing", "trainable_parameters", "peak_memory_bytes", "eval_peak_bytes", "run_peak_bytes",
            "peak_reserved_bytes", "peak_rss_bytes",
            "predicted_peak_bytes", "predicted_reserved_bytes", "samples_per_second", "optimizer_steps_per_second",
            "step_time_spread", "run_samples_per_second", "speed_rounds",
            "val_accuracy", "accuracy_delta_points", "memory_ratio", "speed_ratio", "oom_recoveries", "seconds",
            "error")


@dataclass(frozen=True, slots=True)
class Setup:
    key: str
    name: str
    config: TrainConfig | None
    """``None`` for the int8 row (it quantizes the FP32 baseline's model) or a setup that does not fit."""
    accuracy_neutral: bool
    predicted: Estimate | None = None
    error: str | None = None


@dataclass(kw_only=True, slots=True)
class BenchResult:
    rows: list[dict[str, Any]]
    machine: dict[str, Any]
    command: str
    budget_bytes: int
    budget_source: str
    timelines: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        neutral = [row for row in self.rows if row["accuracy_neutral"] and row["key"] != "fp32"
                   and row["accuracy_delta_points"] is not None]
        return {"rows": self.rows, "machine": self.machine, "command": self.command,
                "budget_bytes": self.budget_bytes, "budget_source": self.budget_source,
                "accuracy_neutral_within_points": ACCURACY_POINTS,
                "accuracy_neutral_all_within": all(abs(row["accuracy_delta_points"]) <= ACCURACY_POINTS
                                                   for row in neutral) if neutral else None}


def run_bench(config: BenchConfig, *, command: str = "", log: Callable[[str], None] = print) -> BenchResult:
    """Run the matrix of ``config``; write the table, CSV, JSON and plots; return the result."""
    config.validate()
    config = config.resolved()
    started = time.perf_counter()
    base = TrainConfig(model=config.model, data=config.data, text_column=config.text_column,
                       label_column=config.label_column, max_length=config.max_length,
                       effective_batch=config.effective_batch, train_samples=config.samples,
                       val_samples=config.val_samples, epochs=config.epochs, lr=config.lr, seed=config.seed,
                       log_every=1, memory_timeline=True, overwrite=True)
    prepared = prepare(base)  # model, data and every option checked before any run
    budget, source = _budget(config, prepared)
    capped = config.device_profile is not None or config.emulate_budget is not None
    base = dataclasses.replace(base, emulate_budget=f"{budget}B" if capped else None)
    profile = profile_for(prepared.device, memory_bytes=budget if prepared.device.kind == "cuda" else None)
    output = Path(config.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    log(f"memfit bench: {config.model} on {config.data} ({len(prepared.train_examples)} train / "
        f"{len(prepared.val_examples)} val samples), effective batch {config.effective_batch}, "
        f"{prepared.device.describe()}, budget {format_bytes(budget)} ({source})")
    setups = _setups(config, base, prepared, profile, budget, log)
    rows: list[dict[str, Any]] = []
    timelines: dict[str, dict[str, Any]] = {}
    for setup in setups:
        if setup.key == "int8":
            rows.append(_int8_row(setup, setup_dir(output, "fp32"), setup_dir(output, "int8"), log))
            continue
        row = _run_row(setup, setup_dir(output, setup.key), log)
        rows.append(row)
        timeline = setup_dir(output, setup.key) / "memory_timeline.json"
        if row["error"] is None and timeline.is_file():
            timelines[setup.name] = json.loads(timeline.read_text())
    speed_rounds(setups, rows, rounds=config.resolved_speed_rounds, steps=config.speed_steps, log=log)
    _compare(rows)
    result = BenchResult(rows=rows, machine=machine(prepared), command=command, budget_bytes=budget,
                         budget_source=source, timelines=timelines)
    write_outputs(result, output)
    log(f"bench done in {time.perf_counter() - started:.0f} s: {output / 'bench.md'}")
    return result


def setup_dir(output: Path, key: str) -> Path:
    """Where setup ``key`` of a bench in ``output`` trains (and its speed rounds, below it)."""
    return output / "runs" / key


def _budget(config: BenchConfig, prepared: Prepared) -> tuple[int, str]:
    if config.device_profile is not None:
        profile = resolve_profile(config.device_profile)
        return profile.memory_bytes, f"the memory of {profile.description}"
    if config.emulate_budget is not None:
        return parse_bytes(config.emulate_budget, option="--emulate-budget"), "--emulate-budget"
    if prepared.device.kind == "cuda":
        return prepared.device.total_memory_bytes or 0, "the device's memory"
    return psutil.virtual_memory().available, HOST_RAM


def _setups(config: BenchConfig, base: TrainConfig, prepared: Prepared, profile: DeviceProfile, budget: int,
            log: Callable[[str], None]) -> list[Setup]:
    """The matrix: each setup's config, fitted to the budget where the setup says 'largest that fits'."""
    low = "bf16" if profile.has_native_bf16 else "fp16"
    top = min(TOP_LAYERS, prepared.spec.num_layers - 1)
    usable = int(budget * (1 - config.margin))
    labels = len(prepared.label_names)

    def predict(setup_config: TrainConfig) -> Estimate:
        return estimate(setup_config, device=profile, num_labels=labels)

    def largest(name: str, key: str, **techniques: Any) -> Setup:
        """The largest micro-batch whose estimate fits ``usable``."""
        for size in micro_batch_sizes(config.effective_batch):
            candidate = dataclasses.replace(base, micro_batch_size=size, **techniques)
            predicted = predict(candidate)
            if predicted.total_bytes <= usable:
                return Setup(key, name, candidate, accuracy_neutral="train_top_layers" not in techniques,
                             predicted=predicted)
        return Setup(key, name, None, accuracy_neutral=False,
                     error=f"does not fit {format_bytes(usable)} even at micro-batch 1")

    made: list[Setup] = []
    for key in config.setups:
        if key == "fp32":
            made.append(largest("FP32 baseline", key, precision="fp32"))
        elif key == "low-accum4":
            accumulated = dataclasses.replace(base, precision=low, accumulation_steps=min(4, base.effective_batch))
            made.append(Setup(key, f"{low.upper()} + accumulation x4", accumulated, accuracy_neutral=True,
                              predicted=predict(accumulated)))
        elif key == "low-ckpt":
            made.append(largest(f"{low.upper()} + full checkpointing", key, precision=low, checkpointing="full"))
        elif key == "low-ckpt-top":
            if top < 1:
                made.append(Setup(key, f"{low.upper()} + checkpointing + top-{TOP_LAYERS} layers", None,
                                  accuracy_neutral=False, error="the model has a single layer: nothing to freeze"))
                continue
            made.append(largest(f"{low.upper()} + checkpointing + top-{top} layers", key, precision=low,
                                checkpointing="full", train_top_layers=top))
        elif key == "int8":
            made.append(Setup(key, "int8 inference (FP32 baseline's model)", None, accuracy_neutral=False))
        else:
            made.append(_plan_setup(config, base, prepared, profile, budget, log))
    return [dataclasses.replace(setup, config=dataclasses.replace(
        setup.config, output_dir=str(setup_dir(Path(config.output_dir), setup.key))))
        if setup.config is not None else setup for setup in made]


def _plan_setup(config: BenchConfig, base: TrainConfig, prepared: Prepared, profile: DeviceProfile, budget: int,
                log: Callable[[str], None]) -> Setup:
    made = plan(base, device=profile, budget=budget, seq_len=base.max_length, margin=config.margin,
                num_labels=len(prepared.label_names))
    log(f"plan: {made.verdict} (planned in {made.seconds:.1f} s)")
    if made.chosen is None:
        return Setup("plan", "memfit plan", None, accuracy_neutral=False, error=made.verdict)
    chosen = made.to_config(base=base)
    family = made.chosen.family
    name = (f"memfit plan ({family.precision}, {made.chosen.micro_batch_size} x {made.chosen.accumulation_steps}"
            f"{', ckpt ' + family.checkpointing if family.checkpointing != 'none' else ''})")
    return Setup("plan", name, chosen, accuracy_neutral=family.freeze == "none",
                 predicted=estimate(chosen, device=profile, num_labels=len(prepared.label_names)))


def _run_row(setup: Setup, run_dir: Path, log: Callable[[str], None]) -> dict[str, Any]:
    row = _empty_row(setup)
    if setup.config is None:
        log(f"skip {setup.name}: {setup.error}")
        return row
    config = setup.config
    row.update(micro_batch_size=config.resolved_micro_batch_size,
               accumulation_steps=config.resolved_accumulation_steps, precision=config.precision,
               checkpointing=config.checkpointing)
    if setup.predicted is not None:
        row.update(predicted_peak_bytes=setup.predicted.peak_bytes,
                   predicted_reserved_bytes=setup.predicted.peak_reserved_bytes
                   if setup.predicted.device != "cpu" else None)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir.parent / f"{setup.key}.json"
    log(f"run {setup.name}: micro-batch {row['micro_batch_size']} x {row['accumulation_steps']}, "
        f"{config.precision}, checkpointing {config.checkpointing} ...")
    started = time.perf_counter()
    summary, error = _train(config, config_path)
    row["seconds"] = round(time.perf_counter() - started, 1)
    if summary is None:
        row["error"] = error
        log(f"  failed: {error}")
        return row
    per_sample, per_step, spread = step_speeds([run_dir / "metrics.jsonl"], config.effective_batch)
    phases = summary["peak_memory_by_phase"]
    row.update(peak_memory_bytes=max(phases[name] for name in PHASES), eval_peak_bytes=phases["eval"],
               run_peak_bytes=summary["peak_memory_bytes"], peak_reserved_bytes=summary["peak_reserved_bytes"],
               peak_rss_bytes=summary["peak_rss_bytes"], samples_per_second=per_sample,
               optimizer_steps_per_second=per_step, step_time_spread=round(spread, 3),
               run_samples_per_second=per_sample, val_accuracy=summary["val_accuracy"],
               trainable_parameters=summary["trainable_parameters"],
               micro_batch_size=summary["micro_batch_size"], accumulation_steps=summary["accumulation_steps"],
               oom_recoveries=len(summary["oom_recoveries"]))
    log(f"  peak {format_bytes(row['peak_memory_bytes'])} (predicted {format_bytes(row['predicted_peak_bytes'])}), "
        f"{per_sample:.1f} samples/s, val accuracy {_accuracy(row['val_accuracy'])} ({row['seconds']:.0f} s)")
    return row


def _train(config: TrainConfig, config_path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``memfit train --config`` in its own process: (summary, None), or (None, its error line)."""
    config_path.write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    process = subprocess.run([sys.executable, "-m", "memfit", "train", "--config", str(config_path), "--json"],
                             capture_output=True, text=True, env={**os.environ, "COLUMNS": "120"})
    config_path.with_suffix(".log").write_text(process.stderr)
    if process.returncode != 0:
        errors = [line for line in process.stderr.splitlines() if line.startswith("memfit:")]
        return None, errors[-1] if errors else f"exit code {process.returncode}"
    return json.loads(process.stdout.strip().splitlines()[-1]), None


def speed_rounds(setups: list[Setup], rows: list[dict[str, Any]], *, rounds: int, steps: int,
                 log: Callable[[str], None]) -> None:
    """Re-time the training setups that ran: ``rounds`` rounds, each running every setup in turn for
    :data:`WARMUP_STEPS` + ``steps`` steps, so a machine's drift over minutes hits every setup alike. The
    rows' speeds become the medians over all rounds (the long run's own stays in ``run_samples_per_second``)."""
    timed = [(setup.name, setup.config, row) for setup, row in zip(setups, rows, strict=True)
             if setup.config is not None and row["kind"] == "training" and row["error"] is None]
    if not rounds or not timed:
        return
    log(f"speed: {rounds} interleaved round(s) of {WARMUP_STEPS} + {steps} steps per setup ...")
    files: dict[str, list[Path]] = {name: [] for name, _, _ in timed}
    for index in range(1, rounds + 1):
        for name, config, row in timed:
            run_dir = Path(str(config.output_dir)) / f"speed-{index}"
            run_dir.mkdir(parents=True, exist_ok=True)
            summary, error = _train(dataclasses.replace(config, max_steps=WARMUP_STEPS + steps, memory_timeline=False,
                                                        val_samples=config.effective_batch, output_dir=str(run_dir)),
                                    run_dir.parent / f"speed-{index}.json")
            if summary is None:
                row["error"] = f"speed round {index}: {error}"
            else:
                files[name].append(run_dir / "metrics.jsonl")
    for name, config, row in timed:
        if row["error"] is None:
            per_sample, per_step, spread = step_speeds(files[name], config.effective_batch)
            row.update(samples_per_second=per_sample, optimizer_steps_per_second=per_step,
                       step_time_spread=round(spread, 3), speed_rounds=rounds)
            log(f"  {name}: {per_sample:.1f} samples/s (long run: {row['run_samples_per_second']:.1f})")


def step_speeds(metrics: list[Path], effective_batch: int) -> tuple[float, float, float]:
    """(samples/s, optimizer steps/s, spread): medians over the full windows after each run's
    :data:`WARMUP_STEPS` steps, pooled over the ``metrics.jsonl`` files given; spread = the interquartile range
    of those step times over their median (the timing noise)."""
    steady = []
    for path in metrics:
        steps = [record for record in map(json.loads, path.read_text().splitlines())
                 if record["type"] == "train" and "step_seconds" in record]
        full = [record for record in steps if record["window_samples"] == effective_batch] or steps
        steady += full[WARMUP_STEPS:] or full[-1:]
    seconds = statistics.median(record["step_seconds"] for record in steady)
    per_sample = statistics.median(record["window_samples"] / record["step_seconds"] for record in steady)
    times = [record["step_seconds"] for record in steady]
    quartiles = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else [seconds] * 3
    return per_sample, 1.0 / seconds, (quartiles[2] - quartiles[0]) / seconds


def _int8_row(setup: Setup, baseline_dir: Path, output_dir: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """The FP32 baseline's model, int8-quantized for CPU inference: weight memory, batch-8 throughput."""
    row = _empty_row(setup)
    row.update(kind="inference", precision="int8")
    if not (baseline_dir / "model").is_dir():
        row["error"] = "the FP32 baseline did not finish: nothing to quantize"
        return row
    from memfit.quantize import run_quantize

    log(f"run {setup.name} ...")
    started = time.perf_counter()
    try:
        report = run_quantize(str(baseline_dir), output_dir=str(output_dir))
    except Exception as error:  # an optional row: report it, keep the rest of the table
        row["error"] = f"{type(error).__name__}: {error}"
        return row
    row.update(peak_memory_bytes=report["int8"]["memory_bytes"], val_accuracy=report["int8"]["val_accuracy"],
               samples_per_second=8000.0 / report["int8"]["latency_ms_batch8"],
               seconds=round(time.perf_counter() - started, 1))
    log(f"  weights {format_bytes(row['peak_memory_bytes'])}, {row['samples_per_second']:.1f} samples/s "
        f"inference, val accuracy {row['val_accuracy']:.4f}")
    return row


def _empty_row(setup: Setup) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    row.update(setup=setup.name, key=setup.key, kind="training", accuracy_neutral=setup.accuracy_neutral,
               oom_recoveries=0, error=setup.error)
    return row


def _compare(rows: list[dict[str, Any]]) -> None:
    """Accuracy delta (points), memory and speed ratios against the FP32 baseline row."""
    baseline = next((row for row in rows if row["key"] == "fp32" and row["error"] is None), None)
    if baseline is None:
        return
    for row in rows:
        if row["error"] is not None:
            continue
        if row["val_accuracy"] is not None and baseline["val_accuracy"] is not None:  # open-ended LM: none
            row["accuracy_delta_points"] = round(100 * (row["val_accuracy"] - baseline["val_accuracy"]), 2) + 0.0
        row["memory_ratio"] = round(row["peak_memory_bytes"] / baseline["peak_memory_bytes"], 3)
        if row["kind"] == "training":
            row["speed_ratio"] = round(row["samples_per_second"] / baseline["samples_per_second"], 3)


def machine(prepared: Prepared) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": prepared.device.describe(), "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "ram_bytes": psutil.virtual_memory().total,
        "python": platform.python_version(), "torch": torch.__version__}
    import transformers

    info["transformers"] = transformers.__version__
    if prepared.device.kind == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_memory_bytes"] = prepared.device.total_memory_bytes
    return info


# --- outputs -----------------------------------------------------------------------------------------------

def markdown(result: BenchResult) -> str:
    """The table in the seed's format (setup, batch, memory, speed), then the columns it lacked."""
    cpu = result.machine["device"] == "cpu"
    memory = "training peak (tracked tensors)" if cpu else "training peak allocated"
    lines = [f"| setup | batch (micro x acc) | {memory} | {'RSS' if cpu else 'reserved'} | predicted | "
             "samples/s | opt. steps/s | val acc | delta acc (points) | memory vs FP32 | speed vs FP32 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result.rows:
        if row["error"] is not None:
            lines.append(f"| {row['setup']} | - | - | - | - | - | - | - | - | - | {row['error']} |")
            continue
        batch = (f"{row['micro_batch_size'] * row['accumulation_steps']} ({row['micro_batch_size']} x "
                 f"{row['accumulation_steps']})" if row["kind"] == "training" else "8 (inference)")
        second = row["peak_rss_bytes"] if cpu else row["peak_reserved_bytes"]
        eval_higher = (row["eval_peak_bytes"] or 0) > row["peak_memory_bytes"]
        lines.append("| " + " | ".join([
            row["setup"] + ("" if row["kind"] == "training" else " ¹"), batch,
            format_bytes(row["peak_memory_bytes"]) + (" ²" if eval_higher else ""),
            format_bytes(second) if row["kind"] == "training" else "-",
            format_bytes(row["predicted_peak_bytes"]), f"{row['samples_per_second']:.1f}" + (
                f" ±{50 * row['step_time_spread']:.0f}%" if row["step_time_spread"] is not None else ""),
            f"{row['optimizer_steps_per_second']:.3f}" if row["optimizer_steps_per_second"] else "-",
            _accuracy(row["val_accuracy"]), _signed(row["accuracy_delta_points"]), _ratio(row["memory_ratio"]),
            _ratio(row["speed_ratio"])]) + " |")
    payload = result.to_dict()
    verdict = payload["accuracy_neutral_all_within"]
    lines += ["", f"Budget {format_bytes(result.budget_bytes)} ({result.budget_source}); machine: "
              f"{result.machine['device']}, {result.machine['cpu_count']} CPUs, torch {result.machine['torch']}, "
              f"{result.machine['date']}.",
              f"Accuracy-neutral setups within {ACCURACY_POINTS:g} points of FP32: "
              f"{'-' if verdict is None else 'yes' if verdict else 'NO'}."]
    if any(row["eval_peak_bytes"] and row["eval_peak_bytes"] > row["peak_memory_bytes"] for row in result.rows):
        lines.append("² evaluation (batch 64, no gradients) peaked higher than training: "
                     + ", ".join(f"{row['setup']} {format_bytes(row['eval_peak_bytes'])}" for row in result.rows
                                 if row["eval_peak_bytes"] and row["eval_peak_bytes"] > row["peak_memory_bytes"])
                     + ".")
    rounds = max((row["speed_rounds"] or 0 for row in result.rows), default=0)
    timing = (f"median over {rounds} interleaved speed rounds (every setup in turn, each after {WARMUP_STEPS} "
              "warm-up steps)" if rounds else f"median of the run's steps after {WARMUP_STEPS} warm-up steps")
    lines.append(f"samples/s: {timing}; ± half the interquartile range of the step times, relative: the timing "
                 "noise. Speed ratios within it are not differences.")
    if any(row["kind"] == "inference" and row["error"] is None for row in result.rows):
        lines.append("¹ int8 row: memory = the quantized weights in memory, speed = CPU inference at batch 8 "
                     "(memfit quantize); its ratios compare with the FP32 baseline's training peak and accuracy.")
    if result.command:
        lines.append(f"Command: `{result.command}`")
    return "\n".join(lines) + "\n"


def _accuracy(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def write_outputs(result: BenchResult, output: Path) -> None:
    (output / "bench.md").write_text(markdown(result), encoding="utf-8")
    with (output / "bench.csv").open("w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=ROW_KEYS)
        writer.writeheader()
        writer.writerows(result.rows)
    write_json(output / "bench.json", result.to_dict())
    plot(result, output)


def plot(result: BenchResult, output: Path) -> list[Path]:
    """``bench_memory_speed.png`` and ``bench_timelines.png``; none without matplotlib (the plots extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return []
    rows = [row for row in result.rows if row["error"] is None and row["kind"] == "training"]
    written = []
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        axes.scatter(row["samples_per_second"], row["peak_memory_bytes"] / 2**20, s=60)
        axes.annotate(row["setup"], (row["samples_per_second"], row["peak_memory_bytes"] / 2**20),
                      textcoords="offset points", xytext=(6, 4), fontsize=8)
    if result.budget_source != HOST_RAM:  # a budget worth drawing
        axes.axhline(result.budget_bytes / 2**20, color="red", linestyle="--", linewidth=1,
                     label=f"budget {format_bytes(result.budget_bytes)}")
    axes.set_xlabel("samples / s (median after warm-up)")
    axes.set_ylabel("peak memory (MiB)")
    axes.set_title(f"memfit bench on {result.machine['device']}: memory vs speed")
    axes.set_ylim(bottom=0)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize=8)
    figure.tight_layout()
    written.append(output / "bench_memory_speed.png")
    figure.savefig(written[-1], dpi=110)
    plt.close(figure)
    if result.timelines:
        colors = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green", "other": "0.85"}
        count = len(result.timelines)
        figure, grid = plt.subplots(count, 1, figsize=(8, 1.9 * count), squeeze=False)
        for axes, (name, timeline) in zip(grid[:, 0], result.timelines.items(), strict=True):
            values = [value / 2**20 for value in timeline["bytes"]]
            axes.plot(range(len(values)), values, color="black", linewidth=0.8)
            for phase in timeline["phases"]:
                axes.axvspan(phase["start"], phase["end"], color=colors.get(phase["name"], "0.9"), alpha=0.25,
                             linewidth=0)
            axes.set_title(f"{name}: step {timeline['step']}, peak {format_bytes(timeline['peak_bytes'])}",
                           fontsize=9)
            axes.set_ylabel("MiB")
            axes.set_ylim(bottom=0)
        grid[-1, 0].set_xlabel("allocations and frees during one optimizer step")
        handles = [Patch(color=color, alpha=0.4) for color in colors.values()]
        figure.legend(handles, list(colors), loc="upper right", fontsize=8, ncol=4)
        figure.tight_layout(rect=(0, 0, 1, 0.97))
        written.append(output / "bench_timelines.png")
        figure.savefig(written[-1], dpi=110)
        plt.close(figure)
    return written
