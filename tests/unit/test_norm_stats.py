"""Mixed-type normalisation under a fake trace makes the tensors the CPU kernels make (memfit.memory.norm_stats)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.memory.fake_answers import FakeAnswers

aten = torch.ops.aten
Make = Callable[[torch.Tensor], torch.Tensor]


def layer_norm(make: Make, weight_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    x, w = make(torch.randn(2, 4, 3, dtype=torch.bfloat16)), make(torch.ones(3, dtype=weight_dtype))
    return tuple(aten.native_layer_norm.default(x, [3], w, w, 1e-5))


def batch_norm(make: Make, weight_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    x, w = make(torch.randn(2, 4, 3, 3, dtype=torch.bfloat16)), make(torch.ones(4, dtype=weight_dtype))
    stats = make(torch.zeros(4, dtype=weight_dtype)), make(torch.ones(4, dtype=weight_dtype))
    return tuple(aten.native_batch_norm.default(x, w, w, *stats, True, 0.1, 1e-5))


def group_norm(make: Make, weight_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    x, w = make(torch.randn(2, 4, 3, 3, dtype=torch.bfloat16)), make(torch.ones(4, dtype=weight_dtype))
    return tuple(aten.native_group_norm.default(x, w, w, 2, 4, 9, 2, 1e-5))


def group_norm_backward(make: Make, weight_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    x, grad = make(torch.randn(2, 4, 3, 3, dtype=torch.bfloat16)), make(torch.randn(2, 4, 3, 3, dtype=torch.bfloat16))
    w = make(torch.ones(4, dtype=weight_dtype))
    mean, rstd = make(torch.zeros(2, 2, dtype=weight_dtype)), make(torch.ones(2, 2, dtype=weight_dtype))
    return tuple(aten.native_group_norm_backward.default(grad, x, mean, rstd, w, 2, 4, 9, 2, [True, True, True]))


@pytest.mark.parametrize("op", [layer_norm, batch_norm, group_norm, group_norm_backward],
                         ids=lambda op: op.__name__)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fake_outputs_have_the_real_kernels_dtypes(op: Callable[[Make, torch.dtype], tuple[torch.Tensor, ...]],
                                                   weight_dtype: torch.dtype) -> None:
    real = op(lambda tensor: tensor, weight_dtype)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, FakeAnswers():
        fake = op(mode.from_tensor, weight_dtype)
    assert [(t.dtype, t.shape) for t in fake] == [(t.dtype, t.shape) for t in real]
