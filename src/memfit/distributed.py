"""More than one process: data-parallel (DDP) and sharded (FSDP2) training, launched by ``torchrun``.

memfit does not build a parallel engine; it uses PyTorch's own and gets the details right:

- ``ddp``: :class:`~torch.nn.parallel.DistributedDataParallel` keeps a full replica per rank and all-reduces
  the gradients. Memory per rank is a single process's (gradients live in DDP's buckets for the whole run:
  ``gradient_as_bucket_view``), speed scales with the ranks minus the all-reduce that backward does not hide.
- ``fsdp``: FSDP2 (:func:`torch.distributed.fsdp.fully_shard`, one group per transformer layer, then the root)
  shards parameters, gradients and optimizer state: each rank holds ``1/N`` of them plus one layer gathered
  at a time. It costs an all-gather of every layer in forward and again in backward, and a reduce-scatter of
  the gradients: about 1.5x DDP's traffic. ``cpu_offload`` keeps the shards and the optimizer step on the
  host (``CPUOffloadPolicy``): the least device memory, at the price of host-device copies every step.
- ``auto``: FSDP when a replica would not fit the budget, else DDP.

Rules every rank follows, so the ranks never disagree:

- The effective batch is the *global* batch: one window of ``effective_batch`` samples per optimizer step,
  the same windows a single process takes. Rank ``r`` takes samples ``r, r + N, ...`` of each window
  (:func:`rank_chunks`), cut into the same number of micro-batches on every rank; a rank that runs out pads
  with a copy of a sample whose label is ignored, which adds nothing to the loss or the gradients. Each
  rank's loss is its share of the window's summed loss, scaled by N because DDP and FSDP average gradients:
  the averaged gradient is exactly the single-process window gradient.
- Gradients are synchronised once per optimizer step, in the window's last backward (:func:`gradient_sync`:
  ``no_sync()`` for DDP, ``set_requires_gradient_sync(False)`` for FSDP2 on the others), or under FSDP2 with
  ``reduce_every_micro_step`` in every backward, so they stay sharded (:func:`micro_step_sync`).
- A stop signal received by any rank is agreed on at the next window boundary (one all-reduce of one number
  per window, :func:`any_rank`), so all ranks save the same checkpoint and exit together.
- Rank 0 alone prints and writes metrics, the summary and the model.

Not supported: shrinking the micro-batch after an out-of-memory error (every rank would have to agree at
the failing op); a distributed run stops with a message that says how to plan it instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from memfit.config import TrainConfig
from memfit.errors import ConfigError
from memfit.models import transformer_layers

TIMEOUT = datetime.timedelta(minutes=10)
DECISION_TIMEOUT = datetime.timedelta(hours=2)
"""How long the other ranks wait for rank 0's decision (a plan of a large model takes minutes)."""
T = TypeVar("T")


@dataclass(kw_only=True)
class World:
    """This process's place in the run."""

    strategy: str = "none"
    """``none``, ``ddp`` or ``fsdp`` (``auto`` is resolved before the world exists)."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    cpu_offload: bool = False
    shard_group: int | None = None
    """FSDP: ranks per group that shards (HSDP: replicated across the groups); ``None``: all of them."""
    reduce_every_micro_step: bool = False
    """FSDP: gradients reduced in every micro-step (:func:`micro_step_sync`)."""
    allreduce_seconds: float = 0.0
    """DDP only: summed time the gradient buckets spent in flight (launch to completion), overlapping
    backward; the part backward does not hide is what the scaling benchmark measures."""

    @property
    def distributed(self) -> bool:
        return self.strategy != "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device_for(self, kind: str) -> torch.device:
        """This process's device of ``kind``: a distributed rank's own GPU is the one of its local rank."""
        if kind == "cuda" and self.distributed:
            return torch.device("cuda", self.local_rank)
        return torch.device(kind)


CANNOT_RECOVER = ("a distributed run cannot shrink its micro-batch on the fly (every rank would have to agree); "
                  "plan it with memfit plan --gpus N --budget SIZE, or lower --micro-batch-size, or use "
                  "--distributed fsdp")


def launched_world_size() -> int:
    """Processes in this launch: ``WORLD_SIZE`` as torchrun sets it, 1 without torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_per_node() -> int | None:
    """Processes on this machine where the launch spans several (``LOCAL_WORLD_SIZE`` below ``WORLD_SIZE``),
    else ``None``."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    return local if 0 < local < launched_world_size() else None


def launched_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def for_launch(config: TrainConfig) -> TrainConfig:
    """The training config with the world size torchrun launched; refuses a launch that does not match."""
    launched = launched_world_size()
    if launched > 1 and config.distributed == "none":
        raise ConfigError(f"launched with {launched} processes but --distributed none; add --distributed ddp, "
                          "fsdp or auto (or launch one process)")
    if config.world_size not in (1, launched):
        raise ConfigError(f"--world-size {config.world_size} but {launched} process(es) were launched; train "
                          f"with torchrun --nproc-per-node {config.world_size} (--world-size is for memfit "
                          "estimate and plan)")
    return dataclasses.replace(config, world_size=launched) if launched > 1 else config


def device_problems(config: TrainConfig, device_kind: str | None) -> list[str]:
    """What the run's strategy cannot do on a device of ``device_kind`` (when known)."""
    if config.cpu_offload and device_kind not in (None, "cuda"):
        return [f"--cpu-offload moves FSDP's shards from a CUDA card to host memory; on a {device_kind} device they "
                "are in host memory already: drop --cpu-offload"]
    return []


