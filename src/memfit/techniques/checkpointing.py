"""Gradient (activation) checkpointing: keep only each checkpointed block's input, recompute the rest.

Trade-off: the activations saved inside a checkpointed block are freed after its forward and rebuilt during
backward, so activation memory drops from ~all layers' internals to one block's plus each block's input; the
price is one extra forward of those blocks (~30% more compute for full checkpointing).

- ``full``: every transformer block.
- ``every-n``: one block in every N (blocks 0, N, 2N, ...), trading memory back for speed.

Hugging Face models use transformers' own API (``activation_checkpointing_enable`` in 5.x,
``gradient_checkpointing_enable`` in 4.x) with ``use_reentrant=False``, which lets gradients flow to trained
layers even when the embeddings below are frozen. Any other ``nn.Module`` whose repeated blocks sit in a
``ModuleList`` has those blocks wrapped with :func:`torch.utils.checkpoint.checkpoint`.

Incompatible: dropout RNG is replayed exactly by torch's checkpoint, so results are unchanged; models without
a ``ModuleList`` of blocks cannot be checkpointed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from memfit.models import transformer_layers

CHECKPOINT_KWARGS = {"use_reentrant": False}  # what transformers passes on to torch.utils.checkpoint


def apply_checkpointing(model: nn.Module, *, mode: str, every: int) -> None:
    """Enable ``mode`` (``none | full | every-n``) on ``model``; ``every`` is N for ``every-n``."""
    if mode == "none":
        return
    period = 1 if mode == "full" else every
    if getattr(model, "supports_gradient_checkpointing", False):
        _enable_hf(model, period)
    else:
        _wrap_blocks(model, period)


def _enable_hf(model: Any, period: int) -> None:
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=dict(CHECKPOINT_KWARGS),
                                              every_n_layers=period)
        return
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(CHECKPOINT_KWARGS))  # 4.x
    if period > 1:  # 4.x has no every-n: switch the other blocks back off
        for index, block in enumerate(transformer_layers(model)):
            for module in block.modules():
                if hasattr(module, "gradient_checkpointing"):
                    setattr(module, "gradient_checkpointing", index % period == 0)  # noqa: B010


def _wrap_blocks(model: nn.Module, period: int) -> None:
    for index, block in enumerate(transformer_layers(model)):
        if index % period == 0:
            block.forward = _checkpointed(block.forward)


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
