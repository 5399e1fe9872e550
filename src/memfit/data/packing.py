"""Packed sequences for causal-LM training (``--packing``): examples concatenated into rows of exactly
``--max-length`` tokens, so every training step is full length and no token is padding.

Algorithm. The training examples (each already ``prompt + completion`` cut to ``--max-length`` by
:func:`memfit.data.batches.fit_pair`) are put in one seeded order (:func:`memfit.data.batches.window_order` of
``--seed`` at epoch 0), concatenated into one stream, and the stream is cut into rows of ``--max-length``
tokens. The packing is made once per run: the epochs shuffle the rows, not the examples inside them. Only the
last row can be short; its rest is the pad token, labelled -100, with positions of its own restarting at 0.

What a row carries. ``position_ids`` are each token's position in its own example: they restart at 0 where an
example starts, and transformers reads those restarts (``masking_utils.find_packed_sequence_indices``) to
build a block-diagonal causal mask, so attention never crosses two examples, and the padding attends only to
itself. The batch has no ``attention_mask`` (with one, transformers would not look for packed sequences), and
the model must run without a KV cache (:func:`disable_cache`: with one it does not look either). ``labels`` are
each example's own shifted completion labels (:func:`memfit.data.batches.completion_labels`): an example's last
token predicts nothing, never the first token of the next example, and the loss counts exactly the
completion tokens it counts unpacked.

Trade-off. Padded micro-batches spend compute and activation memory on padding and are as wide as their
longest example; packed rows have none (a run over many short examples takes far fewer, denser steps), but
every step is ``--max-length`` wide, the mask is a (B, 1, S, S) tensor, and with grouped-query attention SDPA
repeats K and V to every head (the estimate counts both). An example the stream cuts at a row's end goes on at
the start of the next row with its positions continuing, but its second part no longer sees its first: its
tokens there are predicted with less context than unpacked (their labels stay). A "sample" of the run is a
row: ``--effective-batch`` counts rows, ``samples/s`` is rows per second. Validation stays per example,
unpacked, so its loss and accuracy compare with an unpacked run. Causal-LM only (a classification label
belongs to a whole text).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.data.batches import Batch, CausalEncoder, completion_labels, window_order

IGNORE_INDEX = -100
PACKING_ORDER_EPOCH = 0
"""The packing's order is ``window_order(seed, epoch=0)``: the training epochs count from 1."""


@dataclass(frozen=True, slots=True)
class PackedEncoder:
    """The training examples packed into rows; ``encoder(indices)`` is a batch of those rows (indices of rows,
    not of examples)."""

    input_ids: torch.Tensor
    """(R, S) token ids; the end of the last row is the pad token."""
    position_ids: torch.Tensor
    """(R, S) each token's position in its example (the padding: its own run from 0)."""
    labels: torch.Tensor
    """(R, S) each example's shifted completion labels, -100 elsewhere."""
    num_examples: int

    @classmethod
    def build(cls, encoder: CausalEncoder, max_length: int, *, seed: int) -> PackedEncoder:
        """Pack a causal encoder's examples in the seeded order."""
        order = window_order(len(encoder.sequences), seed=seed, epoch=PACKING_ORDER_EPOCH)
        return pack([encoder.sequences[i] for i in order], [encoder.prompt_lengths[i] for i in order],
                    max_length=max_length, pad_token_id=encoder.pad_token_id)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def __call__(self, indices: Sequence[int]) -> Batch:
        rows = torch.tensor(list(indices), dtype=torch.long)
        return {"input_ids": self.input_ids[rows], "position_ids": self.position_ids[rows],  # (B, S)
                "labels": self.labels[rows]}  # (B, S); no attention_mask: the positions say where examples start


