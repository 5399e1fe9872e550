"""The step a ``transformers.Trainer`` runs, traced with fake tensors: what :class:`MemfitCallback` predicts.

Not memfit's engine step but the Trainer's own code, on the Trainer's own model and collator:

- the batch: the collator's batch of the ``per_device_train_batch_size`` longest training examples (the
  widest batch it will build), once per micro-step of a window, all alive through the window as the Trainer
  prefetches them (``get_batch_samples``), with its ``num_items_in_batch``, and one more: accelerate's
  dataloader holds the next batch while it yields the current one;
- the model: the Trainer's (wrapped) model with every parameter and buffer swapped for a fake tensor of the
  same shape, dtype and ``requires_grad`` for the trace, so checkpointing, PEFT adapters, frozen weights and
  accelerate's autocast wrapper are the run's; a bitsandbytes 4-bit weight (QLoRA: the model loaded with
  ``BitsAndBytesConfig(load_in_4bit=True)``) keeps a fake copy of its quantisation state, so its layers
  dequantise in the trace as they do in the run;
- ``Trainer.training_step`` for each micro-batch, ``Trainer._clip_grad_norm`` and the optimizer that
  ``Trainer.create_optimizer`` builds from ``args.optim``, stepped twice: the second step is the steady
  state (the optimizer's state exists), and its peak is the prediction.

On a CUDA target (the Trainer runs on a card, or ``profile`` names one) the trace runs on CPU fake tensors
with memfit's CUDA emulation and caching-allocator model (:mod:`memfit.memory.emulation`), autocast on the
trace device in place of accelerate's CUDA one, as ``memfit estimate`` traces a card. Nothing of the real
model or optimizer changes: the fake tensors are swapped back out when the trace ends.
"""

from __future__ import annotations

import collections
import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from memfit.devices import DeviceProfile
from memfit.errors import ConfigError
from memfit.memory.allocator import CachingAllocatorModel
from memfit.memory.emulation import CudaEmulation
from memfit.memory.estimate import CATEGORIES, StepPeak, cublas_workspace_bytes, label_gradients, label_optimizer_state
from memfit.memory.mask_values import known_masks
from memfit.memory.tracker import StorageTracker

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


def widest_batch(trainer: Any) -> tuple[dict[str, torch.Tensor], bool]:
    """The collator's batch of the ``per_device_train_batch_size`` longest training examples: the widest
    batch the Trainer will build (its dataloader is not touched, so the run's data order stays the same);
    and whether no batch is ever padded (every example as long, the widest batch's mask all ones)."""
    dataset = trainer.train_dataset
    if dataset is None:
        raise ConfigError("the Trainer has no train_dataset: memfit estimates the training step from its examples")
    dataset = trainer._remove_unused_columns(dataset, description="training")
    lengths = [len(ids) for ids in (dataset["input_ids"] if hasattr(dataset, "column_names")
                                    else (example["input_ids"] for example in dataset))]
    if not lengths:
        raise ConfigError("the Trainer's train_dataset is empty: nothing to estimate")
    count = min(trainer.args.per_device_train_batch_size, len(lengths))
    longest = sorted(range(len(lengths)), key=lambda index: -lengths[index])[:count]
    batch = trainer.data_collator([dataset[index] for index in longest])
    mask = batch.get("attention_mask")
    unpadded = len(set(lengths)) == 1 and (not isinstance(mask, torch.Tensor) or bool(mask.all()))
    return {name: value for name, value in batch.items() if isinstance(value, torch.Tensor)}, unpadded


