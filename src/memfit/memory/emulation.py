"""Emulating a CUDA target while tracing on CPU fake tensors.

The trace runs CPU kernels (on fake tensors, so only shapes and dtypes matter). Where a CUDA device would
keep different tensors, :class:`CudaEmulation` changes what the trace produces. It swaps the torch-level
functions concerned for wrappers for the duration of the trace (a ``TorchFunctionMode`` would be cleaner, but
it is suspended while ``Tensor.backward`` runs, which is exactly when checkpointed layers recompute their
forward):

- **Autocast op policy.** CPU and CUDA autocast cast the same matmul-class ops (linear, matmul, bmm, baddbmm,
  addmm, einsum, conv, SDPA) to 16 bits and share the weight-cast cache, so CPU autocast is kept for those;
  mv, addmv and addr, which only CUDA casts, are cast by a wrapper. CUDA additionally runs an fp32 list
  (softmax, log_softmax, layer_norm, rms_norm, group_norm, exp, log, pow, sum, cumsum, norms, rsqrt, the
  losses, upsampling, ...) in fp32 when handed fp16/bf16 inputs, where CPU autocast keeps the input dtype.
  The wrappers upcast those inputs, so the trace stores fp32 outputs exactly where CUDA would. Not emulated:
  RNN cells (CUDA casts them; transformers do not use them).
- **Attention kernel.** ``scaled_dot_product_attention`` picks flash attention on sm80+ for fp16/bf16 without
  an arbitrary mask, memory-efficient attention on sm50+ otherwise. Both save only q, k, v, the output and a
  float32 log-sum-exp of shape (B, H, S) (memory-efficient pads S to a multiple of 32), plus a philox seed
  and offset for dropout. The CPU math path instead saves the S x S probabilities and dropout masks. The
  wrapper replaces the call by an autograd function that produces and saves what the chosen kernel keeps.
- **Attention FLOPs.** The stand-in runs no matmuls, so ``FlopCounterMode`` cannot see them; it adds the
  fused kernels' FLOPs to :attr:`CudaEmulation.attention_flops` instead: 4·B·H·S·S'·D forward (QK^T and PV)
  and 10·B·H·S·S'·D backward (the kernels recompute QK^T, then four gradient matmuls), the counts
  FlashAttention's own papers use.
- **4-bit matmuls (QLoRA).** bitsandbytes' CUDA ``gemm_4bit`` runs a fused kernel only for a handful of
  rows (up to 4 everywhere, 7 on cards before compute capability 7.0; on sm75+ some shapes up to 1,536, by
  a per-card table this does not copy); otherwise it dequantises: an fp32 copy of the block scales, the same plus the
  offset, and the whole weight in the compute dtype, live while ``F.linear`` makes its output. The wrapper of
  ``bitsandbytes.matmul_4bit`` makes those transients around the CPU call. On sm75+ it is an upper bound
  (the fused kernel needs none).
- **Allocator rounding** is not done here: the tracker rounds each storage to 512 bytes for CUDA targets.

- **cuBLAS workspaces** (:func:`cublas_workspaces`) come from PyTorch's caching allocator, so they count in
  ``memory_allocated``: one per (thread, stream) that runs a matmul, kept for the life of the process. A
  training step has two such threads, the Python thread (forward) and the autograd engine's thread of the
  device (backward, and the recomputed forward of checkpointed layers). Each gets a cuBLAS workspace (32 MiB
  on compute capability 9.0, else 4 MiB x 2 + 16 KiB x 8, PyTorch's ``:4096:2:16:8`` default) and, when it
  runs a Linear with a bias (addmm through cuBLASLt), a 1 MiB cuBLASLt workspace. On an H200 that is
  65 MiB after one step, measured (``benchmarks/cuda_workspace_probe.py``).

What only a GPU can confirm: the kernels' internal scratch (flash backward's fp32 accumulators) is not
modelled; ``benchmarks/validate_estimator.py`` measures the remaining error.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves, tree_map

if TYPE_CHECKING:
    from memfit.memory.allocator import CachingAllocatorModel

LOW_PRECISION = (torch.float16, torch.bfloat16)

# CUDA autocast's fp32 list (ATen's AT_FORALL_FP32 and AT_FORALL_FP32_SET_OPT_DTYPE: run in float32), as the
# torch-level callables models reach them by. tests/unit/test_emulation.py checks it against the installed
# torch's own ATen/autocast_mode.h, op by op.
CUDA_FP32_FUNCTIONS: tuple[tuple[Any, str], ...] = (
    *((F, name) for name in (
        "softmax", "log_softmax", "layer_norm", "group_norm", "rms_norm", "softplus", "cross_entropy", "nll_loss",
        "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "binary_cross_entropy_with_logits",
        "cosine_similarity", "margin_ranking_loss", "soft_margin_loss", "multilabel_margin_loss",
        "multi_margin_loss", "triplet_margin_loss", "poisson_nll_loss", "cosine_embedding_loss",
        "hinge_embedding_loss", "pdist", "interpolate")),
    *((torch, name) for name in (
        "softmax", "log_softmax", "layer_norm", "group_norm", "rms_norm", "exp", "expm1", "log", "log10", "log2",
        "log1p", "reciprocal", "rsqrt", "sinh", "cosh", "tan", "acos", "asin", "erfinv", "pow", "sum", "prod",
        "cumsum", "cumprod", "norm", "nuclear_norm", "logsumexp", "dist", "cdist", "pdist", "renorm")),
    *((torch.linalg, name) for name in ("vector_norm", "matrix_norm")),
    *((torch.Tensor, name) for name in (
        "softmax", "log_softmax", "exp", "expm1", "log", "log10", "log2", "log1p", "pow", "__pow__", "sum", "prod",
        "cumsum", "cumprod", "rsqrt", "reciprocal", "sinh", "cosh", "tan", "acos", "asin", "erfinv", "norm",
        "logsumexp", "renorm", "dist")),
)

# Matrix-vector ops that CUDA autocast casts to 16 bits and CPU autocast leaves in fp32.
CUDA_ONLY_LOW_PRECISION_FUNCTIONS: tuple[tuple[Any, str], ...] = (
    *((torch, name) for name in ("addmv", "addr", "mv")),
    *((torch.Tensor, name) for name in ("addmv", "addr", "mv")),
)


CUBLAS_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
"""PyTorch's default cuBLAS workspace per (thread, stream), ``CUBLAS_WORKSPACE_CONFIG=:4096:2:16:8``."""
CUBLAS_WORKSPACE_BYTES_SM90 = 4096 * 1024 * 8
"""... on compute capability 9.0 (Hopper), ``:4096:8``."""
CUBLASLT_WORKSPACE_BYTES = 1024 * 1024
"""PyTorch's default cuBLASLt workspace (``CUBLASLT_WORKSPACE_SIZE``, in KiB: 1024)."""


