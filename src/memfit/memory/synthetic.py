"""The synthetic batches a trace (or a measured run of the same steps) runs on: every text at full length, the
worst case padding can reach, in the shapes each task's real encoder makes (:mod:`memfit.memory.estimate`)."""

from __future__ import annotations

import torch

from memfit.data.batches import Batch, pad, with_one_eos
from memfit.data.packing import synthetic_rows
from memfit.data.seq2seq import seq2seq_batch
from memfit.models import ModelSpec, decoder_input_shift, end_token_id, position_limit


def synthetic_batch(spec: ModelSpec, batch_size: int, length: int, *, padded: bool = True,
                    causal: bool = False, packed: bool = False) -> Batch:
    """A host batch of the given shape: texts at full length, the worst case padding can reach.

    ``padded``: one position is masked out, as in a padded batch. That is a different step, not only a
    different mask: without a mask (the encoders leave out an all-ones one, :func:`memfit.data.batches.pad`)
    attention runs SDPA with ``is_causal`` and grouped-query K/V as they are, while a padded batch builds a
    (B, 1, S, S) mask and, for grouped-query attention, repeats K and V to every head, tensors the backward
    keeps. (transformers cannot read a fake mask's values, so a fake all-ones mask would take the padded
    branch.) A micro-batch of one sample is never padded; nor is any micro-batch of texts that all fill
    ``--max-length``.

    ``causal``: token labels, shifted as the causal-LM encoder shifts them, on every position but the last
    (the worst case: a one-token prompt, the rest completion).

    ``packed`` (with ``causal``): packed rows, ``position_ids`` and no mask
    (:func:`memfit.data.packing.synthetic_rows`); the trace builds their block-diagonal mask as the real step
    does (:func:`memfit.memory.mask_values.known_masks`).
    """
    if packed and causal:
        return synthetic_rows(batch_size, length)
    labels = torch.zeros((batch_size, length) if causal else (batch_size,), dtype=torch.long)  # (B, S) or (B,)
    if causal:
        labels[:, -1] = -100
    if spec.modality == "vision":
        channels, size = spec.num_channels, spec.image_size
        return {"pixel_values": torch.zeros(batch_size, channels, size, size), "labels": labels}  # (B, C, H, W)
    batch = {"input_ids": torch.zeros(batch_size, length, dtype=torch.long), "labels": labels}  # (B, S)
    if padded and batch_size > 1 and length > 1:
        attention_mask = torch.ones(batch_size, length, dtype=torch.long)  # (B, S)
        attention_mask[-1, -1] = 0
        batch["attention_mask"] = attention_mask
    return batch


TRACE_PAD = 0
"""The pad id of the traced model and its synthetic batches (a value no memory depends on)."""


def encoder_decoder_batch(spec: ModelSpec, batch_size: int, length: int, *, padded: bool, task: str,
                          target_length: int) -> Batch:
    """:func:`synthetic_batch` of an encoder-decoder, made by the encoders' own code: sources at full length
    (the last one a token shorter when ``padded``, as there), each holding the end-of-sequence token once
    (:func:`memfit.data.batches.with_one_eos`: the classification head finds it, and the trace is told so,
    :func:`memfit.memory.mask_values.known_eos`). seq2seq: targets at ``target_length``, all labelled, the
    decoder inputs made by the model's shift (:func:`memfit.data.seq2seq.seq2seq_batch`)."""
    eos = end_token_id(spec)
    filler = next(token for token in range(4)
                  if token not in (TRACE_PAD, eos, getattr(spec.hf_config, "pad_token_id", None)))
    lengths = [length] * batch_size
    if padded and batch_size > 1 and length > 1:
        lengths[-1] -= 1
    rows = [ended_row(filler, eos, size) for size in lengths]
    if task == "seq2seq":
        target = ended_row(filler, eos, target_length)
        return seq2seq_batch(rows, [target] * batch_size, pad_token_id=TRACE_PAD,
                             shift=decoder_input_shift(spec, TRACE_PAD))
    batch = pad(rows, TRACE_PAD)  # input_ids (B, S), attention_mask when padded
    batch["labels"] = torch.zeros(batch_size, dtype=torch.long)  # (B,)
    return batch


def ended_row(filler: int, eos_token_id: int | None, length: int) -> list[int]:
    """``length`` tokens ending with the end-of-sequence token, as the encoders end a row without one."""
    row = [filler] * length
    return row if eos_token_id is None else with_one_eos(row[:-1], eos_token_id, length)


def shape_problems(spec: ModelSpec, length: int, image_size: int | None) -> list[str]:
    if spec.modality == "text":
        limit = position_limit(spec)
        if limit is not None and length > limit:
            return [f"--seq-len {length} exceeds {spec.name}'s {limit} positions; use at most {limit}"]
        return []
    size, patch = image_size or spec.image_size, spec.patch_size
    if size % patch:
        return [f"--image-size {size} does not divide into {patch}x{patch} patches; use a multiple of {patch}"]
    return []
