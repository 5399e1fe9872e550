"""Predict the peak memory of a training step without running it: a fake-tensor trace of the real step.

The trace builds the model with the engine's builder and techniques (:func:`memfit.build.build_with_techniques`),
runs its window step (:func:`memfit.step.accumulate_window`) and optimizer step
(:func:`memfit.techniques.stability.guarded_step`) under ``FakeTensorMode`` on CPU: shapes and dtypes, no data.
The tracker (:class:`~memfit.memory.tracker.StorageTracker`) counts live storages as in a real CPU run: with
``device="cpu"`` the estimate equals the run's tracked peak.

Steady state: AdamW creates its state lazily in the first optimizer step, so the trace runs ``steps``
(default 2) full windows and the peak is taken over all of them. For CUDA targets,
:mod:`memfit.memory.emulation` switches the autocast policy and attention kernel to CUDA's, and the tracker
counts each storage at the size of the block the caching allocator would serve it from
(:mod:`memfit.memory.allocator`), which also gives ``reserved``.

Modelled rather than traced: the GradScaler's found-inf check reads a value, so fp16 traces run without the
scaler and add its state (four one-element tensors). ``non_pytorch_bytes`` (the CUDA context and library
workspaces) is the device profile's.

One rank of N (``distributed``/``world_size``): FSDP2 is traced for real over a fake process group of N
ranks (:func:`memfit.distributed.fake_world`; the mesh is made before the fake mode), with the engine's
no-sync micro-steps; collectives complete at once there, so a real reduce-scatter that finishes late can keep
up to one layer's buffer longer than the trace. DDP cannot be built on fake tensors: its persistent gradient
buckets are modelled (:class:`~memfit.memory.ddp_buckets.DdpBuckets`). On CPU both equal a 2-process gloo
run's per-rank tracked peak (DDP to the byte, FSDP to 8 bytes), counted as the trace counts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException

from memfit import distributed
from memfit.build import (
    build_optimizer_for,
    build_with_techniques,
    classification_eos,
    depth_problems,
    device_problems,
    resolve_task,
    task_fit_problems,
)
from memfit.config import TrainConfig, runs_sharded
from memfit.data.batches import Batch
from memfit.data.packing import packing_problems
from memfit.devices import Device, DeviceProfile, profile_for, resolve_profile
from memfit.errors import ConfigError, Problems
from memfit.memory.allocator import CachingAllocatorModel
from memfit.memory.build_values import BuildValuesFakeMode, no_init_weights
from memfit.memory.ddp_buckets import DdpBuckets
from memfit.memory.emulation import CudaEmulation, cublas_workspace_bytes
from memfit.memory.fake_answers import FakeAnswers
from memfit.memory.fake_memo import memo_enabled
from memfit.memory.host_shards import HostShards, offload_problems, offloaded
from memfit.memory.mask_values import known_eos, known_masks
from memfit.memory.monitor import timeline_record
from memfit.memory.repeats import (
    BLOCK,
    MICRO,
    NotRepeating,
    RecordingTracker,
    expand,
    replay,
    scaled,
)
from memfit.memory.shortened import Shortened, after_refusal, needs_spacer, shortened_trace
from memfit.memory.synthetic import TRACE_PAD, encoder_decoder_batch, shape_problems, synthetic_batch
from memfit.memory.trace_inputs import TraceInputs
from memfit.memory.tracker import StorageTracker, label_gradients, label_optimizer_state
from memfit.models import (
    ModelSpec,
    count_parameters,
    is_encoder_decoder,
    resolve_model,
    transformer_layers,
    with_depth,
    with_image_size,
)
from memfit.quiet import quiet_transformers, raised_loggers
from memfit.rank0_load import load_host_bytes
from memfit.step import PhaseTracker, accumulate_window, item_count, optimizer_step
from memfit.support import architecture_problems, model_support
from memfit.techniques.offload import OffloadedOptimizer
from memfit.techniques.offload_activations import ActivationOffload
from memfit.techniques.optim import build_scheduler
from memfit.techniques.optimizer_in_backward import InBackwardOptimizer, assume_finite_gradient
from memfit.techniques.precision import Precision, resolve_precision
from memfit.techniques.stability import assume_finite, read_values

CATEGORIES = ("parameters", "frozen_parameters", "quantized_weights", "gradients", "optimizer_state",
              "kahan_compensation", "activations", "logits_and_loss", "temporaries", "inputs", "workspaces")
HOST_CATEGORIES = ("offloaded_optimizer", "offloaded_activations", "paged_optimizer", "offloaded_parameters",
                   "offloaded_gradients")
"""What holds host memory in a step (:attr:`Estimate.host_breakdown`)."""
SCALER_TENSORS = 4
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"


@dataclass(kw_only=True, slots=True)
class StepPeak:
    """A traced step's predicted peak: what :class:`Estimate` and a Trainer's step estimate share."""

    peak_bytes: int
    """Steady-state peak of allocated bytes (the tracked peak on CPU)."""
    peak_reserved_bytes: int
    """Approximate peak reserved by the caching allocator (equal to ``peak_bytes`` on CPU)."""
    non_pytorch_bytes: int
    breakdown: dict[str, int]
    """Bytes per category live at the peak."""
    phases: dict[str, int]
    """Peak bytes per phase: forward, backward, optimizer (the step, freeing the gradients, the schedule)."""
    peak_phase: str
    device: str

    @property
    def total_bytes(self) -> int:
        """What must fit the card: the allocator's reserve plus the memory outside PyTorch (CUDA context)."""
        return self.peak_reserved_bytes + self.non_pytorch_bytes


