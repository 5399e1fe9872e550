"""Running one window (the samples of one optimizer step) and one evaluation, in one process or as one rank of
several. The engine picks its runner once, when it builds the run, so the loop has no distributed branches.

- :class:`LocalWindows`: the window's micro-batches in this process; a window resumed part-way continues after
  its last finished micro-step, and a stop signal between micro-steps ends the window early (the engine saves
  its gradients so far).
- :class:`RankWindows`: this rank's share of the window (samples r, r+N, ...), gradients reduced over the ranks
  in the window's last backward only; a stop signal is agreed between windows, never inside one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from memfit import distributed
from memfit.data.batches import Batch, Encoder, cut
from memfit.step import IGNORE_INDEX, PhaseTracker, accumulate_window, item_count, loss_sum, to_device
from memfit.techniques.offload_activations import ActivationOffload
from memfit.techniques.precision import Precision


@dataclass(kw_only=True, slots=True)
class PartialWindow:
    """A window a checkpoint saved part-way: its micro-steps done (their gradients are back in ``.grad``),
    its loss so far, and the random state at its start (what an OOM restart of the window replays)."""

    micro_steps_done: int
    loss: torch.Tensor | None
    rng_window_start: dict[str, Any]


class WindowResult(NamedTuple):
    loss: torch.Tensor
    """The window's loss (a device tensor, not synced)."""
    items: int
    """Labelled items in the window (over all ranks)."""
    done: int
    """Micro-steps finished: all of them, unless a stop signal ended the window early."""
    micro_steps: int
    """Micro-steps of the window."""


class LocalWindows:
    """Windows and evaluations of a run in one process."""

    def __init__(self, model: nn.Module, encoder: Encoder, *, precision: Precision,
                 scaler: torch.amp.GradScaler | None, device: torch.device, phases: PhaseTracker,
                 stop_requested: Callable[[], bool], loss_chunk: int | None = None,
                 offload: ActivationOffload | None = None) -> None:
        self.model, self.encoder, self.precision, self.scaler = model, encoder, precision, scaler
        self.device, self.phases, self.stop_requested = device, phases, stop_requested
        self.loss_chunk = loss_chunk
        self.offload = offload
        """Activation offload around each forward (``--offload-activations``); its peak host bytes are reported."""

    def run(self, window: list[int], size: int, partial: PartialWindow | None) -> WindowResult:
        """Forward + backward of each micro-batch of ``size``; gradients accumulate in ``.grad``."""
        micro_batches = [self.encoder(chunk) for chunk in cut(window, size)]
        window_items = sum(item_count(batch) for batch in micro_batches)  # host-side: no sync
        start = partial.micro_steps_done if partial is not None else 0
        loss, done = accumulate_window(self.model, micro_batches[start:], window_items, precision=self.precision,
                                       scaler=self.scaler, device=self.device, phases=self.phases,
                                       loss_so_far=partial.loss if partial is not None else None,
                                       should_stop=self.stop_requested, loss_chunk=self.loss_chunk,
                                       saved_tensors=self.offload)
        return WindowResult(loss, window_items, start + done, len(micro_batches))

    def stop_agreed(self, requested: bool) -> bool:
        """Whether the run stops before its next window (``requested``: a stop signal reached this process)."""
        return requested

    def evaluation_batches(self, num_examples: int, size: int, *, choices: bool = False,
                           ) -> tuple[nn.Module, Iterable[Batch]]:
        """The model to evaluate and this process's batches of the first ``num_examples`` examples
        (``choices``: the candidate-scoring batches of a causal-LM encoder with a closed set)."""
        encode = self.encoder.choices if choices else self.encoder  # type: ignore[attr-defined]
        return self.model, (encode(chunk) for chunk in cut(range(num_examples), size))

    def total(self, values: list[float]) -> list[float]:
        """Counts summed over the processes that evaluated."""
        return values


class RankWindows(LocalWindows):
    """Windows and evaluations of one rank of a distributed run."""

    def __init__(self, model: nn.Module, encoder: Encoder, world: distributed.World, **options: Any) -> None:
        super().__init__(model, encoder, **options)
        self.world = world

    def run(self, window: list[int], size: int, partial: PartialWindow | None) -> WindowResult:
        """This rank's share of the window, gradients reduced in its last backward (or in each, with FSDP's
        ``reduce_every_micro_step``); the loss is averaged over the ranks. Sequence- and image-level heads have
        one labelled item per sample, so the window's item count over all ranks is its length, known to every
        rank without a collective; token-level labels (a causal LM's completion tokens) are counted on each rank
        and summed over the ranks (one all-reduce)."""
        micro_batches = rank_batches(self.encoder, window, size, self.world)
        items = len(window)
        if micro_batches and micro_batches[0]["labels"].dim() == 2:  # token-level: the ranks' counts, summed
            items = int(self.total([float(sum(item_count(batch) for batch in micro_batches))])[0])
        loss, done = accumulate_window(self.model, micro_batches, items / self.world.world_size,
                                       precision=self.precision, scaler=self.scaler, device=self.device,
                                       phases=self.phases, sync=distributed.micro_step_sync(
                                           self.model, every=self.world.reduce_every_micro_step),
                                       loss_chunk=self.loss_chunk, saved_tensors=self.offload)
        return WindowResult(distributed.mean_over_ranks(loss), items, done, len(micro_batches))

    def stop_agreed(self, requested: bool) -> bool:
        """A stop signal on any rank stops every rank at the same window (one all-reduce of one number)."""
        return distributed.any_rank(requested, self.device)

    def evaluation_batches(self, num_examples: int, size: int, *, choices: bool = False,
                           ) -> tuple[nn.Module, Iterable[Batch]]:
        # DDP's forward would sync buffers; FSDP2's gathers (it is its own module)
        encode = self.encoder.choices if choices else self.encoder  # type: ignore[attr-defined]
        return distributed.unwrap(self.model), rank_batches(encode, list(range(num_examples)), size, self.world)

    def total(self, values: list[float]) -> list[float]:
        return distributed.sum_over_ranks(values, self.device)


