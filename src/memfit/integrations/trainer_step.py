"""The step a ``transformers.Trainer`` runs, traced with fake tensors: what :class:`MemfitCallback` predicts.

Not memfit's engine step but the Trainer's own code, on the Trainer's own model and collator:

- the batch: the collator's batch of the ``per_device_train_batch_size`` longest training examples (the
  widest batch it will build), once per micro-step of a window, all alive through the window as the Trainer
  prefetches them (``get_batch_samples``), with its ``num_items_in_batch``, and one more: accelerate's
  dataloader holds the next batch while it yields the current one. The examples are read as Trainer's
  dataloader reads them (:func:`~memfit.integrations.trainer_compat.training_data`): a ``datasets.Dataset``
  without its unused columns, its ``input_ids`` column read once for the lengths; any other map-style
  dataset in one pass over its examples, only the longest kept; a stream (an ``IterableDataset``, torch's or
  ``datasets``') from its first window of examples only, which the estimate then says;
- the model: the Trainer's (wrapped) model with every parameter and buffer swapped for a fake tensor of the
  same shape, dtype and ``requires_grad`` for the trace, so checkpointing, PEFT adapters, frozen weights and
  accelerate's autocast wrapper are the run's; a bitsandbytes 4-bit weight (QLoRA: the model loaded with
  ``BitsAndBytesConfig(load_in_4bit=True)``) keeps a fake copy of its quantisation state, so its layers
  dequantise in the trace as they do in the run;
- ``Trainer.training_step`` for each micro-batch, Trainer's gradient clipping and the optimizer that
  ``Trainer.create_optimizer`` builds from ``args.optim``, stepped twice: the second step is the steady
  state (the optimizer's state exists), and its peak is the prediction. A GradScaler (fp16) is the trace's
  own, unscaling and updating once per window as the run's does: the run's scaler is never touched.

On a CUDA target (the Trainer runs on a card, or ``profile`` names one) the trace runs on CPU fake tensors
with memfit's CUDA emulation and caching-allocator model (:mod:`memfit.memory.emulation`), autocast on the
trace device in place of accelerate's CUDA one (found on the module under a DDP wrapper too), as
``memfit estimate`` traces a card. Nothing of the real model or optimizer changes: the fake tensors are swapped
back out when the trace ends. :class:`StepSetup` traces another setup of the same Trainer (a plan's advice).
"""

from __future__ import annotations

import contextlib
import copy
import heapq
import itertools
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from memfit.devices import DeviceProfile
from memfit.errors import ConfigError
from memfit.integrations import trainer_compat as compat
from memfit.memory.allocator import CachingAllocatorModel
from memfit.memory.emulation import CudaEmulation, cublas_workspace_bytes
from memfit.memory.estimate import CATEGORIES, StepPeak
from memfit.memory.fake_answers import FakeAnswers
from memfit.memory.mask_values import known_masks
from memfit.memory.tracker import StorageTracker, label_gradients, label_optimizer_state
from memfit.quiet import raised_loggers

STEPS = 2
"""Optimizer steps traced: the first makes the optimizer's state, the second is the steady state."""


@dataclass(kw_only=True, slots=True)
class TrainerStepEstimate(StepPeak):
    """The predicted peak of a Trainer's training step (the steady state: optimizer step 2 on)."""

    micro_batch_size: int
    accumulation_steps: int
    sequence_length: int
    precision: str
    optimizer: str
    streamed_examples: int = 0
    """0: the widest batch of the whole dataset; else the training data is a stream, and the batch is the
    widest of its first window of this many examples (a wider batch later needs more)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepSetup:
    """A setup to trace in place of the Trainer's own arguments (a plan's advice, checked on Trainer's step)."""

    micro_batch_size: int
    accumulation_steps: int
    optim: str
    """A ``TrainingArguments.optim`` name."""
    checkpoint_every: int | None
    """Checkpoint every layer (1), one layer in this many, or none (``None``)."""
    frozen_dtype: torch.dtype | None = None
    """The frozen float weights of Linear and embedding layers stored in this dtype (a LoRA plan's 16-bit
    base, :func:`memfit.techniques.lora.store_frozen`); ``None``: as they are."""


