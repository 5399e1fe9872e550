"""QLoRA for mixture-of-experts blocks: the experts' stacked weights stored in NF4 too.

A MoE block keeps each projection of all its experts in one ``(experts, in, out)`` weight, not in Linear
layers, so bitsandbytes' ``Linear4bit`` (:mod:`memfit.techniques.quantized_base`) does not reach them, yet they
are nearly all of such a model's bytes (19 of gpt-oss-20b's 20.9 B parameters). Under ``--quantize-base nf4``
each of those weights is quantised with bitsandbytes' own NF4 (blocks of 64, double quantisation: about 0.52
bytes per weight) and dequantised, whole, each time the block reads it: a parametrization on the experts module
(``torch.nn.utils.parametrize``), so transformers' experts code reads an ordinary 16-bit weight.

Trade-off: the dequantised copy of a block's experts exists while that block runs, and autograd keeps it for
the block's backward (the grouped matmul saves its weight). With activation checkpointing only the block being
computed holds one; without it, every block's copy stays until backward, which is about what 16-bit experts
would cost. Plans for MoE models therefore pair it with checkpointing; the trace counts either case as it runs.
Quality: the frozen experts compute with NF4's quantisation error, as QLoRA's Linear layers do. The experts
cannot train (no LoRA on quantised experts: PEFT's ``target_parameters`` wraps a plain weight).

``--quantize-base int8`` leaves the experts in 16 bits (bitsandbytes' int8 matmul is for Linear layers).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from memfit.models import transformer_blocks
from memfit.techniques.quantized_base import NF4_BLOCKSIZE, bitsandbytes


class DequantizedExperts(nn.Module):
    """The parametrization: the packed NF4 codes -> the experts' weight in the compute dtype."""

    def __init__(self, quant_state: Any) -> None:
        super().__init__()
        self.nf4_state = quant_state  # (not "quant_state": that names a 4-bit Linear layer's own)

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        weight: torch.Tensor = bitsandbytes().functional.dequantize_4bit(packed, self.nf4_state)
        return weight  # (experts, in, out) in the compute dtype


def is_expert_weight(module: nn.Module, name: str, parameter: torch.Tensor) -> bool:
    """A MoE block's stacked expert weight: a 3-D floating-point projection (``gate_up_proj``, ``down_proj``) of an
    experts module (not a convolution's kernel, a class token or RWKV's mixing vectors)."""
    return (parameter.dim() == 3 and parameter.is_floating_point() and not isinstance(module, nn.modules.conv._ConvNd)
            and ("expert" in type(module).__name__.lower() or name.endswith("_proj")))


def expert_weights(block: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, name) of every stacked expert weight in ``block`` (:func:`is_expert_weight`)."""
    return [(module, name) for module in block.modules()
            for name, parameter in list(module.named_parameters(recurse=False))
            if is_expert_weight(module, name, parameter)]


def quantize_experts(model: nn.Module, compute_dtype: torch.dtype) -> int:
    """Store every stacked expert weight of ``model``'s repeated blocks (``model`` itself when it has none) in
    NF4, read back through :class:`DequantizedExperts`; returns how many were quantised. Applied with
    :func:`memfit.techniques.quantized_base.quantize_base` under ``--quantize-base nf4``."""
    has_blocks = any(isinstance(module, nn.ModuleList) and len(module) > 0 for module in model.modules())
    blocks = transformer_blocks(model) if has_blocks else [model]
    weights = [weight for block in blocks for weight in expert_weights(block)]
    for module, name in weights:
        _quantize(module, name, compute_dtype)
    return len(weights)


def _quantize(module: nn.Module, name: str, compute_dtype: torch.dtype) -> None:
    bnb = bitsandbytes()
    weight = getattr(module, name).detach().to(compute_dtype).contiguous()
    packed, state = bnb.functional.quantize_4bit(weight, blocksize=NF4_BLOCKSIZE, compress_statistics=True,
                                                 quant_type="nf4")
    del weight
    stored = nn.Parameter(packed, requires_grad=False)
    # what count_parameters and the tracker read
    stored.quant_state = state  # type: ignore[attr-defined]
    delattr(module, name)
    module.register_parameter(name, stored)
    parametrize.register_parametrization(module, name, DequantizedExperts(state), unsafe=True)


def quantized_expert_names(model: nn.Module) -> set[str]:
    """The last names (``gate_up_proj``) of the expert weights stored in NF4."""
    return {name for module in model.modules()
            for name, parametrizations in getattr(module, "parametrizations", {}).items()
            if any(isinstance(each, DequantizedExperts) for each in parametrizations)}
