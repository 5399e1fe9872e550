"""The ops memfit answers itself on fake tensors, where torch's shape functions differ from the real kernels:
one dispatch mode entered with the trace (each mode in the stack costs every op of a trace some microseconds,
so the answers share one)."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from memfit.memory.fake_memo import FakeMemo, memo_enabled
from memfit.memory.moe import grouped_mm_answer, is_fake_grouped_mm
from memfit.memory.norm_stats import norm_stats_answer


class FakeAnswers(TorchDispatchMode):
    """Mixed-type normalisations' statistics (:mod:`memfit.memory.norm_stats`) and the grouped matmul of a
    mixture of experts (:mod:`memfit.memory.moe`), answered on fake tensors; every other op passes through, a
    repeated one answered from its first answer (:mod:`memfit.memory.fake_memo`).
    ``cuda``: the trace is of a CUDA card's step."""

    def __init__(self, *, cuda: bool = False) -> None:
        super().__init__()
        self.cuda = cuda
        self.memo = FakeMemo() if memo_enabled() else None
        """Repeated ops answered from their first answer (:mod:`memfit.memory.fake_memo`)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if is_fake_grouped_mm(func, args):
            return grouped_mm_answer(args, kwargs, cuda=self.cuda)
        out = func(*args, **kwargs) if self.memo is None else self.memo(func, args, kwargs)
        return norm_stats_answer(func, args, out)
