"""Quantised base weights (QLoRA): the frozen Linear layers of the repeated blocks stored in 4 or 8 bits.

Trade-off: a frozen ``nn.Linear`` weight costs 4 bytes per parameter in fp32, 2 in bf16. bitsandbytes' NF4
stores it in about 0.52 bytes (two 4-bit codes per byte, one 8-bit scale per block of 64 weights, and with
double quantisation one fp32 scale per 256 of those); ``int8`` in about 1.0 (one int8 code per weight, one
fp32 scale per output row). The price is compute: every forward and backward dequantises the weight, and the
quantisation error changes what the frozen layers compute, so the adapters trained on top (LoRA, required:
quantised weights cannot train) learn around it (SmolLM2-135M on rotten-tomatoes-sft here: 0.8 points below
16-bit LoRA).

Only the Linear layers inside the repeated transformer blocks are quantised, and under ``nf4`` a
mixture-of-experts block's stacked expert weights (:mod:`memfit.techniques.quantized_experts`);
embeddings, norms and the output or classification head keep their precision, as in QLoRA. The compute
dtype of the dequantised weights is the run's 16-bit dtype (fp32 under ``--precision fp32``).

Applied first, before freezing and adapters: ``nf4`` uses ``bitsandbytes.nn.Linear4bit`` (blocksize 64,
double quantisation on); ``int8`` uses ``bitsandbytes.nn.Linear8bitLt`` without outlier decomposition
(``threshold=0``). The model is quantised on the host, where it is built; the packed weights then move to the
device as they are.

The ``int8`` layers run bitsandbytes' forward but not its backward (:class:`FrozenInt8Matmul`):
bitsandbytes' 8-bit matmul keeps each layer's input as a plain attribute of its autograd context, for the
weight's gradient, which a frozen weight never has. Activation checkpointing and saved-tensor hooks only see
what ``save_for_backward`` saves, so a checkpointed block kept every Linear input alive anyway (Llama-2-7B,
4 x 2048 tokens, fp16: 11 GiB; without checkpointing, 9 GiB of inputs no other op keeps). Backward needs
only ``grad_output @ W``, which memfit computes with bitsandbytes' own formula: the gradients are the same
to the bit.

The estimator builds the same layers on fake tensors: bitsandbytes registers fake kernels for its ops, so the
packed weights, scales and quantisation state have their real shapes and dtypes and are counted storage by
storage, as in a real run (:func:`quantized_tensors`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from memfit.models import transformer_blocks
from memfit.quiet import raised_loggers

NF4_BLOCKSIZE = 64


@functools.cache
def bitsandbytes() -> Any:
    """bitsandbytes, imported once and quietly: on a CPU it logs that it cannot fetch an optional kernel from
    a hub (there is none to reach), which is no concern of memfit's run. Its cached quantisation map is made
    here on real tensors: making it reads values, which a fake tensor in the estimator's trace has not."""
    # outside any dispatch mode: its modules make tables at import, which must be real tensors even when the
    # first import happens inside the estimator's fake-tensor trace (or a build on the meta device)
    with raised_loggers("bitsandbytes", "kernels", level=logging.CRITICAL), _disable_current_modes(), \
            torch.device("cpu"):  # (the innermost default device wins over a build's "meta")
        import bitsandbytes as bnb

        bnb.functional.quantize_4bit(torch.zeros(NF4_BLOCKSIZE * 256), blocksize=NF4_BLOCKSIZE,
                                     compress_statistics=True, quant_type="nf4")
    return bnb


def quantize_base(model: nn.Module, kind: str, compute_dtype: torch.dtype) -> None:
    """Replace every ``nn.Linear`` of the repeated blocks by its ``kind`` (``nf4 | int8``) counterpart."""
    if kind == "none":
        return
    kept = set(getattr(model, "_keep_in_fp32_modules", None) or ())  # T5's "wo": as transformers' 4-bit loading
    for block in transformer_blocks(model):  # (both stacks of an encoder-decoder)
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and name not in kept:
                    setattr(parent, name, _quantized(child, kind, compute_dtype))


