"""Normalisation statistics under a fake trace: the dtype the real kernel saves them in.

Under mixed precision a normalisation layer often gets a 16-bit input with fp32 weights: a convolution's bf16
output into ``BatchNorm2d`` (ResNet, RegNet), a depthwise convolution's into ``LayerNorm`` (ConvNeXt), a
vision tower's last bf16 projection into its final ``LayerNorm`` (SigLIP). The kernels then compute, and save
for backward, the mean and inverse standard deviation in fp32 (the CPU kernels' "mixed type" path; CUDA's
batch norm does the same), while torch's shape functions for fake tensors give them the input's dtype: half
the bytes. :func:`norm_stats_answer` (called by :class:`memfit.memory.fake_answers.FakeAnswers`) answers these
ops on fake tensors with the statistics in fp32, as the real step makes them; their normalised output, and
every op not mixed (all fp32, all 16-bit), pass through. Group norm's backward shape function then takes the
input's gradient to fp32 (it follows the statistics), where the kernel gives it the input's dtype: that output
is answered too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

aten = torch.ops.aten
NORMS_WITH_STATS = frozenset({aten.native_layer_norm.default, aten.native_batch_norm.default,
                              aten._native_batch_norm_legit.default, aten._native_batch_norm_legit.no_stats,
                              aten.native_group_norm.default})
"""Ops returning (output, mean, inverse std): the two statistics are what backward keeps."""
GROUP_NORM_BACKWARD = aten.native_group_norm_backward.default
LOW_PRECISION = (torch.bfloat16, torch.float16)


def is_mixed(args: tuple[Any, ...]) -> bool:
    """A 16-bit input normalised with an fp32 weight, bias or running statistic: the kernels' mixed type."""
    return args[0].dtype in LOW_PRECISION and any(
        isinstance(arg, torch.Tensor) and arg.dtype == torch.float32 for arg in args[1:])


def norm_stats_answer(func: Any, args: Any, out: Any) -> Any:
    """``out`` of ``func`` on ``args``, with a mixed-type normalisation's statistics in fp32, as its CPU and
    CUDA kernels make them."""
    if func in NORMS_WITH_STATS and isinstance(args[0], FakeTensor) and is_mixed(args):
        output, mean, inverse_std = out
        return (output, torch.empty_like(mean, dtype=torch.float32),
                torch.empty_like(inverse_std, dtype=torch.float32))
    if func is GROUP_NORM_BACKWARD and isinstance(args[1], FakeTensor) and out[0] is not None and \
            out[0].dtype != args[1].dtype:  # (grad_out, input, mean, rstd, weight, ...)
        return (torch.empty_like(args[1]), *out[1:])
    return out
