"""What transformers decides by reading values, decided in a trace from the values the trace knows.

A decoder's attention takes SDPA's mask-free ``is_causal`` path when transformers, reading the batch, finds
no padding (an all-ones 2-D mask, or none), no packed sequences (contiguous position ids) and no cache offset.
A fake tensor has no values, and transformers treats one as a compiler's trace (``is_tracing``): it always
builds the 4-D mask instead, a mask the real step never makes. When the trace knows the batch is unpadded
(every text fills the length, as its real batch shows), :func:`unpadded_masks` answers those two questions
as the real step would: no packed sequences, and the causal mask skipped when the real step would skip it
(query as long as the keys, no padding, offset 0 in training).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor


@contextlib.contextmanager
def unpadded_masks() -> Iterator[None]:
    """Inside, transformers' mask decisions on fake tensors are those of an unpadded training batch."""
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - transformers without its masking module
        yield
        return
    ignore, packed = masking_utils._ignore_causal_mask_sdpa, masking_utils.find_packed_sequence_indices

    def ignore_causal_mask(padding_mask: torch.Tensor | None, q_length: int, kv_length: int, q_offset: Any,
                           kv_offset: int, local_attention_size: int | None = None) -> bool:
        if isinstance(padding_mask, FakeTensor):
            padding_mask = None  # all ones: the batch is unpadded
        if isinstance(q_offset, FakeTensor):
            q_offset = 0  # a training forward starts at position 0
        return bool(ignore(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size))

    def packed_sequences(position_ids: torch.Tensor) -> torch.Tensor | None:
        return None if isinstance(position_ids, FakeTensor) else packed(position_ids)

    masking_utils._ignore_causal_mask_sdpa = ignore_causal_mask
    masking_utils.find_packed_sequence_indices = packed_sequences
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa, masking_utils.find_packed_sequence_indices = ignore, packed