def _quantized(linear: nn.Linear, kind: str, compute_dtype: torch.dtype) -> Any:
    bnb = bitsandbytes()
    weight = linear.weight.detach()
    fake = isinstance(weight, FakeTensor)
    bias = linear.bias is not None
    module: Any
    # built on the meta device (outside a fake mode, where its parameter classes cannot wrap a tensor): only
    # the parameters set below own memory
    with _disable_current_modes():
        module = (bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=bias, compute_dtype=compute_dtype,
                                    compress_statistics=True, quant_type="nf4", device="meta") if kind == "nf4"
                  else bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=bias,
                                           has_fp16_weights=False, threshold=0.0, device="meta"))
    if kind == "nf4":
        packed, state = bnb.functional.quantize_4bit(weight.contiguous(), blocksize=NF4_BLOCKSIZE,
                                                     compress_statistics=True, quant_type="nf4")
        if fake:  # Params4bit cannot wrap a fake tensor: a plain frozen parameter with the same storage
            parameter = nn.Parameter(packed, requires_grad=False)
            parameter.quant_state = state  # type: ignore[attr-defined]
            module.register_forward_pre_hook(_fake_quant_state)
        else:
            parameter = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, blocksize=NF4_BLOCKSIZE,
                                          compress_statistics=True, quant_type="nf4", module=module,
                                          bnb_quantized=True)
        module.weight = parameter
        module.quant_state = state
        module.support_avx512bf16_for_cpu = False  # its inference repacking would change the trained layout
    else:
        codes, scales, _ = bnb.functional.int8_vectorwise_quant(weight.to(torch.float16))
        if fake:
            parameter = nn.Parameter(codes, requires_grad=False)
        else:
            parameter = bnb.nn.Int8Params(codes, requires_grad=False, has_fp16_weights=False)
        parameter.CB, parameter.SCB = codes, scales  # type: ignore[attr-defined]
        module.weight = parameter
        module.state.CB, module.state.SCB = codes, scales
        # an instance's forward, not a subclass: bitsandbytes is optional and imported only when used
        module.forward = functools.partial(frozen_int8_forward, module)
    if bias:
        module.bias = nn.Parameter(linear.bias.detach().to(compute_dtype), requires_grad=False)
    return module


def _fake_quant_state(module: Any, args: Any) -> None:
    """A traced 4-bit layer's state on the weight FSDP2 gathered for its forward (a plain parameter, which
    bitsandbytes re-wraps as ``Params4bit`` in a real run, sharing its storage; it cannot wrap a fake tensor)."""
    if getattr(module.weight, "quant_state", None) is None:
        module.weight.quant_state = module.quant_state


def frozen_int8_forward(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """``layer``'s (a ``bitsandbytes.nn.Linear8bitLt`` with a frozen weight) forward, keeping nothing of ``x``
    for backward; bitsandbytes' own forward where no gradient is recorded (evaluation, generation)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return FrozenInt8Matmul.apply(x, layer)
    return type(layer).forward(layer, x)


class FrozenInt8Matmul(torch.autograd.Function):
    """``y = x @ W.T (+ b)`` for a frozen int8 weight ``W``: bitsandbytes' forward, the input's gradient only.

    The forward runs bitsandbytes' ``Linear8bitLt.forward`` inside this function's forward, where autograd
    records nothing: its context (and the reference to ``x`` it keeps there) is dropped on return. The backward
    is bitsandbytes' own input gradient (``MatMul8bitLt`` and ``MatMul8bitFp`` share it, bitsandbytes 0.50.2):
    the weight dequantised into the input's dtype from its int8 rows ``state.CB`` and row scales
    ``state.SCB``, then ``grad_output @ W``; the same ops in the same dtypes, so gradients equal bitsandbytes'
    to the bit. Nothing is saved; the weight and bias get no gradient (they never train here).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: Any) -> torch.Tensor:
        assert not layer.weight.requires_grad and (layer.bias is None or not layer.bias.requires_grad)
        output: torch.Tensor = type(layer).forward(layer, x)
        ctx.state, ctx.input_dtype, ctx.input_shape = layer.state, x.dtype, x.shape
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _int8_input_grad(grad_output, ctx.state, ctx.input_dtype, ctx.input_shape), None


