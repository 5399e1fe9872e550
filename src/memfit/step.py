"""The pieces of a training step shared by the engine and the estimator: the window's forward and backward
(:func:`accumulate_window`) and the optimizer step (:func:`optimizer_step`).

The loss is a *sum* over the micro-batch's labelled items, divided by the item count of the whole window,
so that accumulating ``k`` micro-batches gives exactly the gradient of one batch of the window's size, also
when micro-batches are unequal or padded differently. (A mean of per-micro-batch means would weight a short
last micro-batch too much.) Labels equal to -100 are not counted, which makes token-level losses normalise by
the window's token count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from memfit.data.batches import Batch
from memfit.support import model_logits
from memfit.techniques.chunked_loss import chunked_loss_sum
from memfit.techniques.optim import advance_schedule
from memfit.techniques.precision import Precision
from memfit.techniques.router_loss import with_router_loss
from memfit.techniques.stability import StepCheck, guarded_step, read_values

IGNORE_INDEX = -100


def item_count(batch: Batch) -> int:
    """Labelled items in a micro-batch, counted on the host before the batch moves (no device sync)."""
    return int((batch["labels"] != IGNORE_INDEX).sum())


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}


def loss_sum(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy in fp32, logits) of one micro-batch."""
    inputs = {name: tensor for name, tensor in batch.items() if name != "labels"}
    outputs = model(**inputs)
    logits = model_logits(model, outputs)  # (B, C), or (B, S, C) for token-level heads
    aux_loss = getattr(outputs, "aux_loss", None)  # a MoE's load-balancing loss, when its config asks for it
    del outputs  # the rest of the output (a KV cache) goes now, as it always went
    labels = batch["labels"]
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           reduction="sum", ignore_index=IGNORE_INDEX)
    return with_router_loss(loss, aux_loss, model, labels), logits


class PhaseTracker(Protocol):
    """What the step reports to: the runtime :class:`~memfit.memory.Monitor` or an estimator's tracker."""

    def track(self, *tensors: torch.Tensor, category: str | None = None) -> None: ...

    def track_module(self, module: nn.Module) -> None: ...

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]: ...


def accumulate_window(model: nn.Module, micro_batches: list[Batch], window_items: float, *, precision: Precision,
                      scaler: torch.amp.GradScaler | None, device: torch.device, phases: PhaseTracker,
                      loss_so_far: torch.Tensor | None = None, should_stop: Callable[[], bool] | None = None,
                      sync: Callable[[bool], contextlib.AbstractContextManager[None]] | None = None,
                      loss_chunk: int | None = None,
                      saved_tensors: contextlib.AbstractContextManager[Any] | None = None,
                      ) -> tuple[torch.Tensor, int]:
    """Forward and backward over one window's micro-batches, accumulating gradients in ``.grad``.

    ``window_items`` is the window's labelled-item count (:func:`item_count`, summed on the host). Returns the
    window's loss, a device tensor (not synced), and how many micro-batches ran: all of them, unless
    ``should_stop()`` turned true after one (a stop signal; the caller saves the partial window). A window
    resumed part-way passes its remaining micro-batches and ``loss_so_far``. Each micro-batch's graph is freed
    before the next forward, so only one micro-batch's activations are alive at a time.

    ``sync(last)`` wraps each micro-step of a distributed run: gradients are reduced over the ranks only in
    the window's last backward. There ``window_items`` is the window's items over the ranks divided by their
    number (DDP and FSDP average the ranks' gradients). ``loss_chunk``: a causal LM's loss over chunks of
    token positions (:mod:`memfit.techniques.chunked_loss`). ``saved_tensors``: entered around each forward
    (and loss), where autograd saves what backward needs: activation offload
    (:class:`memfit.techniques.offload_activations.ActivationOffload`).
    """
    window_loss = torch.zeros((), device=device) if loss_so_far is None else loss_so_far.to(device)
    done = 0
    for index, host_batch in enumerate(micro_batches):
        batch = to_device(host_batch, device)
        phases.track(*batch.values(), category="inputs")
        with sync(index == len(micro_batches) - 1) if sync is not None else contextlib.nullcontext():
            with phases.phase("forward"), precision.autocast(), saved_tensors or contextlib.nullcontext():
                loss, _ = loss_sum(model, batch) if loss_chunk is None else chunked_loss_sum(model, batch,
                                                                                              chunk=loss_chunk)
                loss = loss / window_items  # normalised over the whole window, not per micro-batch
            with phases.phase("backward"):
                (scaler.scale(loss) if scaler is not None else loss).backward()
        window_loss += loss.detach()
        del loss, batch  # free this micro-batch's graph before the next forward
        done += 1
        if should_stop is not None and done < len(micro_batches) and should_stop():
            break
    return window_loss, done


def optimizer_step(optimizer: torch.optim.Optimizer, trained: list[tuple[str, nn.Parameter]],
                   window_loss: torch.Tensor, *, scaler: torch.amp.GradScaler | None, max_grad_norm: float | None,
                   scheduler: torch.optim.lr_scheduler.LRScheduler | None, phases: PhaseTracker,
                   read: Callable[[torch.Tensor, torch.Tensor], tuple[float, float]] = read_values,
                   after_update: Callable[[], None] | None = None) -> StepCheck:
    """The optimizer's half of a window, in the ``optimizer`` phase: unscale, check, clip and step (skipped when
    the loss or the gradients are not finite), free the gradients, advance the schedule.

    The engine and the estimator both run it (the estimator with ``read=assume_finite`` on fake tensors and
    ``after_update`` labelling the optimizer state it just created). The caller drops ``window_loss`` after
    this returns, so it does not live into the next window.
    """
    with phases.phase("optimizer"):
        check = guarded_step(optimizer, trained, window_loss, scaler=scaler, max_grad_norm=max_grad_norm, read=read)
        if after_update is not None:
            after_update()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            advance_schedule(scheduler)  # once per optimizer step, applied or skipped
    return check
