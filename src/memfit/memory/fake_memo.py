"""The ops a trace repeats, answered from their first answer: the same outputs, a few microseconds an op.

A trace runs the same few thousand ops again and again: every block of the copy, every micro-step, the
recomputed forward of a checkpointed block. Torch's fake tensors answer a repeated op from their own cache,
but building that cache's key (every argument's full metadata, checked and flattened in Python) and the
answer costs about 70 microseconds an op on this CPU: most of a trace. :class:`FakeMemo` keys an op by what
its outputs follow from (the op; each tensor's dtype, shape, strides, offset and device; every other argument,
as given; the default dtype) in one or two microseconds, and makes the outputs itself, as torch's cache does:
a fresh storage of the size the first answer had, or a view of the input storage the first answer aliased, or
the input itself (an in-place op). The first time a key is seen the op runs through fake tensors and its answer
is checked for being one the memo can repeat; an answer that is not (a constant's value, an output aliasing
another output, a storage larger than its tensor) is never memoised.

It answers the training step's ops only (:meth:`memfit.memory.fake_answers.FakeAnswers.memoising`): a model's
build runs each of its ops once, and reads values fake mode keeps as constants while it builds.

Trade-off: none in what is counted. The outputs have the metadata and the storages (fresh or shared) fake
tensors gave the first time, so the tracker counts the same bytes and the same ops; tests trace with and
without it and compare every figure. What passes through untouched: ops outside ``aten``, ops whose output
shape depends on values (``dynamic_output_shape``, ``data_dependent_output``), ops that change an input's
metadata in place (``inplace_view``, ``resize_``, ``set_``, any ``out=`` variant, whose kernel resizes its
output), any argument that is not a plain fake tensor of the trace's mode (a real tensor, a DTensor, a quantized
parameter subclass) or a plain Python value, fake tensors carrying constants, and answers that are not tensors or
``None``. Which of an op's inputs alias each other is checked when its answer is recorded, not on each repeat.

Torch internals used, all here (checked against torch 2.13): ``FakeTensor(fake_mode, meta_tensor, device)``,
its ``fake_mode``, ``fake_device`` and ``constant`` attributes, and ``torch._C._DisableTorchDispatch`` (making
the meta tensors under the trace's modes), as torch's own fake-tensor cache makes its answers.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

MAX_ENTRIES = 200_000
"""Keys kept before the memo starts over (a plan's traces share it: a few thousand keys a model)."""
VALUE_TYPES = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                         torch.memory_format})
"""Arguments other than tensors that a key holds as they are (with their type: ``1`` is not ``1.0``)."""
METADATA_CHANGES = frozenset({"resize_", "resize_as_", "set_", "_resize_output_"})
MEMOISED_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output, torch.Tag.inplace_view)
"""Ops tagged with any of these are never memoised."""


@dataclass(frozen=True, slots=True)
class _Output:
    """How one output of a memoised answer is made again: ``kind`` ``"same"`` (the input ``index`` itself),
    ``"view"`` (a view of input ``index``'s storage), ``"fresh"`` (a new storage), ``"none"``."""

    kind: str
    index: int = 0
    shape: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    offset: int = 0
    dtype: torch.dtype = torch.float32
    device: torch.device | None = None


@dataclass(frozen=True, slots=True)
class _Answer:
    outputs: tuple[_Output, ...]
    container: type | None
    """``tuple`` or ``list`` for several outputs, ``None`` for one."""


AMBIGUOUS = _Answer((), None)
"""An answer aliasing an input that shares its storage with another input: which one it follows is not known,
so the key is recorded again next time."""
_MEMO: dict[tuple[Any, ...], _Answer | None] = {}
"""Every memoised answer by key; ``None``: a key whose answer cannot be repeated."""
_OPS: dict[Any, bool] = {}
"""Whether an op may be memoised at all, by op."""


_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("memfit_fake_memo", default=True)


@contextlib.contextmanager
def unmemoised() -> Iterator[None]:
    """Inside (this thread), every op runs through fake tensors (the trace the memo must equal)."""
    token = _ENABLED.set(False)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def memo_enabled() -> bool:
    """Whether traces memoise repeated ops: not inside :func:`unmemoised`, nor where this torch's fake tensors
    cannot be made as :func:`_made` makes them (checked once: a fresh output, a view and an in-place result
    against fake tensors' own answers)."""
    return _ENABLED.get() and _usable()


@functools.cache
def _usable() -> bool:
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten = torch.ops.aten

    def storage(tensor: torch.Tensor) -> int:
        return int(tensor.untyped_storage()._cdata)

    try:
        with FakeTensorMode():
            a, b, c = torch.empty(2, 3), torch.empty(3, 4), torch.empty(2, 3)
            memo = FakeMemo(table={})  # its own table: the check never reads what traces recorded
            for func, args in ((aten.mm.default, (a, b)), (aten.t.default, (a,)), (aten.add_.Tensor, (a, c))):
                plain, first, again = func(*args), memo(func, args, {}), memo(func, args, {})
                same = [(o.dtype, o.shape, o.stride(), o.storage_offset(), o.device, o.untyped_storage().nbytes())
                        for o in (plain, first, again)]
                if same.count(same[0]) != 3 or type(again) is not FakeTensor:
                    return False
                if func is aten.mm.default and len({storage(plain), storage(again), storage(a), storage(b)}) != 4:
                    return False  # a fresh storage of its own
                if func is aten.t.default and storage(again) != storage(a):
                    return False  # a view of its input's storage
                if func is aten.add_.Tensor and again is not a:
                    return False  # the input itself
            if memo.hits != 3:
                return False
    except Exception:  # an internal this torch does not have as used here: every op through fake tensors
        return False
    return True