@dataclass(kw_only=True, slots=True)
class Estimate(StepPeak):
    device_memory_bytes: int
    fits: bool | None
    """Whether reserved + non-PyTorch bytes fit the device; ``None`` on CPU (no fixed budget)."""
    headroom_bytes: int | None
    micro_batch_size: int
    accumulation_steps: int
    sequence_length: int | None
    image_size: int | None
    precision: str
    config: dict[str, Any]
    traced_ops: int
    """ATen ops dispatched in the trace (forward, backward and optimizer of every traced step)."""
    phase_ops: dict[str, int]
    """ATen ops per phase over the traced steps: forward and backward sum every micro-step's."""
    flops: int | None
    """Matmul-class FLOPs of the traced steps (with checkpointing's recompute); with ``count_flops=True``."""
    dequantized_bytes: int | None
    """Bytes the traced steps read and write to dequantise 4-bit weights (QLoRA); with ``flops``."""
    trainable_parameters: int
    """Parameters that get gradients and optimizer state."""
    parameters: int
    """All parameters (of the whole model, also when sharded)."""
    world_size: int
    distributed: str
    """The strategy traced: ``none``, ``ddp`` or ``fsdp`` (``auto`` resolved); the peak is one rank's."""
    traced_micro_steps: int
    """Forward/backward passes the traced steps ran."""
    traced_samples: int
    """Samples the traced steps ran: ``flops / traced_samples`` is the FLOPs per sample."""
    seconds: float
    host_bytes: int = 0
    """Host memory the step keeps (0 without offload): an offloaded optimizer's state and pinned copies, offloaded
    activations, FSDP's offloaded shards and optimizer (:data:`HOST_CATEGORIES`)."""
    host_breakdown: dict[str, int] = dataclasses.field(default_factory=dict)
    """``host_bytes`` by what holds them (:data:`HOST_CATEGORIES`) at the host's peak."""
    trace: str = "full trace"
    """How the step was traced: in full (and why), or which blocks and micro-steps, the rest replayed."""
    timeline: dict[str, Any] | None = None
    """With ``timeline=True``: allocated bytes over the traced steps, as in :attr:`peak_bytes`, each point with its
    phase (``memfit train --memory-timeline``'s form); a shortened trace's may order simultaneous frees otherwise."""
    load_host_bytes: int = 0
    """Host memory of one machine while the ranks build the model, all on one machine
    (:func:`memfit.rank0_load.load_host_bytes`: rank 0 alone reads under FSDP)."""
    communicators: int = 0
    """The NCCL communicators a rank's card holds (:func:`memfit.distributed.communicators`; none on a CPU)."""
    communicator_bytes: int = 0
    """Their buffers, part of :attr:`non_pytorch_bytes` (the profile's per-communicator figure, unmeasured unless
    :attr:`communicator_measured`)."""
    communicator_measured: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def prepare_trace(config: TrainConfig, *, device: str | DeviceProfile = "cpu", seq_len: int | None = None,
                  image_size: int | None = None, steps: int = 2, lean_warmup: bool = False,
                  padded: bool = True, layers: int | None = None) -> TraceInputs:
    """Validate ``config`` for the target and make the inputs; every problem is reported at once.

    ``padded=False``: every text fills the sequence length, so no micro-batch carries padding
    (:func:`synthetic_batch`)."""
    config.validate()
    problems = Problems()
    profile = problems.collect(lambda: device if isinstance(device, DeviceProfile) else resolve_profile(device))
    spec = problems.collect(lambda: resolve_model(config.model))
    precision_name = config.precision
    if profile is not None:
        precision_name, precision_problems = resolve_precision(config.precision, profile.as_device(),
                                                               force_cpu_fp16=config.force_cpu_fp16,
                                                               force_bf16=config.force_bf16)
        problems.lines.extend(precision_problems)
        problems.lines.extend(device_problems(config, profile.kind))
    problems.lines.extend(offload_problems(config))
    if spec is not None:
        problems.lines.extend(depth_problems(config, spec))
        problems.lines.extend(architecture_problems(spec.hf_config))
        problems.lines.extend(shape_problems(spec, seq_len or config.max_length, image_size))
    problems.raise_if_any(ConfigError)
    assert profile is not None and spec is not None
    length = seq_len or config.max_length
    vision = spec.modality == "vision"
    size = (image_size or spec.image_size) if vision else None
    spec = _config_only(spec if layers is None else with_depth(spec, layers), size)
    task = resolve_task(config, spec)
    problems.lines.extend(packing_problems(config.packing, task, spec.hf_config))
    problems.lines.extend(task_fit_problems(config, spec, task))
    problems.raise_if_any(ConfigError)
    # Host batches and their item counts, made before any fake mode: counting reads label values.
    micro, per_rank = config.resolved_micro_batch_size, config.per_rank_batch  # one rank's share of a window
    counts = [min(micro, per_rank - start) for start in range(0, per_rank, micro)]
    if is_encoder_decoder(spec) and task != "causal-lm":
        windows = [[encoder_decoder_batch(spec, count, length, padded=padded, task=task,
                                          target_length=config.max_target_length or length) for count in counts]
                   for _ in range(steps)]
    else:
        windows = [[synthetic_batch(spec, count, length, padded=padded, causal=task == "causal-lm",
                                    packed=config.packing) for count in counts] for _ in range(steps)]
    if lean_warmup and steps > 1:  # step 1 only creates the optimizer state: one micro-batch does that
        windows[0] = windows[0][:1]
    return TraceInputs(profile=profile, spec=spec, precision=precision_name,
                       sequence_length=None if vision else length, image_size=size, windows=windows,
                       window_items=[sum(item_count(batch) for batch in window) for window in windows], task=task)


