"""FSDP2's CPU offload (``--cpu-offload``) as a CUDA run does it, in a trace that runs on the CPU.

With ``CPUOffloadPolicy`` each rank keeps its parameter shards, their gradients and the optimizer on the host.
Before a layer's all-gather FSDP2 copies the layer's shards to the card (and casts them to the compute dtype
there); after the layer's reduce-scatter it copies the gradient shard to the host and drops the card's copy; the
optimizer steps on the host. The trace runs on the CPU, where those copies are no-ops (the tensor is already on
the CPU), and FSDP2 makes them inside its autograd hooks, where no Python-level interception runs. So they are
given at the level every op passes, the tracker's dispatch:

- the shards, once FSDP2 has made them, are the host's (``offloaded_parameters``);
- an all-gather's input made from host shards (the compute-dtype cast, or FSDP2's copy-in op) runs on the card:
  the shards' card copies live while it runs, its output is the card's;
- a reduce-scatter's output (the gradient shards) moves to the host once reduced (``offloaded_gradients``);
  where it is reduced in another dtype than the shards' (``--precision bf16-true``: bf16 shards, gradients reduced
  in fp32), FSDP2 first casts it on the card: the reduced output stays there until the cast, and the cast moves;
- HSDP (a shard group smaller than the ranks, of two or more) first all-reduces the reduced output across the
  groups (one reduced in an earlier micro-step without it stays on the card, to be added in), and FSDP2 keeps
  the all-reduced output on the card until the backward is finalised (its all-reduce state), cast or not: the
  gradient shards move to the host at the all-reduce (or at the cast), and the card keeps a buffer of the
  all-reduced output's bytes until the backward ends (``temporaries``);
- any other op whose tensors are on the host runs there (the optimizer's state and update, clipping, FSDP2's
  padding of a shard at its first forward): ``offloaded_optimizer`` in the optimizer's phase.

Trade-off: the card-side copies follow FSDP2's order of work as torch 2.13 lays it out (the shard copies of a
layer before its all-gather buffer without a cast: the same bytes live at the copy-in, a caching allocator may
place them differently). The host figure counts the gradient shards with FSDP2's padding. Under HSDP the card
holds every layer's all-reduced output at the backward's end, as FSDP2 keeps them: offload spares the card the
parameters and the optimizer, not those; and with the step in backward the host counts every layer's gradient
shards until the backward ends (in the trace they share the storage FSDP2 keeps), where a card run frees each
after its update: the host figure is over by all but one layer's shards. Groups of one rank (``--shard-group
1``) reduce without a reduce-scatter: not emulated, refused. Pinned or pageable host memory is the same bytes;
fake tensors cannot pin, so the trace does not.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from memfit.config import TrainConfig
from memfit.errors import ConfigError
from memfit.memory.tracker import StorageTracker, local_tensors

SHARDS = "offloaded_parameters"
GRADIENTS = "offloaded_gradients"
OPTIMIZER = "offloaded_optimizer"
CARD_SIDE = ("aten::_to_copy", "fsdp::all_gather_copy_in")
"""Ops FSDP2 runs on the card with the shards' card copies (the cast to the compute dtype, its copy-in)."""
REDUCE_SCATTER = "c10d::_reduce_scatter_base_"
ALL_REDUCE = "c10d::allreduce_"


