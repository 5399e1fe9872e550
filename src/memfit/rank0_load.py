"""One copy of the model per launch: under FSDP, rank 0 reads the weights, the other ranks build the model's
structure on the ``meta`` device (no memory) and receive their shards from rank 0.

Without it each of a machine's N ranks builds the whole model in host memory before sharding it: N fp32 copies
at once (an 8B model on 8 GPUs: 8 x 30 GiB of host memory at load), though each rank keeps 1/N of it. Here the
ranks build the same modules, the techniques applied (freezing, checkpointing, LoRA), rank 0 from the weights and
the others on ``meta``; every rank shards its model (FSDP2 shards meta parameters as it shards real ones), the
others allocate their empty shards (on the host under ``--cpu-offload``, where FSDP2 keeps them, the buffers on
the card), and rank 0 broadcasts every parameter through the device, one at a time, each rank copying its slice
into its shard, then every buffer. The weights are rank 0's, bit for bit, as they would have been on every rank;
the random number generator is rank 0's after its build on every rank, as a build on each would have left it.

Trade-off: the machine of rank 0 still holds one full copy while it broadcasts, and the broadcast sends every
tensor to every rank once (a load's worth of traffic over the link, against N reads of the files); each tensor
passes whole through every rank's device on its way to the shard, one at a time (an 8B model's embedding: 2 GiB
in fp32, before training starts: not in the step's estimate, but in the run's overall peak).

A 4-bit base (QLoRA) is quantised by rank 0 alone. The other ranks quantise their meta weights on the meta device
(bitsandbytes' kernels have meta implementations: the packed weights and every quantisation state get their
shapes and dtypes); their packed weights are filled like any weight, and every state's tensors (codes, scales,
offsets, which are neither parameters nor buffers) are made empty on the device and broadcast from rank 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memfit.build import loads_as_saved
from memfit.config import TrainConfig
from memfit.distributed import any_rank, decided_once
from memfit.errors import TrainingError
from memfit.models import ModelSpec
from memfit.techniques.quantized_base import place_quant_states

Manifest = dict[str, tuple[tuple[int, ...], torch.dtype]]


def loads_once(config: TrainConfig, spec: ModelSpec, strategy: str, world_size: int) -> bool:
    """Whether this run's model is read by rank 0 alone (see the module docstring for the runs that are not;
    nor a checkpoint stored quantised, whose modules only its weights make)."""
    return strategy == "fsdp" and world_size > 1 and config.quantize_base in ("none", "nf4") \
        and getattr(spec.hf_config, "quantization_config", None) is None


def load_host_bytes(config: TrainConfig, spec: ModelSpec, task: str, low_dtype: torch.dtype | None, *,
                    strategy: str, ranks: int) -> int:
    """Host memory one machine holds while its ``ranks`` build the model: each build's weights as loaded (as
    saved, or in fp32: :func:`memfit.build.loads_as_saved`; a config without a dtype, a preset's, builds fp32;
    a QLoRA base is quantised after it is loaded whole), on rank 0 alone where it reads for all
    (:func:`loads_once`), else on every rank."""
    from memfit.memory.depth import parameter_count

    saved = getattr(spec.hf_config, "dtype", None)
    saved = getattr(torch, saved, None) if isinstance(saved, str) else saved
    size = saved.itemsize if isinstance(saved, torch.dtype) and saved.is_floating_point else 4
    builders = 1 if loads_once(config, spec, strategy, config.world_size) else ranks
    return builders * parameter_count(spec, task) * (size if loads_as_saved(config, low_dtype) else 4)


def build(make: Callable[[bool], nn.Module], *, main: bool, once: bool, device: torch.device) -> nn.Module:
    """The model: as ``make(True)`` builds it, with its weights; with ``once``, on rank 0 (``main``) alone, and
    elsewhere its structure, ``make(False)`` (from the config: weights cannot be read onto ``meta``), on the
    ``meta`` device, once rank 0 has built its model. The other ranks wait for that in torchrun's key-value
    store (:func:`memfit.distributed.decided_once`), not in a collective, whose timeout a large model's read
    could outlast; rank 0's failure is raised on every rank."""
    if not once:
        return make(True)
    built = decided_once("model", lambda: make(True) if main else None, encode=lambda _: "built",
                         decode=lambda _: None)
    if built is not None:
        return built
    with torch.device("meta"):
        model = make(False)
    place_quant_states(model, device)  # empty 4-bit states, filled by :func:`shard_from_rank_0`: a state dict
    return model  # reads them (checkpoints.architecture)