@quiet_transformers()
def estimate(config: TrainConfig, *, device: str | DeviceProfile = "cpu", seq_len: int | None = None,
             image_size: int | None = None, num_labels: int = 2, steps: int = 2, execute: bool = False,
             count_flops: bool = False, lean_warmup: bool = False, padded: bool = True,
             layers: int | None = None, exact_trace: bool = False, timeline: bool = False) -> Estimate:
    """Trace ``steps`` optimizer steps of ``config`` with fake tensors and return the predicted peak.

    ``count_flops=True`` also counts the FLOPs of the traced steps. ``lean_warmup=True`` runs the first step
    on one micro-batch only: that step exists to create the optimizer state (the steady-state peak is reached
    in step 2 and later), so the peak of a window of accumulation is the same for fewer ops. ``padded=False``
    when every text fills the sequence length (no micro-batch is ever padded, see :func:`synthetic_batch`).
    ``execute=True`` runs the very same steps on real CPU tensors instead (``device="cpu"`` only): the
    measurement the estimate is checked against. ``layers``: the same model with that many blocks.

    A model whose blocks repeat is traced as a copy a few blocks deep over the first micro-steps of each
    window, and the rest replayed (:mod:`memfit.memory.repeats`): the same numbers as the full trace, which
    ``exact_trace=True`` forces (``Estimate.trace`` says which ran, and why a shortened trace was refused).
    ``timeline=True``: the memory over the traced steps too (:attr:`Estimate.timeline`).
    """
    started = time.perf_counter()
    trace = prepare_trace(config, device=device, seq_len=seq_len, image_size=image_size, steps=steps,
                          lean_warmup=lean_warmup, padded=padded, layers=layers)
    if execute and trace.profile.kind != "cpu":
        raise ConfigError("execute=True measures on this machine's CPU; use device='cpu'")
    strategy = strategy_for(config, trace.profile)
    if strategy == "fsdp" and execute:
        raise ConfigError("execute=True measures one process; measure FSDP with torchrun (memfit train)")
    # before the trace consumes the windows; samples, not items (a causal LM's items are its labelled tokens)
    traced_samples = sum(len(batch["labels"]) for window in trace.windows for batch in window)
    traced_micro_steps = sum(len(window) for window in trace.windows)
    # fake tensors log each op they cannot run; the one line that follows says it once
    events: list[tuple[int, str | None]] | None = [] if timeline else None
    with model_support(trace.spec.hf_config), raised_loggers(FAKE_TENSOR_LOGGER, level=logging.CRITICAL):
        run = _run(config, trace, strategy, execute=execute, count_flops=count_flops, num_labels=num_labels,
                   exact_trace=exact_trace, timeline=events)
    tracker, profile = run.tracker, trace.profile
    extra = run.scaler_bytes + run.workspace_bytes
    peak = tracker.peak_bytes + extra
    breakdown = {name: tracker.peak_breakdown.get(name, 0) for name in CATEGORIES}
    breakdown["temporaries"] += run.scaler_bytes
    breakdown["workspaces"] += run.workspace_bytes
    peak_reserved = run.allocator.peak_reserved_bytes if run.allocator is not None else peak
    communicators = distributed.communicators(strategy, config.world_size, config.shard_group, profile.kind)
    outside = profile.non_pytorch_bytes + communicators * profile.communicator_bytes
    headroom = profile.memory_bytes - peak_reserved - outside if profile.kind == "cuda" else None
    phases = {name: value + extra for name, value in tracker.phase_peaks.items()}
    return Estimate(
        peak_bytes=peak, peak_reserved_bytes=peak_reserved, non_pytorch_bytes=outside, communicators=communicators,
        communicator_bytes=outside - profile.non_pytorch_bytes, communicator_measured=profile.communicator_measured,
        breakdown=breakdown, phases=phases, peak_phase=max(phases, key=lambda name: phases[name]),
        device=profile.name, device_memory_bytes=profile.memory_bytes,
        fits=None if headroom is None else headroom >= 0, headroom_bytes=headroom,
        micro_batch_size=config.resolved_micro_batch_size, accumulation_steps=config.resolved_accumulation_steps,
        sequence_length=trace.sequence_length, image_size=trace.image_size, precision=trace.precision,
        config=config.to_dict(), traced_ops=run.ops, phase_ops=run.phase_ops,
        flops=run.flops if count_flops else None, dequantized_bytes=run.dequantized_bytes if count_flops else None,
        trace=run.how,
        trainable_parameters=run.trainable, parameters=run.parameters, world_size=config.world_size,
        distributed=strategy, traced_micro_steps=traced_micro_steps, traced_samples=traced_samples,
        seconds=time.perf_counter() - started, **_host_figures(tracker, config, trace, strategy),
        timeline=None if events is None else timeline_record([(live + extra, phase) for live, phase in events]))


