"""Gradient clipping and the non-finite guard.

Clipping bounds the global gradient norm; under fp16 it runs after ``scaler.unscale_`` so the threshold is in
real units. It costs one reduction over all gradients per optimizer step and no persistent memory.

The guard keeps non-finite values away from the weights. Under fp16 the GradScaler already skips a step whose
gradients overflow (and lowers its scale). Otherwise memfit checks the loss and the gradient norm once per
optimizer step -- one CPU-GPU synchronisation -- and skips the step when either is not finite, logging the
step and the first offending parameters. A run stops after ``max_nonfinite_steps`` consecutive bad steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from memfit.techniques.optimizer_in_backward import InBackwardOptimizer


def gradient_norm(parameters: list[nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of the gradients, as a tensor on their device (no sync)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads)
    full_tensor = getattr(norm, "full_tensor", None)  # FSDP2: a norm over sharded gradients, reduced over ranks
    return full_tensor() if full_tensor is not None else norm


def clip_to_norm(parameters: list[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale the gradients so their global norm is at most ``max_norm`` (call only with a finite norm)."""
    grads = [p for p in parameters if p.grad is not None]
    torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total_norm)


def nonfinite_parameters(named: list[tuple[str, nn.Parameter]], limit: int = 3) -> list[str]:
    """Names of the first ``limit`` parameters whose gradient holds a NaN or an infinity."""
    names = []
    for name, parameter in named:
        if parameter.grad is not None and not bool(torch.isfinite(parameter.grad).all()):
            names.append(name)
            if len(names) == limit:
                break
    return names


@dataclass(frozen=True, slots=True)
class StepCheck:
    loss: float
    grad_norm: float
    loss_finite: bool
    grads_finite: bool
    bad_parameters: list[str]
    """The first parameters with non-finite gradients (empty when the gradients are finite)."""

    @property
    def applied(self) -> bool:
        return self.loss_finite and self.grads_finite


def read_values(window_loss: torch.Tensor, norm: torch.Tensor) -> tuple[float, float]:
    """The loss and the gradient norm on the host: the step's one synchronisation."""
    loss_value, norm_value = torch.stack([window_loss.float(), norm.to(window_loss.device).float()]).tolist()
    return loss_value, norm_value


def assume_finite(window_loss: torch.Tensor, norm: torch.Tensor) -> tuple[float, float]:
    """For traces with fake tensors, which hold no values: take the branch of a step that updates.

    Builds the same small tensor :func:`read_values` does, so the traced step allocates what the real one does.
    """
    torch.stack([window_loss.float(), norm.to(window_loss.device).float()])
    return 0.0, 0.0


def guarded_step(optimizer: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]], window_loss: torch.Tensor,
                 *, scaler: torch.amp.GradScaler | None, max_grad_norm: float | None,
                 read: Callable[[torch.Tensor, torch.Tensor], tuple[float, float]] = read_values) -> StepCheck:
    """Unscale, check, clip and step: weights and optimizer state change only if loss and gradients are finite.

    One host-device synchronisation (reading the loss and the norm together). Gradients are left in place;
    the caller zeroes them.
    """
    if isinstance(optimizer, InBackwardOptimizer):  # already stepped, parameter by parameter, in backward
        return _released_check(optimizer, named, window_loss, read)
    if scaler is not None:
        scaler.unscale_(optimizer)  # clip and check in real units
    parameters = [parameter for _, parameter in named]
    norm = gradient_norm(parameters)
    loss_value, norm_value = read(window_loss, norm)
    grads_finite = math.isfinite(norm_value)
    check = StepCheck(loss_value, norm_value, math.isfinite(loss_value), grads_finite,
                      [] if grads_finite else nonfinite_parameters(named))
    if check.applied and max_grad_norm is not None:
        clip_to_norm(parameters, max_grad_norm, norm)
    if scaler is not None:
        if check.loss_finite:
            scaler.step(optimizer)  # skips the update itself when the gradients overflowed
        scaler.update()  # lowers the scale after an overflow
    elif check.applied:
        optimizer.step()
    return check


def _released_check(optimizer: InBackwardOptimizer, named: list[tuple[str, nn.Parameter]],
                    window_loss: torch.Tensor, read: Callable[[torch.Tensor, torch.Tensor], tuple[float, float]],
                    ) -> StepCheck:
    """The check of a step that ran inside backward: the loss and the norm of the gradients it used, and the
    parameters it left unchanged because their gradient was not finite (the others were updated)."""
    loss_value, norm_value = read(window_loss, optimizer.take_norm())
    skipped = {id(parameter) for parameter in optimizer.take_skipped()}
    bad = [name for name, parameter in named if id(parameter) in skipped]
    # under FSDP another rank may have kept a shard: the norm summed over the ranks says so on every rank
    finite = not bad and (optimizer.group is None or math.isfinite(norm_value))
    return StepCheck(loss_value, norm_value, math.isfinite(loss_value), finite, bad[:3])