def pack(sequences: list[list[int]], prompt_lengths: list[int], *, max_length: int,
         pad_token_id: int) -> PackedEncoder:
    """``sequences`` concatenated in the order given and cut into rows of ``max_length`` tokens."""
    tokens: list[int] = []
    positions: list[int] = []
    labels: list[int] = []
    for sequence, prompt_length in zip(sequences, prompt_lengths, strict=True):
        tokens += sequence
        positions += range(len(sequence))
        labels += completion_labels(sequence, prompt_length)
    padding = -len(tokens) % max_length
    tokens += [pad_token_id] * padding
    positions += range(padding)  # a segment of its own: it attends to no real token, and none to it
    labels += [IGNORE_INDEX] * padding

    def rows(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).view(-1, max_length)  # (R, S)

    return PackedEncoder(input_ids=rows(tokens), position_ids=rows(positions), labels=rows(labels),
                         num_examples=len(sequences))


def synthetic_rows(batch_size: int, length: int) -> Batch:
    """``batch_size`` packed rows of ``length`` tokens for a traced step: two examples to a row (a one-token
    prompt, the rest completion), so the rows take the block-diagonal mask branch of a real packed batch."""
    halves = [(length + 1) // 2, length // 2] if length > 1 else [length]
    sequences = [[0] * size for size in halves] * batch_size
    return pack(sequences, [1] * len(sequences), max_length=length, pad_token_id=0)(range(batch_size))


def packing_problems(packing: bool, task: str, hf_config: Any = None) -> list[str]:
    """``--packing`` is for causal-LM data, on a model that reads ``position_ids``: the restarts in them are what
    keeps packed examples apart (models with ALiBi biases, Bloom and MPT, take none and would attend across)."""
    if packing and task == "seq2seq":
        return ["--packing packs causal-LM examples into full rows; a seq2seq example is two sequences, a source "
                "for the encoder and a target for the decoder, which do not pack into one: drop --packing"]
    if packing and task != "causal-lm":
        return ["--packing packs causal-LM examples (prompt/completion or chat data) into full rows; this run is "
                "classification, whose labels belong to whole texts: drop --packing"]
    if packing and hf_config is not None and not takes_position_ids(hf_config):
        return [f"--packing keeps packed examples apart through their position ids, which a "
                f"{type(hf_config).__name__.removesuffix('Config')} model does not take (its attention would cross "
                "examples): drop --packing"]
    return []


def takes_position_ids(hf_config: Any) -> bool:
    """Whether the causal LM of ``hf_config`` takes ``position_ids`` (unknown architectures: assumed to)."""
    import inspect

    import transformers

    from memfit.quiet import quiet_imports

    quiet_imports()  # the model classes' imports, before transformers imports optional libraries on its own
    mapping: Any = transformers.MODEL_FOR_CAUSAL_LM_MAPPING
    model_class = mapping[type(hf_config)] if type(hf_config) in mapping else None
    return model_class is None or "position_ids" in inspect.signature(model_class.forward).parameters


def disable_cache(model: nn.Module) -> None:
    """Train without a KV cache: a training step reads no cache, and a decoder that makes one keeps each
    layer's keys and values in it and makes per-layer objects before its first block (a sliding-window layer's
    window as a tensor), which a trace of fewer blocks would not make as often. transformers also looks for
    packed sequences in ``position_ids`` only when the forward has no cache
    (``masking_utils._preprocess_mask_arguments``). A composite model's text config (a vision-language model's)
    is set too. The saved model's config keeps the setting it was loaded with (:func:`cache_as_loaded`)."""
    for config in _cache_configs(getattr(model, "config", None)):
        config.use_cache = False


def _cache_configs(config: Any) -> list[Any]:
    """The configs of ``config`` that hold a ``use_cache`` setting: itself and its text config."""
    if config is None:
        return []
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return [each for each in ([config] if text is config else [config, text]) if hasattr(each, "use_cache")]


@contextlib.contextmanager
def cache_as_loaded(model: nn.Module, loaded: Any) -> Iterator[None]:
    """Inside, ``model``'s config (and its text config) has the KV-cache setting of ``loaded`` (the config it was
    built from): a fine-tuned model is saved for inference as it was loaded."""
    trained = _cache_configs(getattr(model, "config", None))
    originals = _cache_configs(loaded)
    if len(trained) != len(originals):
        yield
        return
    training = [config.use_cache for config in trained]
    for config, original in zip(trained, originals, strict=True):
        config.use_cache = original.use_cache
    try:
        yield
    finally:
        for config, setting in zip(trained, training, strict=True):
            config.use_cache = setting