def _host_figures(tracker: StorageTracker, config: TrainConfig, trace: TraceInputs, strategy: str) -> dict[str, Any]:
    """The host's side of an estimate: the step's peak and what holds it, and the model's load."""
    low = Precision(trace.precision, "cpu").low_dtype
    return {"host_bytes": tracker.host_peak_bytes,
            "host_breakdown": {name: tracker.host_peak_breakdown.get(name, 0) for name in HOST_CATEGORIES},
            "load_host_bytes": load_host_bytes(config, trace.spec, trace.task, low, strategy=strategy,
                                               ranks=config.world_size if strategy != "none" else 1)}


@dataclass(kw_only=True, slots=True)
class _TracedRun:
    """What one traced (or executed) run of the steps leaves to read: the tracker's counts, and the bytes
    and FLOPs counted beside it."""

    tracker: StorageTracker
    allocator: CachingAllocatorModel | None
    scaler_bytes: int
    workspace_bytes: int
    trainable: int
    parameters: int
    ops: int = 0
    phase_ops: dict[str, int] = dataclasses.field(default_factory=dict)
    flops: int = 0
    """Matmul-class FLOPs, the emulated attention kernels' included."""
    dequantized_bytes: int = 0
    how: str = "full trace"


def _run(config: TrainConfig, trace: TraceInputs, strategy: str, *, execute: bool, count_flops: bool,
         num_labels: int, exact_trace: bool, timeline: list[tuple[int, str | None]] | None) -> _TracedRun:
    """The shortened trace replayed where the step repeats, else the full trace (saying why); ``timeline``: a
    list that receives (live bytes, phase) after every allocation and free of the (replayed) steps."""
    shortened, spaced = "full trace" if exact_trace or execute else shortened_trace(config, trace, strategy), False
    while isinstance(shortened, Shortened):
        try:
            replayed = _replayed(config, shortened, strategy, count_flops=count_flops, num_labels=num_labels,
                                 timeline=timeline)
        except NotRepeating as reason:
            if timeline is not None:
                timeline.clear()
            retry = after_refusal(config, trace, strategy, shortened, reason)
            spaced, shortened = isinstance(retry, Shortened) and retry.spacer and not shortened.spacer, retry
            continue
        if spaced:  # a copy with a spacer repeated where the one without did not
            needs_spacer(config, trace)
        return replayed
    run = _trace_steps(config, trace, strategy, execute=execute, count_flops=count_flops, num_labels=num_labels,
                       timeline=timeline)
    run.how = shortened
    return run