@dataclass(frozen=True, slots=True)
class WidestBatch:
    tensors: dict[str, torch.Tensor]
    unpadded: bool
    """No batch is ever padded: every example seen as long, the widest batch's mask all ones."""
    streamed_examples: int
    """0, or the examples of a stream's first window it was chosen from."""


def widest_batch(trainer: Any, args: Any = None) -> WidestBatch:
    """The collator's batch of the ``per_device_train_batch_size`` longest training examples (of ``args``,
    default the Trainer's): the widest batch the Trainer will build. Its dataloader is not touched, so the
    run's data order stays the same; a stream is read from its start by an iterator of its own."""
    args = args or trainer.args
    dataset, collator = compat.training_data(trainer)
    if dataset is None:
        raise ConfigError("the Trainer has no train_dataset: memfit estimates the training step from its examples")
    count = args.per_device_train_batch_size
    streamed = 0
    if isinstance(dataset, torch.utils.data.IterableDataset):
        window = itertools.islice(iter(dataset), count * args.gradient_accumulation_steps)
        examples, lengths = _longest(enumerate(window), count)
        streamed = len(lengths)
    elif "input_ids" in (getattr(dataset, "column_names", None) or ()):  # a datasets.Dataset: one column
        all_lengths = [len(ids) for ids in dataset["input_ids"]]
        chosen = heapq.nsmallest(count, range(len(all_lengths)), key=lambda index: (-all_lengths[index], index))
        examples, lengths = [dataset[index] for index in chosen], all_lengths
    else:
        examples, lengths = _longest(((index, dataset[index]) for index in range(len(dataset))), count)
    if not examples:
        raise ConfigError("the Trainer's train_dataset is empty: nothing to estimate")
    batch = collator(examples)
    mask = batch.get("attention_mask")
    unpadded = len(set(lengths)) == 1 and (not isinstance(mask, torch.Tensor) or bool(mask.all()))
    tensors = {name: value for name, value in batch.items() if isinstance(value, torch.Tensor)}
    return WidestBatch(tensors, unpadded, streamed)


def _longest(examples: Iterable[tuple[int, Any]], count: int) -> tuple[list[Any], list[int]]:
    """The ``count`` longest of ``examples`` ((index, example) pairs; the first of equally long ones), longest
    first, read in one pass that keeps no others; and the length of every example seen."""
    kept: list[tuple[int, int, Any]] = []  # (length, -index, example): the shortest kept first
    lengths: list[int] = []
    for index, example in examples:
        length = _length(example)
        lengths.append(length)
        if len(kept) < count:
            heapq.heappush(kept, (length, -index, example))
        elif (length, -index) > kept[0][:2]:
            heapq.heapreplace(kept, (length, -index, example))
    return [example for _, _, example in sorted(kept, key=lambda item: item[:2], reverse=True)], lengths


def _length(example: Any) -> int:
    """An example's length: of its ``input_ids``, else of its longest field (0 for an example not a mapping)."""
    if not isinstance(example, Mapping):
        return 0
    if example.get("input_ids") is not None:
        return _size(example["input_ids"])
    return max((_size(value) for value in example.values()), default=0)


