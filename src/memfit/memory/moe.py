"""Mixture-of-experts layers under a fake trace: the grouped matmul as the real step runs it.

transformers runs the experts of a MoE block (Mixtral, Qwen3-MoE, gpt-oss, DeepSeek-V3, OLMoE, ...) with one
grouped matmul per projection (``grouped_mm`` experts implementation, its default): the (token, expert) pairs
are sorted by expert into ``S = tokens x k`` rows, and ``torch._grouped_mm`` multiplies each expert's block of
rows with that expert's weight, the blocks given by cumulative counts (``offs``). Every tensor of the step,
forward and backward, is then a function of ``S`` alone (rows, not which expert they go to), so the step's
memory does not depend on the routing: a skewed router that sends every token to the same experts uses the
same bytes as a balanced one (tests/unit/test_moe.py runs both for real and checks it).

What the fake mode lacks: torch's shape function for ``aten._grouped_mm`` repeats the CUDA kernel's checks and
accepts bf16 only, while the real step also runs it in fp32 and fp16 (the CPU kernel; transformers' own loop
on cards it does not cover). :func:`grouped_mm_answer` answers the op with the output the kernel makes, for
every dtype, inside memfit's trace only: :class:`memfit.memory.fake_answers.FakeAnswers`, a dispatch mode entered
with the trace, calls it; nothing changes torch's or transformers' registrations.

Assumption, stated: on a CUDA card below compute capability 8.0 (the 1080 Ti), transformers replaces the
grouped matmul with its own per-expert loop (``transformers::grouped_mm_fallback``); its outputs and its
saved tensors are the same sizes (the input and weight are saved, the output and the input's gradient are
``S`` rows), so the trace of the grouped path stands for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

_GROUPED_MM_PACKET = getattr(torch.ops.aten, "_grouped_mm", None)
GROUPED_MM = _GROUPED_MM_PACKET.default if _GROUPED_MM_PACKET is not None else None
"""``aten._grouped_mm`` (a private op, checked against torch 2.13; ``None`` in a torch without it, where
transformers runs its own loop and nothing needs answering)."""


CUDA_ROW_ALIGNMENT = 16
"""Bytes a CUDA grouped matmul aligns each output row to (torch 2.13's shape function: its rows' stride is padded
to a multiple of 16 bytes); the CPU kernel's rows are dense."""


def grouped_mm_output(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None,
                      out_dtype: torch.dtype | None, *, cuda: bool = False) -> torch.Tensor:
    """An empty tensor shaped as ``torch._grouped_mm(mat_a, mat_b, offs=offs)``'s result: 2-D x 3-D (a row
    block per expert) gives (rows, out); 3-D x 2-D (rows, out); 2-D x 2-D with offsets (groups, m, n), what the
    weights' gradient is; 3-D x 3-D a batched matmul. ``cuda``: rows padded as a CUDA card's kernel pads them."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        assert offs is not None, "a 2-D x 2-D grouped matmul needs offsets"
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif mat_a.dim() == 2:  # (S, in) x (E, in, out)
        size = [mat_a.size(0), mat_b.size(-1)]
    elif mat_b.dim() == 2:  # (E, m, in) x (in, S)
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    dtype = out_dtype or mat_a.dtype
    if not cuda:
        return torch.empty(size, dtype=dtype, device=mat_a.device)
    alignment = CUDA_ROW_ALIGNMENT // dtype.itemsize
    row = -(-size[-1] // alignment) * alignment
    stride = [size[1] * row, row, 1] if len(size) == 3 else [row, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


def is_fake_grouped_mm(func: Any, args: Any) -> bool:
    """Whether ``func`` is ``aten._grouped_mm`` on fake tensors, the op :func:`grouped_mm_answer` answers."""
    return GROUPED_MM is not None and func is GROUPED_MM and isinstance(args[0], FakeTensor)


def grouped_mm_answer(args: Any, kwargs: dict[str, Any], *, cuda: bool) -> torch.Tensor:
    """The output of ``aten._grouped_mm`` on fake ``args``; ``cuda``: the trace is of a CUDA card's step (padded
    output rows)."""
    mat_a, mat_b = args[0], args[1]
    offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
    bias = kwargs.get("bias", args[3] if len(args) > 3 else None)
    assert bias is None, "transformers adds the experts' bias after the grouped matmul"
    out_dtype = kwargs.get("out_dtype", args[4] if len(args) > 4 else None)
    return grouped_mm_output(mat_a, mat_b, offs, out_dtype, cuda=cuda)


@contextlib.contextmanager
def skewed_routing(experts: list[int]) -> Iterator[list[int]]:
    """Every token sent to the same ``experts``, the most skewed routing there is, for measuring that the step's
    memory does not depend on the routing: each experts module's routing input (``top_k_index``) is replaced
    before it runs. Yields the number of tokens of each replaced call (empty if no experts module ran)."""
    calls: list[int] = []

    def skew(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not type(module).__name__.endswith("Experts") or len(args) != 3:
            return None
        hidden, top_k_index, top_k_weights = args
        calls.append(int(top_k_index.shape[0]))
        skewed = torch.tensor(experts, dtype=top_k_index.dtype).expand_as(top_k_index).contiguous()
        return hidden, skewed, top_k_weights

    # (the hook returns the replaced arguments: torch's type says None)
    handle = nn.modules.module.register_module_forward_pre_hook(skew)  # type: ignore[arg-type]
    try:
        yield calls
    finally:
        handle.remove()