def _replayed(config: TrainConfig, shortened: Shortened, strategy: str, *, count_flops: bool,
              num_labels: int, timeline: list[tuple[int, str | None]] | None) -> _TracedRun:
    """Trace the shortened step with a recording tracker, expand its record to the full step and replay it
    through the accounting a full trace would have run (:mod:`memfit.memory.repeats`)."""
    blocks = shortened.depth.repeats if shortened.depth is not None else ()
    recorder = RecordingTracker(count_flops=count_flops, groups=blocks)
    try:
        run = _trace_steps(shortened.config, shortened.trace, strategy, execute=False, count_flops=count_flops,
                           num_labels=num_labels, recorder=recorder)
    finally:  # its storages' finalizers hold the recorder: it must not hold the model's blocks in turn
        recorder.blocks = []
    if recorder.unexpandable is not None:
        raise NotRepeating(recorder.unexpandable, buckets=recorder.spanning)
    events = recorder.events
    for window in shortened.windows:
        events = expand(events, MICRO, window)
    for group in blocks:  # the highest first: each renumbers only the blocks above it
        events = expand(events, BLOCK, group)
    tracker = StorageTracker(allocator=run.allocator)
    tracker.timeline = timeline
    replay(events, tracker)
    phases = {key[2] for key in recorder.ops if key[2] is not None}
    per_block = recorder.block_parameters
    grown = [sum(sum(per_block[owner - 1][i] for owner in range(group.first + group.period, group.last + 1))
                 * group.copies for group in blocks) for i in (0, 1)]
    return dataclasses.replace(
        run, tracker=tracker, ops=scaled(recorder.ops, blocks, shortened.windows),
        phase_ops={phase: scaled(Counter({k: v for k, v in recorder.ops.items() if k[2] == phase}), blocks,
                                 shortened.windows) for phase in sorted(phases)},
        flops=scaled(recorder.flops_by, blocks, shortened.windows),
        dequantized_bytes=scaled(recorder.dequantized_by, blocks, shortened.windows),
        trainable=run.trainable + grown[0], parameters=run.parameters + grown[1], how=shortened.how)


