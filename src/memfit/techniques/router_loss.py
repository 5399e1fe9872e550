"""Mixture-of-experts: the router's load-balancing loss, added as transformers' own training adds it.

A MoE config with ``output_router_logits`` set asks for the auxiliary loss that keeps the experts' loads
balanced: transformers' MoE models then keep every layer's router logits and return ``aux_loss``, and their
own loss is ``cross_entropy + router_aux_loss_coef * aux_loss``. memfit sums its cross-entropy over the
window's labelled items and divides by their count (:mod:`memfit.step`), so the auxiliary loss enters each
micro-batch weighted by its items: the window's loss is the same mean the model's own loss would give.

Trade-off: the router logits of every layer stay alive until the loss (a (tokens, experts) tensor per layer)
and the auxiliary loss adds a few small ops; the trace counts both because it runs the same forward. With
``output_router_logits`` off (the default of the published MoE configs), nothing changes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

IGNORE_INDEX = -100


def with_router_loss(loss_sum: torch.Tensor, aux_loss: Any, model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """``loss_sum`` plus the micro-batch's share of the load-balancing loss ``aux_loss`` (a forward's
    ``outputs.aux_loss``) where the model returns one."""
    if not isinstance(aux_loss, torch.Tensor):
        return loss_sum
    coefficient = float(getattr(_config(model), "router_aux_loss_coef", 0.0) or 0.0)
    items = (labels != IGNORE_INDEX).sum()  # stays on the device: no sync
    return loss_sum + coefficient * aux_loss.float() * items


def adds_router_loss(model: nn.Module) -> bool:
    """Whether the model's forward returns a load-balancing loss to add (``output_router_logits``)."""
    return bool(getattr(_config(model), "output_router_logits", False))


def _config(model: nn.Module) -> Any:
    base_of: Any = getattr(model, "get_base_model", None)
    inner: Any = base_of() if callable(base_of) else model
    return getattr(inner, "config", None)
