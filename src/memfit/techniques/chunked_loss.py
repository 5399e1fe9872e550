"""Chunked loss for causal LMs: the cross-entropy over slices of the token positions, each slice's fp32
logits and log-softmax recomputed in backward instead of kept (``--loss-chunk N``).

Trade-off. A causal LM's loss keeps, for every position of the micro-batch, a fp32 copy of the logits (under
bf16/fp16 autocast) and the log-softmax the backward needs: ``2 x positions x vocabulary x 4`` bytes. At
Llama-3's 128k vocabulary that is 1 GiB per 1,024 positions, often the peak of the whole step. Chunked, the
step keeps only the model's own logits; the backward recomputes one chunk's fp32 copy and log-softmax at a time
(one more log-softmax pass over the logits: no matmul is repeated, since the logits themselves are kept).
Memory: about ``2 x chunk x vocabulary x 4`` bytes instead of the whole. The loss and the gradients are the
same sums in another grouping: equal up to float rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfit.data.batches import Batch

IGNORE_INDEX = -100


def chunked_loss_sum(model: nn.Module, batch: Batch, *, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy in fp32, logits), as :func:`memfit.step.loss_sum`, over chunks of ``chunk``
    token positions; sequence-level labels (classification) take the plain path."""
    inputs = {name: tensor for name, tensor in batch.items() if name != "labels"}
    logits = model(**inputs).logits  # (B, S, V)
    labels = batch["labels"]
    if labels.dim() != 2:  # sequence-level labels: nothing to chunk
        return F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=IGNORE_INDEX), logits
    positions = logits.reshape(-1, logits.shape[-1])  # (B * S, V), a view
    targets = labels.reshape(-1)
    total = torch.zeros((), device=logits.device)
    for piece, target in zip(positions.split(chunk), targets.split(chunk), strict=True):
        total = total + checkpoint(_summed_cross_entropy, piece, target, use_reentrant=False)
    return total, logits


def _summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=IGNORE_INDEX)