def _size(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        return len(value)
    shape = getattr(value, "shape", None)  # a tensor or an array
    return int(shape[0]) if shape else 0


def trace_trainer_step(trainer: Any, profile: DeviceProfile, setup: StepSetup | None = None) -> TrainerStepEstimate:
    """Trace ``trainer``'s training step for ``profile`` (see the module docstring); ``setup``: another
    setup's arguments in place of the Trainer's own."""
    args = trainer.args if setup is None else _arguments_of(trainer.args, setup)
    model: nn.Module = trainer.model_wrapped
    if any(type(module).__name__ == "Linear8bitLt" for module in model.modules()):
        raise ConfigError("the Trainer's model has 8-bit (bitsandbytes) weights, whose layers keep their int8 state "
                          "outside the weights: memfit traces 4-bit QLoRA models, not 8-bit ones; estimate it with "
                          "memfit estimate --lora-rank R --quantize-base int8")
    widest = widest_batch(trainer, args)
    batch = widest.tensors
    accumulation = args.gradient_accumulation_steps
    with _disable_current_modes():
        num_items = compat.items_in_window(trainer, [batch] * accumulation)
    cuda = profile.kind == "cuda"
    allocator = CachingAllocatorModel() if cuda else None
    tracker = StorageTracker(allocator=allocator)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        fakes = _fake_tensors(model, frozen_dtype=setup.frozen_dtype if setup is not None else None)
        tr_loss = torch.zeros(())  # the Trainer's running loss, made before its first step
    emulation = CudaEmulation(profile.compute_capability) if cuda and profile.compute_capability else None
    saved = _bookkeeping(trainer)
    trainer.optimizer = None
    trainer.args = args
    try:
        # fake tensors log each op they cannot run; the error that follows says it once
        with raised_loggers("torch._subclasses.fake_tensor", level=logging.CRITICAL), fake_mode, \
                _reparametrize_module(model, fakes, tie_weights=True), \
                _on_trace_device(model, trainer, cuda=trainer.args.device.type == "cuda"), \
                _checkpointing(model, setup), known_masks(all_ones=widest.unpadded), FakeAnswers(cuda=cuda), \
                _own_scaler(trainer) as scaler, tracker, \
                emulation or contextlib.nullcontext(), _PlaceholderReads():
            workspace_bytes = cublas_workspace_bytes(model, emulation, allocator, recompute=_recomputes(model))
            _run(trainer, model, batch, num_items, tr_loss, tracker, fake_mode, scaler, cuda=cuda)
    finally:
        _restore(trainer, saved)
    peak = tracker.peak_bytes + workspace_bytes
    phases = {name: value + workspace_bytes for name, value in tracker.phase_peaks.items()}
    breakdown = {name: tracker.peak_breakdown.get(name, 0) for name in CATEGORIES}
    breakdown["workspaces"] += workspace_bytes
    precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    ids = batch.get("input_ids")
    return TrainerStepEstimate(
        peak_bytes=peak, peak_reserved_bytes=allocator.peak_reserved_bytes if allocator is not None else peak,
        non_pytorch_bytes=profile.non_pytorch_bytes, breakdown=breakdown, phases=phases,
        peak_phase=max(phases, key=lambda name: phases[name]), device=profile.name,
        micro_batch_size=int(next(iter(batch.values())).shape[0]), accumulation_steps=accumulation,
        sequence_length=int(ids.shape[-1]) if ids is not None else 0, precision=precision,
        optimizer=getattr(args.optim, "value", str(args.optim)), streamed_examples=widest.streamed_examples)


def _arguments_of(args: Any, setup: StepSetup) -> Any:
    """A copy of the Trainer's ``args`` with ``setup``'s batch split and optimizer."""
    from transformers.training_args import OptimizerNames

    changed = copy.copy(args)
    changed.per_device_train_batch_size = setup.micro_batch_size
    changed.gradient_accumulation_steps = setup.accumulation_steps
    changed.optim = OptimizerNames(setup.optim)
    return changed


def _checkpointing(model: nn.Module, setup: StepSetup | None) -> contextlib.AbstractContextManager[None]:
    return compat.checkpointing_as(model, setup.checkpoint_every) if setup is not None \
        else contextlib.nullcontext()


def _recomputes(model: nn.Module) -> bool:
    """Whether any layer of ``model`` is checkpointed (its forward recomputed in backward)."""
    return any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())


def _bookkeeping(trainer: Any) -> dict[str, tuple[Any, Any]]:
    """What the traced step may change on ``trainer``, to put back after it: which object each attribute names
    (the optimizer, TRL's token count: rebound) and the contents of its dicts (TRL's metric lists, appended
    to in ``compute_loss``), a list inside a dict kept as a list of the same items. Nothing else is copied: a
    dataset or a list attribute stays the one object it is."""
    return {name: (value, _contents(value)) for name, value in vars(trainer).items()}


def _contents(value: Any, *, nested: bool = False) -> Any:
    if isinstance(value, dict):
        return [(key, item, _contents(item, nested=True)) for key, item in value.items()]
    return list(value) if nested and isinstance(value, list) else None


def _put_back(value: Any, contents: Any) -> None:
    if contents is None:
        return
    if isinstance(value, dict):
        value.clear()
        for key, item, inner in contents:
            _put_back(item, inner)
            value[key] = item
    else:
        value[:] = contents


