"""Values a model computes from its config while it is built, known to the fake trace.

Some constructors read the values of tensors they have just made: ConvNeXt, ConvNeXt-V2, FocalNet and
Data2Vec-Vision spread the drop-path rate over their blocks with
``[x.item() for x in torch.linspace(0, config.drop_path_rate, n)]`` (or ``.split(depths)`` and ``tolist()``)
and make a ``DropPath`` or an ``Identity`` from each value. A fake tensor has no values, so under a plain
``FakeTensorMode`` such a build stops at ``aten._local_scalar_dense``. Those values are a function of the
config alone, so the trace can compute them exactly as the real build does.

:class:`BuildValuesFakeMode` is the trace's fake mode. While the model is built
(:meth:`BuildValuesFakeMode.building`), the sequence factories (``torch.arange``, ``linspace``, ``logspace``)
run on real tensors and their results enter the trace as fake tensors that keep their real values (fake
mode's "constants", for results of up to :data:`BUILD_VALUE_NUMEL` elements); fake mode's own constant
propagation carries the values through what follows (``split``, iteration, arithmetic), answers ``item()``
and ``tolist()`` from them, and forgets a value as soon as something without known values writes to it. The
model's tensors are fake tensors of the same shapes, dtypes and storages as before: the tracker counts
exactly what it counted. Once the build is done the mode keeps torch's own rule (only one-element results
keep their values), so the training step is traced as it always was.

Not covered (by design): values that depend on the batch or the weights (a forward that reads its inputs,
IBERT's NaN check on activations); those still stop the trace.

Torch internals used, all here (checked against torch 2.13): ``FakeTensorMode.may_turn_const`` (which
results keep their values; torch's own rule allows one element), ``FakeTensor.constant``, the constant path
of ``aten.lift_fresh_copy`` in fake mode, and ``torch.utils._python_dispatch._disable_current_modes``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from memfit.quiet import quiet_imports

BUILD_VALUE_NUMEL = 1 << 16
"""Largest result (elements) that keeps its values while a model is built: drop-path schedules and position
tables; bigger ones are plain fake tensors, as before."""
SEQUENCE_FACTORIES: frozenset[Callable[..., Any]] = frozenset({torch.arange, torch.linspace, torch.logspace})


class BuildValuesFakeMode(FakeTensorMode):
    """``FakeTensorMode`` (non-fake inputs allowed) that knows the values a model's constructor computes from
    its config while :meth:`building`."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.value_numel = 1  # torch's own CONSTANT_NUMEL_LIMIT outside a build

    def may_turn_const(self, t: torch.Tensor) -> bool:
        """Whether an op's real result keeps its values in the trace: up to ``value_numel`` elements."""
        return bool(super().may_turn_const(t) or (
            t.numel() <= self.value_numel and t.layout == torch.strided and not self.is_our_fake(t)
            and t.device.type == "cpu"))

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """Inside (and inside this mode), sequence factories give fake tensors with their real values."""
        self.value_numel = BUILD_VALUE_NUMEL
        cache_enabled, self.cache_enabled = self.cache_enabled, False  # entries made with build-time constants
        try:
            with _RealSequences():
                yield
        finally:
            self.value_numel = 1
            self.cache_enabled = cache_enabled


class _RealSequences(TorchFunctionMode):
    """Runs a sequence factory given Python numbers only on real tensors, and lifts the result into the
    active fake mode (with its values; a plain copy where no fake mode is active)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in SEQUENCE_FACTORIES or not _from_numbers(args, kwargs):
            return func(*args, **kwargs)
        with _disable_current_modes():
            real = func(*args, **kwargs)
        return torch.ops.aten.lift_fresh_copy.default(real)


def _from_numbers(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A call whose result is a function of Python numbers alone, made on the CPU, without autograd."""
    device = kwargs.get("device")
    return (not any(isinstance(value, torch.Tensor) for value in (*args, *kwargs.values()))
            and "out" not in kwargs and not kwargs.get("requires_grad", False)
            and (device is None or torch.device(device).type == "cpu"))


@contextlib.contextmanager
def no_init_weights() -> Any:
    """Skip weight initialisation (``trunc_normal_`` reads values, which fake tensors do not have)."""
    quiet_imports()
    try:
        from transformers.initialization import no_init_weights as skipped
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights as skipped  # type: ignore[attr-defined,no-redef]
    with skipped():
        yield
