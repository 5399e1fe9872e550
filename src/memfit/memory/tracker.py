"""Live tensor bytes, counted at the storage level by a dispatch mode.

:class:`StorageTracker` sees every op's outputs. Each output's ``untyped_storage()`` is counted once (views
and in-place results share their base's storage) and subtracted when that storage is freed, observed through
a weak-reference finalizer. The count is exact for tensors created while the tracker is active; tensors that
existed before (parameters, buffers) are added with :meth:`StorageTracker.track`.

``round_to`` rounds each storage up to a block size. With ``allocator`` (a
:class:`~memfit.memory.allocator.CachingAllocatorModel`), each storage is instead counted at the size of the
block that CUDA's caching allocator would hand out for it, so the live count is ``memory_allocated`` of the
target. Peaks are kept overall and per named phase (:meth:`StorageTracker.phase`).

Every storage also carries a category, so the bytes live at the peak can be broken down: ``parameters`` and
``inputs`` are given when tracked (``frozen_parameters`` and ``quantized_weights`` for weights that do not
train), storages created in forward are ``activations`` (what autograd saves, plus
the forward's short-lived temporaries), and anything else made during a phase is ``temporaries`` until
:meth:`StorageTracker.relabel` says otherwise (``gradients`` when accumulated into ``.grad``,
``optimizer_state`` after the optimizer step). The breakdown is copied at each new peak: a handful of integers.

``budget_bytes`` emulates a device of that size: the op whose output would take the live bytes past it
raises ``torch.OutOfMemoryError`` at the real point of the step, with the real allocation pattern, as
CUDA's allocator would (``memfit train --emulate-budget``).

With ``timeline`` set to a list, every allocation and free appends (live bytes, phase): the memory timeline
of a step (:meth:`memfit.memory.monitor.Monitor.start_timeline`).

Overhead: one Python call per op, a few microseconds; negligible next to a transformer layer's matmuls.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from memfit.techniques.bf16_true import KAHAN_STATE

DEVICE_QUERY = torch.ops.prim.device.default
"""``tensor.device`` of a tensor subclass (a fake tensor) goes through dispatch, about 70 % of what a fake
step dispatches (autograd's engine and the optimizer's grouping ask it per tensor); a real step never
dispatches it. It is answered without counting it as an op."""

OUT_OF_MEMORY: type[Exception] = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
"""``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` before torch 2.5)."""

if TYPE_CHECKING:
    from memfit.memory.allocator import CachingAllocatorModel


def local_tensors(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The tensors that own memory: a wrapper subclass (an FSDP2 shard's ``DTensor``) reports its global size,
    so its inner (local) tensors are counted instead."""
    for tensor in tensors:
        if is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            yield from local_tensors(getattr(tensor, name) for name in names
                                     if isinstance(getattr(tensor, name), torch.Tensor))
        else:
            yield tensor


LOGITS = "logits_and_loss"


def quantized_op_cost(name: str, args: Any, out: Any) -> tuple[int, int]:
    """(FLOPs, bytes moved to dequantise) of a bitsandbytes 4-bit op, which torch's FLOP formulas do not know.

    ``gemm_4bit`` (forward: input ``A`` of K features times a packed N x K weight) is a matmul of
    ``2 * rows * N * K`` FLOPs that first dequantises the weight (read half a byte, write the compute dtype's
    bytes per weight); ``dequantize_4bit`` (backward) is that dequantisation alone."""
    if name == "gemm_4bit":
        a, shape = args[0], args[2]
        weights = int(shape[0]) * int(shape[1])
        return 2 * (a.numel() // int(shape[1])) * weights, weights * (a.element_size() * 2 + 1) // 2
    if name == "dequantize_4bit" and isinstance(out, torch.Tensor):
        return 0, out.numel() * (out.element_size() * 2 + 1) // 2
    return 0, 0


def _weight_categories(module: torch.nn.Module) -> list[tuple[list[torch.Tensor], str]]:
    """The module's weights by category, most specific first: packed quantised weights and their state, the
    trained parameters, the frozen ones and the buffers."""
    from memfit.techniques.quantized_base import quantized_tensors

    parameters = list(module.parameters())
    return [(quantized_tensors(module), "quantized_weights"),
            ([p for p in parameters if p.requires_grad], "parameters"),
            ([p for p in parameters if not p.requires_grad] + list(module.buffers()), "frozen_parameters")]


class OpRouter(Protocol):
    """Runs and counts each op in a tracker's place (:class:`memfit.memory.host_shards.HostShards`)."""

    def dispatch(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any: ...


class StorageTracker(TorchDispatchMode):
    def __init__(self, *, round_to: int = 1, allocator: CachingAllocatorModel | None = None,
                 budget_bytes: int | None = None, count_flops: bool = False) -> None:
        super().__init__()
        self.round_to = round_to
        self.allocator = allocator
        self.budget_bytes = budget_bytes
        """Emulated device memory: a storage that would take live bytes past it raises ``OutOfMemoryError``."""
        self.live_bytes = 0
        self.peak_bytes = 0
        self.op_count = 0
        """Ops dispatched while tracking: what a trace's cost scales with."""
        self.phase_peaks: dict[str, int] = {}
        self.phase_ops: dict[str, int] = {}
        self.flops = 0
        self.dequantized_bytes = 0
        """Bytes bitsandbytes' 4-bit ops read and write to dequantise weights (``count_flops``): the memory
        traffic a QLoRA step adds, which no FLOP count shows."""
        """Matmul-class FLOPs of the ops seen (``count_flops``), by torch's own FLOP formulas. Counted here
        rather than by ``FlopCounterMode``, whose module hooks keep checkpointed layers' recomputed tensors
        alive and so change the very peak being traced."""
        self._flop_formulas = flop_registry if count_flops else None
        """Ops dispatched per named phase: what a step's per-op (launch) overhead scales with."""
        self._phase: str | None = None
        self._label: str | None = None
        """Category of what the rest of this phase allocates (set by an output-embedding hook)."""
        self._sizes: dict[Hashable, int] = {}
        self._categories: dict[Hashable, str] = {}
        self.category_bytes: dict[str, int] = {}
        self.peak_breakdown: dict[str, int] = {}
        self.timeline: list[tuple[int, str | None]] | None = None
        """When a list: (live bytes, phase) after every allocation and free (:meth:`Monitor.start_timeline`)."""
        self.host_bytes = 0
        """Live bytes of the storages made inside :meth:`elsewhere` (the target's host memory)."""
        self.host_peak_bytes = 0
        self.host_category_bytes: dict[str, int] = {}
        self.host_peak_breakdown: dict[str, int] = {}
        """Host bytes per :meth:`elsewhere` category live at the host peak."""
        self._host_sizes: dict[Hashable, tuple[int, str]] = {}
        self._elsewhere: str | None = None
        self.host_shards: OpRouter | None = None
        """FSDP2's CPU offload emulated (:class:`memfit.memory.host_shards.HostShards`): every op runs through it,
        which counts the shards and the optimizer on the host, their copies to and from the card."""
        self._resizable: dict[Hashable, tuple[weakref.ReferenceType[torch.UntypedStorage], str]] = {}
        """Storages an op wrote into as ``out=`` (FSDP2's gathered parameters), with their category: FSDP2 frees
        them with ``storage.resize_(0)`` after a block's forward and backward and makes them again with
        ``resize_(n)`` before its next all-gather, on the same storage object; no op says so."""
        self._live_resizable: set[Hashable] = set()
        """Those counted now: the ones checked before each op (a few blocks' worth at a time)."""
        self._paused = False
        """Inside :meth:`paused`: ops run, nothing is counted."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is DEVICE_QUERY:
            return args[0].fake_device if type(args[0]) is FakeTensor else func(*args)
        if self._paused:
            return func(*args, **(kwargs or {}))
        if self._resizable:
            self._resized(kwargs.get("out") if kwargs else None)
        shards = self.host_shards if self._elsewhere is None else None
        if shards is not None:
            out = shards.dispatch(func, args, kwargs or {})
        else:
            out = func(*args, **(kwargs or {}))
        if kwargs and kwargs.get("out") is not None:
            self._watch(kwargs["out"])
        if shards is not None:
            return out
        leaves = [leaf for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor)]
        self._attribute(func, args, leaves)
        if self._elsewhere is not None:
            self._track_host(leaves, self._elsewhere)
            return out
        self.count_outputs(func, args, kwargs, out, leaves)
        return out

    def count_outputs(self, func: Any, args: Any, kwargs: Any, out: Any, leaves: list[torch.Tensor]) -> None:
        """Count an op of the device and the storages of its outputs."""
        self._count(func, args, kwargs, out)
        for leaf in leaves:
            self.track(leaf)

    def attribute(self, func: Any, args: Any, leaves: list[torch.Tensor]) -> None:
        self._attribute(func, args, leaves)

    def track_host(self, leaves: list[Any], category: str) -> None:
        self._track_host(leaves, category)

    def count_host_op(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Count an op that runs on the host (its outputs are the host's): its launch costs the step as a device
        op's does (an offloaded optimizer's update, parameter by parameter)."""
        self._count(func, args, kwargs, out)

    def _attribute(self, func: Any, args: Any, leaves: list[torch.Tensor]) -> None:
        """Before an op's outputs are counted: nothing here (a recording tracker says whose they are)."""

    def _count(self, func: Any, args: Any, kwargs: Any, out: Any) -> tuple[int, int]:
        """Count one op of the device, its FLOPs and dequantised bytes; returns (FLOPs, dequantised bytes)."""
        self.op_count += 1
        flops = dequantized = 0
        if self._flop_formulas is not None:
            if func._overloadpacket in self._flop_formulas:
                flops = self._flop_formulas[func._overloadpacket](*args, **(kwargs or {}), out_val=out)
            elif func.namespace == "bitsandbytes":
                flops, dequantized = quantized_op_cost(func._opname, args, out)
            self.flops += flops
            self.dequantized_bytes += dequantized
        if self._phase is not None:
            self.phase_ops[self._phase] = self.phase_ops.get(self._phase, 0) + 1
        return flops, dequantized

    def _rounded(self, nbytes: int) -> int:
        return -(-nbytes // self.round_to) * self.round_to

    def track(self, *tensors: torch.Tensor, category: str | None = None) -> None:
        """Count the storages of ``tensors`` (idempotent: a storage already counted is skipped)."""
        if self._live_resizable:
            self._resized()
        for tensor in local_tensors(tensors):
            if tensor.layout != torch.strided:
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in self._sizes or key in self._host_sizes:  # counted already, on the device or the host
                continue
            raw = storage.nbytes()
            if key in self._resizable:  # freed in place before: counted again once it is made again
                if raw:
                    self._recount(key, raw)
                continue
            self._admit(raw)
            kind = category or self._label or ("activations" if self._phase == "forward" else "temporaries")
            self._allocate(key, raw, kind)
            weakref.finalize(storage, self._release, key)

    def _admit(self, raw: int) -> None:
        if self.budget_bytes is not None and self.live_bytes + self._rounded(raw) > self.budget_bytes:
            raise OUT_OF_MEMORY(
                f"emulated budget: tried to allocate {raw:,} bytes with {self.live_bytes:,} of "
                f"{self.budget_bytes:,} bytes live")

    def _watch(self, targets: Any) -> None:
        """Storages written into as ``out=`` may be resized in place from now on (:attr:`_resizable`)."""
        for tensor in local_tensors(leaf for leaf in tree_leaves(targets) if isinstance(leaf, torch.Tensor)):
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in self._sizes and key not in self._resizable:
                self._resizable[key] = (weakref.ref(storage), self._categories[key])
                self._live_resizable.add(key)
                weakref.finalize(storage, self._resizable.pop, key, None)

    def _resized(self, targets: Any = None) -> None:
        """Before an op (and a phase, a storage counted outside an op): the watched storages freed in place
        since; those the op writes into (``targets``, its ``out=``) that were made again, counted again."""
        for key in list(self._live_resizable):
            entry = self._resizable.get(key)
            storage = entry[0]() if entry is not None else None
            if storage is None or key not in self._sizes:  # gone, and released as any storage is
                self._live_resizable.discard(key)
            elif storage.nbytes() == 0:
                self._resizable[key] = (entry[0], self._categories[key])  # type: ignore[index]
                self._live_resizable.discard(key)
                self._release(key)
        for tensor in local_tensors(leaf for leaf in tree_leaves(targets) if isinstance(leaf, torch.Tensor)):
            key = tensor.untyped_storage()._cdata
            raw = tensor.untyped_storage().nbytes()
            if key in self._resizable and key not in self._sizes and raw:
                self._recount(key, raw)

    def _recount(self, key: Hashable, raw: int) -> None:
        """A watched storage made again in place: counted again, in the category it had."""
        self._admit(raw)
        self._allocate(key, raw, self._resizable[key][1])
        self._live_resizable.add(key)

    def _allocate(self, key: Hashable, raw: int, kind: str) -> None:
        """Count a storage of ``raw`` bytes as ``kind`` (the allocator's block size on a CUDA target)."""
        nbytes = self.allocator.allocate(key, raw) if self.allocator is not None and raw else self._rounded(raw)
        self._sizes[key] = nbytes
        self._categories[key] = kind
        self.category_bytes[kind] = self.category_bytes.get(kind, 0) + nbytes
        self._grow(nbytes)

    def track_module(self, module: torch.nn.Module) -> None:
        """Count the module's weights: ``quantized_weights`` (packed weights, their scales and quantisation
        state), ``parameters`` (trained), ``frozen_parameters`` (and buffers). A language model's logits, and
        what the loss makes of them in the same phase (the fp32 copy, log-softmax), count as
        ``logits_and_loss``."""
        for tensors, category in _weight_categories(module):  # the first category a storage is in
            self.track(*tensors, category=category)
        head = getattr(module, "get_output_embeddings", lambda: None)()
        if isinstance(head, torch.nn.Module):
            head.register_forward_pre_hook(self._logits_start)

    def relabel_module(self, module: torch.nn.Module) -> None:
        """The module's weights made while tracking (FSDP2's shards, which replace its parameters) in the
        categories :meth:`track_module` gives them."""
        for tensors, category in reversed(_weight_categories(module)):
            self.relabel(tensors, category)

    def _logits_start(self, module: torch.nn.Module, args: Any) -> None:
        if self._phase is not None:
            self._label = LOGITS

    def relabel(self, tensors: list[torch.Tensor], category: str) -> None:
        """Move already-counted storages to ``category`` (e.g. a gradient once it sits in ``.grad``)."""
        for tensor in local_tensors(tensors):
            key = tensor.untyped_storage()._cdata
            old = self._categories.get(key)
            if old is not None and old != category:
                self._relabel(key, category)

    def _relabel(self, key: Hashable, category: str) -> None:
        nbytes = self._sizes[key]
        self.category_bytes[self._categories[key]] -= nbytes
        self.category_bytes[category] = self.category_bytes.get(category, 0) + nbytes
        self._categories[key] = category

    @contextlib.contextmanager
    def elsewhere(self, category: str = "host") -> Iterator[None]:
        """Ops inside run on the target's host, not on its device (an offloaded optimizer's step): what they
        make counts as host memory (:attr:`host_bytes`) of ``category``, and they are not counted as the
        device's ops."""
        outer, self._elsewhere = self._elsewhere, category
        try:
            yield
        finally:
            self._elsewhere = outer

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops inside are not the target's: what they make is counted where it is later put, if anywhere
        (FSDP2 with CPU offload makes each shard in host memory from the model the host holds)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    @contextlib.contextmanager
    def made_for(self, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
        """What is allocated inside serves ``tensors`` (a gradient bucket of a group of parameters): nothing
        here; a recording tracker gives it their block (:mod:`memfit.memory.repeats`)."""
        yield

    def allocate(self, key: Hashable, nbytes: int, category: str) -> None:
        """Count ``nbytes`` under ``key`` (a storage no tensor stands for: a copy the trace does not make)."""
        if self._live_resizable:
            self._resized()
        self._allocate(key, nbytes, category)

    def release(self, key: Hashable) -> None:
        self._release(key)

    def counts(self, key: Hashable) -> bool:
        """Whether the storage ``key`` is counted on the device."""
        return key in self._sizes

    def host_category_of(self, key: Hashable) -> str | None:
        """The host category the storage ``key`` is counted in, or ``None``."""
        entry = self._host_sizes.get(key)
        return entry[1] if entry is not None else None

    def in_phase(self, name: str) -> bool:
        return self._phase == name

    def move_to_host(self, tensors: list[torch.Tensor], category: str) -> None:
        """Count the storages of ``tensors`` on the host from now on (a copy there that replaces the device's)."""
        for tensor in local_tensors(tensors):
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in self._sizes:
                self._release(key)
            if key not in self._host_sizes:
                self._host_allocate(key, storage.nbytes(), category)
                weakref.finalize(storage, self._release_host, key)

    def _track_host(self, leaves: list[Any], category: str) -> None:
        for leaf in local_tensors(leaf for leaf in leaves if isinstance(leaf, torch.Tensor)):
            if leaf.layout != torch.strided:
                continue
            storage = leaf.untyped_storage()
            key = storage._cdata
            if key in self._sizes or key in self._host_sizes:
                continue
            self._host_allocate(key, storage.nbytes(), category)
            weakref.finalize(storage, self._release_host, key)

    def _host_allocate(self, key: Hashable, nbytes: int, category: str) -> None:
        self._host_sizes[key] = (nbytes, category)
        self.host_bytes += nbytes
        self.host_category_bytes[category] = self.host_category_bytes.get(category, 0) + nbytes
        if self.host_bytes > self.host_peak_bytes:
            self.host_peak_bytes = self.host_bytes
            self.host_peak_breakdown = dict(self.host_category_bytes)

    def _release_host(self, key: Hashable) -> None:
        nbytes, category = self._host_sizes.pop(key, (0, "host"))
        self.host_bytes -= nbytes
        self.host_category_bytes[category] = self.host_category_bytes.get(category, 0) - nbytes

    def forget(self, tensors: list[torch.Tensor]) -> None:
        """Stop counting already-counted storages: they live elsewhere on the target (e.g. host-side scalars)."""
        for tensor in local_tensors(tensors):
            key = tensor.untyped_storage()._cdata
            if key in self._sizes:
                self._release(key)

    def _grow(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        if self.timeline is not None:
            self.timeline.append((self.live_bytes, self._phase))
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.peak_breakdown = dict(self.category_bytes)
        if self._phase is not None and self.live_bytes > self.phase_peaks[self._phase]:
            self.phase_peaks[self._phase] = self.live_bytes

    def _release(self, key: Hashable) -> None:
        nbytes = self._sizes.pop(key, None)
        if nbytes is None:  # forgotten earlier
            return
        if self.allocator is not None:
            self.allocator.free(key)
        self.live_bytes -= nbytes
        self.category_bytes[self._categories.pop(key)] -= nbytes
        if self.timeline is not None:
            self.timeline.append((self.live_bytes, self._phase))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute the peak reached inside the block to phase ``name`` (the max over all its entries)."""
        outer = self._phase
        if self._live_resizable:  # freed in place before the phase starts: not in its peak
            self._resized()
        self._enter_phase(name)
        try:
            yield
        finally:
            self._exit_phase(outer)

    def _enter_phase(self, name: str) -> None:
        self._phase, self._label = name, None
        self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self.live_bytes)

    def _exit_phase(self, outer: str | None) -> None:
        self._phase, self._label = outer, None

    def reset_peaks(self) -> None:
        self.peak_bytes = self.live_bytes
        self.peak_breakdown = dict(self.category_bytes)
        self.phase_peaks = {}


def label_optimizer_state(tracker: StorageTracker, optimizer: torch.optim.Optimizer, *,
                          host_step_counters: bool) -> None:
    """Count the optimizer's state as ``optimizer_state``; on CUDA, Adam's step counters live on the host
    unless the step is fused (or capturable), so then they are not device memory."""
    state = [(key, value) for per_param in optimizer.state.values()
             for key, value in per_param.items() if isinstance(value, torch.Tensor)]
    tracker.relabel([value for key, value in state if key != KAHAN_STATE], "optimizer_state")
    tracker.relabel([value for key, value in state if key == KAHAN_STATE], "kahan_compensation")
    if host_step_counters:
        tracker.forget([value for key, value in state if key == "step"])
        # (a paged optimizer's big states were made outside the card's count: see run_steps)


def label_gradients(tracker: StorageTracker, trained: list[torch.nn.Parameter]) -> None:
    """Count a trained parameter's gradient as ``gradients`` from the moment it lands in ``.grad``."""
    for parameter in trained:
        parameter.register_post_accumulate_grad_hook(
            lambda p: tracker.relabel([p.grad], "gradients") if p.grad is not None else None)
