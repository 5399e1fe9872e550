"""The optimizer and its learning-rate schedule.

Trade-offs (memory per trained parameter, fp32 weights):

- ``adamw``: two fp32 states, 8 bytes. Its step has three implementations: ``fused`` (memfit's default in
  one process, on CPU and CUDA) runs the whole update in one kernel per parameter group with no temporaries
  beyond the states: fastest and leanest; ``foreach`` (torch's default on CUDA) runs one multi-tensor kernel
  per op, but materialises temporaries the size of all gradients during the step, which can set the peak;
  a ``loop`` updates one parameter at a time and peaks lower than foreach, slower than both.
- ``sgd``: one momentum buffer, 4 bytes (none without momentum). Usually needs a higher learning rate.
- ``adamw8bit``: bitsandbytes' block-wise 8-bit states: one byte per moment plus one fp32 scale per block of
  256 (tensors under 4,096 elements keep fp32 states), ~2 bytes. Changes the update's numerics slightly.
- ``paged-adamw8bit``: the same states in CUDA unified memory, which the driver pages out to the host when the
  device runs short instead of failing: survives spikes, slower when it pages. CUDA only.

Only parameters that require gradients are given to the optimizer, so frozen ones never get state. Biases
and norm weights get no weight decay. The schedule warms up linearly then decays linearly to zero, stepped
once per optimizer step.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.errors import ConfigError


def optimizer_problems(name: str, device_kind: str | None = None, *, offload: bool = False) -> list[str]:
    """What ``--optimizer name`` needs: bitsandbytes for the 8-bit ones, a CUDA device (``device_kind``, when
    known) for the paged one, whose states page between device and host memory through CUDA's unified
    memory, and for ``offload`` (``--offload-optimizer``), which moves them from a card to the host."""
    problems = []
    if "8bit" in name and importlib.util.find_spec("bitsandbytes") is None:
        problems.append(f"--optimizer {name} needs bitsandbytes: pip install 'memfit[lora]' (or use --optimizer "
                        "adamw)")
    elif name == "paged-adamw8bit" and device_kind not in (None, "cuda"):
        problems.append(f"--optimizer paged-adamw8bit pages its states through CUDA unified memory, which a "
                        f"{device_kind} device has not; use --optimizer adamw8bit")
    if offload and device_kind not in (None, "cuda"):
        problems.append(f"--offload-optimizer moves the optimizer's state from a CUDA card to host memory; on a "
                        f"{device_kind} device it is in host memory already: drop --offload-optimizer")
    return problems


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        (no_decay if parameter.ndim < 2 or "norm" in name.lower() else decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def step_kernels(name: str, *, foreach: bool | None, fused: bool | None,
                 distributed: bool) -> tuple[bool | None, bool]:
    """(foreach, fused) for torch: AdamW fuses unless told otherwise, or ``foreach`` is set either way, or the
    run is distributed (whose sharded parameters keep torch's default)."""
    if name != "adamw":
        return foreach, False
    if fused is None:
        fused = foreach is None and not distributed
    return (None if fused else foreach), fused


def build_optimizer(model: nn.Module, *, name: str, lr: float, weight_decay: float, momentum: float,
                    foreach: bool | None, fused: bool = False, offload: bool = False, kahan: bool = False,
                    in_backward: bool = False) -> torch.optim.Optimizer:
    """``offload``: the same optimizer on the host (fused AdamW there, whatever ``fused`` says for the card),
    behind :class:`~memfit.techniques.offload.OffloadedOptimizer`. ``kahan``: torch-optimi's Kahan-summed
    optimizer (:mod:`memfit.techniques.bf16_true`). ``in_backward``: one optimizer per parameter, stepped in
    backward (:mod:`memfit.techniques.optimizer_in_backward`)."""
    groups = [group for group in parameter_groups(model, weight_decay) if group["params"]]
    if not groups:
        raise ConfigError("every parameter is frozen: nothing to train; train more layers")
    if in_backward:
        from memfit.techniques.optimizer_in_backward import InBackwardOptimizer

        def per_parameter(one: list[dict[str, Any]]) -> torch.optim.Optimizer:
            return build_optimizer_of(one, name=name, lr=lr, momentum=momentum, foreach=foreach, fused=fused,
                                      kahan=kahan)

        return InBackwardOptimizer(groups, per_parameter, lr=lr)
    if offload:
        from memfit.techniques.offload import OffloadedOptimizer

        def on_host(host_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
            return build_optimizer_of(host_groups, name=name, lr=lr, momentum=momentum, foreach=None,
                                      fused=name == "adamw")

        return OffloadedOptimizer(groups, on_host, lr=lr)
    return build_optimizer_of(groups, name=name, lr=lr, momentum=momentum, foreach=foreach, fused=fused, kahan=kahan)


def build_optimizer_of(groups: list[dict[str, Any]], *, name: str, lr: float, momentum: float,
                       foreach: bool | None, fused: bool, kahan: bool = False) -> torch.optim.Optimizer:
    """The optimizer ``name`` over parameter ``groups``."""
    if kahan:
        from memfit.techniques.bf16_true import kahan_optimizer

        return kahan_optimizer(groups, name=name, lr=lr, momentum=momentum, foreach=foreach)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, foreach=foreach, fused=fused or None)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, foreach=foreach)
    if "8bit" in name:
        return _adamw8bit(groups, lr=lr, paged=name == "paged-adamw8bit")
    raise AssertionError(f"optimizer {name!r} passed validation")


