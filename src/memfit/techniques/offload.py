"""Optimizer offload (``--offload-optimizer``): the optimizer's state and its update on the host, the weights
and gradients on the card.

Trade-off: the card no longer holds the optimizer state (AdamW: 8 bytes per trained fp32 parameter; SGD with
momentum: 4), so full fine-tuning of a model whose Adam moments do not fit becomes possible without changing
what is learned (the same update, run by torch's CPU kernel: fused AdamW). The host pays a pinned copy of
every trained parameter and of its gradient (8 bytes per fp32 parameter) plus the state, and each optimizer
step pays time: the gradients go to the host and the updated weights come back over PCIe (8 bytes per
parameter) and the update runs at the host's memory bandwidth. Worth it when the optimizer state is what does
not fit; pointless for LoRA (small adapters, small state) and on the CPU, whose state is in host memory
already (refused there).

memfit's own implementation rather than torchao's ``CPUOffloadOptimizer``, which copies each gradient to the
host in a backward hook as soon as it is accumulated: before memfit's fp16 unscaling, non-finite guard and
gradient clipping have run on the device gradients, so its host update would use scaled, unchecked or
unclipped gradients, and under accumulation it copies every micro-step's partial sum. Here the gradients are
copied once per optimizer step, after the guard (:func:`memfit.techniques.stability.guarded_step`) has checked
and clipped them; the price is that the copies do not overlap the backward pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

HostOptimizer = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
"""Builds the optimizer that runs on the host from parameter groups of host tensors."""


class OffloadedOptimizer(torch.optim.Optimizer):
    """An optimizer whose state and update live on the host. Its parameter groups are the model's (device)
    parameters, so GradScaler, clipping and learning-rate schedules work on it as on any optimizer; each
    :meth:`step` copies the gradients to the host, steps the host optimizer (same hyperparameters, the
    schedule's learning rate) and copies the weights back.

    The host copies are made at the first step, from the weights as they are then (a resumed run's loaded
    ones). ``host_context`` wraps everything that runs on the host: the estimator sets it so that the tensors
    made there count as host memory, not the card's."""

    def __init__(self, groups: list[dict[str, Any]], host_optimizer: HostOptimizer, *, lr: float) -> None:
        super().__init__(groups, {"lr": lr})
        self._host_optimizer = host_optimizer
        self.host_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
        self.host: torch.optim.Optimizer | None = None
        self._copies: dict[nn.Parameter, torch.Tensor] = {}
        self._grads: dict[nn.Parameter, torch.Tensor] = {}
        self._saved: dict[str, Any] | None = None

    def _start(self) -> torch.optim.Optimizer:
        """The host copies (pinned when the weights are on a CUDA card) and the host optimizer over them."""
        host_groups = []
        for group in self.param_groups:
            copies = []
            for parameter in group["params"]:
                pinned = parameter.is_cuda
                copy = torch.empty_like(parameter, device="cpu", pin_memory=pinned)
                copy.copy_(parameter.detach())
                self._copies[parameter] = copy
                self._grads[parameter] = torch.empty_like(parameter, device="cpu", pin_memory=pinned)
                copies.append(copy)
            host_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": copies})
        self.host = self._host_optimizer(host_groups)
        if self._saved is not None:
            self.host.load_state_dict(self._saved)
            self._saved = None
        return self.host

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        with self.host_context():
            host = self.host or self._start()
            cuda = False
            for group, host_group in zip(self.param_groups, host.param_groups, strict=True):
                host_group.update({k: v for k, v in group.items() if k != "params"})  # the schedule's lr
                for parameter in group["params"]:
                    copy = self._copies[parameter]
                    if parameter.grad is None:
                        copy.grad = None
                        continue
                    copy.grad = self._grads[parameter]
                    copy.grad.copy_(parameter.grad, non_blocking=True)
                    cuda = cuda or parameter.is_cuda
            if cuda:  # the copies into pinned memory are asynchronous: wait for them before the update
                torch.cuda.current_stream().synchronize()
            host.step()
            for parameter, copy in self._copies.items():
                if copy.grad is not None:  # on the card's stream, before the next forward
                    parameter.copy_(copy, non_blocking=True)
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"groups": super().state_dict(), "host": self.host.state_dict() if self.host else self._saved}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict["groups"])
        if self.host is None:
            self._saved = state_dict["host"]
            return
        if state_dict["host"] is not None:
            self.host.load_state_dict(state_dict["host"])
        with torch.no_grad():
            for parameter, copy in self._copies.items():
                copy.copy_(parameter.detach())