def materialised_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers that hold memory (none on ``meta``), each storage once."""
    storages = {id(t): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()] if not t.is_meta}
    return sum(storages.values())


def shard_from_rank_0(model: nn.Module, shard: Callable[[nn.Module], nn.Module], *, main: bool,
                      device: torch.device, offload: bool = False) -> nn.Module:
    """``model`` sharded by ``shard`` on every rank, each shard holding rank 0's values (a collective);
    ``offload``: FSDP2 keeps the shards on the host."""
    full: dict[str, Any] = _loadable(model) if main else {}  # rank 0's tensors, kept until broadcast
    manifest: Manifest = {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in full.items()}
    manifest.update({f"buffer:{name}": (tuple(buffer.shape), buffer.dtype) for name, buffer in model.named_buffers()
                     if main})  # every buffer is broadcast, the non-persistent ones too
    shared: list[Any] = [manifest]
    dist.broadcast_object_list(shared, src=0)
    problem = None if main else _match(model, shared[0])
    if any_rank(problem is not None, device):  # every rank stops, none waits on a collective
        raise TrainingError(problem or "another rank built a model other than rank 0's; report it, with the model "
                            "and the command")
    model = shard(model)
    if not main:
        _allocate(model, device, offload=offload)
    for tensor in place_quant_states(model, device):  # the same slots, in the same order, on every rank
        dist.broadcast(tensor, src=0)
    _broadcast_parameters(model, full, shared[0], main=main, device=device)
    del full
    for buffer in model.buffers():  # every buffer, the non-persistent ones too, whole on every rank
        dist.broadcast(buffer, src=0)
    state = [torch.get_rng_state()]
    dist.broadcast_object_list(state, src=0)
    torch.set_rng_state(state[0])
    return model


def _allocate(model: nn.Module, device: torch.device, *, offload: bool) -> None:
    """The meta model's shards and buffers made empty on ``device``; with ``offload`` its shards on the host
    (FSDP2 pins them there), never all on the card at once."""
    model.to_empty(device=torch.device("cpu") if offload else device)
    if offload:
        for module in model.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                setattr(module, name, buffer.to(device))


def _broadcast_parameters(model: nn.Module, full: dict[str, torch.Tensor], manifest: Manifest, *, main: bool,
                          device: torch.device) -> None:
    """Rank 0's parameters (``full``), each broadcast whole through ``device`` in the manifest's order, each
    other rank copying its slice into its shard; a tied weight once (every rank's model ties the same names)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    targets = _loadable(model, keep_vars=True)
    buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    done: set[int] = set()
    with torch.no_grad():
        for name, (shape, dtype) in manifest.items():
            if name.startswith("buffer:") or name in buffers or id(targets[name]) in done:
                continue
            done.add(id(targets[name]))
            whole = full[name].to(device) if main else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(whole, src=0)
            if main:  # its shards were made from these values
                continue
            target = targets[name]
            if isinstance(target, DTensor):
                part = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(part.to_local())
            else:
                target.copy_(whole)


def _loadable(model: nn.Module, *, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """``model``'s state dict as torch's distributed state dicts load it: its parameters and buffers, without the
    quantisation state bitsandbytes adds for a 4-bit layer (broadcast on its own)."""
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    names |= {name for name, _ in model.named_buffers(remove_duplicate=False)}
    return {name: tensor for name, tensor in model.state_dict(keep_vars=keep_vars).items() if name in names}


def _match(model: nn.Module, manifest: Manifest) -> str | None:
    """The meta model given rank 0's dtypes (a checkpoint may load in its own: ``dtype="auto"``); or, where its
    structure differs from rank 0's (a defect), what differs."""
    tensors = {**_loadable(model, keep_vars=True),
               **{f"buffer:{name}": buffer for name, buffer in model.named_buffers()}}
    differs = sorted(set(tensors) ^ set(manifest)) or [name for name, (shape, _) in manifest.items()
                                                        if tuple(tensors[name].shape) != shape]
    if differs:
        return (f"rank {dist.get_rank()} built a model other than rank 0's ({', '.join(differs[:3])}); report it, "
                "with the model and the command")
    for name, (_, dtype) in manifest.items():
        tensor = tensors[name]
        if tensor.dtype != dtype:  # a buffer's data too: its module keeps the same tensor object
            tensor.data = tensor.data.to(dtype)
    return None