def _int8_input_grad(grad_output: torch.Tensor, state: Any, input_dtype: torch.dtype,
                     input_shape: Sequence[int]) -> torch.Tensor:
    if grad_output.dim() == 3:  # (B, S, out) -> (B*S, out)
        grad_output = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
    weight = state.CB.to(input_dtype, copy=True).mul_(state.SCB.unsqueeze(1).mul(1.0 / 127.0))  # (out, in)
    return torch.matmul(grad_output.to(input_dtype), weight).view(input_shape)


def quantized_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor of the quantised layers: packed weights, their scales and quantisation state (most of
    which are neither parameters nor buffers, so a module's ``parameters()`` do not list them)."""
    tensors: list[torch.Tensor] = []
    module: Any
    for module in model.modules():
        # the weight's own state first: a traced Trainer's fake weight carries a fake copy of the module's
        state = getattr(getattr(module, "weight", None), "quant_state", None) or getattr(module, "quant_state", None)
        if state is not None and hasattr(state, "absmax"):  # a 4-bit layer
            tensors.append(module.weight)
            tensors.extend(_state_tensors(state))
        cb = getattr(getattr(module, "weight", None), "CB", None)
        if isinstance(cb, torch.Tensor):  # an 8-bit layer
            tensors.extend([module.weight, cb, module.weight.SCB])
        for packed in getattr(module, "parametrizations", {}).values():  # NF4 experts (quantized_experts)
            state = getattr(packed.original, "quant_state", None)
            if state is not None:
                tensors.append(packed.original)
                tensors.extend(_state_tensors(state))
    return tensors


def quant_states(model: nn.Module) -> list[Any]:
    """Every 4-bit quantisation state of ``model`` (a 4-bit Linear layer's, an NF4 expert stack's), each once, in
    the modules' order: the same list on every rank that built the same model."""
    states: list[Any] = []
    seen: set[int] = set()
    module: Any
    for module in model.modules():
        # a Linear layer's (on the module: FSDP2's sharded parameter drops the weight's), an expert stack's
        # (on its parametrization, the same object as its packed weight's)
        found = [getattr(module, "quant_state", None), getattr(getattr(module, "weight", None), "quant_state", None),
                 getattr(module, "nf4_state", None)]
        found += [getattr(packed.original, "quant_state", None)
                  for packed in getattr(module, "parametrizations", {}).values()]
        for state in found:
            if state is not None and hasattr(state, "absmax") and id(state) not in seen:
                seen.add(id(state))
                states.append(state)
    return states


def place_quant_states(model: nn.Module, device: torch.device) -> list[torch.Tensor]:
    """Put every 4-bit state's tensors (codes, scales, offset, nested ones) on ``device`` and return them, one per
    slot, in a fixed order. FSDP2 moves a model's parameters and buffers only, so a state made on the host would
    stay there while bitsandbytes dequantises the gathered weight on the card; the estimate counts them on the
    card. A tensor several states share stays shared; one on the ``meta`` device (a model built without its
    weights, :mod:`memfit.rank0_load`) becomes an empty one, to be filled."""
    placed: dict[int, torch.Tensor] = {}
    tensors = []
    for state in quant_states(model):
        for owner, name in _state_slots(state):
            tensor = getattr(owner, name)
            if id(tensor) not in placed:
                placed[id(tensor)] = torch.empty_like(tensor, device=device) if tensor.is_meta else tensor.to(device)
            setattr(owner, name, placed[id(tensor)])
            tensors.append(placed[id(tensor)])
    return tensors


def _state_slots(state: Any) -> list[tuple[Any, str]]:
    """(object, attribute) of each tensor of a quantisation state, its nested state's too."""
    slots = [(state, name) for name in ("absmax", "code", "offset")
             if isinstance(getattr(state, name, None), torch.Tensor)]
    if getattr(state, "state2", None) is not None:
        slots.extend(_state_slots(state.state2))
    return slots


def _state_tensors(state: Any) -> list[torch.Tensor]:
    return [getattr(owner, name) for owner, name in _state_slots(state)]