def decided_once(name: str, decide: Callable[[], T], *, encode: Callable[[T], str],
                 decode: Callable[[str], T]) -> T:
    """``decide()``, run by rank 0 alone under torchrun and read by the other ranks, so every rank goes on with
    the same answer (a plan) and one process, not N, does the work. It passes through the launcher's own
    key-value store (torchrun's agent hosts it at ``MASTER_ADDR:MASTER_PORT`` for its workers), before any
    process group exists; a :class:`ConfigError` (or any failure) of rank 0 is raised on every rank. Without
    torchrun's store, and in one process, every process decides for itself."""
    if launched_world_size() == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return decide()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,  # type: ignore[attr-defined]
                          timeout=DECISION_TIMEOUT)
    key = f"memfit/{name}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if launched_rank() != 0:
        answer = json.loads(store.get(key))
        if "error" in answer:
            raise ConfigError(answer["error"])
        return decode(answer["value"])
    try:
        value = decide()
    except BaseException as error:
        reason = str(error) if isinstance(error, ConfigError) else f"rank 0 failed to decide the {name}: {error!r}"
        store.set(key, json.dumps({"error": reason}))
        raise
    store.set(key, json.dumps({"value": encode(value)}))
    return value


def replica_config(config: TrainConfig) -> TrainConfig:
    """One rank's share of a distributed run as a single-process run: its micro-batch and accumulation."""
    return dataclasses.replace(config, distributed="none", world_size=1, cpu_offload=False, shard_group=None,
                               reduce_every_micro_step=False, effective_batch=config.per_rank_batch,
                               micro_batch_size=config.resolved_micro_batch_size, accumulation_steps=None,
                               budget=None, plan=None, device_profile=None).without_opt_ins()


@contextlib.contextmanager
def process_group(strategy: str, device_type: str, *, cpu_offload: bool = False,
                  shard_group: int | None = None, reduce_every_micro_step: bool = False) -> Iterator[World]:
    """The run's world: the default process group of a torchrun launch (NCCL on CUDA, gloo on CPU).

    Without torchrun a distributed strategy runs as a world of one (a real process group over an in-memory
    store), so a one-process run takes exactly the code path of an N-process one.
    """
    if strategy == "none":
        yield World()
        return
    backend = "nccl" if device_type == "cuda" else "gloo"
    launched = "RANK" in os.environ and "MASTER_ADDR" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    if launched:
        dist.init_process_group(backend, timeout=TIMEOUT)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,  # type: ignore[attr-defined]
                                timeout=TIMEOUT)
    try:
        yield World(strategy=strategy, rank=dist.get_rank(), world_size=dist.get_world_size(),
                    local_rank=local_rank, cpu_offload=cpu_offload, shard_group=shard_group,
                    reduce_every_micro_step=reduce_every_micro_step and strategy == "fsdp")
    finally:
        dist.destroy_process_group()