class HostShards:
    """The rules above, for ``tracker`` (which runs every op it sees through :meth:`dispatch` while
    :attr:`StorageTracker.host_shards` is set)."""

    def __init__(self, tracker: StorageTracker, *, hybrid: bool = False) -> None:
        self.tracker = tracker
        self.hybrid = hybrid
        """HSDP: each reduced output is all-reduced across the shard groups before it moves."""
        self._all_reducing: set[int] = set()
        """Reduced outputs on the card, to be all-reduced (HSDP)."""
        self._held: list[tuple[str, int]] = []
        """The card's buffers of all-reduced outputs, kept until the backward ends (HSDP)."""
        self._copies = itertools.count()
        self.reduced = 0
        """Reduce-scatters seen (each output leaving the card by the rules above)."""
        self.gradient_dtypes: set[torch.dtype] = set()
        """The trained shards' dtypes: the gradient shards' a reduced output is cast to, if another."""
        self._cast_pending: set[int] = set()
        """Reduced outputs, on the card until their cast to the shards' dtype."""

    def offload(self, module: torch.nn.Module) -> None:
        """The sharded module's parameters (its shards) move to the host."""
        self.tracker.move_to_host(list(module.parameters()), SHARDS)
        self.gradient_dtypes = {parameter.dtype for parameter in module.parameters() if parameter.requires_grad}

    def dispatch(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """Run one op the tracker sees, on the side of the rules above, and count it there."""
        tracker = self.tracker
        if not tracker.in_phase("backward") and (self._held or self._all_reducing or self._cast_pending):
            for buffer in self._held:  # the backward was finalised
                tracker.release(buffer)
            self._held = []
            self._all_reducing.clear()  # partial outputs, added into the last micro-step's before its all-reduce
            self._cast_pending.clear()
        copies = self.card_copies(func, (args, kwargs))
        try:
            out = func(*args, **kwargs)
            leaves = [leaf for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor)]
            tracker.attribute(func, args, leaves)
            host = None if copies else self.host_category((args, kwargs))
            if host is not None:
                tracker.count_host_op(func, args, kwargs, out)
                tracker.track_host(leaves, host)
                return out
            tracker.count_outputs(func, args, kwargs, out, leaves)
        finally:
            for key in copies:
                tracker.release(key)
        name = func._schema.name
        if name == REDUCE_SCATTER:
            self.reduced += 1
            if self.hybrid:
                self._all_reducing.add(args[0].untyped_storage()._cdata)
            else:
                self._reduced_on_card(args[0], held=False)
        elif name == ALL_REDUCE and self._all_reducing:
            for tensor in self._local(args[0]):
                if tensor.untyped_storage()._cdata in self._all_reducing:
                    self._all_reducing.discard(tensor.untyped_storage()._cdata)
                    self._reduced_on_card(tensor, held=True)
        elif self._cast_pending and name == "aten::_to_copy":
            pending = {tensor.untyped_storage()._cdata for tensor in self._local(args)} & self._cast_pending
            if pending:  # the cast gradient shards move to the host; the reduced output is freed once FSDP2 drops it
                self._cast_pending -= pending
                tracker.move_to_host(leaves, GRADIENTS)
        return out

    def _reduced_on_card(self, tensor: torch.Tensor, *, held: bool) -> None:
        """A layer's reduced gradient shards, ready to leave the card: cast first where the shards are in another
        dtype (the reduced output then stays counted on the card for as long as FSDP2 references it), else moved
        to the host, and under HSDP (``held``) a buffer of its bytes kept on the card until the backward ends."""
        if tensor.dtype not in self.gradient_dtypes and len(self.gradient_dtypes) == 1:
            self._cast_pending.add(tensor.untyped_storage()._cdata)
            return
        self.tracker.move_to_host([tensor], GRADIENTS)
        if held:  # first moved, then held: never counted twice on the card
            buffer = ("all-reduce state", next(self._copies))
            self.tracker.allocate(buffer, tensor.untyped_storage().nbytes(), "temporaries")
            self._held.append(buffer)

    def check(self) -> None:
        """After a step: FSDP2 reduce-scattered through the op the rules know (another torch's FSDP2 may not,
        and its gradient shards would stay counted on the card)."""
        if not self.reduced:
            raise ConfigError(f"--cpu-offload: this torch's FSDP2 ({torch.__version__}) reduces gradients "
                              f"without {REDUCE_SCATTER}, which the estimate's offload emulation follows; "
                              "estimate without --cpu-offload (the card then holds at most that figure)")

    def card_copies(self, func: Any, args: Any) -> list[tuple[str, int]]:
        """Before a card-side op on host shards: their card copies, allocated (released by the caller after
        the op)."""
        if func._schema.name not in CARD_SIDE or self.tracker.in_phase("optimizer"):
            return []
        copies = []
        for storage in self._host_storages(args):
            key = ("card copy", next(self._copies))
            self.tracker.allocate(key, storage.nbytes(), "temporaries")
            copies.append(key)
        return copies

    def host_category(self, args: Any) -> str | None:
        """Where an op whose tensors are on the host (one at least, none on the card) puts its outputs."""
        keys = [tensor.untyped_storage()._cdata for tensor in self._local(args)]
        hosts = [category for key in keys for category in [self.tracker.host_category_of(key)] if category]
        if not hosts or any(self.tracker.counts(key) for key in keys):
            return None
        return OPTIMIZER if self.tracker.in_phase("optimizer") else hosts[0]

    def _host_storages(self, args: Any) -> list[torch.UntypedStorage]:
        seen: dict[int, torch.UntypedStorage] = {}
        for tensor in self._local(args):
            storage = tensor.untyped_storage()
            if self.tracker.host_category_of(storage._cdata) == SHARDS:
                seen.setdefault(storage._cdata, storage)
        return list(seen.values())

    @staticmethod
    def _local(args: Any) -> list[torch.Tensor]:
        return list(local_tensors(leaf for leaf in tree_leaves(args) if isinstance(leaf, torch.Tensor)))


def offload_problems(config: TrainConfig) -> list[str]:
    """What of ``--cpu-offload`` the estimate cannot emulate: groups of one rank, which reduce without a
    reduce-scatter (each rank a whole replica, all-reduced as DDP does)."""
    if config.cpu_offload and config.shard_group == 1 and config.world_size > 1:
        return ["--cpu-offload with --shard-group 1 is not estimated (groups of one rank reduce without a "
                "reduce-scatter, which the offload emulation follows): use a larger --shard-group, or estimate "
                "without --cpu-offload; the card then holds at most that figure"]
    return []


def offloaded(tracker: StorageTracker, model: torch.nn.Module, *, hybrid: bool = False) -> None:
    """From now on ``tracker`` counts ``model``'s FSDP2 shards, their gradients and the optimizer on the host;
    ``hybrid``: sharded within groups (HSDP)."""
    shards = HostShards(tracker, hybrid=hybrid)
    tracker.host_shards = shards
    shards.offload(model)
