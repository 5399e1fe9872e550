"""Trace a few blocks and a few micro-steps, replay the whole step: the same bytes as the full trace, sooner.

A training step repeats itself. The blocks of a decoder are the same block again and again, and after the
second micro-step of an accumulation window every micro-step but the last repeats the second (the gradients
already exist, the same activations come and go). A full trace dispatches every op of every repetition
(about 600,000 ops for 16 micro-steps of an 8B model); what the memory does is decided by the order and the
sizes of allocations and frees, which the repetitions only repeat.

So a shallow copy of the model (``k`` blocks) runs a short window (the first three micro-steps and the last)
under a :class:`RecordingTracker`, which writes down every allocation, free, relabelling and phase change,
each with its *owners*: the block and the micro-step it belongs to. A block owns what is allocated while it
runs (its forward up to the next block's, its backward from the gradient of its output to the gradient of its
input); outside them, a storage belongs to the one block whose tensors it is made from (the optimizer's state and its
temporaries, a parameter's shard; to none when made from several, as the sum of tied embeddings' gradients),
and a free belongs to whoever owns the freed storage.
:func:`expand` then inserts copies of one group of owners (blocks ``r+p .. r+2p-1``, or the third
micro-step) until the step has the model's depth and the window its length, renaming storages so that each
copy frees what its own copy allocated and hands its gradient to its neighbour, and :func:`replay` runs the
long record through an ordinary :class:`~memfit.memory.tracker.StorageTracker` (with the caching-allocator
model on a CUDA target). Peak, reserve, breakdown, phases and timeline come out of the same accounting code as
a full trace's, so they are equal to the byte where the step really repeats.

It is checked, not assumed: the group copied must be *congruent* to the group before it (the same events,
sizes, categories and relative references), the blocks of the full-depth model must have the structure of the
blocks they are copied from (:func:`memfit.memory.depth.repeat_of`), and an op that combines tensors of several
blocks into one must be a ``stack``/``cat`` (whose size grows by the copies' share) or the record is refused.
Anything refused is traced in full, and the estimate says why (``Estimate.trace``).

Trade-off: replaying costs a few microseconds per allocation in Python (about a second for an 8B model's two
windows of 16 micro-steps on a CUDA target), against tens of microseconds per op dispatched under fake tensors.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from memfit.memory.free_order import frees_in_order
from memfit.memory.tracker import StorageTracker, local_tensors

Event = tuple[str, Hashable, int, Any, int | None, int | None, tuple[int, ...] | int, Hashable]
"""(kind, storage, bytes, label, block, micro-step, extra bytes, place). Kinds: ``a`` allocate (label: the
category), ``f`` free, ``r`` relabel (label: the new category), ``p``/``q`` enter/leave a phase (label: the
phase entered, or the one returned to), ``h``/``g`` allocate/free on the host. ``extra``: 0, or a stack/cat's
growth per copied group of blocks. ``place``: where in its owner's sequence an allocation is (made while the
block ran, or from its tensors; the phase)."""
BLOCK, MICRO = 4, 5
"""The positions of the two owners in an :class:`Event`."""
WINDOW_STRIDE = 1000
"""A micro-step's owner is ``window * WINDOW_STRIDE + index``: micro-steps of different windows never neighbour."""
SPANNING_BUCKETS = "DDP's gradient buckets group parameters of several blocks"
COMBINING_OPS = ("aten::stack", "aten::cat")
"""Ops that may combine tensors of several blocks into one: their output grows by the copies' inputs."""


class NotRepeating(Exception):
    """The record does not repeat the way it would have to: the step is traced in full (the message says why).
    ``blocks``: a group of blocks does not repeat the one before it (a deeper copy may); ``buckets``: DDP's
    gradient buckets group parameters of several blocks (no copy of this run's model repeats)."""

    def __init__(self, message: str, *, blocks: bool = False, buckets: bool = False) -> None:
        super().__init__(message)
        self.blocks, self.buckets = blocks, buckets