@torch.no_grad()
def evaluate(windows: LocalWindows, num_examples: int, batch_size: int) -> dict[str, float | None]:
    """The validation metrics; no activations are kept for backward.

    Classification: ``accuracy`` and ``loss`` (mean over examples). Causal LM: ``loss`` (mean over completion
    tokens), ``perplexity`` and, when the completions are a closed set, ``accuracy``
    (:func:`choice_accuracy`). Distributed: each rank evaluates its share (padded so every rank runs the same
    forwards) and the sums are summed over the ranks.
    """
    model, batches = windows.evaluation_batches(num_examples, batch_size)
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=windows.device)
    total_loss = torch.zeros((), device=windows.device)
    items, token_level = 0, False
    for host_batch in batches:
        items += item_count(host_batch)
        batch = to_device(host_batch, windows.device)
        token_level = batch["labels"].dim() == 2
        with windows.precision.autocast():
            loss, logits = token_loss_sum(model, batch) if token_level else loss_sum(model, batch)
        if not token_level:
            correct += (logits.argmax(dim=-1) == batch["labels"]).sum()  # a masked label (-100) never matches
        total_loss += loss
    total_correct, summed_loss, total_items = windows.total([float(correct), float(total_loss), float(items)])
    if not token_level:
        return {"accuracy": total_correct / num_examples, "loss": summed_loss / num_examples}
    mean = summed_loss / max(total_items, 1.0)
    accuracy = choice_accuracy(windows, num_examples, batch_size) if getattr(windows.encoder, "targets", None) \
        else None
    return {"accuracy": accuracy, "loss": mean, "perplexity": math.exp(min(mean, 700.0))}


def token_loss_sum(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`memfit.step.loss_sum` of a causal LM without gradients: the fp32 copy and the log-softmax only
    for the labelled (completion) positions, not for every position of the batch, which with a large
    vocabulary would make the evaluation, not training, the run's peak."""
    logits = model(**{name: tensor for name, tensor in batch.items() if name != "labels"}).logits  # (B, S, V)
    labels = batch["labels"]
    scored = labels != IGNORE_INDEX
    return F.cross_entropy(logits[scored].float(), labels[scored], reduction="sum"), logits


@torch.no_grad()
def choice_accuracy(windows: LocalWindows, num_examples: int, batch_size: int) -> float:
    """Share of examples whose own completion has the highest summed log-probability among the candidates."""
    candidates = len(windows.encoder.candidates[0])  # type: ignore[attr-defined]
    model, batches = windows.evaluation_batches(num_examples, max(1, batch_size // candidates), choices=True)
    correct = torch.zeros((), dtype=torch.long, device=windows.device)
    for host_batch in batches:
        batch = to_device(host_batch, windows.device)
        targets = batch.pop("choice_targets")  # (E,), -100 for a rank's padding
        with windows.precision.autocast():
            logits = model(**{name: tensor for name, tensor in batch.items() if name != "labels"}).logits
        labels = batch["labels"]  # (E * C, S)
        scored = labels != IGNORE_INDEX
        token_loss = F.cross_entropy(logits[scored].float(), labels[scored], reduction="none")  # (T,)
        del logits
        rows = torch.arange(labels.shape[0], device=labels.device)[:, None].expand_as(labels)[scored]
        log_prob = -torch.zeros(labels.shape[0], device=labels.device).index_add(0, rows, token_loss)  # (E * C,)
        predicted = log_prob.view(targets.shape[0], candidates).argmax(dim=-1)
        correct += (predicted == targets).sum()
    return windows.total([float(correct)])[0] / num_examples


def rank_batches(encoder: Encoder, indices: list[int], size: int, world: distributed.World) -> list[Batch]:
    """This rank's micro-batches of ``indices`` (:func:`memfit.distributed.rank_chunks`), padding masked out."""
    chunks, padding = distributed.rank_chunks(indices, size, world)
    batches = [encoder(chunk) for chunk in chunks]
    for batch in batches[len(batches) - padding:]:
        for name in ("labels", "choice_targets"):
            if name in batch:
                batch[name] = torch.full_like(batch[name], IGNORE_INDEX)
    return batches


def window_runner(model: nn.Module, encoder: Encoder, world: distributed.World, **options: Any) -> LocalWindows:
    """The runner of this process's windows: one rank's share when the run is distributed."""
    if world.distributed:
        return RankWindows(model, encoder, world, **options)
    return LocalWindows(model, encoder, **options)

