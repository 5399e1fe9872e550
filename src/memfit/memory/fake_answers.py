"""The ops memfit answers itself on fake tensors, where torch's shape functions differ from the real kernels:
one dispatch mode entered with the trace (each mode in the stack costs every op of a trace some microseconds,
so the answers share one)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from memfit.memory.fake_memo import FakeMemo
from memfit.memory.moe import grouped_mm_answer, is_fake_grouped_mm
from memfit.memory.norm_stats import norm_stats_answer


class FakeAnswers(TorchDispatchMode):
    """Mixed-type normalisations' statistics (:mod:`memfit.memory.norm_stats`) and the grouped matmul of a
    mixture of experts (:mod:`memfit.memory.moe`), answered on fake tensors; every other op passes through, a
    repeated one answered from its first answer (:mod:`memfit.memory.fake_memo`) inside :meth:`memoising` where
    ``memo`` (:func:`memfit.memory.fake_memo.memo_enabled`, asked before the trace: its check runs ops of its
    own). ``cuda``: the trace is of a CUDA card's step."""

    def __init__(self, *, cuda: bool = False, memo: bool = False) -> None:
        super().__init__()
        self.cuda = cuda
        self.memo = FakeMemo() if memo else None
        """Repeated ops answered from their first answer (:mod:`memfit.memory.fake_memo`), inside
        :meth:`memoising`."""
        self._memoising = False

    @contextlib.contextmanager
    def memoising(self) -> Iterator[None]:
        """Inside, repeated ops are answered from the memo: the training step, once the model is built (a
        build's ops carry values fake mode keeps as constants, and run once)."""
        self._memoising = True
        try:
            yield
        finally:
            self._memoising = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if is_fake_grouped_mm(func, args):
            return grouped_mm_answer(args, kwargs, cuda=self.cuda)
        memo = self.memo if self._memoising else None
        out = func(*args, **kwargs) if memo is None else memo(func, args, kwargs)
        return norm_stats_answer(func, args, out)
