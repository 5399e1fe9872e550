"""What the commands print: the plan table, the estimate's breakdown, the int8 report and the device list.

Each view takes a rich ``Console`` and a result; :mod:`memfit.cli` chooses which one a command shows.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from memfit.errors import MemfitError


def print_plan(console: Console, result: Any, *, top: int) -> None:
    from rich.table import Table

    from memfit.report import format_bytes

    shape = (f"seq len {result.sequence_length}" if result.sequence_length is not None
             else f"image {result.image_size}px")
    console.print(f"[bold]memfit plan[/]: {result.model} on {result.device_description}, effective batch "
                  f"{result.effective_batch}, {shape}, budget {format_bytes(result.budget_bytes)} "
                  f"({format_bytes(result.usable_bytes)} usable)")
    if result.chosen is not None:
        console.print(f"[green]chosen[/]: {result.chosen.describe()}")
    table = Table(caption="peak: ~ = from the family's fit (a line or a lean trace), - = not traced (its speed "
                          "is a bound)")
    for column in ("#", "micro x acc", "precision", "checkpoint", "optimizer", "fits", "peak", "samples/s",
                   "vs chosen", "why"):
        table.add_column(column, justify="right" if column in ("#", "peak", "samples/s", "vs chosen") else "left",
                         no_wrap=column != "why")
    for rank, candidate in enumerate(result.candidates[:top], start=1):
        family = candidate.family
        fits = {True: "[green]yes", False: "[red]no", None: "-"}[candidate.fits]
        peak = "-" if candidate.predicted_peak_bytes is None else (
            ("" if candidate.exact else "~") + format_bytes(candidate.predicted_peak_bytes))
        speed = f"{candidate.relative_speed:.2f}x" if candidate.relative_speed is not None else "-"
        optimizer = family.optimizer_label + (" on the host" if family.offload_optimizer else "") + (
            "" if family.freeze == "none" else f", freeze {family.freeze}") + (
            f", {family.technique_label}" if family.lora_rank else "") + (
            ", gradients reduced every micro-step" if candidate.reduces_every else "")
        ranks = f"{family.strategy_label}: " if family.ranks else ""
        table.add_row(str(rank), f"{ranks}{candidate.micro_batch_size} x {candidate.accumulation_steps}",
                      family.precision,
                      family.checkpointing + (f", loss/{family.loss_chunk}" if family.loss_chunk else ""), optimizer,
                      fits, peak, f"{candidate.predicted_samples_per_second:.1f}",
                      speed, candidate.reason)
    console.print(table)
    if len(result.candidates) > top:
        console.print(f"({len(result.candidates) - top} more rows: --top {len(result.candidates)} or --json)")
    console.print(result.verdict)
    console.print(f"planned in {result.seconds:.1f} s from {result.traces} traces; peak = allocator reserve + "
                  "non-PyTorch memory; speed from the FLOP/overhead cost model (memfit.planner)")


def print_gpu_count(console: Console, counted: Any) -> None:
    """``memfit plan --max-gpus``: each technique's setup per number of GPUs, the fewest each needs, and the
    command that trains the chosen one."""
    from rich.table import Table

    from memfit.report import format_bytes

    first = counted.cells[0].plan
    shape = (f"seq len {first.sequence_length}" if first.sequence_length is not None
             else f"image {first.image_size}px")
    console.print(f"[bold]memfit plan[/]: {first.model} on up to {counted.max_gpus} x {first.device_description}, "
                  f"effective batch {first.effective_batch} over all GPUs, {shape}, budget "
                  f"{format_bytes(first.budget_bytes)} per GPU ({format_bytes(first.usable_bytes)} usable)")
    table = Table(caption="per GPU: the fastest setup that fits, its peak and the predicted samples/s of all GPUs "
                          "together; else the least any setup needs")
    table.add_column("GPUs", justify="right")
    for technique in counted.techniques:
        table.add_column(counted.label(technique))
    for gpus in sorted({cell.gpus for cell in counted.cells}):
        row = [str(gpus)]
        for technique in counted.techniques:
            cell = next(c for c in counted.cells if c.technique == technique and c.gpus == gpus)
            chosen = cell.plan.chosen
            row.append(f"[green]{chosen.describe()}: {format_bytes(chosen.predicted_peak_bytes or 0)}, "
                       f"{chosen.predicted_samples_per_second:.2f}/s" if chosen is not None else
                       f"[red]needs at least {format_bytes(cell.least_bytes)}" if cell.least_bytes is not None
                       else "[red]does not fit")
        table.add_row(*row)
    console.print(table)
    for technique, why in counted.skipped.items():
        console.print(f"{counted.label(technique)} not planned: {why}")
    console.print(counted.verdict())
    chosen = counted.chosen
    if chosen is not None:
        from memfit.commands import train_command

        command = train_command(chosen.plan.to_config(), chosen.plan.gpus_per_node)
        console.print(f"train with: {command}", soft_wrap=True)


def print_devices(console: Console) -> None:
    from rich.table import Table

    from memfit.report import format_bytes

    table = Table(title="device profiles")
    for column in ("name", "device", "memory", "sm", "fp32 TFLOP/s", "fp16 TFLOP/s", "bf16 TFLOP/s",
                   "tensor cores"):
        table.add_column(column)
    from memfit.devices import PROFILES as BUILT_IN

    for profile in BUILT_IN.values():
        capability = profile.compute_capability
        table.add_row(profile.name, profile.description,
                      format_bytes(profile.memory_bytes) if profile.memory_bytes else "host RAM",
                      f"{capability[0]}.{capability[1]}" if capability else "-", f"{profile.fp32_flops / 1e12:g}",
                      f"{profile.fp16_flops / 1e12:g}", f"{profile.bf16_flops / 1e12:g}" if profile.bf16_flops
                      else "no", "yes" if profile.tensor_cores else "no")
    console.print(table)
    console.print(this_machine())


def this_machine() -> str:
    """The card this process sees, and whether the installed torch carries kernels for it. Without an NVIDIA
    driver there is no card to ask torch about, and torch is not imported (it takes seconds)."""
    linux_without_driver = sys.platform.startswith("linux") and not Path("/proc/driver/nvidia").exists() \
        and not list(Path("/dev").glob("nvidia[0-9]*"))
    if linux_without_driver or sys.platform == "darwin":
        return "this machine: no NVIDIA driver, no CUDA device; memfit trains on the CPU"
    import torch

    from memfit.devices import profile_for, resolve_device

    if not torch.cuda.is_available():
        return f"this machine: no CUDA device (torch {torch.__version__}); memfit trains on the CPU"
    try:
        device = resolve_device("cuda")  # checks torch.cuda.get_arch_list() against the card
    except MemfitError as error:
        return f"this machine: {error.problems[0]}"
    return (f"this machine: {device.describe()}, profile {profile_for(device).name}; torch {torch.__version__} "
            "runs on it")


def print_quantize(console: Console, report: dict[str, Any]) -> None:
    from rich.table import Table

    from memfit.report import format_bytes

    table = Table(title=f"memfit quantize: {report['method']} ({report['backend']}), CPU, {report['threads']} "
                        f"threads, {report['val_samples']} validation samples", title_justify="left")
    for column in ("", "fp32", "int8", "fp32 / int8"):
        table.add_column(column, justify="right")
    fp32, int8 = report["fp32"], report["int8"]
    table.add_row("size on disk", format_bytes(fp32["size_bytes"]), format_bytes(int8["size_bytes"]),
                  f"{report['size_ratio']:.2f}x")
    table.add_row("weights in memory", format_bytes(fp32["memory_bytes"]), format_bytes(int8["memory_bytes"]),
                  f"{report['memory_ratio']:.2f}x")
    table.add_row("val accuracy", f"{fp32['val_accuracy']:.4f}", f"{int8['val_accuracy']:.4f}",
                  f"{report['accuracy_delta_points']:+.2f} points")
    table.add_row("latency batch 1 (median)", f"{fp32['latency_ms_batch1']:.1f} ms",
                  f"{int8['latency_ms_batch1']:.1f} ms", f"{report['latency_ratio_batch1']:.2f}x")
    table.add_row("latency batch 8 (median)", f"{fp32['latency_ms_batch8']:.1f} ms",
                  f"{int8['latency_ms_batch8']:.1f} ms", f"{report['latency_ratio_batch8']:.2f}x")
    console.print(table)
    console.print(f"predictions agree on {100 * report['prediction_agreement']:.2f} % of the validation set; "
                  f"largest logit difference {report['max_abs_logit_diff']:.4f}; saved to {report['output_dir']}")
    if report.get("kept_fp32"):
        console.print(f"kept in fp32 so that int8 keeps 98 % of the predictions: {', '.join(report['kept_fp32'])}")


def print_estimate(console: Console, result: Any) -> None:
    from rich.table import Table

    from memfit.report import format_bytes

    shape = (f"seq len {result.sequence_length}" if result.sequence_length is not None
             else f"image {result.image_size}px")
    if result.config.get("max_target_length"):  # seq2seq: the decoder's side (else the sequence length)
        shape += f", target len {result.config['max_target_length']}"
    console.print(f"[bold]memfit estimate[/]: {result.config['model']} on {result.device}, micro-batch "
                  f"{result.micro_batch_size} x {result.accumulation_steps}, {shape}, {result.precision}, "
                  f"checkpointing {result.config['checkpointing']}"
                  + (", activations offloaded" if result.config.get("offload_activations") else "")
                  + f", {result.config['optimizer']}"
                  + (" on the host" if result.config.get("offload_optimizer") else "")
                  + (f"; one rank of {result.world_size} ({result.distributed})" if result.distributed != "none"
                     else ""))
    table = Table()
    table.add_column("at the peak")
    table.add_column("bytes", justify="right")
    for name, value in result.breakdown.items():
        if value or name not in ("frozen_parameters", "quantized_weights", "logits_and_loss", "workspaces"):
            # those only where the step has them
            table.add_row(name.replace("_", " "), format_bytes(value))
    table.add_row("[bold]peak allocated", f"[bold]{format_bytes(result.peak_bytes)}")
    table.add_row("peak reserved (approx.)", format_bytes(result.peak_reserved_bytes))
    table.add_row("outside PyTorch (CUDA context)", format_bytes(result.non_pytorch_bytes - result.communicator_bytes))
    if result.communicators:
        plural = "s" if result.communicators > 1 else ""
        said = "" if result.communicator_measured else ", unmeasured"
        table.add_row(f"outside PyTorch (NCCL, {result.communicators} communicator{plural}{said})",
                      format_bytes(result.communicator_bytes))
    for name, value in (result.host_breakdown or {"offloaded_optimizer": result.host_bytes}).items():
        if value:  # at the host's peak, beside the card's
            table.add_row(f"host memory ({name.replace('_', ' ')})", format_bytes(value))
    if result.load_host_bytes:  # before the first step: the model as its ranks build it
        ranks = f", {result.world_size} ranks on one machine" if result.world_size > 1 else ""
        table.add_row(f"host memory while loading ({result.distributed if ranks else 'one process'}{ranks})",
                      format_bytes(result.load_host_bytes))
    console.print(table)
    phases = "  ".join(f"{name} {format_bytes(value)}" for name, value in result.phases.items())
    console.print(f"peak per phase: {phases}  (peak in {result.peak_phase})", soft_wrap=True)
    if result.fits is None:
        console.print("target: cpu (no fixed memory budget)")
    else:
        verdict = "[green]fits" if result.fits else "[red]does not fit"
        console.print(f"{verdict}[/] in {format_bytes(result.device_memory_bytes)}: needs "
                      f"{format_bytes(result.total_bytes)}, headroom {format_bytes(result.headroom_bytes)}")
    console.print(f"{result.traced_ops:,} ops of the step in {result.seconds:.1f} s ({result.trace})")


def print_cached_models() -> None:
    """The models in the local Hugging Face cache, usable as ``--model org/name`` offline."""
    from memfit.hub import cache_dir, cached_models
    from memfit.report import format_bytes

    models = cached_models()
    if not models:
        return
    print(f"\nin the local Hugging Face cache ({cache_dir()}):")
    width = max(len(model["repo_id"]) for model in models)
    for model in models:
        contents = "weights" if model["weights"] else "config only"
        print(f"{model['repo_id']:<{width}}  {','.join(model['revisions']) or '-'}  {contents}  "
              f"{format_bytes(model['bytes'])}")


class TraceProgress:
    """A plan's progress on stderr (traces done, the families searched), shown once it has run ``after``
    seconds: a plan that answers at once shows none. Used as a context manager around the plan."""

    def __init__(self, after: float = 2.0) -> None:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.after = after
        self.started = time.perf_counter()
        self.traces = 0
        self.families: set[str] = set()
        self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                  console=Console(stderr=True), transient=True, auto_refresh=False)
        # redrawn at each trace, not by rich's refresh thread: a plan with a thread alive cannot fork workers
        self._task = self._progress.add_task("planning", total=None)
        self._shown = False

    def __call__(self, family: str) -> None:
        self.traces += 1
        self.families.add(family)
        if not self._shown and self._progress.console.is_terminal and \
                time.perf_counter() - self.started >= self.after:
            self._progress.start()
            self._shown = True
        self._progress.update(self._task, description=f"planning: {self.traces} traces of "
                                                       f"{len(self.families)} techniques, last {family}")
        if self._shown:
            self._progress.refresh()

    def __enter__(self) -> TraceProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._shown:
            self._progress.stop()