def wrap(model: nn.Module, world: World, *, low_precision: torch.dtype | None,
         device: torch.device) -> nn.Module:
    """The model as the strategy trains it. Techniques (freezing, checkpointing) are applied before this.

    FSDP2: one ``fully_shard`` per transformer layer, then the root (embeddings and head), as the FSDP2 docs
    order it; ``low_precision`` becomes a ``MixedPrecisionPolicy`` (parameters gathered in bf16/fp16, gradients
    reduced in fp32), and autocast still runs around the forward as in a single process.
    """
    if world.strategy == "ddp":
        model.to(device)
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[world.local_rank] if device.type == "cuda" else None,  # this rank's own GPU
            gradient_as_bucket_view=True)
        ddp.register_comm_hook(world, _timed_allreduce)
        return ddp
    if world.strategy == "fsdp":
        return shard(model, device_mesh(device.type, world.shard_group), low_precision=low_precision,
                     cpu_offload=world.cpu_offload)
    return model


def shard(model: nn.Module, mesh: Any, *, low_precision: torch.dtype | None, cpu_offload: bool,
          pin_memory: bool = True) -> nn.Module:
    """FSDP2 over ``mesh``: each transformer layer its own group, then the root (embeddings and head).
    ``pin_memory``: offloaded shards in pinned host memory (not in a trace: fake tensors cannot pin)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    options: dict[str, Any] = {"mesh": mesh, "offload_policy": CPUOffloadPolicy(pin_memory=pin_memory)
                               if cpu_offload else OffloadPolicy()}
    if low_precision is not None:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=low_precision, reduce_dtype=torch.float32)
    for layer in transformer_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def communicators(strategy: str, world_size: int, shard_group: int | None, device_kind: str) -> int:
    """The NCCL communicators each rank's card holds in a run: none in one process or on a CPU (gloo); the
    default group (DDP's all-reduce, FSDP over a mesh of every rank, memfit's own agreements); with HSDP also the
    mesh's two (across the groups, within each)."""
    if strategy == "none" or world_size == 1 or device_kind != "cuda":
        return 0
    return 3 if strategy == "fsdp" and hybrid(world_size, shard_group) else 1


def hybrid(world_size: int, shard_group: int | None) -> bool:
    """Whether ``shard_group`` makes FSDP2 hybrid (HSDP: groups that shard, replicated across each other); a
    group of every rank is plain FSDP."""
    return shard_group is not None and shard_group < world_size


def device_mesh(device_type: str, shard_group: int | None = None) -> Any:
    """The mesh FSDP2 shards over (made outside any fake-tensor mode: it is real process-group state): all ranks,
    or with ``shard_group`` a 2-D mesh of groups that each shard and replicate across each other (HSDP: FSDP2
    reduce-scatters the gradients within a group, then all-reduces them across the groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    ranks = dist.get_world_size()
    if shard_group is None or not hybrid(ranks, shard_group):
        return init_device_mesh(device_type, (ranks,))
    return init_device_mesh(device_type, (ranks // shard_group, shard_group), mesh_dim_names=("replicate", "shard"))


@contextlib.contextmanager
def fake_world(world_size: int, shard_group: int | None = None) -> Iterator[Any]:
    """A fake process group of ``world_size`` ranks, this process as rank 0, and its mesh (:func:`device_mesh`):
    collectives return at once and move no data, so one process can trace one rank's step (``memfit estimate
    --world-size``)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    require_no_group("estimating a distributed run")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield device_mesh("cpu", shard_group)
    finally:
        dist.destroy_process_group()


