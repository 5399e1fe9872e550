"""What a run shows and writes: the resolved config, live progress, evaluations, the summary.

Files under the output directory: ``metrics.jsonl`` (one JSON object per logged step and per evaluation),
``summary.json`` (:class:`Summary`), and ``model/`` (the fine-tuned Hugging Face model, safetensors).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


def format_bytes(nbytes: int | float | None) -> str:
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass(kw_only=True, slots=True)
class Summary:
    """The result of :func:`memfit.train`, also written as ``summary.json``."""

    val_accuracy: float | None
    """Classification accuracy; for a causal LM, accuracy over the closed set of completions (``None`` when
    they are open-ended)."""
    val_loss: float
    """Mean per example (classification) or per completion token (causal LM)."""
    train_loss: float
    """Mean training loss over the last logged window of steps."""
    peak_memory_bytes: int
    """CPU: peak live tensor bytes (storage tracker); CUDA: peak allocated bytes."""
    peak_memory_by_phase: dict[str, int]
    samples_per_second: float
    """Training samples (packed rows with ``--packing``) per second of training time (evaluation excluded)."""
    optimizer_steps: int
    """Optimizer steps that updated the weights (skipped non-finite steps excluded)."""
    effective_batch_size: int
    micro_batch_size: int
    accumulation_steps: int
    precision: str
    checkpointing: str
    trainable_parameters: int
    total_parameters: int
    device: str
    config: dict[str, Any]
    optimizer_steps_per_second: float = 0.0
    epochs_completed: int = 0
    train_samples: int = 0
    val_samples: int = 0
    train_seconds: float = 0.0
    total_seconds: float = 0.0
    peak_rss_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    offloaded_activations_peak_bytes: int | None = None
    """``--offload-activations``: the most host memory the offloaded activations held at once (pinned; one
    micro-batch's), apart from the card's peak; ``None`` without offloading."""
    skipped_steps: list[dict[str, Any]] = field(default_factory=list)
    oom_recoveries: list[dict[str, Any]] = field(default_factory=list)
    """One event per out-of-memory error survived: step, action (retry/split), old and new micro-batch."""
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    task: str = "classification"
    val_perplexity: float | None = None
    """Causal LM: exp of the validation loss per completion token."""
    val_accuracy_before: float | None = None
    """With ``--eval-before``: the accuracy before the first step (zero-shot)."""
    plan: dict[str, Any] | None = None
    """With ``--budget``/``--plan``: the chosen setup as planned (its predicted peak and speed), the budget and
    the planner's verdict; the whole plan is in ``plan.json``."""
    resumed_from: str | None = None
    """The checkpoint this run continued from, if any (peak memory and speed are of the resumed part)."""
    output_dir: str = ""
    world_size: int = 1
    """Ranks that trained (``torchrun --nproc-per-node``); the effective batch is over all of them."""
    distributed: str = "none"
    """``none``, ``ddp`` or ``fsdp``."""
    per_rank_peak_memory_bytes: list[int] = field(default_factory=list)
    """Each rank's peak (in rank order); ``peak_memory_bytes`` is rank 0's."""
    per_rank_training_peak_bytes: list[int] = field(default_factory=list)
    """Each rank's peak over forward, backward and optimizer: what ``memfit estimate --world-size`` predicts."""
    per_rank_built_bytes: list[int] = field(default_factory=list)
    """Host bytes of the model each rank built before sharding or placing it: under FSDP rank 0's alone
    (:mod:`memfit.rank0_load`), the others building on the meta device."""
    model_from_shards: bool = False
    """FSDP: ``model/`` was written from each rank's shards, never gathered on one rank
    (:mod:`memfit.streamed_export`)."""
    allreduce_seconds: float | None = None
    """DDP: summed time gradient buckets spent in flight (overlapping backward); ``None`` otherwise."""
    packed_rows: int | None = None
    """``--packing``: the rows the training examples were packed into (the run's samples: ``train_samples``);
    ``None`` unpacked."""
    train_examples: int = 0
    """Training examples (the same as ``train_samples`` unless packed)."""
    examples_per_second: float = 0.0
    """Training examples per second: ``samples_per_second`` times the examples per sample (a packed row holds
    several). What compares a packed run's speed with a padded one's."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl``."""

    def __init__(self, path: Path) -> None:
        self._file: TextIO = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    @property
    def offset(self) -> int:
        """The file's length in bytes (every line is flushed)."""
        return os.fstat(self._file.fileno()).st_size

    def close(self) -> None:
        self._file.close()


def config_table(rows: list[tuple[str, str]], *, title: str = "memfit train: resolved config") -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("option", style="cyan")
    table.add_column("value")
    for name, value in rows:
        table.add_row(name, value)
    return table


class Reporter:
    """Console output of a run (rich), and its metrics file."""

    def __init__(self, console: Console, output_dir: Path, *, write: bool = True) -> None:
        """``write=False`` (ranks other than 0): the metrics go nowhere."""
        self.console = console
        self.metrics = MetricsLog(output_dir / "metrics.jsonl" if write else Path(os.devnull))
        self._progress: Progress | None = None
        self._task: Any = None

    def show_config(self, rows: list[tuple[str, str]]) -> None:
        self.console.print(config_table(rows))

    def warn(self, message: str) -> None:
        self.console.print(f"[bold yellow]warning:[/] {message}")

    def start(self, total_steps: int, *, completed: int = 0) -> None:
        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[stats]}"), console=self.console, transient=False)
        self._task = self._progress.add_task("train", total=total_steps, completed=completed, stats="")
        self._progress.start()

    def step(self, *, step: int, loss: float, lr: float, samples_per_second: float, memory_bytes: int,
             peak_bytes: int) -> None:
        assert self._progress is not None
        stats = (f"loss {loss:.4f}  lr {lr:.2e}  {samples_per_second:.1f} samples/s  "
                 f"mem {format_bytes(memory_bytes)} (peak {format_bytes(peak_bytes)})")
        self._progress.update(self._task, completed=step, stats=stats)

    def evaluation(self, record: dict[str, Any]) -> None:
        self.metrics.write(record)
        when = "before training" if record["epoch"] == 0 else f"epoch {record['epoch']}  step {record['step']}"
        line = (f"eval  {when}  accuracy {_metric(record['accuracy'])}  loss {record['loss']:.4f}"
                + (f"  perplexity {record['perplexity']:.2f}" if record.get("perplexity") is not None else ""))
        if self._progress is not None:
            self._progress.console.print(line)
        else:
            self.console.print(line)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def summary(self, summary: Summary) -> None:
        table = Table(title="memfit train: summary", show_header=False, title_justify="left")
        table.add_column("metric", style="cyan")
        table.add_column("value")
        phases = "  ".join(f"{name} {format_bytes(value)}" for name, value in summary.peak_memory_by_phase.items())
        rows = [
            ("val accuracy", _metric(summary.val_accuracy) + (
                f" (before training {_metric(summary.val_accuracy_before)})"
                if summary.val_accuracy_before is not None else "")),
            *((("val perplexity", f"{summary.val_perplexity:.2f}"),) if summary.val_perplexity is not None else ()),
            ("val loss / train loss", f"{summary.val_loss:.4f} / {summary.train_loss:.4f}"),
            ("peak memory", f"{format_bytes(summary.peak_memory_bytes)} ({_peak_kind(summary)})"),
            ("peak by phase", phases),
            ("throughput", f"{summary.samples_per_second:.1f} samples/s, "
                           f"{'' if summary.packed_rows is None else f'{summary.examples_per_second:.1f} examples/s, '}"
                           f"{summary.optimizer_steps_per_second:.2f} optimizer steps/s"),
            ("batch", f"{summary.effective_batch_size} = {summary.micro_batch_size} x "
                      f"{summary.accumulation_steps} accumulation"),
            ("optimizer steps", f"{summary.optimizer_steps} ({len(summary.skipped_steps)} skipped)"),
            ("techniques", f"precision {summary.precision}, checkpointing {summary.checkpointing}"
                           + (f", LoRA r={summary.config['lora_rank']}" if summary.config.get("lora_rank") else "")
                           + (f" on a {summary.config['quantize_base']} base"
                              if summary.config.get("quantize_base", "none") != "none" else "")),
            ("parameters", f"{summary.trainable_parameters:,} trainable of {summary.total_parameters:,}"),
            ("time", f"{summary.train_seconds:.1f} s training, {summary.total_seconds:.1f} s total"),
            *([("ranks", f"{summary.world_size} ({summary.distributed}), peak per rank "
                         f"{', '.join(format_bytes(b) for b in summary.per_rank_peak_memory_bytes)}")]
              if summary.world_size > 1 or summary.distributed != "none" else []),
            ("output", summary.output_dir),
        ]
        if summary.peak_rss_bytes is not None:
            rows.insert(3, ("peak process RSS", format_bytes(summary.peak_rss_bytes)))
        if summary.offloaded_activations_peak_bytes is not None:
            rows.insert(3, ("host memory (offloaded activations)",
                            format_bytes(summary.offloaded_activations_peak_bytes)))
        for name, value in rows:
            table.add_row(name, value)
        self.console.print(table)

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()
        self.metrics.close()


def _metric(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _peak_kind(summary: Summary) -> str:
    return "live tensor bytes" if summary.device == "cpu" else "allocated"


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
