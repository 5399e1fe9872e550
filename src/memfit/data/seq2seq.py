"""Source/target pairs for encoder-decoder fine-tuning (``--task seq2seq``: T5, BART, mBART).

An instruction pair (prompt/completion, Alpaca, chat; :mod:`memfit.data.causal`) becomes a *source*, the prompt
that the encoder reads, and a *target*, the completion that the decoder learns to write. A batch carries:

- ``input_ids`` (B, S): the sources with the tokenizer's special tokens, padded to the longest, and an
  ``attention_mask`` when any is padded (:func:`memfit.data.batches.pad`);
- ``labels`` (B, T): the targets, each holding the model's end-of-sequence token once (at its end, where the
  tokenizer does not put it elsewhere), -100 after it;
- ``decoder_input_ids`` (B, T): made from ``labels`` by the model's own shift
  (:func:`memfit.models.decoder_input_shift`), the inputs the model would make itself if it were handed
  ``labels``, which memfit's loss (:func:`memfit.step.loss_sum`) never hands it.

There is no ``decoder_attention_mask``: a target's padding comes after its end, and the decoder's causal
attention never lets a position see a later one, so every labelled position is computed the same with or
without it; without it the decoder runs SDPA's mask-free causal path, as transformers' own seq2seq training
(labels only) does. The estimator's synthetic batches are made by :func:`seq2seq_batch` too, so the trace runs
the batch the run makes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memfit.data.batches import Batch, pad, with_one_eos
from memfit.data.examples import CausalExamples

IGNORE_INDEX = -100
Shift = Callable[[torch.Tensor], torch.Tensor]
"""(B, T) labels to (B, T) decoder input ids: the model's ``prepare_decoder_input_ids_from_labels``."""


@dataclass(frozen=True, slots=True)
class Seq2SeqEncoder:
    """Tokenises every source and target once; each micro-batch pads sources and targets to their longest."""

    source_ids: list[list[int]]
    target_ids: list[list[int]]
    pad_token_id: int
    shift: Shift
    candidates: list[list[list[int]]]
    """Per example, the target ids of each completion of the closed set (the same list for every example);
    empty without a closed set. The evaluation scores them as a causal LM's (:func:`memfit.windows.evaluate`)."""
    targets: list[int]
    """Per example, the index of its own completion among the candidates (empty without a closed set)."""

    @classmethod
    def build(cls, examples: CausalExamples, tokenizer: Any, *, max_length: int, target_length: int,
              eos_token_id: int | None, shift: Shift, choices: bool = True) -> Seq2SeqEncoder:
        """Sources cut to ``max_length`` tokens, targets to ``target_length`` (the end-of-sequence token kept:
        the decoder learns where to stop). ``choices=False``: no candidates (training batches never score
        them)."""
        texts = [source_text(prompt) for prompt in examples.prompts]
        sources = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
        closed = choices and bool(examples.label_names)
        names = target_rows(tokenizer, examples.label_names, target_length, eos_token_id) if closed else []
        return cls(source_ids=[list(row) for row in sources],
                   target_ids=target_rows(tokenizer, examples.completions, target_length, eos_token_id),
                   pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0, shift=shift,
                   candidates=[names] * len(examples) if closed else [],
                   targets=list(examples.labels) if closed else [])

    def __len__(self) -> int:
        return len(self.source_ids)

    def __call__(self, indices: Sequence[int]) -> Batch:
        return seq2seq_batch([self.source_ids[i] for i in indices], [self.target_ids[i] for i in indices],
                             pad_token_id=self.pad_token_id, shift=self.shift)

    def choices(self, indices: Sequence[int]) -> Batch:
        """One row per (example, candidate): the example's source, the candidate as the target; and
        ``choice_targets``, each example's own candidate index."""
        pairs = [(self.source_ids[i], candidate) for i in indices for candidate in self.candidates[i]]
        batch = seq2seq_batch([source for source, _ in pairs], [target for _, target in pairs],
                              pad_token_id=self.pad_token_id, shift=self.shift)
        batch["choice_targets"] = torch.tensor([self.targets[i] for i in indices], dtype=torch.long)  # (B,)
        return batch


def target_rows(tokenizer: Any, texts: list[str], target_length: int, eos_token_id: int | None) -> list[list[int]]:
    """Targets as the tokenizer encodes them (``text_target``), cut to ``target_length`` tokens, each holding the
    model's end-of-sequence token once (:func:`memfit.data.batches.with_one_eos`)."""
    rows = [list(row) for row in tokenizer(text_target=texts, truncation=True, max_length=target_length)["input_ids"]]
    return rows if eos_token_id is None else [with_one_eos(row, eos_token_id, target_length) for row in rows]


def source_text(prompt: str | list[dict[str, str]]) -> str:
    """The encoder's text of a prompt: as it is, or a conversation's turns one per line (encoder-decoder
    tokenizers have no chat template)."""
    return prompt if isinstance(prompt, str) else "\n".join(turn["content"] for turn in prompt)


def seq2seq_batch(sources: list[list[int]], targets: list[list[int]], *, pad_token_id: int,
                  shift: Shift) -> Batch:
    """A batch of token rows: padded sources (and their mask when padded), labels and the decoder's inputs."""
    batch = pad(sources, pad_token_id)  # input_ids (B, S), attention_mask (B, S) when padded
    labels = torch.full((len(targets), max(len(row) for row in targets)), IGNORE_INDEX, dtype=torch.long)  # (B, T)
    for position, row in enumerate(targets):
        labels[position, : len(row)] = torch.tensor(row, dtype=torch.long)
    batch["labels"] = labels
    batch["decoder_input_ids"] = shift(labels)  # (B, T)
    return batch
