"""Gradient clipping and the non-finite guard.

Clipping bounds the global gradient norm; under fp16 it runs after ``scaler.unscale_`` so the threshold is in
real units. It costs one reduction over all gradients per optimizer step and no persistent memory.

The guard keeps non-finite values away from the weights. Under fp16 the GradScaler already skips a step whose
gradients overflow (and lowers its scale). Otherwise memfit checks the loss and the gradient norm once per
optimizer step -- one CPU-GPU synchronisation -- and skips the step when either is not finite, logging the
step and the first offending parameters. A run stops after ``max_nonfinite_steps`` consecutive bad steps.
"""

from __future__ import annotations

import torch
from torch import nn


def gradient_norm(parameters: list[nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of the gradients, as a tensor on their device (no sync)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(grads)


def clip_to_norm(parameters: list[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale the gradients so their global norm is at most ``max_norm`` (call only with a finite norm)."""
    grads = [p for p in parameters if p.grad is not None]
    torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total_norm)


def nonfinite_parameters(model: nn.Module, limit: int = 3) -> list[str]:
    """Names of the first ``limit`` parameters whose gradient holds a NaN or an infinity."""
    names = []
    for name, parameter in model.named_parameters():
        if parameter.grad is not None and not bool(torch.isfinite(parameter.grad).all()):
            names.append(name)
            if len(names) == limit:
                break
    return names