class FakeMemo:
    """Repeated ops of one trace answered from their first answer (see the module docstring); ``hits``: how many
    were."""

    def __init__(self, *, table: dict[tuple[Any, ...], _Answer | None] | None = None) -> None:
        self.hits = 0
        self.table = _MEMO if table is None else table
        """The answers by key: the process's, shared by every trace (``table``: a table of its own)."""

    def __call__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func(*args, **kwargs)`` on the fake tensors below, answered from the memo where the op repeats."""
        memoisable = _OPS.get(func)
        if memoisable is None:
            memoisable = _OPS[func] = _may_memoise(func)
        if not memoisable:
            return func(*args, **kwargs)
        tensors: list[FakeTensor] = []
        parts: list[Any] = [func, torch.get_default_dtype(), tuple(kwargs)]
        mode = _describe(args, parts, tensors, None)
        if mode is not False:
            mode = _describe(tuple(kwargs.values()), parts, tensors, mode)
        if mode is False or mode is None:
            return func(*args, **kwargs)
        key = tuple(parts)
        answer = self.table.get(key, AMBIGUOUS)  # never kept: here, a key not seen yet
        if answer is None:
            return func(*args, **kwargs)
        if answer is not AMBIGUOUS:
            self.hits += 1
            return _made(answer, tensors, mode)
        out = func(*args, **kwargs)
        recorded = _recorded(out, tensors, mode)
        if recorded is not AMBIGUOUS:
            if len(self.table) >= MAX_ENTRIES:
                self.table.clear()
            self.table[key] = recorded
        return out


def _may_memoise(func: Any) -> bool:
    """An aten op that changes no input's metadata: not tagged so, not one of :data:`METADATA_CHANGES`, and
    without an ``out=`` argument (which its kernel resizes to the result)."""
    return isinstance(func, torch._ops.OpOverload) and func.namespace == "aten" \
        and func._schema.name.split("::")[-1] not in METADATA_CHANGES \
        and not any(tag in func.tags for tag in MEMOISED_TAGS) \
        and not any(argument.is_out for argument in func._schema.arguments)


def _describe(values: tuple[Any, ...] | list[Any], parts: list[Any], tensors: list[FakeTensor],
              mode: Any) -> Any:
    """Append what the outputs follow from in ``values`` to ``parts`` and their fake tensors to ``tensors``;
    returns the fake mode they share (``None`` while none is seen), or ``False`` where an argument rules the
    memo out."""
    for value in values:
        cls = type(value)
        if cls is FakeTensor:
            if value.constant is not None or value.layout is not torch.strided or value.is_complex() \
                    or (mode is not None and value.fake_mode is not mode):
                return False
            mode = value.fake_mode
            tensors.append(value)
            parts.append((value.dtype, value.shape, value.stride(), value.storage_offset(), value.fake_device,
                          value.is_neg()))
        elif cls in VALUE_TYPES:
            parts.append((cls, value))
        elif cls is list or cls is tuple:
            parts.append(cls)
            mode = _describe(value, parts, tensors, mode)
            if mode is False:
                return False
            parts.append(len(value))
        else:
            return False
    return mode


def _recorded(out: Any, tensors: list[FakeTensor], mode: Any) -> _Answer | None:
    """How to make ``out`` again from the op's inputs; ``None`` where it cannot be repeated, :data:`AMBIGUOUS`
    where it follows an input whose storage another input shares."""
    container = type(out) if isinstance(out, (tuple, list)) else None
    leaves = list(out) if container is not None else [out]
    storages = [tensor.untyped_storage()._cdata for tensor in tensors]
    fresh: set[int] = set()
    outputs = []
    for leaf in leaves:
        if leaf is None:
            outputs.append(_Output("none"))
            continue
        if type(leaf) is not FakeTensor or leaf.fake_mode is not mode or leaf.constant is not None \
                or leaf.layout is not torch.strided or leaf.requires_grad or leaf.is_neg() or leaf.is_conj():
            return None
        storage = leaf.untyped_storage()._cdata
        if storages.count(storage) > 1:
            return AMBIGUOUS
        same = next((index for index, tensor in enumerate(tensors) if tensor is leaf), None)
        if same is not None:
            outputs.append(_Output("same", same))
            continue
        shape, stride, offset = tuple(leaf.shape), tuple(leaf.stride()), int(leaf.storage_offset())
        if storage in storages:
            outputs.append(_Output("view", storages.index(storage), shape, stride, offset, leaf.dtype,
                                   leaf.fake_device))
            continue
        with torch._C._DisableTorchDispatch():
            made = torch.empty_strided(shape, stride, dtype=leaf.dtype, device="meta")
        if storage in fresh or offset or made.untyped_storage().nbytes() != leaf.untyped_storage().nbytes():
            return None
        fresh.add(storage)
        outputs.append(_Output("fresh", 0, shape, stride, 0, leaf.dtype, leaf.fake_device))
    return _Answer(tuple(outputs), container)


def _made(answer: _Answer, tensors: list[FakeTensor], mode: Any) -> Any:
    """The outputs of a memoised ``answer`` for this call's input ``tensors``."""
    made: list[Any] = []
    for output in answer.outputs:
        if output.kind == "none":
            made.append(None)
        elif output.kind == "same":
            made.append(tensors[output.index])
        else:
            with torch._C._DisableTorchDispatch():
                if output.kind == "fresh":
                    meta = torch.empty_strided(output.shape, output.stride, dtype=output.dtype, device="meta")
                else:
                    meta = torch.empty((0,), dtype=output.dtype, device="meta").set_(
                        tensors[output.index].untyped_storage(), output.offset, output.shape, output.stride)
            made.append(FakeTensor(mode, meta, output.device))
    return made[0] if answer.container is None else answer.container(made)