def cublas_workspaces(compute_capability: tuple[int, int], *, biased_linear: bool,
                      recompute: bool) -> list[int]:
    """Bytes of each cuBLAS/cuBLASLt workspace a training step keeps from its first backward on.

    ``biased_linear``: the model has a Linear with a bias (its forward runs addmm through cuBLASLt);
    ``recompute``: checkpointed layers run that forward again on the backward thread.
    """
    cublas = CUBLAS_WORKSPACE_BYTES_SM90 if compute_capability == (9, 0) else CUBLAS_WORKSPACE_BYTES
    sizes = [cublas, cublas]  # the Python thread's and the autograd engine's device thread's
    if biased_linear:
        sizes += [CUBLASLT_WORKSPACE_BYTES] * (2 if recompute else 1)
    return sizes


def attention_kernel(compute_capability: tuple[int, int], dtype: torch.dtype, has_mask: bool,
                     head_dim: int, value_head_dim: int | None = None) -> str:
    """The SDPA kernel CUDA would run: ``flash``, ``efficient`` or ``math``. Flash needs the values' head size
    to be the queries' (multi-head latent attention's are not: DeepSeek's 192 and 128)."""
    same_heads = value_head_dim is None or value_head_dim == head_dim
    if compute_capability >= (8, 0) and dtype in LOW_PRECISION and not has_mask and head_dim <= 256 and same_heads:
        return "flash"
    if compute_capability >= (5, 0):
        return "efficient"
    return "math"


class _FusedAttention(torch.autograd.Function):
    """Shapes-only stand-in for a fused attention kernel: saves what flash / memory-efficient attention save."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: torch.Tensor | None, lse_length: int, dropout: bool, counter: CudaEmulation,
                kernel: str) -> torch.Tensor:
        counter.attention_flops += 4 * _attention_size(query, key)
        ctx.counter = counter
        if kernel == "efficient":  # allocated (B, S, H, D of the values) and returned transposed, whatever the
            # query's layout: a (B, S, H*D) reshape of it is then a view, not a copy
            output = query.new_empty((query.shape[0], query.shape[2], query.shape[1], value.shape[-1]))
            output = output.transpose(1, 2)  # (B, H, S, Dv)
        else:  # flash: laid out like its query (whose head size the values share)
            output = torch.empty_like(query)  # (B, H, S, D)
        batch, heads = query.shape[0], query.shape[1]
        logsumexp = query.new_empty((batch, heads, lse_length), dtype=torch.float32)  # (B, H, S')
        rng_state = query.new_empty((2,), dtype=torch.int64) if dropout else query.new_empty((0,), dtype=torch.int64)
        saved = [query, key, value, output, logsumexp, rng_state]
        ctx.has_mask = mask is not None
        if mask is not None:
            saved.append(mask)
        ctx.save_for_backward(*saved)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        query, key, value = ctx.saved_tensors[:3]
        ctx.counter.attention_flops += 10 * _attention_size(query, key)
        grad_query = torch.empty_like(query)
        grad_key = torch.empty_like(key)
        grad_value = torch.empty_like(value)
        return grad_query, grad_key, grad_value, None, None, None, None, None


def _attention_size(query: torch.Tensor, key: torch.Tensor) -> int:
    """B·H·S·S'·D: one multiply-add per query, key and head dimension."""
    batch, heads, length, head_dim = query.shape
    return int(batch * heads * length * key.shape[-2] * head_dim)