def build_scheduler(optimizer: torch.optim.Optimizer, *, total_steps: int,
                    warmup_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    warmup_steps = int(total_steps * warmup_ratio)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        remaining = total_steps - step
        return max(0.0, remaining / max(1, total_steps - warmup_steps))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def advance_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Advance the schedule by one optimizer step, applied or skipped.

    A skipped (non-finite) step keeps the schedule on the step count, so warm-up and decay stay aligned with
    ``--max-steps``; torch warns when the first step was skipped, which is expected here and not shown.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        scheduler.step()


PAGED_MIN_ELEMENTS = 100_000
"""bitsandbytes pages the 8-bit states of tensors of at least this many elements (smaller ones stay put)."""


def _adamw8bit(groups: list[dict[str, Any]], *, lr: float, paged: bool) -> torch.optim.Optimizer:
    """bitsandbytes' (paged) AdamW8bit. Its two quantisation maps (256 values each) are computed from real
    numbers, then made as tensors where the optimizer is built: in the estimator's fake-tensor trace as in a
    real run, and counted there as in a real run."""
    from torch.utils._python_dispatch import _disable_current_modes

    from memfit.techniques.quantized_base import bitsandbytes

    bnb = bitsandbytes()
    base = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit

    class AdamW8bit(base):  # type: ignore[misc,valid-type]
        paged_states: tuple[torch.Tensor, ...] = ()
        paged_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
        """Wraps the making of a paged state in a trace: the estimator counts it as host-backed memory."""

        def fill_qmap(self) -> None:
            with _disable_current_modes():
                signed = bnb.functional.create_dynamic_map(signed=True).tolist()
                unsigned = bnb.functional.create_dynamic_map(signed=False).tolist()
            self.name2qmap["dynamic"], self.name2qmap["udynamic"] = torch.tensor(signed), torch.tensor(unsigned)

        def get_state_buffer(self, p: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            if p.device.type != "cpu" or not self.is_paged:
                return super().get_state_buffer(p, dtype=dtype)
            # a trace for a CUDA target (a run on CPU is refused): the buffer CUDA would page, noted as such
            if p.numel() < PAGED_MIN_ELEMENTS:
                return torch.zeros_like(p, dtype=dtype)
            with self.paged_context():  # unified memory, outside the card's allocator
                buffer = torch.zeros_like(p, dtype=dtype)
            self.paged_states = (*self.paged_states, buffer)
            return buffer

    optimizer: torch.optim.Optimizer = AdamW8bit(groups, lr=lr)
    return optimizer
