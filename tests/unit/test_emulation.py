"""CUDA emulation: the autocast policy checked op by op against the installed torch's ATen lists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from memfit.memory.emulation import (
    CUDA_FP32_FUNCTIONS,
    CUDA_ONLY_LOW_PRECISION_FUNCTIONS,
    CudaEmulation,
    attention_kernel,
)

HEADER = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"

# ATen ops reached through another torch-level function that the emulation wraps.
REACHED_THROUGH = {"native_layer_norm": "layer_norm", "nll_loss2d": "nll_loss", "frobenius_norm": "norm",
                   "linalg_vector_norm": "vector_norm", "linalg_matrix_norm": "matrix_norm"}
# CUDA casts these to 16 bits; CPU autocast already does (kept), or transformers never call them (documented).
CPU_CASTS_TOO = {"_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
                 "conv_transpose3d", "convolution", "prelu", "addmm", "matmul", "einsum", "mm", "linalg_vecdot",
                 "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
                 "_scaled_dot_product_flash_attention", "scaled_dot_product_attention"}
NOT_EMULATED = {"_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell",
                "rnn_relu_cell"}


def aten_list(macro: str) -> set[str]:
    text = HEADER.read_text()
    body = text[text.index(f"#define {macro}(_)"):]
    body = body[:body.index("\n\n")]
    return set(re.findall(r"_\((\w+)", body))


needs_header = pytest.mark.skipif(not HEADER.is_file(), reason="this torch build ships no ATen headers")


@needs_header
def test_every_cuda_fp32_op_is_emulated() -> None:
    aten = aten_list("AT_FORALL_FP32") | aten_list("AT_FORALL_FP32_SET_OPT_DTYPE")
    assert {"layer_norm", "softmax", "exp", "sum"} <= aten  # the parse found the lists
    wrapped = {name for _, name in CUDA_FP32_FUNCTIONS}
    missing = {op for op in aten if op not in wrapped and REACHED_THROUGH.get(op) not in wrapped
               and not (op.lstrip("_").startswith("upsample") and "interpolate" in wrapped)}
    assert missing == set()


@needs_header
def test_every_cuda_low_precision_op_is_cast_on_the_trace() -> None:
    aten = aten_list("AT_FORALL_LOWER_PRECISION_FP")
    cuda_only = {name for _, name in CUDA_ONLY_LOW_PRECISION_FUNCTIONS}
    assert aten - CPU_CASTS_TOO - NOT_EMULATED == cuda_only


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp32_ops_upcast_and_matrix_vector_ops_downcast(dtype: torch.dtype) -> None:
    x = torch.randn(2, 3, 8, 8).to(dtype)
    weight = torch.randn(8, 8)
    vector = torch.randn(8)
    calls = {
        "softmax": lambda: x.softmax(-1), "layer_norm": lambda: F.layer_norm(x, (8,)),
        "rms_norm": lambda: F.rms_norm(x, (8,)), "pow operator": lambda: x ** 2, "exp": lambda: torch.exp(x),
        "sum": lambda: x.sum(-1), "interpolate": lambda: F.interpolate(x, scale_factor=2.0),
        "vector_norm": lambda: torch.linalg.vector_norm(x, dim=-1),
    }
    originals = (torch.Tensor.__pow__, F.softmax, torch.mv)
    with torch.autocast("cpu", dtype=dtype):
        plain = {name: call().dtype for name, call in calls.items()}
        with CudaEmulation((6, 1)):
            emulated = {name: call().dtype for name, call in calls.items()}
            matrix_vector = torch.mv(weight, vector).dtype
        after = torch.mv(weight, vector).dtype
    assert set(plain.values()) == {dtype}  # CPU autocast keeps these in the input dtype
    assert set(emulated.values()) == {torch.float32}
    assert (matrix_vector, after) == (dtype, torch.float32)
    assert (torch.Tensor.__pow__, F.softmax, torch.mv) == originals  # restored on exit


def test_attention_kernel_follows_the_card() -> None:
    assert attention_kernel((8, 0), torch.bfloat16, has_mask=False, head_dim=64) == "flash"
    assert attention_kernel((8, 0), torch.float16, has_mask=True, head_dim=64) == "efficient"  # flash: no masks
    assert attention_kernel((8, 0), torch.float32, has_mask=False, head_dim=64) == "efficient"  # flash: 16-bit
    assert attention_kernel((6, 1), torch.float16, has_mask=False, head_dim=64) == "efficient"  # Pascal
    assert attention_kernel((9, 0), torch.float16, has_mask=False, head_dim=512) == "efficient"
    assert attention_kernel((3, 7), torch.float16, has_mask=False, head_dim=64) == "math"


def test_fused_attention_saves_a_log_sum_exp_not_the_scores() -> None:
    query = torch.randn(2, 4, 96, 16, requires_grad=True)  # (B, H, S, D)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), \
            CudaEmulation((7, 5)):
        F.scaled_dot_product_attention(query, query, query, dropout_p=0.1).sum().backward()
    shapes = {tuple(t.shape) for t in saved}
    assert (2, 4, 96) in shapes  # log-sum-exp, padded to a multiple of 32 (96 already is)
    assert (2, 4, 96, 96) not in shapes  # no S x S probabilities, no dropout mask
    assert query.grad is not None and query.grad.shape == query.shape


def test_fused_attention_counts_its_flops_forward_and_backward() -> None:
    query, key, value = (torch.zeros(2, 2, 4, 8, requires_grad=True) for _ in range(3))  # (B, H, S, D)
    with CudaEmulation((6, 1)) as emulation:  # memory-efficient kernel: no FLOPs visible to the tracker
        output = F.scaled_dot_product_attention(query, key, value)
        assert emulation.attention_flops == 4 * 2 * 2 * 4 * 4 * 8  # QK^T and PV
        output.sum().backward()
    assert emulation.attention_flops == 14 * 2 * 2 * 4 * 4 * 8  # + recomputed QK^T and four gradient matmuls


@pytest.mark.parametrize("contiguous_query", [True, False])
def test_fused_attention_outputs_are_laid_out_as_the_kernels_lay_them_out(contiguous_query: bool) -> None:
    """Memory-efficient attention allocates (B, S, H, D) and returns it transposed, whatever the query's layout
    (torch's meta function for it: ``empty(B, M, num_heads, Kv)``), so a (B, S, H*D) reshape of it copies
    nothing; flash attention lays its output out like its query."""
    shape = (2, 4, 8, 16)  # (B, H, S, D)
    query = torch.randn(*shape) if contiguous_query else torch.randn(2, 8, 4, 16).transpose(1, 2)
    with CudaEmulation((6, 1)):  # efficient
        efficient = F.scaled_dot_product_attention(query, query, query)
    with CudaEmulation((8, 0)), torch.autocast("cpu", dtype=torch.bfloat16):  # flash
        flash = F.scaled_dot_product_attention(query, query, query)
    assert efficient.shape == flash.shape == shape
    assert efficient.transpose(1, 2).is_contiguous()
    assert flash.stride() == query.stride()