def _restore(trainer: Any, saved: dict[str, tuple[Any, Any]]) -> None:
    for name in [name for name in vars(trainer) if name not in saved]:
        del vars(trainer)[name]
    for name, (value, contents) in saved.items():
        _put_back(value, contents)
        vars(trainer)[name] = value


class _PlaceholderReads(TorchDispatchMode):
    """A value read from a fake tensor (``.item()``, ``bool()``) is 1 (``True``, ``1.0``): the step's metrics
    and checks read values that a trace has not; what they compute is restored afterwards
    (:func:`_bookkeeping`), and the memory of the step does not depend on them."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            dtype = args[0].dtype
            return True if dtype == torch.bool else 1.0 if dtype.is_floating_point else 1
        return func(*args, **(kwargs or {}))


def _fake_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A new tensor of each of ``batch``'s shapes (fake inside the trace: no values, no memory)."""
    return {name: _fake_like(tensor) for name, tensor in batch.items()}


def _fake_tensors(model: nn.Module, *, frozen_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A fake CPU tensor per parameter (a parameter, with its ``requires_grad``) and buffer of ``model``. A
    bitsandbytes 4-bit weight's fake keeps a fake copy of its quantisation state (the scales its forward and
    backward dequantise with), so the QLoRA layers run as they do on the real weights. ``frozen_dtype``: the
    frozen fp32 weights of Linear and embedding layers are faked in it."""
    stored = frozen_weights(model) if frozen_dtype is not None else set()
    fakes: dict[str, torch.Tensor] = {}
    for name, parameter in model.named_parameters():
        dtype = frozen_dtype if name in stored else None
        fake = nn.Parameter(_fake_like(parameter, dtype=dtype), requires_grad=parameter.requires_grad)
        state = getattr(parameter, "quant_state", None)
        if state is not None:
            fake.quant_state = _fake_quant_state(state)  # type: ignore[attr-defined]
        fakes[name] = fake
    for name, buffer in model.named_buffers():
        fakes[name] = _fake_like(buffer)
    return fakes


def frozen_weights(model: nn.Module) -> set[str]:
    """Names of the frozen fp32 parameters that :func:`memfit.techniques.lora.store_frozen` stores in 16 bits
    (Linear and embedding weights, a MoE block's stacked experts)."""
    from memfit.techniques.lora import stored_in_16_bits

    return {f"{prefix}.{name}" if prefix else name for prefix, module in model.named_modules()
            for name, parameter in module.named_parameters(recurse=False)
            if stored_in_16_bits(module, name, parameter)}


def _fake_like(tensor: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=dtype or tensor.dtype)


def _fake_quant_state(state: Any) -> Any:
    """A copy of a bitsandbytes ``QuantState`` whose tensors (and its nested state's) are fakes."""
    fake = copy.copy(state)
    for name in ("absmax", "code", "offset"):
        if isinstance(getattr(state, name, None), torch.Tensor):
            setattr(fake, name, _fake_like(getattr(state, name)))
    if getattr(state, "state2", None) is not None:
        fake.state2 = _fake_quant_state(state.state2)
    return fake


@contextlib.contextmanager
def _on_trace_device(model: nn.Module, trainer: Any, *, cuda: bool) -> Iterator[None]:
    """A Trainer on a card runs its step on CPU fake tensors for the trace: its inputs stay where the trace
    runs (``_prepare_input`` would move them to the card), and accelerate's CUDA autocast wrapper is rebuilt
    with the trace device's autocast (memfit's emulation makes up the difference between the two)."""
    if not cuda:
        yield
        return
    with compat.inputs_where_they_are(trainer), trace_autocast(model, trainer.accelerator.mixed_precision):
        yield


@contextlib.contextmanager
def trace_autocast(model: nn.Module, mixed_precision: str) -> Iterator[None]:
    """Accelerate's autocast wrapper of ``model`` (on the module under a DDP or DataParallel wrapper too)
    rebuilt with CPU autocast of the same dtype while inside; nothing without one or without fp16/bf16."""
    holder = compat.autocast_holder(model)
    wrapped = vars(holder).get("forward")  # accelerate's wrapper, an attribute of the instance
    original = compat.original_forward(holder)
    if wrapped is None or original is None or mixed_precision not in ("fp16", "bf16"):
        yield
        return
    from accelerate.utils import convert_outputs_to_fp32

    dtype = torch.float16 if mixed_precision == "fp16" else torch.bfloat16
    holder.forward = convert_outputs_to_fp32(torch.autocast("cpu", dtype=dtype)(original))
    try:
        yield
    finally:
        holder.forward = wrapped


@contextlib.contextmanager
def _own_scaler(trainer: Any) -> Iterator[torch.amp.GradScaler | None]:
    """Where the run scales its fp16 loss (accelerate's ``GradScaler``), the trace's own scaler in its place
    while inside (on the trace device): the trace's backward, clipping and step go through it, and the run's
    scaler keeps its state (its per-optimizer stages, its scale) untouched; ``None`` without one."""
    accelerator: Any = getattr(trainer, "accelerator", None)
    real = getattr(accelerator, "scaler", None)
    if real is None:
        yield None
        return
    own = torch.amp.GradScaler("cpu")
    accelerator.scaler = own
    try:
        yield own
    finally:
        accelerator.scaler = real


class _Phases:
    """forward from the model's forward pre-hook to its forward hook, backward from there to the end of the
    micro-step (with checkpointing, recomputation runs inside the layers, not through these hooks)."""

    def __init__(self, tracker: StorageTracker) -> None:
        self.tracker = tracker
        self.current: contextlib.AbstractContextManager[None] | None = None

    def enter(self, name: str) -> None:
        self.leave()
        self.current = self.tracker.phase(name)
        self.current.__enter__()

    def leave(self) -> None:
        if self.current is not None:
            self.current.__exit__(None, None, None)
            self.current = None


def _run(trainer: Any, model: nn.Module, batch: dict[str, torch.Tensor], num_items: Any, tr_loss: torch.Tensor,
         tracker: StorageTracker, fake_mode: FakeTensorMode, scaler: torch.amp.GradScaler | None, *,
         cuda: bool) -> None:
    """The Trainer's loop body for :data:`STEPS` windows, on the fake model inside ``tracker``."""
    tracker.track_module(model)
    label_gradients(tracker, [p for p in model.parameters() if p.requires_grad])
    phases = _Phases(tracker)
    hooks = [model.register_forward_pre_hook(lambda *_: phases.enter("forward")),
             model.register_forward_hook(lambda *_: phases.enter("backward"))]
    fake_items = fake_mode.from_tensor(num_items) if isinstance(num_items, torch.Tensor) else num_items
    if isinstance(fake_items, torch.Tensor):  # the window's count, alive through it as the run's is
        tracker.track(fake_items, category="inputs")
    optimizer = trainer.create_optimizer(getattr(trainer.accelerator, "unwrap_model", lambda m: m)(model))
    # the loop's variables that outlive their statement: the last micro-step's loss, the last clip's norm
    step_loss = grad_norm = None
    # accelerate's dataloader fetches one batch ahead of the one it yields: one more batch is always alive
    ahead = _fake_batch(batch)
    tracker.relabel(list(ahead.values()), "inputs")
    try:
        for step in range(1, STEPS + 1):
            window = [_fake_batch(batch) for _ in range(trainer.args.gradient_accumulation_steps)]
            tracker.relabel([t for micro in window for t in micro.values()], "inputs")
            for inputs in window:
                step_loss = trainer.training_step(model, inputs, fake_items)
                tr_loss += step_loss
                phases.leave()
            with tracker.phase("optimizer"):
                if scaler is not None:  # the run's scaler.step unscales first (or clipping did, through accelerate)
                    scaler.unscale_(optimizer)
                if trainer.args.max_grad_norm > 0:
                    grad_norm = compat.clip_gradients(trainer, model)
                optimizer.step()  # the run's scaler.step runs it, unless it found an inf: not readable here
                if scaler is not None:
                    scaler.update()
                label_optimizer_state(tracker, optimizer, host_step_counters=cuda and not
                                      optimizer.defaults.get("fused"))
                model.zero_grad()
            del window
            if step == 1:
                tracker.reset_peaks()
    finally:
        phases.leave()
        for hook in hooks:
            hook.remove()
        del step_loss, grad_norm, ahead
