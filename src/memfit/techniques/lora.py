"""LoRA: train a low-rank update beside each frozen Linear weight instead of the weight itself (PEFT).

Trade-off: a Linear of ``d_in x d_out`` trained in full costs, under fp32 AdamW, 16 bytes per weight (the
weight, its gradient, two moments); with LoRA of rank ``r`` it trains ``r * (d_in + d_out)`` parameters
instead, usually well under 1 % of the model, and the frozen base weight needs no gradient and no optimizer
state. Under a 16-bit ``--precision`` the frozen base Linear and embedding weights are also stored in that
dtype (2 bytes each): they are never updated, so they need no fp32 master copy, and autocast would cast them
to it at every matmul anyway. Activations are not reduced: the backward still passes through every frozen
layer (checkpointing reduces those). Quality: close to full fine-tuning for instruction and classification
tuning at ranks 8-64; it learns less new knowledge than full fine-tuning.

Targets: by default every Linear inside the repeated transformer blocks (attention and MLP projections);
``--lora-targets`` names others by their last name (``q_proj,v_proj``). With ``--train-top-layers K`` only the
top K blocks get adapters. A classification head is trained in full (PEFT's ``modules_to_save``). The adapter
is saved in PEFT's format (``PeftModel.from_pretrained`` loads it); ``--merge`` also writes the base model
with the update merged in.

Applied last: after quantising the base (:mod:`memfit.techniques.quantized_base`), freezing and
checkpointing (which transformers switches on in the blocks, where the adapters then sit).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from memfit.models import transformer_blocks
from memfit.quiet import NOISY_LOGGERS, raised_loggers
from memfit.techniques.quantized_base import bitsandbytes
from memfit.techniques.quantized_experts import is_expert_weight, quantized_expert_names

HEAD_NAMES = ("classifier", "score")
"""Classification heads of Hugging Face models: trained in full beside the adapters."""


def lora_target_names(model: nn.Module, targets: tuple[str, ...], train_top_layers: int | None) -> list[str]:
    """Full names of the Linear layers (plain or quantised) that get adapters."""
    return [f"{block_name}.{name}" for block_name, block in _adapted_blocks(model, train_top_layers)
            for name, module in block.named_modules()
            if isinstance(module, nn.Linear) and name and (not targets or name.rsplit(".", 1)[-1] in targets)]


def lora_target_parameters(model: nn.Module, targets: tuple[str, ...], train_top_layers: int | None) -> list[str]:
    """Full names of the stacked expert weights (3-D parameters of a mixture-of-experts block, not Linear layers)
    that ``targets`` names by their last name (``gate_up_proj,down_proj``): PEFT's ``target_parameters``. Only
    when named: by default a MoE model's adapters sit on its Linear layers (attention, shared experts)."""
    if not targets:
        return []
    return [f"{block_name}.{name}" for block_name, block in _adapted_blocks(model, train_top_layers)
            for name, parameter in block.named_parameters() if parameter.dim() == 3
            and name.rsplit(".", 1)[-1] in targets]  # (named: the user says which 3-D weights are experts)


def _adapted_blocks(model: nn.Module, train_top_layers: int | None) -> list[tuple[str, nn.Module]]:
    """(name, block) of the blocks that get adapters: every block (an encoder-decoder's in both stacks), or the
    top ``train_top_layers``."""
    blocks = transformer_blocks(model)
    if train_top_layers is not None:
        blocks = blocks[len(blocks) - train_top_layers:]
    block_ids = {id(block) for block in blocks}
    return [(name, module) for name, module in model.named_modules() if id(module) in block_ids]


def apply_lora(model: nn.Module, *, rank: int, alpha: float | None, dropout: float, targets: tuple[str, ...],
               train_top_layers: int | None, frozen_dtype: torch.dtype | None) -> nn.Module:
    """``model`` with LoRA adapters of ``rank`` (a ``peft.PeftModel``); the base is frozen, a classification
    head trains in full. ``frozen_dtype``: store the frozen float Linear, embedding and expert weights in it.
    ``targets`` may name a MoE block's stacked expert weights (:func:`lora_target_parameters`): PEFT adds the
    low-rank update to each expert's weight in every forward (a temporary of the experts' size)."""
    quantized = sorted(set(targets) & quantized_expert_names(model))
    if quantized:
        from memfit.errors import ConfigError

        raise ConfigError(f"--lora-targets {','.join(quantized)}: those expert weights are stored in NF4 "
                          "(--quantize-base nf4) and cannot take adapters; drop them from --lora-targets, or use "
                          "LoRA without --quantize-base")
    names = lora_target_names(model, targets, train_top_layers)
    parameters = lora_target_parameters(model, targets, train_top_layers)
    if not names and not parameters:
        from memfit.errors import ConfigError

        raise ConfigError(f"--lora-targets {','.join(targets)} names no Linear layer (or expert weight) of the "
                          "transformer blocks; give names such as q_proj,v_proj or drop the option for every Linear")
    fake = any(isinstance(p, FakeTensor) for p in model.parameters())
    with quiet_peft():
        from peft import LoraConfig, get_peft_model

        heads = [name for name in HEAD_NAMES if isinstance(getattr(model, name, None), nn.Module)]
        scale: Any = alpha if alpha is not None else 2 * rank  # PEFT types it int; a float works as well
        experts: dict[str, Any] = {"target_parameters": parameters} if parameters else {}  # (PEFT >= 0.17)
        config = LoraConfig(r=rank, lora_alpha=scale, lora_dropout=dropout, target_modules=names,
                            modules_to_save=heads or None, bias="none", **experts)
        # PEFT moves each new adapter to its base layer's device (and dtype, then back to fp32): where it was
        # made, as it was made. On fake tensors (the estimator's trace) a module's move swaps its tensors,
        # which fake parameters do not always allow, so there the moves are skipped.
        skip_move = mock.patch.object(nn.Module, "to", _unmoved) if fake else contextlib.nullcontext()
        with skip_move:
            peft_model: Any = get_peft_model(model, config)
    if frozen_dtype is not None:
        store_frozen(peft_model, frozen_dtype)
    return peft_model


