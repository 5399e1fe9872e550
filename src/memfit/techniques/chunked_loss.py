"""Chunked loss for causal LMs: the output layer and the cross-entropy over slices of the token positions,
each slice's logits recomputed in backward instead of kept (``--loss-chunk N``).

Trade-off. A causal LM's loss keeps, for every position of the micro-batch, the logits (16-bit under
autocast), a fp32 copy of them and the log-softmax the backward needs, and its backward makes the logits'
gradient: at Llama-3's 128k vocabulary about 2.5 GiB per 1,024 positions with bf16 autocast, often the peak of
the whole step. Chunked, the step keeps only the last hidden state (``positions x hidden``); the output layer
runs on one chunk of positions at a time, in forward and again in backward, so a chunk's logits, their fp32
copy, log-softmax and gradient are all that exist at once: about ``chunk x vocabulary x 12`` bytes. The price
is one more matmul of the output layer (recomputed in backward: about 1/(3 x layers) more FLOPs for a
decoder) and one more log-softmax pass. The loss and the gradients are the same sums in another grouping:
equal up to float rounding, not bit for bit.

The output layer is chunked where the model's logits are exactly its output layer applied to its base model's
last hidden state (a plain ``nn.Linear`` head with no logit scaling or soft-capping, in one process). Other
models (soft-capped Gemma-2 logits, scaled logits, a head wrapped by PEFT, a sharded or replicated run) keep
their whole logits and chunk only the fp32 copy and the log-softmax; so do encoder-decoders (seq2seq), whose
logits add a bias (BART) or scale the hidden state (T5) on top of the output layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfit.data.batches import Batch
from memfit.support import model_logits
from memfit.techniques.router_loss import adds_router_loss, with_router_loss

IGNORE_INDEX = -100


LOGIT_SCALING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
"""Config fields of architectures whose logits are not the output layer's plain product."""


def chunked_loss_sum(model: nn.Module, batch: Batch, *, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy in fp32, the logits or, where the output layer runs per chunk, the last hidden
    state), as :func:`memfit.step.loss_sum`, over chunks of ``chunk`` token positions; sequence-level labels
    (classification) take the plain path."""
    inputs = {name: tensor for name, tensor in batch.items() if name != "labels"}
    labels = batch["labels"]
    parts = plain_head(model) if labels.dim() == 2 else None
    if parts is not None:
        decoder, head = parts
        hidden = decoder(**inputs).last_hidden_state  # (B, S, H)
        total = torch.zeros((), device=hidden.device)
        rows, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)  # (B * S, H), a view
        for piece, target in zip(rows.split(chunk), targets.split(chunk), strict=True):
            total = total + checkpoint(_head_cross_entropy, head, piece, target, use_reentrant=False)
        return total, hidden
    outputs = model(**inputs)
    logits = model_logits(model, outputs)  # (B, S, V)
    aux_loss = getattr(outputs, "aux_loss", None)  # a MoE's load-balancing loss, when its config asks for it
    del outputs
    if labels.dim() != 2:  # sequence-level labels: nothing to chunk
        loss = F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=IGNORE_INDEX)
        return with_router_loss(loss, aux_loss, model, labels), logits
    positions = logits.reshape(-1, logits.shape[-1])  # (B * S, V), a view
    targets = labels.reshape(-1)
    total = torch.zeros((), device=logits.device)
    for piece, target in zip(positions.split(chunk), targets.split(chunk), strict=True):
        total = total + checkpoint(_summed_cross_entropy, piece, target, use_reentrant=False)
    return with_router_loss(total, aux_loss, model, labels), logits


def _summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=IGNORE_INDEX)


def _head_cross_entropy(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), labels, reduction="sum", ignore_index=IGNORE_INDEX)


def plain_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(the base model, the output layer) where the logits are the output layer of the base model's last hidden
    state and nothing else, else ``None`` (see the module docstring)."""
    from torch.distributed.fsdp import FSDPModule

    base_of: Any = getattr(model, "get_base_model", None)
    inner: Any = base_of() if callable(base_of) else model  # under PEFT: the model it wraps
    if isinstance(model, FSDPModule) or isinstance(inner, FSDPModule) or not hasattr(inner, "get_output_embeddings"):
        return None  # a sharded (or wrapped) model runs its own forward: its root gathers the head
    if adds_router_loss(inner):
        return None  # the load-balancing loss comes from the whole model's forward
    head, decoder = inner.get_output_embeddings(), getattr(inner, "base_model", None)
    config = getattr(inner, "config", None)
    scaled = any(getattr(config, name, None) not in (None, 1, 1.0) for name in LOGIT_SCALING)
    # an encoder-decoder's logits are more than its head: BART adds final_logits_bias, T5 scales a tied head
    scaled = scaled or bool(getattr(config, "is_encoder_decoder", False))
    if type(head) is not nn.Linear or not isinstance(decoder, nn.Module) or decoder is inner or scaled:
        return None
    return decoder, head