def _trace_steps(config: TrainConfig, trace: TraceInputs, strategy: str, *, execute: bool, count_flops: bool,
                 num_labels: int, recorder: RecordingTracker | None = None,
                 timeline: list[tuple[int, str | None]] | None = None) -> _TracedRun:
    """Build the model under fake tensors (real ones when ``execute``) and run the steps on ``trace``'s
    windows inside the tracker."""
    profile, windows = trace.profile, trace.windows
    precision = Precision(trace.precision, "cpu")  # traced with CPU autocast, CUDA differences emulated
    allocator = CachingAllocatorModel() if profile.kind == "cuda" else None
    tracker = recorder or StorageTracker(allocator=allocator, count_flops=count_flops)
    if recorder is None:
        tracker.timeline = timeline
    fake_mode = None if execute else BuildValuesFakeMode()
    if fake_mode is not None:  # one fake tensor per input, made up front: converting on use would copy it
        windows = [[{name: fake_mode.from_tensor(tensor) for name, tensor in batch.items()} for batch in window]
                   for window in windows]
    world = distributed.fake_world(config.world_size, config.shard_group) if strategy == "fsdp" else \
        contextlib.nullcontext()
    answers = None if execute else FakeAnswers(cuda=profile.kind == "cuda", memo=memo_enabled())
    with world as mesh, fake_mode or contextlib.nullcontext(), (
            contextlib.nullcontext() if execute else no_init_weights()), answers or contextlib.nullcontext():
        build = functools.partial(build_with_techniques, trace.spec, config,
                                  label_names=[str(i) for i in range(num_labels)], pad_token_id=TRACE_PAD,
                                  task=trace.task, low_dtype=precision.low_dtype,
                                  weights_dtype=precision.weights_dtype)
        model: torch.nn.Module = _built(build, fake_mode)
        model.train()
        trainable, total = count_parameters(model)
        emulation = CudaEmulation(profile.compute_capability) if profile.compute_capability else None
        if recorder is not None:
            recorder.mark_blocks(_blocks_of(model))
            if emulation is not None:
                recorder.attention_flops = functools.partial(getattr, emulation, "attention_flops")
        # an encoder-decoder's causal mask is its decoder's, never padded (memfit.data.seq2seq): all ones
        decoder_unpadded = is_encoder_decoder(trace.spec) and trace.task != "causal-lm"
        with _eos_answers(trace, windows, execute=execute), tracker, emulation or contextlib.nullcontext(), \
                known_masks(all_ones=decoder_unpadded, packed=config.packing):
            scaler_bytes, workspace_bytes = _persistent_bytes(model, config, precision, emulation, allocator)
            if strategy == "fsdp":  # sharded inside the tracker, as the engine shards a built model
                host = config.cpu_offload and not execute  # shards, gradients and optimizer on the host
                with tracker.paused() if host else contextlib.nullcontext():  # each shard made there
                    model = distributed.shard(model, mesh, low_precision=precision.low_dtype,
                                              cpu_offload=config.cpu_offload, pin_memory=execute)
                tracker.relabel_module(model)
                if host:
                    offloaded(tracker, model, hybrid=distributed.hybrid(config.world_size, config.shard_group))
            with answers.memoising() if answers is not None else contextlib.nullcontext():  # the step's ops
                run_steps(model, config, precision, windows, trace.window_items, device=torch.device("cpu"),
                          phases=tracker, tracker=tracker, read=read_values if execute else assume_finite,
                          cuda=profile.kind == "cuda", world_size=config.world_size if strategy == "fsdp" else 1,
                          persistent_grads=strategy == "ddp")
            if isinstance(tracker.host_shards, HostShards):
                tracker.host_shards.check()
    attention_flops = emulation.attention_flops if emulation is not None else 0
    return _TracedRun(tracker=tracker, allocator=allocator, scaler_bytes=scaler_bytes, workspace_bytes=workspace_bytes,
                      trainable=trainable, parameters=total, ops=tracker.op_count, phase_ops=dict(tracker.phase_ops),
                      flops=tracker.flops + attention_flops, dequantized_bytes=tracker.dequantized_bytes)


