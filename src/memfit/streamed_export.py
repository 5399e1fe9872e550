"""The fine-tuned model of a sharded (FSDP2) run, saved as a Hugging Face directory without gathering it.

Gathering the state dict to save it (:func:`memfit.distributed.full_state_dict`) puts the whole model in rank
0's host memory: 32 GB for an 8B model in fp32, 140 GB for a 70B one in 16 bits, on top of what the node
already holds. Here each rank writes the shards of the weights it holds
(:class:`torch.distributed.checkpoint.hf_storage.HuggingFaceStorageWriter`: no collective moves a weight), then rank 0
consolidates them into the model's safetensors files by copying byte ranges from the shard files: no rank
ever holds more than its own shards and one range being copied.

Trade-off: the disk holds the shards beside the consolidated files until those are written (twice the model,
for a moment). The files are those a one-process ``save_pretrained`` writes: ``model.safetensors`` up to 50 GB
of weights, else ``model-0000k-of-0000n.safetensors`` with their index. A model whose transformers
class converts its weights when it saves (a fused mixture of experts saved as separate experts) is gathered
and saved by transformers, as before: the conversion needs the whole state dict.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit import distributed

FILE_BYTES = 50 * 10**9
"""The most bytes of weights in one consolidated file, as ``save_pretrained``'s default (a larger single weight
gets a file of its own)."""
INDEX = "model.safetensors.index.json"


def streams(model: nn.Module) -> bool:
    """Whether ``model`` (sharded) saves its weights under the names and shapes it holds them: a transformers
    model without weight conversions on saving."""
    from transformers import PreTrainedModel
    from transformers.core_model_loading import revert_weight_conversion

    held = distributed.unwrap(model)
    if not isinstance(held, PreTrainedModel):
        return False
    shapes = {name: (tuple(value.shape), value.dtype) for name, value in _sharded_state(model).items()}
    meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in shapes.items()}
    try:
        saved = revert_weight_conversion(held, meta)
    except Exception:  # a conversion that cannot run on shapes alone: transformers saves it
        return False
    return {name: (tuple(value.shape), value.dtype) for name, value in saved.items()} == shapes


def save(model: nn.Module, directory: Path, *, main: bool, file_bytes: int = FILE_BYTES) -> None:
    """Write ``model``'s weights and config to ``directory`` as a Hugging Face model (a collective: every rank
    writes its shards; ``main``, rank 0, consolidates them and writes the config)."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict_saver import save as save_shards

    state = _sharded_state(model)
    writer = HuggingFaceStorageWriter(str(directory), fqn_to_index_mapping=_files(state, file_bytes),
                                      save_distributed=True, enable_consolidation=True)
    save_shards(dict(state), storage_writer=writer)  # returns on every rank once rank 0 has consolidated
    if main:
        shutil.rmtree(writer.path)  # the shards, now in the consolidated files
        files = sorted(directory.glob("model-*-of-*.safetensors"))
        if len(files) == 1:  # one file: named as one process names it, no index
            files[0].rename(directory / "model.safetensors")
            (directory / INDEX).unlink()
        _save_config(distributed.unwrap(model), directory)


def _sharded_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight under the name one process saves it, as each rank holds it (a DTensor's shard); a tied
    weight once, under its first name."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    aliases = distributed.tied_aliases(distributed.unwrap(model))
    return {name: value for name, value in get_model_state_dict(model).items()
            if name not in aliases and isinstance(value, torch.Tensor)}


def _files(state: dict[str, torch.Tensor], file_bytes: int) -> dict[str, int]:
    """The consolidated file (1, 2, ...) of each weight, in order, at most ``file_bytes`` of weights per file."""
    files, index, filled = {}, 1, 0
    for name, value in state.items():
        size = value.numel() * value.element_size()  # a DTensor's: the whole weight's
        if filled and filled + size > file_bytes:
            index, filled = index + 1, 0
        files[name], filled = index, filled + size
    return files


def _save_config(model: Any, directory: Path) -> None:
    """The config (and generation config) of a transformers ``model`` as ``save_pretrained`` writes them: the
    weights' dtype and the model's class (FSDP2's wrapper class named without its prefix) recorded."""
    config = model.config
    config.dtype = str(model.dtype).split(".")[1]
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.save_pretrained(directory)
    if model.can_generate():
        model.generation_config.save_pretrained(directory)
