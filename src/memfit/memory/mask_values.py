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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor


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