def trace_trainer_step(trainer: Any, profile: DeviceProfile) -> TrainerStepEstimate:
    """Trace ``trainer``'s training step for ``profile`` (see the module docstring)."""
    args = trainer.args
    model: nn.Module = trainer.model_wrapped
    if any(type(module).__name__ == "Linear8bitLt" for module in model.modules()):
        raise ConfigError("the Trainer's model has 8-bit (bitsandbytes) weights, whose layers keep their int8 state "
                          "outside the weights: memfit traces 4-bit QLoRA models, not 8-bit ones; estimate it with "
                          "memfit estimate --lora-rank R --quantize-base int8")
    batch, unpadded = widest_batch(trainer)
    accumulation = args.gradient_accumulation_steps
    with _disable_current_modes():
        num_items = trainer._get_num_items_in_batch([batch] * accumulation, torch.device("cpu"))
    cuda = profile.kind == "cuda"
    allocator = CachingAllocatorModel() if cuda else None
    tracker = StorageTracker(allocator=allocator)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        fakes = _fake_tensors(model)
        tr_loss = torch.zeros(())  # the Trainer's running loss, made before its first step
    emulation = CudaEmulation(profile.compute_capability) if cuda and profile.compute_capability else None
    saved = _bookkeeping(trainer)
    trainer.optimizer = None
    try:
        with fake_mode, _reparametrize_module(model, fakes, tie_weights=True), \
                _on_trace_device(model, trainer, cuda=trainer.args.device.type == "cuda"), \
                known_masks(all_ones=unpadded), \
                tracker, emulation or contextlib.nullcontext(), _PlaceholderReads():
            workspace_bytes = cublas_workspace_bytes(model, emulation, allocator,
                                                     recompute=args.gradient_checkpointing)
            _run(trainer, model, batch, num_items, tr_loss, tracker, fake_mode, cuda=cuda)
    finally:
        vars(trainer).update(saved)
    peak = tracker.peak_bytes + workspace_bytes
    phases = {name: value + workspace_bytes for name, value in tracker.phase_peaks.items()}
    breakdown = {name: tracker.peak_breakdown.get(name, 0) for name in CATEGORIES}
    breakdown["workspaces"] += workspace_bytes
    precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    return TrainerStepEstimate(
        peak_bytes=peak, peak_reserved_bytes=allocator.peak_reserved_bytes if allocator is not None else peak,
        non_pytorch_bytes=profile.non_pytorch_bytes, breakdown=breakdown, phases=phases,
        peak_phase=max(phases, key=lambda name: phases[name]), device=profile.name,
        micro_batch_size=int(next(iter(batch.values())).shape[0]), accumulation_steps=accumulation,
        sequence_length=int(batch["input_ids"].shape[-1]), precision=precision,
        optimizer=getattr(args.optim, "value", str(args.optim)))


def _bookkeeping(trainer: Any) -> dict[str, Any]:
    """Copies of what the traced step may change on ``trainer``: its optimizer and its counters and metric
    lists (TRL's trainers append token counts and accuracies in ``compute_loss``), restored after the trace."""
    kept = (int, float, dict, list)
    return {"optimizer": trainer.optimizer, **{name: copy.deepcopy(value) for name, value in vars(trainer).items()
                                               if type(value) in kept or isinstance(value, collections.defaultdict)}}


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


def _fake_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """A fake CPU tensor per parameter (a parameter, with its ``requires_grad``) and buffer of ``model``. A
    bitsandbytes 4-bit weight's fake keeps a fake copy of its quantisation state (the scales its forward and
    backward dequantise with), so the QLoRA layers run as they do on the real weights."""
    fakes: dict[str, torch.Tensor] = {}
    for name, parameter in model.named_parameters():
        fake = nn.Parameter(_fake_like(parameter), requires_grad=parameter.requires_grad)
        state = getattr(parameter, "quant_state", None)
        if state is not None:
            fake.quant_state = _fake_quant_state(state)  # type: ignore[attr-defined]
        fakes[name] = fake
    for name, buffer in model.named_buffers():
        fakes[name] = _fake_like(buffer)
    return fakes


def _fake_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)


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
    runs (``_prepare_input`` would move them to the card), accelerate's CUDA autocast wrapper is rebuilt with
    the trace device's autocast (memfit's emulation makes up the difference between the two), and the
    GradScaler's lazily made state is put back as it was (the trace would leave fake tensors in it)."""
    if not cuda:
        yield
        return
    scaler = getattr(trainer.accelerator, "scaler", None)
    scaler_state = dict(vars(scaler)) if scaler is not None else None
    wrapped = vars(model).get("forward")  # accelerate's wrapper, an attribute of the instance
    original = getattr(model, "_original_forward", None)
    mixed = trainer.accelerator.mixed_precision
    if wrapped is not None and original is not None and mixed in ("fp16", "bf16"):
        from accelerate.utils import convert_outputs_to_fp32

        dtype = torch.float16 if mixed == "fp16" else torch.bfloat16
        model.forward = convert_outputs_to_fp32(torch.autocast("cpu", dtype=dtype)(original))
    trainer._prepare_input = lambda data: data
    try:
        yield
    finally:
        del trainer._prepare_input
        if wrapped is not None:
            model.forward = wrapped
        if scaler is not None and scaler_state is not None:
            vars(scaler).clear()
            vars(scaler).update(scaler_state)


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
         tracker: StorageTracker, fake_mode: FakeTensorMode, *, cuda: bool) -> None:
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
                if trainer.args.max_grad_norm > 0:
                    grad_norm = trainer._clip_grad_norm(model)
                optimizer.step()
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


