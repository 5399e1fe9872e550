"""The fine-tuned model of a sharded (FSDP2) run, saved as a Hugging Face directory without gathering it.

Gathering the state dict to save it (:func:`memfit.distributed.full_state_dict`) puts the whole model in rank
0's host memory, twice while safetensors serialises it: an 8B model is 32 GB in fp32, a 70B one 140 GB in 16
bits. Here each rank writes the shards of the weights it holds
(:class:`torch.distributed.checkpoint.hf_storage.HuggingFaceStorageWriter`: no collective moves a weight), one
output file's share at a time, then rank 0 consolidates them into the model's safetensors files by copying byte
ranges from the shard files (one weight at a time). A rank holds at most its share of one file twice (the
tensors and their serialised bytes), rank 0 one weight more.

Trade-offs:

- The disk holds the shards beside the consolidated files until those are written (twice the model, for a
  moment).
- The files are at most 5 GB each, as large models on the Hub are: ``model.safetensors`` for a smaller model
  (the file one process's ``save_pretrained`` writes), else ``model-0000k-of-0000n.safetensors`` and their index,
  where one process writes one file up to 50 GB.
- Gathered and saved by transformers, as before:
  - a model whose transformers class converts its weights when it saves (a fused mixture of experts saved as
    separate experts), since the conversion needs the whole state dict;
  - a model with integer, 0-dimensional or replicated (not sharded) state, such as batch norm's counters;
  - a launch over several machines, whose ranks may not share a disk.

Rank 0 decides which of the two saves runs and tells the others: only rank 0 loaded the weights
(:mod:`memfit.rank0_load`), so only its model knows the conversions its checkpoint went through.

While rank 0 consolidates, the other ranks wait in a collective of the save. Consolidating a 70B model copies
140-280 GB: minutes, perhaps more than the run's collective timeout (10 minutes). So the save's collectives run
on a gloo group of their own, made for it, whose timeout is :data:`CONSOLIDATION_TIMEOUT`, and rank 0 copies
with :data:`CONSOLIDATION_THREADS` threads.
"""

from __future__ import annotations

import datetime
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memfit import distributed

FILE_BYTES = 5 * 10**9
"""The most bytes of weights in one consolidated file (a larger single weight gets a file of its own)."""
INDEX = "model.safetensors.index.json"
SHARDS = "sharded"
"""Where the writer puts the ranks' shards, inside the directory (torch's name for it)."""
CONSOLIDATION_TIMEOUT = datetime.timedelta(hours=2)
"""How long the other ranks wait, in the save's last collective, for rank 0 to consolidate the files."""
CONSOLIDATION_THREADS = 4


def streams(model: nn.Module, *, main: bool) -> bool:
    """Whether ``model`` (sharded) is saved from its shards (:func:`save`): decided by rank 0 (``main``) and
    told to every rank (a collective)."""
    try:
        decision = [_streams(model) if main else None]
    except Exception:  # whatever rank 0 cannot check (a conversion that needs values), it gathers
        decision = [False]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(decision, src=0)
    return bool(decision[0])


def _streams(model: nn.Module) -> bool:
    """A transformers model on one machine, every weight a sharded floating-point tensor saved under the name
    and shape it is held in (no weight conversion on saving)."""
    from torch.distributed.tensor import DTensor
    from transformers import PreTrainedModel
    from transformers.core_model_loading import revert_weight_conversion

    held = distributed.unwrap(model)
    if distributed.launched_per_node() is not None or not isinstance(held, PreTrainedModel):
        return False
    state = _sharded_state(model)
    if not state or not all(isinstance(value, DTensor) and value.is_floating_point() and value.dim() > 0
                            for value in state.values()):
        return False
    shapes = {name: (tuple(value.shape), value.dtype) for name, value in state.items()}
    meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in shapes.items()}
    saved = revert_weight_conversion(held, meta)  # one that cannot run on shapes alone raises: gathered
    return {name: (tuple(value.shape), value.dtype) for name, value in saved.items()} == shapes


def save(model: nn.Module, directory: Path, *, main: bool, file_bytes: int = FILE_BYTES) -> None:
    """Write ``model``'s weights and config to ``directory`` as a Hugging Face model (a collective: every rank
    writes its shards; ``main``, rank 0, consolidates them and writes the config). Weight files of an earlier
    save there are removed first (a resumed run saves again)."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict_saver import save as save_shards

    state = _sharded_state(model)
    files = _files(state, file_bytes)
    writer = HuggingFaceStorageWriter(str(directory), fqn_to_index_mapping=files, save_distributed=True,
                                      enable_consolidation=True, thread_count_consolidation=CONSOLIDATION_THREADS)
    shards = Path(writer.path)
    assert shards == directory / SHARDS, shards
    if main:
        remove_weights(directory)
    group = dist.new_group(backend="gloo", timeout=CONSOLIDATION_TIMEOUT)  # (every rank makes it: a collective)
    try:
        dist.barrier(group=group)
        save_shards(dict(state), storage_writer=writer, process_group=group)  # returns once rank 0 consolidated
    finally:
        dist.destroy_process_group(group)
    if main:
        shutil.rmtree(shards)  # now in the consolidated files
        if max(files.values(), default=1) == 1:  # one file: named as one process names it, no index
            (directory / "model-00001-of-00001.safetensors").rename(directory / "model.safetensors")
            (directory / INDEX).unlink()
        _save_config(distributed.unwrap(model), directory)


def remove_weights(directory: Path) -> None:
    """Remove the weight files an earlier save left in ``directory`` (a resumed run saves again, perhaps the
    other way: one file where there were several, or the other way round), and its shards."""
    shutil.rmtree(directory / SHARDS, ignore_errors=True)
    for stale in [*directory.glob("model-*-of-*.safetensors"), directory / INDEX, directory / "model.safetensors"]:
        stale.unlink(missing_ok=True)


def _sharded_state(model: nn.Module) -> dict[str, Any]:
    """Every weight under the name one process saves it, as each rank holds it (a DTensor's shard), but the
    names transformers leaves out of a save; a tied weight once, under its first name."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    held = distributed.unwrap(model)
    left_out = distributed.tied_aliases(held) | set(getattr(held, "_keys_to_ignore_on_save", None) or ())
    return {name: value for name, value in get_model_state_dict(model).items() if name not in left_out}


def _files(state: dict[str, Any], file_bytes: int) -> dict[str, int]:
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
