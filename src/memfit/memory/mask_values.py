"""What transformers decides by reading values, decided in a trace from the values the trace knows.

A decoder's attention takes SDPA's mask-free ``is_causal`` path when transformers, reading the batch, finds
no padding (an all-ones 2-D mask, or none), no packed sequences (contiguous position ids) and no cache offset.
A fake tensor has no values, and transformers treats one as a compiler's trace (``is_tracing``): it always
builds the 4-D mask instead, a mask the real step never makes. :func:`known_masks` answers those questions
as the real training step would: a batch without a mask has contiguous positions (no packed sequences), a
training forward starts at offset 0, and, when the trace knows the batch's mask is all ones (its real
batch shows it), the mask is no padding; a mask with padding stays unread, and the 4-D mask is built, as in
the real step. A packed batch (``--packing``, :mod:`memfit.data.packing`) is the exception to the first:
its positions restart where each example starts, and the real step finds those sequences and builds the
block-diagonal 4-D mask, which the trace then builds too.

An encoder-decoder's classification head (BART, mBART, T5) reads the batch too: it checks that every row holds as
many end-of-sequence tokens and picks the hidden state at the last one, questions whose answers a fake tensor
does not have (``unique_consecutive``, boolean indexing). memfit's batches hold exactly one per row, and
:func:`known_eos` answers from that fact.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode


@contextlib.contextmanager
def known_masks(*, all_ones: bool = False, packed: bool = False) -> Iterator[None]:
    """Inside, transformers' mask decisions on fake tensors are those of the real training step (``all_ones``:
    the batch's attention mask, when it has one, holds no padding; ``packed``: the batch's position ids hold
    packed sequences, several examples to a row)."""
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - transformers without its masking module
        yield
        return
    ignore, find_packed = masking_utils._ignore_causal_mask_sdpa, masking_utils.find_packed_sequence_indices

    def ignore_causal_mask(padding_mask: torch.Tensor | None, q_length: int, kv_length: int, q_offset: Any,
                           kv_offset: int, local_attention_size: int | None = None) -> bool:
        if isinstance(padding_mask, FakeTensor) and all_ones:
            padding_mask = None  # all ones: the batch is unpadded
        if isinstance(q_offset, FakeTensor):
            q_offset = 0  # a training forward starts at position 0
        return bool(ignore(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size))

    def packed_sequences(position_ids: torch.Tensor) -> torch.Tensor | None:
        if isinstance(position_ids, FakeTensor) and not packed:
            return None  # contiguous positions: one sequence per row
        # transformers' own function: on fake positions it skips its value check and returns the (B, S)
        # sequence ids, the tensors a real packed batch makes
        return find_packed(position_ids)

    masking_utils._ignore_causal_mask_sdpa = ignore_causal_mask
    masking_utils.find_packed_sequence_indices = packed_sequences
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa, masking_utils.find_packed_sequence_indices = ignore, find_packed


# An encoder-decoder's classification head (BART, mBART, T5 ``*ForSequenceClassification.forward``, checked
# against transformers 5.25) finds the end-of-sequence tokens from the values: ``eos_mask = input_ids.eq(eos)``,
# ``torch.unique_consecutive(eos_mask.sum(1))`` to check every row holds as many, then ``hidden[eos_mask, :]``
# (whose backward is ``index_put`` with the same mask). The ATen ops below and the CPU kernel's allocation
# for ``unique_consecutive`` are torch 2.13's.
ATEN = torch.ops.aten
INDEX_PUTS = (ATEN.index_put.default, ATEN.index_put_.default, ATEN._index_put_impl_.default)


class _Tagged:
    """Tensors known by identity, held weakly (a tensor's ``==`` is elementwise, so no set of tensors)."""

    def __init__(self, tensors: list[torch.Tensor] | None = None) -> None:
        self._refs: dict[int, weakref.ref[torch.Tensor]] = {}
        for tensor in tensors or []:
            self.add(tensor)

    def add(self, tensor: torch.Tensor) -> None:
        self._refs[id(tensor)] = weakref.ref(tensor)

    def __contains__(self, tensor: object) -> bool:
        ref = self._refs.get(id(tensor))
        return ref is not None and ref() is tensor


class OneEosPerRow(TorchDispatchMode):
    """Answers the head's end-of-sequence questions on fake ``input_ids`` as the real batch answers them: each
    row holds exactly one (memfit's encoders make it so: :func:`memfit.data.batches.with_one_eos`). Entered
    below the storage tracker, so the tracker sees each answered op with the outputs the real kernel makes."""

    def __init__(self, eos_token_id: int, input_ids: list[torch.Tensor]) -> None:
        super().__init__()
        self.eos_token_id = eos_token_id
        self.inputs = _Tagged(input_ids)
        self.masks = _Tagged()
        """``input_ids.eq(eos)``: one True per row."""
        self.counts = _Tagged()
        """``mask.sum(1)``: 1 in every row."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        answer = self._answer(func, args, kwargs)
        if answer is not None:
            return answer
        out = func(*args, **kwargs)
        if func is ATEN.eq.Scalar and args[0] in self.inputs and args[1] == self.eos_token_id:
            self.masks.add(out)
        elif func is ATEN.sum.dim_IntList and args[0] in self.masks and list(args[1]) in ([1], [-1]):
            self.counts.add(out)
        return out

    def _answer(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        if func is ATEN.unique_consecutive.default and args[0] in self.counts and not any(args[1:3]) and \
                not kwargs.get("return_inverse") and not kwargs.get("return_counts"):
            counts = args[0]  # one distinct count; the CPU kernel allocates the input's size, then shrinks
            return counts.new_empty(counts.shape)[:1], counts.new_empty((0,)), counts.new_empty((0,))
        indices = args[1] if func is ATEN.index.Tensor or func in INDEX_PUTS else None
        if not indices or indices[0] not in self.masks or any(index is not None for index in indices[1:]):
            return None
        source = args[0]
        if func is ATEN.index.Tensor:  # (B, S, H)[mask] -> (B, H): one row each
            return source.new_empty((source.shape[0], *source.shape[2:]))
        return source if func is not ATEN.index_put.default else source.clone()  # the gradient, (B, S, H)


def known_eos(eos_token_id: int | None, input_ids: list[torch.Tensor]) -> contextlib.AbstractContextManager[Any]:
    """Inside, an encoder-decoder classification head reads from these fake ``input_ids`` what the real batch
    holds: exactly one ``eos_token_id`` per row (:class:`OneEosPerRow`); nothing changes when ``None``. The
    inputs are held weakly: each is freed when its step drops it, as in the real run."""
    return contextlib.nullcontext() if eos_token_id is None else OneEosPerRow(eos_token_id, input_ids)