def _blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks a recording tracker marks; none where the model has none (then only micro-steps)."""
    try:
        return list(transformer_layers(model))
    except ConfigError:
        return []


def _eos_answers(trace: TraceInputs, windows: list[list[Batch]], *,
                 execute: bool) -> contextlib.AbstractContextManager[Any]:
    """An encoder-decoder classification head's end-of-sequence questions on the fake inputs, answered as the
    real batches answer them (:func:`memfit.memory.mask_values.known_eos`; entered below the tracker, which then
    sees the real kernels' outputs). Real tensors (``execute``) and other models need no answer."""
    eos = None if execute else classification_eos(trace.spec, trace.task)
    if eos is None:
        return contextlib.nullcontext()
    return known_eos(eos, [batch["input_ids"] for window in windows for batch in window])


def _built(build: Callable[[], torch.nn.Module], fake_mode: BuildValuesFakeMode | None) -> torch.nn.Module:
    """The model, built as is; a constructor that reads values it computed from the config (ConvNeXt's
    drop-path rates) is built again with those values known (:meth:`BuildValuesFakeMode.building`), which
    only such models need."""
    try:
        return build()
    except DataDependentOutputException:
        if fake_mode is None:
            raise
    with fake_mode.building():
        return build()


def run_steps(model: torch.nn.Module, config: TrainConfig, precision: Precision, windows: list[list[Batch]],
              window_items: list[int], *, device: torch.device, phases: PhaseTracker,
              tracker: StorageTracker | None = None, scaler: torch.amp.GradScaler | None = None,
              read: Callable[[torch.Tensor, torch.Tensor], tuple[float, float]] = read_values,
              cuda: bool = False, after_step: Callable[[int], None] | None = None, world_size: int = 1,
              persistent_grads: bool = False, offload: ActivationOffload | None = None) -> None:
    """The engine's window and optimizer step, once per window, on ``device``.

    The estimator runs it on fake tensors (``read=assume_finite``) with ``tracker`` attributing storages to
    categories; ``benchmarks/validate_estimator.py`` runs it on a real card. ``cuda``: the step runs (or is
    traced for) a CUDA device, where torch defaults to foreach optimizer kernels and Adam's step counters live
    on the host (unless the optimizer is fused or capturable), so the tracker does not count them.
    ``after_step(i)`` runs after step ``i`` (from 1), e.g. to reset peak statistics after a warm-up.

    ``world_size > 1``: ``model`` is sharded (FSDP2 over a fake process group) and the window is one rank's;
    gradients are reduced as the engine reduces them (:func:`memfit.distributed.micro_step_sync`).
    ``persistent_grads``: DDP's gradient buckets, which hold every trainable gradient for the whole run.
    ``offload``: the activation offload of ``config.offload_activations`` (made here when not given; a caller
    that measures its host bytes passes its own).
    """
    phases.track_module(model)
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    sync: Callable[[bool], contextlib.AbstractContextManager[None]] | None = None
    if world_size > 1:
        sync = distributed.micro_step_sync(model, every=config.reduce_every_micro_step)
    buckets = DdpBuckets(trained, phases, tracker) if persistent_grads else None
    if buckets is not None:
        sync = buckets.sync
    if tracker is not None:
        label_gradients(tracker, [parameter for _, parameter in trained])
    # torch defaults to foreach kernels for CUDA parameters, to a loop on CPU
    optimizer = traced_optimizer(model, config, tracker, cuda=cuda, fake=read is assume_finite)
    if config.offload_activations and offload is None:
        offload = ActivationOffload()
    if offload is not None and tracker is not None:  # the host copies are the target's host's
        offload.host_context = functools.partial(tracker.elsewhere, "offloaded_activations")
    scheduler = build_scheduler(optimizer, total_steps=len(windows), warmup_ratio=config.warmup_ratio)
    for step in range(1, len(windows) + 1):
        micro_batches = windows.pop(0)  # dropped after its step, as the engine drops a window's batches
        items = window_items.pop(0)
        if world_size > 1:  # the engine's stop agreement before each window
            distributed.any_rank(False, device)
        window_loss, _ = accumulate_window(model, micro_batches, items,
                                           precision=precision, scaler=scaler, device=device, phases=phases,
                                           sync=sync, loss_chunk=config.loss_chunk, saved_tensors=offload)
        del micro_batches  # the engine's window runner drops its batches before the optimizer step
        if world_size > 1:
            window_loss = distributed.mean_over_ranks(window_loss)
            if tracker is not None:  # FSDP2 sets the reduced shard as .grad (no accumulate-grad hook runs)
                tracker.relabel([p.grad for _, p in trained if p.grad is not None], "gradients")
        optimizer_step(optimizer, trained, window_loss, scaler=scaler, max_grad_norm=config.max_grad_norm,
                       scheduler=scheduler, phases=phases, read=read,
                       after_update=None if tracker is None else functools.partial(
                           label_optimizer_state, tracker, optimizer,
                           host_step_counters=(cuda and not optimizer.defaults.get("fused"))
                           or (config.cpu_offload and world_size > 1)))
        del window_loss
        if after_step is not None:
            after_step(step)
    del buckets


def traced_optimizer(model: torch.nn.Module, config: TrainConfig, tracker: StorageTracker | None, *, cuda: bool,
                     fake: bool) -> torch.optim.Optimizer:
    """The run's optimizer, with what ``tracker`` must see elsewhere than on the card pointed there: an
    offloaded optimizer's copies, state and update (the host's), a paged optimizer's big states (CUDA unified
    memory, which pages to the host). ``fake``: gradients hold no values, so a step in backward takes the
    branch that updates."""
    optimizer = build_optimizer_for(model, config, foreach_default=cuda)
    if isinstance(optimizer, InBackwardOptimizer) and fake:
        optimizer.check = assume_finite_gradient
    if tracker is None:
        return optimizer
    if isinstance(optimizer, OffloadedOptimizer):
        optimizer.host_context = functools.partial(tracker.elsewhere, "offloaded_optimizer")
    for each in optimizer.per_parameter.values() if isinstance(optimizer, InBackwardOptimizer) else [optimizer]:
        if hasattr(each, "paged_context"):
            each.paged_context = functools.partial(tracker.elsewhere, "paged_optimizer")
    return optimizer


def strategy_for(config: TrainConfig, profile: DeviceProfile, budget_bytes: int | None = None) -> str:
    """The strategy a distributed config runs: ``auto`` is FSDP when one rank's replica does not fit
    ``budget_bytes`` (default: the card's memory; DDP where there is no fixed budget, as on CPU, and with an
    8-bit optimizer, whose step does not run on FSDP's sharded parameters)."""
    if config.distributed != "auto":
        return config.distributed
    budget = budget_bytes or (profile.memory_bytes if profile.kind == "cuda" else None)
    if budget is None or not runs_sharded(config.optimizer):
        return "ddp"
    replica = estimate(distributed.replica_config(config), device=profile)
    return "ddp" if replica.total_bytes <= budget else "fsdp"


def resolve_strategy(config: TrainConfig, device: Device) -> str:
    """The strategy a run on ``device`` trains with: ``auto`` is FSDP when one rank's replica (estimated)
    would not fit the run's memory budget, else DDP."""
    if config.distributed != "auto":
        return config.distributed
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return strategy_for(config, profile_for(device), config.emulate_budget_bytes)


def _config_only(spec: ModelSpec, image_size: int | None) -> ModelSpec:
    """The same architecture without weights (values are irrelevant to memory), at the requested image size."""
    if image_size is not None:
        spec = with_image_size(spec, image_size)
    return dataclasses.replace(spec, weights_dir=None)


def _persistent_bytes(model: torch.nn.Module, config: TrainConfig, precision: Precision,
                      emulation: CudaEmulation | None, allocator: CachingAllocatorModel | None) -> tuple[int, int]:
    """(GradScaler state, cuBLAS workspaces): made in the first step and kept, so counted from the start.

    The scaler's four one-element tensors exist from the first backward (fp16); the workspaces from the first
    forward and backward (CUDA targets, :func:`memfit.memory.emulation.cublas_workspaces`)."""
    scaler_bytes = sum(allocator.allocate(-1 - key, 4) if allocator is not None else 4
                       for key in range(SCALER_TENSORS if precision.uses_scaler else 0))
    workspace_bytes = cublas_workspace_bytes(model, emulation, allocator, recompute=config.checkpointing != "none")
    return scaler_bytes, workspace_bytes