def _unmoved(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    return module


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """Where PEFT is used: imported first (:func:`_import_peft`); its warnings about the model's layout are not
    the user's concern."""
    _import_peft()
    with raised_loggers(*NOISY_LOGGERS, "peft"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@functools.cache
def _import_peft() -> None:
    """Import PEFT once, quietly and outside any dispatch mode: it imports bitsandbytes (quietly first) and
    torchao, whose notes are not memfit's, and makes tensors at import, which neither a run's memory monitor
    nor the estimator's fake-tensor trace must take for the run's own; on the CPU, also where the model is
    built on the ``meta`` device (:mod:`memfit.rank0_load`), whose tensors bitsandbytes' first call cannot read."""
    with _disable_current_modes(), torch.device("cpu"):
        if importlib.util.find_spec("bitsandbytes") is not None:
            bitsandbytes()
        with raised_loggers(*NOISY_LOGGERS, "peft"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import peft  # noqa: F401


def store_frozen(model: nn.Module, dtype: torch.dtype) -> None:
    """Store the frozen fp32 weights of Linear and embedding layers, and a MoE block's stacked expert weights
    (3-D: most of such a model's bytes), in ``dtype``, in place (a weight tied to another layer stays tied).
    Norms and biases stay fp32."""
    for module in model.modules():
        for name, parameter in module.named_parameters(recurse=False):
            if stored_in_16_bits(module, name, parameter):
                parameter.data = parameter.data.to(dtype)


def stored_in_16_bits(module: nn.Module, name: str, parameter: nn.Parameter) -> bool:
    """What :func:`store_frozen` stores in 16 bits: a frozen fp32 weight of a Linear or embedding layer, or a
    MoE block's stacked expert weight (:func:`memfit.techniques.quantized_experts.is_expert_weight`)."""
    if parameter.requires_grad or parameter.dtype != torch.float32:
        return False
    return isinstance(module, nn.Linear | nn.Embedding) or is_expert_weight(module, name, parameter)


def settle_as_stored(model: nn.Module, dtype: torch.dtype | None) -> None:
    """A model loaded in its saved (maybe 16-bit) dtype, laid out as an fp32 build after :func:`store_frozen`:
    frozen Linear, embedding and expert weights in ``dtype`` (``None``: fp32, every weight); every other
    floating-point parameter (adapters, a trained head, norms, biases) and 16-bit buffer (a batch norm's
    statistics) in fp32. Without an fp32 copy of the whole model at load where ``dtype`` is 16-bit."""
    with torch.no_grad():
        for module in model.modules():
            for name, parameter in module.named_parameters(recurse=False):
                if not parameter.is_floating_point():  # a 4-bit base's packed storage
                    continue
                weight = not parameter.requires_grad and (isinstance(module, nn.Linear | nn.Embedding)
                                                          or is_expert_weight(module, name, parameter))
                target = dtype if weight and dtype is not None else torch.float32
                if parameter.dtype != target:
                    parameter.data = parameter.data.to(target)
            for name, buffer in module.named_buffers(recurse=False):
                if buffer.dtype in (torch.bfloat16, torch.float16):
                    setattr(module, name, buffer.float())


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


def save_merged(adapter_dir: Path, base: nn.Module, directory: Path) -> None:
    """The base model with the adapter saved in ``adapter_dir`` merged in, as a full model in ``directory``
    (:func:`merge_adapter`); this also proves that the saved adapter loads."""
    merge_adapter(adapter_dir, base).save_pretrained(directory, safe_serialization=True)


def merge_adapter(adapter_dir: Path, base: nn.Module) -> Any:
    """``base`` with the adapter saved in ``adapter_dir`` merged into its weights, through PEFT's own loader.

    ``base`` is the model as built before any technique, in its saved dtype, not quantised: a QLoRA
    adapter is merged into the original weights, as it would be deployed."""
    with quiet_peft():
        from peft import PeftModel

        return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