class CudaEmulation:
    """Makes a CPU trace keep the tensors a CUDA device of ``compute_capability`` would keep (a context)."""

    def __init__(self, compute_capability: tuple[int, int]) -> None:
        self.compute_capability = compute_capability
        self.attention_flops = 0
        """FLOPs of the fused attention kernels the trace stood in for (forward, backward, recompute)."""
        self._originals: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> CudaEmulation:
        for owner, name in CUDA_FP32_FUNCTIONS:
            self._swap(owner, name, _in_fp32(getattr(owner, name)))
        for owner, name in CUDA_ONLY_LOW_PRECISION_FUNCTIONS:
            self._swap(owner, name, _in_low_precision(getattr(owner, name)))
        self._swap(F, "scaled_dot_product_attention", functools.partial(self._attention,
                                                                        F.scaled_dot_product_attention))
        bnb = sys.modules.get("bitsandbytes")
        if bnb is not None:
            self._swap(bnb, "matmul_4bit", _dequantising(bnb.matmul_4bit, self.compute_capability))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        while self._originals:
            owner, name, original = self._originals.pop()
            setattr(owner, name, original)

    def _swap(self, owner: Any, name: str, replacement: Any) -> None:
        self._originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def _attention(self, math_attention: Callable[..., torch.Tensor], query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                   is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
        kernel = attention_kernel(self.compute_capability, dtype, attn_mask is not None, query.shape[-1],
                                  value.shape[-1])
        if kernel == "math":
            return math_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                  scale=scale, enable_gqa=enable_gqa)
        if dtype != query.dtype:  # autocast casts the inputs of SDPA
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        if enable_gqa and key.shape[1] != query.shape[1]:
            repeats = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
        length = query.shape[2]
        lse_length = length if kernel == "flash" else -(-length // 32) * 32
        output: torch.Tensor = _FusedAttention.apply(query, key, value, attn_mask, lse_length, dropout_p > 0,
                                                     self, kernel)
        return output


FUSED_4BIT_ROWS = 4
"""bitsandbytes' CUDA gemm_4bit runs its fused kernel (no dequantised copy) up to this many rows on any card,
and below :data:`FUSED_4BIT_ROWS_PRE_VOLTA` rows on cards older than compute capability 7.0."""
FUSED_4BIT_ROWS_PRE_VOLTA = 8


def _dequantising(matmul_4bit: Callable[..., torch.Tensor],
                  capability: tuple[int, int]) -> Callable[..., torch.Tensor]:
    """``matmul_4bit`` as CUDA's dequantising path allocates: its transients live while the output is made."""
    @functools.wraps(matmul_4bit)
    def run(A: torch.Tensor, B: torch.Tensor, quant_state: Any, out: torch.Tensor | None = None,
            bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = A.numel() // A.shape[-1]
        if rows <= FUSED_4BIT_ROWS or (capability < (7, 0) and rows < FUSED_4BIT_ROWS_PRE_VOLTA):
            return matmul_4bit(A, B, quant_state, out=out, bias=bias)
        transients = []
        if quant_state.nested:  # the block scales in fp32, then plus the offset
            scales = torch.empty(quant_state.absmax.shape, dtype=torch.float32)
            transients += [scales, scales + 0.0]
        transients.append(torch.empty(tuple(quant_state.shape), dtype=A.dtype))  # the dequantised weight
        result = matmul_4bit(A, B, quant_state, out=out, bias=bias)
        del transients
        return result

    return run


def _in_fp32(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.is_autocast_enabled("cpu") and any(
                isinstance(leaf, torch.Tensor) and leaf.dtype in LOW_PRECISION for leaf in tree_leaves(args)):
            args, kwargs = tree_map(_to_fp32, args), tree_map(_to_fp32, kwargs)
        return function(*args, **kwargs)

    return run


def _in_low_precision(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.is_autocast_enabled("cpu"):
            dtype = torch.get_autocast_dtype("cpu")
            args, kwargs = tree_map(functools.partial(_to_low, dtype=dtype), (args, kwargs))
        return function(*args, **kwargs)

    return run


def _to_low(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
        return value.to(dtype)
    return value


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in LOW_PRECISION:
        return value.float()
    return value


def cublas_workspace_bytes(model: torch.nn.Module, emulation: CudaEmulation | None,
                           allocator: CachingAllocatorModel | None, *, recompute: bool) -> int:
    """cuBLAS's workspaces on a CUDA target (:func:`memfit.memory.emulation.cublas_workspaces`), allocated in
    ``allocator``; 0 without an emulated card."""
    if emulation is None:
        return 0
    biased = any(isinstance(module, torch.nn.Linear) and module.bias is not None for module in model.modules())
    sizes = cublas_workspaces(emulation.compute_capability, biased_linear=biased, recompute=recompute)
    return sum(allocator.allocate(-100 - key, size) if allocator is not None else size
               for key, size in enumerate(sizes))