def _timed_allreduce(world: World, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """DDP's own averaging all-reduce, timed from launch to completion."""
    started = time.perf_counter()
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    future = dist.all_reduce(buffer, async_op=True).get_future()  # type: ignore[union-attr,unused-ignore]

    def finished(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        world.allreduce_seconds += time.perf_counter() - started
        return done.value()[0]

    return future.then(finished)


# DDP checks a hook's annotations against the objects themselves; this module's are strings (PEP 563)
_timed_allreduce.__annotations__.update(bucket=dist.GradBucket, world=World,  # type: ignore[attr-defined]
                                        **{"return": torch.futures.Future[torch.Tensor]})


def unwrap(model: nn.Module) -> nn.Module:
    """The model itself (DDP's ``.module``; an FSDP2 model is its own module)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Run one micro-step's forward and backward with (``enabled``) or without the gradient reduction."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        with contextlib.nullcontext() if enabled else model.no_sync():
            yield
        return
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    if set_sync is not None:  # FSDP2
        set_sync(enabled)
    yield


def micro_step_sync(model: nn.Module, *, every: bool) -> Callable[[bool], contextlib.AbstractContextManager[None]]:
    """What wraps each micro-step of a window (given whether it is the window's last): gradients reduced in the
    last backward only, or, with ``every`` (FSDP2), in each.

    Trade-off: reduced only at the end, FSDP2 accumulates every parameter's *unsharded* gradient until the
    window's last backward (a whole model's gradients on each rank, as DDP keeps them), for one reduce-scatter
    per window. Reduced in every micro-step, each block's unsharded gradient is reduce-scattered and freed as
    backward leaves it, and the shards accumulate: 1/N of the gradients stay, for one reduce-scatter per
    micro-step. With HSDP the reduced shards are all-reduced across the groups in the last micro-step only
    (``set_requires_all_reduce``): the slowest link is crossed once per window either way."""
    set_all_reduce = getattr(model, "set_requires_all_reduce", None) if every else None

    @contextlib.contextmanager
    def sync(last: bool) -> Iterator[None]:
        with gradient_sync(model, last or every):
            if set_all_reduce is not None:  # after: turning the sync on turns the all-reduce on too
                set_all_reduce(last)
            yield

    return sync


def rank_chunks(indices: list[int], size: int, world: World) -> tuple[list[list[int]], int]:
    """This rank's share of ``indices`` cut into micro-batches of at most ``size``, and how many of them, at
    the end, are padding (one sample the caller masks out).

    Every rank gets the same number of micro-batches, so collectives (FSDP's all-gathers, the final
    reduction) line up: ``ceil(ceil(len / N) / size)``.
    """
    share = indices[world.rank::world.world_size]
    per_rank = -(-len(indices) // world.world_size)
    count = -(-per_rank // size)
    chunks = [share[start:start + size] for start in range(0, len(share), size)]
    padding = count - len(chunks)
    chunks.extend([[indices[0]]] * padding)
    return chunks, padding


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is true on any rank (one all-reduce of one number)."""
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value)
    return bool(value.item() > 0)


def sum_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sums over the ranks."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return [float(value) for value in tensor.tolist()]


def mean_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """The mean over the ranks of a scalar tensor (a window loss), in place-free form."""
    total = tensor.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def gather(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order."""
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def full_state_dict(model: nn.Module, *, trained_only: bool = False) -> dict[str, torch.Tensor]:
    """Every weight, gathered on rank 0 and on the host (other ranks get ``{}``); ``trained_only``: the trained
    parameters alone (a LoRA run's adapters and head: what it saves), one at a time, so that rank 0 never holds
    the frozen base, gathered, beside them (a 70B base is 140 GB in 16 bits, its adapters a few hundred MB)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    if not trained_only:
        weights: dict[str, torch.Tensor] = get_model_state_dict(  # type: ignore[assignment]  # tensors only here
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # a tied weight is gathered under each of its names, as copies that share nothing: saved once, under its
        # first name (as one process saves it)
        return {name: value for name, value in weights.items() if name not in tied_aliases(unwrap(model))}
    trained = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    gathered: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():  # the same order on every rank: each gather a collective
        if name in trained:
            if isinstance(value, DTensor) and value.device.type != value.device_mesh.device_type:
                value = value.to(value.device_mesh.device_type)  # offloaded shards: gathered on the mesh's device
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            if dist.get_rank() == 0:
                gathered[name] = whole.detach().to("cpu", copy=True)
    return gathered


def tied_aliases(model: nn.Module) -> set[str]:
    """The names under which a parameter named earlier appears again (tied weights: an LM's output layer)."""
    seen: set[int] = set()
    aliases = set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            aliases.add(name)
        seen.add(id(parameter))
    return aliases


def require_no_group(what: str) -> None:
    if dist.is_available() and dist.is_initialized():
        raise ConfigError(f"{what} needs its own (fake) process group and one is already running; estimate "
                          "before launching, or in a separate process")