@dataclass(frozen=True, slots=True)
class Repeat:
    """Owners ``first .. first+period-1`` and the next ``period`` owners (the group copied ``copies`` times)."""

    first: int
    period: int
    copies: int
    limit: int | None = None
    """Owners from here on are another window's: not renumbered."""

    @property
    def last(self) -> int:
        """The last owner of the copied group."""
        return self.first + 2 * self.period - 1

    def copied(self, owner: int | None) -> bool:
        return owner is not None and self.first + self.period <= owner <= self.last

    def multiplier(self, owner: int | None) -> int:
        """How often ``owner``'s events occur once expanded."""
        return 1 + self.copies if self.copied(owner) else 1

    def renumbered(self, owner: int | None) -> int | None:
        if owner is None or owner <= self.last or (self.limit is not None and owner >= self.limit):
            return owner
        return owner + self.copies * self.period


class RecordingTracker(StorageTracker):
    """A :class:`StorageTracker` that also writes down every event with its owners (no allocator: the replay
    models it). ``groups``: the blocks whose copies a ``stack``/``cat`` of several blocks' tensors grows by (its
    output's extra bytes: each group's share, in the order the groups are expanded)."""

    def __init__(self, *, count_flops: bool, groups: tuple[Repeat, ...]) -> None:
        super().__init__(count_flops=count_flops)
        self.events: list[Event] = []
        self.block: int | None = None
        self.micro: int | None = None
        self.unexpandable: str | None = None
        """Why the record cannot be expanded (an op that mixes blocks), or ``None``."""
        self.spanning = False
        """Because a storage serves several blocks' tensors (:meth:`made_for`)."""
        self.ops: Counter[tuple[int | None, int | None, str | None]] = Counter()
        """Ops per (block, micro-step, phase): what the expanded step dispatches, by multiplying."""
        self.flops_by: Counter[tuple[int | None, int | None]] = Counter()
        self.dequantized_by: Counter[tuple[int | None, int | None]] = Counter()
        self._groups = groups
        self.attention_flops: Callable[[], int] | None = None
        """The emulated attention kernels' FLOPs so far (they run no op to count)."""
        self._attention_seen = 0
        self.block_parameters: list[tuple[int, int]] = []
        """(trainable, total) parameters of each block, as built."""
        self._window, self._index = 0, 0
        self._serials: dict[Hashable, int] = {}
        self._next = 0
        self._owners: dict[int, tuple[int | None, int | None]] = {}
        self._param_blocks: dict[int, int] = {}
        self._forgotten: dict[int, int | None] = {}
        self._out_owner: dict[int, int | None] = {}
        self._extra: dict[int, tuple[int, ...]] = {}
        self._op_block: int | None = None
        self._last_micro: int | None = None
        self._input_block: int | None = None
        self._sticky: int | None = None
        self._made_for: list[int | None] | None = None  # inside made_for: the block what is made belongs to
        self.blocks: list[nn.Module] = []

    # --- owners ---
    def mark_blocks(self, blocks: Iterable[nn.Module]) -> None:
        """Hooks that say which block runs: forward from its pre-hook to the next block's (what the model does
        between two blocks, as dropping the last block's outputs, is the earlier block's; after the last block,
        the head and the loss are the last block's), backward from the gradient of its output to the gradient
        of the next block down's output (or of the first block's input)."""
        from memfit.models import count_parameters

        self.blocks = list(blocks)
        self.block_parameters = [count_parameters(block) for block in self.blocks]
        self._learn_parameters()
        for index, block in enumerate(self.blocks, start=1):
            block.register_forward_pre_hook(functools.partial(self._block_starts, index), with_kwargs=True)
            block.register_forward_hook(functools.partial(self._block_ends, index))

    def _learn_parameters(self) -> None:
        """Each block's weights' storages (again once FSDP2 has sharded them): a storage's address is known only
        while it lives, so a later storage at a freed weight's address is not taken for the weight."""
        from memfit.techniques.quantized_base import quantized_tensors

        self._param_blocks.clear()
        for index, block in enumerate(self.blocks, start=1):
            tensors = [*block.parameters(), *block.buffers(), *quantized_tensors(block)]
            for tensor in local_tensors(tensors):
                storage = tensor.untyped_storage()
                if storage._cdata not in self._param_blocks:
                    weakref.finalize(storage, self._param_blocks.pop, storage._cdata, None)
                self._param_blocks[storage._cdata] = index

    def _block_starts(self, index: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._phase != "forward":  # a checkpointed block's recompute runs inside its backward region
            return
        self.block, self._sticky = index, None
        if index == 1:
            first = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
            if isinstance(first, torch.Tensor) and first.requires_grad:
                first.register_hook(self._blocks_done)

    def _block_ends(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        if self._phase != "forward":
            return
        out = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if out is not None:
            out.register_hook(functools.partial(self._block_backward, index))

    def _block_backward(self, index: int, grad: torch.Tensor) -> None:
        if self._phase == "backward":
            self.block, self._sticky = index, None

    def _blocks_done(self, grad: torch.Tensor) -> None:
        if self._phase == "backward":
            self.block = self._sticky = None

    def _data_block(self, tensor: torch.Tensor) -> int | None:
        key = tensor.untyped_storage()._cdata
        serial = self._serials.get(key)
        if serial is not None:
            return self._owners[serial][0]
        return self._param_blocks.get(key, self._forgotten.get(key))

    def forget(self, tensors: list[torch.Tensor]) -> None:
        """Storages no longer counted (host-side scalars, as the optimizer's steps) keep their block: the ops
        that later read them (a for-each step's ``step.item()`` per parameter) are still that block's."""
        for tensor in local_tensors(tensors):
            storage = tensor.untyped_storage()
            serial = self._serials.get(storage._cdata)
            if serial is not None:
                self._forgotten[storage._cdata] = self._owners[serial][0]
                weakref.finalize(storage, self._forgotten.pop, storage._cdata, None)
        super().forget(tensors)

    @contextlib.contextmanager
    def made_for(self, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
        """What is made inside belongs to the one block ``tensors`` belong to (or none); tensors of several blocks
        make the record unexpandable: a copy of one block does not repeat a storage serving several."""
        owners = {owner for tensor in tensors if (owner := self._local_block(tensor)) is not None}
        if len(owners) > 1 and self._groups and self.unexpandable is None:
            self.unexpandable, self.spanning = SPANNING_BUCKETS, True
        outer, op_block, self._made_for = self._made_for, self._op_block, [owners.pop() if len(owners) == 1 else None]
        try:
            yield
        finally:
            self._made_for, self._op_block = outer, op_block

    def _attribute(self, func: Any, args: Any, leaves: list[torch.Tensor]) -> None:
        self._out_owner.clear()
        if self._made_for is not None:
            self._op_block = self._made_for[0]
            for tensor in local_tensors(leaves):
                self._out_owner[tensor.untyped_storage()._cdata] = self._op_block
            return
        if self.block is not None:
            self._op_block = self.block
            if self.block == len(self.blocks) and self._groups and leaves:  # the head and the loss
                self._refuse_growth(func, args, leaves)
            return
        owners = self._data_owners(func, args, leaves)
        for leaf, owner in zip(leaves, owners, strict=True):
            for tensor in local_tensors([leaf]):
                self._out_owner[tensor.untyped_storage()._cdata] = owner
        single = set(owners) if leaves else {self._input_block}  # an in-place op: whose inputs it changes
        self._op_block = single.pop() if len(single) == 1 else None

    def _data_owners(self, func: Any, args: Any, leaves: list[torch.Tensor]) -> list[int | None]:
        """Each output's block outside any block's run: per position for an op over lists of tensors, else the
        one block its inputs belong to (the last op's when they belong to none)."""
        for arg in args:
            if isinstance(arg, list | tuple) and leaves and len(arg) == len(leaves) and \
                    all(isinstance(item, torch.Tensor) for item in arg):
                owners = [self._local_block(item) for item in arg]
                if any(owner is not None for owner in owners):
                    return owners
        inputs = [leaf for leaf in tree_leaves(args) if isinstance(leaf, torch.Tensor)]
        found = {owner for leaf in inputs for owner in [self._local_block(leaf)] if owner is not None}
        self._input_block = next(iter(found)) if len(found) == 1 else None
        if len(found) == 1:
            self._sticky = found.pop()
            return [self._sticky] * len(leaves)
        if not found:
            return [self._sticky] * len(leaves)
        self._sticky = None
        if leaves and func._schema.name in COMBINING_OPS and self._groups:
            grown = tuple(sum(leaf.untyped_storage().nbytes() for leaf in inputs
                              if group.copied(self._local_block(leaf))) for group in self._groups)
            for tensor in local_tensors(leaves[:1]):
                self._extra[tensor.untyped_storage()._cdata] = grown
        elif self._groups and self.unexpandable is None and _grows(inputs, leaves):
            self.unexpandable = f"{func._schema.name} combines tensors of several blocks into a larger one"
        return [None] * len(leaves)

    def _refuse_growth(self, func: Any, args: Any, leaves: list[torch.Tensor]) -> None:
        """After the last block (its region runs on to the loss): an op that combines several blocks' tensors
        into a larger one (a load-balancing loss's ``cat`` of every block's router logits) is refused."""
        inputs = [leaf for leaf in tree_leaves(args) if isinstance(leaf, torch.Tensor)]
        owners = {owner for leaf in inputs for owner in [self._local_block(leaf)] if owner is not None}
        if len(owners) > 2 and self.unexpandable is None and _grows(inputs, leaves):
            self.unexpandable = f"{func._schema.name} combines tensors of several blocks into a larger one"

    def _local_block(self, tensor: torch.Tensor) -> int | None:
        return next((owner for inner in local_tensors([tensor]) for owner in [self._data_block(inner)]
                     if owner is not None), None)

    def _count(self, func: Any, args: Any, kwargs: Any, out: Any) -> tuple[int, int]:
        flops, dequantized = super()._count(func, args, kwargs, out)
        if self.attention_flops is not None:
            seen = self.attention_flops()
            flops, self._attention_seen = flops + seen - self._attention_seen, seen
        block = self.block if self.block is not None else self._op_block
        micro = self.micro if self.micro is not None else self._last_micro  # the micro-step's tail (its loss)
        self.ops[(block, micro, self._phase)] += 1
        if flops or dequantized:
            self.flops_by[(block, micro)] += flops
            self.dequantized_by[(block, micro)] += dequantized
        return flops, dequantized

    # --- events ---
    def track(self, *tensors: torch.Tensor, category: str | None = None) -> None:
        if category == "inputs" and self._phase is None:  # a micro-step starts with its batch
            self._index += 1
            self.micro = self._last_micro = self._window * WINDOW_STRIDE + self._index
        super().track(*tensors, category=category)

    def relabel_module(self, module: nn.Module) -> None:  # FSDP2's shards: made uncounted with CPU offload
        self._learn_parameters()
        super().relabel_module(module)

    def track_module(self, module: nn.Module) -> None:
        self._learn_parameters()  # sharded by now, where FSDP shards
        self._out_owner = {key: owner for key, owner in self._param_blocks.items()}
        super().track_module(module)
        self._out_owner = {}

    def move_to_host(self, tensors: list[torch.Tensor], category: str) -> None:
        """A storage that moves to the host stays its block's (outside a block's run: FSDP's offloaded shards)."""
        for tensor in local_tensors(tensors):
            self._out_owner[tensor.untyped_storage()._cdata] = self._data_block(tensor)
        super().move_to_host(tensors, category)

    def _owners_of(self, serial: int) -> tuple[int | None, int | None]:
        block, micro = self._owners[serial]
        return (self.block if self.block is not None else block, self.micro if self.micro is not None else micro)

    def _allocate(self, key: Hashable, raw: int, kind: str) -> None:
        self._record_allocation("a", key, raw, kind)
        super()._allocate(key, raw, kind)

    def _host_allocate(self, key: Hashable, nbytes: int, category: str) -> None:
        self._record_allocation("h", key, nbytes, category)
        super()._host_allocate(key, nbytes, category)

    def _record_allocation(self, kind: str, key: Hashable, nbytes: int, label: str) -> None:
        serial, self._next = self._next, self._next + 1
        self._serials[key] = serial
        timed = self.block is not None
        block = self.block if timed else self._out_owner.get(key)  # type: ignore[call-overload]
        self._owners[serial] = (block, self.micro)
        extra = self._extra.pop(key, 0) if isinstance(key, int) else 0
        self.events.append((kind, serial, nbytes, label, block, self.micro, extra, (timed, self._phase)))

    def _release(self, key: Hashable) -> None:
        if key in self._sizes:
            serial = self._serials.pop(key)
            block, micro = self._owners_of(serial)
            if self.block is None and self._phase == "optimizer":  # a loop's step frees the last parameter's
                block = self._op_block  # temporaries while it works on the next one's: the free is the next one's
            self.events.append(("f", serial, 0, None, block, micro, 0, None))
        super()._release(key)

    def _release_host(self, key: Hashable) -> None:
        if key in self._host_sizes:
            serial = self._serials.pop(key)
            self.events.append(("g", serial, 0, None, *self._owners_of(serial), 0, None))
        super()._release_host(key)

    def _relabel(self, key: Hashable, category: str) -> None:
        serial = self._serials[key]
        self.events.append(("r", serial, 0, category, *self._owners_of(serial), 0, None))
        super()._relabel(key, category)

    def _enter_phase(self, name: str) -> None:
        self.block = self._sticky = None
        if name == "optimizer":  # the window's micro-steps are over
            self.micro = self._last_micro = self._op_block = None
            self._window, self._index = self._window + 1, 0
        self.events.append(("p", None, 0, name, None, self.micro, 0, None))
        super()._enter_phase(name)

    def _exit_phase(self, outer: str | None) -> None:
        self.events.append(("q", None, 0, outer, self.block, self.micro, 0, None))
        self._sticky = None
        if self._phase == "backward":  # the micro-step's own work ends with its backward
            self.block = self.micro = None
        super()._exit_phase(outer)


def _owner(event: Event, axis: int) -> int | None:
    owner = event[axis]
    assert owner is None or isinstance(owner, int)
    return owner


def _grows(inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> bool:
    """Whether an output is larger than every input: an op over several blocks' tensors whose size could
    grow with the depth (an add of two blocks' gradients does not)."""
    largest = max((tensor.untyped_storage().nbytes() for tensor in local_tensors(inputs)), default=0)
    return any(tensor.untyped_storage().nbytes() > largest for tensor in local_tensors(outputs))


def replay(events: list[Event], tracker: StorageTracker) -> None:
    """Run a record through ``tracker``'s accounting, as the trace's storages would have."""
    for kind, storage, nbytes, label, *_ in events:
        known = tracker._host_sizes if kind == "g" else tracker._sizes
        if kind in ("f", "r", "g") and storage not in known:
            raise NotRepeating(f"the expanded record frees or relabels a storage it never allocated ({storage})")
        if kind == "a":
            tracker._allocate(storage, nbytes, label)
        elif kind == "f":
            tracker._release(storage)
        elif kind == "r":
            tracker._relabel(storage, label)
        elif kind == "p":
            tracker._enter_phase(label)
        elif kind == "q":
            tracker._exit_phase(label)
        elif kind == "h":
            tracker._host_allocate(storage, nbytes, label)
        else:
            tracker._release_host(storage)


def expand(events: list[Event], axis: int, repeat: Repeat) -> list[Event]:
    """``events`` with the owners ``repeat.first + period .. repeat.last`` along ``axis`` (:data:`BLOCK` or
    :data:`MICRO`) copied ``repeat.copies`` times and the later owners renumbered; raises
    :class:`NotRepeating` where the copied group is not congruent to the one before it.

    A storage is known by its owner and its place among what its owner allocates (in a micro-step and phase),
    counted from the first allocation; where the groups are not congruent so, they are compared again with the
    places counted back from the last: a first block that allocates more before its ordinary work (QLoRA's
    casts of its input) shifts the places of everything after, which the next block's backward frees by
    reference to it. Either way the congruence check decides; the copies are named consistently with it."""
    try:
        return _Expansion(events, axis, repeat).run()
    except NotRepeating as first:
        if axis != BLOCK:
            raise
        try:
            return _Expansion(events, axis, repeat, from_end=True).run()
        except NotRepeating:
            raise first from None


class _Expansion:
    def __init__(self, events: list[Event], axis: int, repeat: Repeat, *, from_end: bool = False) -> None:
        self.events, self.axis, self.repeat = events, axis, repeat
        self.other = MICRO if axis == BLOCK else BLOCK
        self.tag = "block" if axis == BLOCK else "micro"
        self.of_blocks = axis == BLOCK
        self.owner: dict[Hashable, int | None] = {}
        self.place: dict[Hashable, tuple[Hashable, ...]] = {}
        counts: Counter[tuple[Hashable, ...]] = Counter()
        spaces: dict[Hashable, tuple[Hashable, ...]] = {}
        for event in events:
            if event[0] in ("a", "h"):
                owner = _owner(event, axis)
                self.owner[event[1]] = owner
                if owner is not None:
                    space = (owner, event[self.other], event[7])
                    self.place[event[1]] = (event[self.other], event[7], counts[space])
                    spaces[event[1]] = space
                    counts[space] += 1
        if from_end:  # the same places, counted back from the last of each owner's (-1 the last)
            self.place = {storage: (*place[:2], place[2] - counts[spaces[storage]])  # type: ignore[operator]
                          for storage, place in self.place.items()}
        self.events = events = frees_in_order(events, axis, self.owner, self.place, repeat.period,
                                              blocks=self.of_blocks)
        self.runs: list[tuple[int | None, int, int]] = []
        start = 0
        for index in range(1, len(events) + 1):
            if index == len(events) or events[index][axis] != events[start][axis]:
                self.runs.append((_owner(events[start], axis), start, index))
                start = index

    def run(self) -> list[Event]:
        repeat = self.repeat
        after: dict[int, list[int]] = {}  # an ascending chain's last copied run -> the copied runs, in order
        before: dict[int, list[int]] = {}  # a descending chain's first copied run -> the copied runs, in order
        paired: set[int] = set()
        for chain in self._chains():
            copied = [i for i in chain if repeat.copied(self.runs[i][0])]
            if not copied:
                continue
            earlier = [i for i in chain if repeat.first <= (self.runs[i][0] or 0) < repeat.first + repeat.period]
            shifted = [(self.runs[i][0] or 0) - repeat.period for i in copied]
            if shifted != [self.runs[i][0] for i in earlier]:
                raise NotRepeating(f"{self.tag} {self.runs[copied[0]][0]}'s events do not follow the "
                                   f"{self.tag}s before it", blocks=self.of_blocks)
            self._congruent(copied, earlier)
            paired.update(copied)
            ascending = copied[0] > earlier[0]
            (after if ascending else before)[copied[-1] if ascending else copied[0]] = copied
        unpaired = [run[0] for index, run in enumerate(self.runs) if repeat.copied(run[0]) and index not in paired]
        if unpaired:
            raise NotRepeating(f"{self.tag} {unpaired[0]} has events outside the repeating pattern",
                               blocks=self.of_blocks)
        out: list[Event] = []
        for index, (owner, start, end) in enumerate(self.runs):
            if index in before:
                for copy in range(repeat.copies, 0, -1):
                    for source in before[index]:
                        self._emit_copy(out, source, copy)
            self._emit(out, start, end, owner, repeat.renumbered(owner), copy=False)
            if index in after:
                for copy in range(1, repeat.copies + 1):
                    for source in after[index]:
                        self._emit_copy(out, source, copy)
        return out

    def _chains(self) -> list[list[int]]:
        """Maximal runs of runs whose owners rise (or fall) one after the other: the blocks in order, as
        forward, backward and the optimizer visit them."""
        chains: list[list[int]] = []
        index = 0
        while index < len(self.runs):
            chain = [index]
            owner = self.runs[index][0]
            if owner is not None and index + 1 < len(self.runs) and self.runs[index + 1][0] is not None:
                rising = (self.runs[index + 1][0] or 0) > owner
                while index + 1 < len(self.runs):
                    following = self.runs[index + 1][0]
                    current = self.runs[index][0] or 0
                    if following is None or (following > current) != rising or following == current:
                        break
                    index += 1
                    chain.append(index)
            chains.append(chain)
            index += 1
        return chains

    def _emit_copy(self, out: list[Event], run: int, copy: int) -> None:
        owner, start, end = self.runs[run]
        assert owner is not None
        self._emit(out, start, end, owner, owner + copy * self.repeat.period, copy=True)

    def _emit(self, out: list[Event], start: int, end: int, owner: int | None, new_owner: int | None, *,
              copy: bool) -> None:
        axis, repeat = self.axis, self.repeat
        for event in self.events[start:end]:
            storage, nbytes = event[1], event[2]
            if storage is not None:
                storage = self._renamed(storage, owner, new_owner, copy=copy)
            extra = event[6]
            if axis == BLOCK and isinstance(extra, tuple):  # a stack/cat of every block's tensors: this
                nbytes, extra = nbytes + repeat.copies * extra[0], (extra[1:] or 0)  # group's copies' share too
            renamed = list(event)
            renamed[1], renamed[2], renamed[axis], renamed[6] = storage, nbytes, new_owner, extra
            out.append(tuple(renamed))

    def _renamed(self, storage: Hashable, owner: int | None, new_owner: int | None, *, copy: bool) -> Hashable:
        target = self.owner.get(storage)
        if target is None:
            return storage
        if owner is None or new_owner is None:
            moved = self.repeat.renumbered(target)
        elif copy or abs(target - owner) <= self.repeat.period:  # a neighbour: the copy's own neighbour
            moved = new_owner + target - owner
        else:
            moved = self.repeat.renumbered(target)
        return (self.tag, moved, *self.place[storage])

    def _congruent(self, group: list[int], before: list[int]) -> None:
        for run, other in zip(group, before, strict=True):
            owner, start, end = self.runs[run]
            other_owner, other_start, other_end = self.runs[other]
            if end - start != other_end - other_start:
                raise NotRepeating(f"{self.tag} {owner} does not repeat {self.tag} {other_owner} "
                                   f"({end - start} events against {other_end - other_start})", blocks=self.of_blocks)
            for event, earlier in zip(self.events[start:end], self.events[other_start:other_end], strict=True):
                if self._shape(event, owner) != self._shape(earlier, other_owner):
                    raise NotRepeating(f"{self.tag} {owner} does not repeat {self.tag} {other_owner}",
                                       blocks=self.of_blocks)

    def _shape(self, event: Event, owner: int | None) -> tuple[Hashable, ...]:
        storage = event[1]
        target = self.owner.get(storage) if storage is not None else None
        reference: Hashable = storage if target is None or owner is None else \
            (target - owner, self.place[storage])
        return (event[0], event[2], event[3], event[self.other], event[6], event[7], reference)


def scaled(counts: Counter[Any], blocks: tuple[Repeat, ...], windows: list[Repeat]) -> int:
    """The sum of ``counts`` (keyed by (block, micro-step, ...)) once every copied owner occurs as often as
    the expanded step runs it."""
    def times(key: Any) -> int:
        block, micro = key[0], key[1]
        factor = math.prod(group.multiplier(block) for group in blocks)
        return factor * next((window.multiplier(micro) for window in windows if window.copied(micro)), 1)

    return sum(value * times(key) for key, value in counts.items())
