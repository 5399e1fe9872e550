"""From examples to tensors: seeded windows of micro-batches, tokenisation and image preprocessing.

A *window* is the samples of one optimizer step (the effective batch), cut into micro-batches of at most
``micro_batch_size`` samples. Cutting the window, rather than stacking micro-batches, is what keeps the
effective batch fixed whatever the micro-batch: a micro-batch that does not divide the window leaves a
smaller last chunk, and the loss is normalised by the window's sample count either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from memfit.data.examples import CausalExamples, ImageExamples, ImageItem, TextExamples
from memfit.errors import DataError

Batch = dict[str, torch.Tensor]


def window_order(num_examples: int, *, seed: int, epoch: int) -> list[int]:
    """The shuffled sample order of one epoch: the same for the same seed and epoch."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_examples, generator=generator).tolist()


def cut(indices: Sequence[int], size: int) -> list[list[int]]:
    """Consecutive chunks of at most ``size`` items."""
    return [list(indices[start:start + size]) for start in range(0, len(indices), size)]


class Encoder(Protocol):
    def __call__(self, indices: Sequence[int]) -> Batch: ...


@dataclass(frozen=True, slots=True)
class TextEncoder:
    """Tokenises every text once, then pads each micro-batch to its own longest sequence."""

    input_ids: list[list[int]]
    labels: list[int]
    pad_token_id: int

    @classmethod
    def build(cls, examples: TextExamples, tokenizer: Any, max_length: int, *,
              eos_token_id: int | None = None) -> TextEncoder:
        """``eos_token_id``: every text holds that token exactly once (:func:`with_one_eos`), as an
        encoder-decoder's classification head requires (it reads the hidden state at the end-of-sequence)."""
        encoded = tokenizer(examples.texts, truncation=True, max_length=max_length)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        rows = [list(row) for row in encoded["input_ids"]]
        if eos_token_id is not None:
            rows = [with_one_eos(row, eos_token_id, max_length) for row in rows]
        return cls(input_ids=rows, labels=list(examples.labels), pad_token_id=pad)

    def __call__(self, indices: Sequence[int]) -> Batch:
        batch = pad([self.input_ids[i] for i in indices], self.pad_token_id)
        batch["labels"] = torch.tensor([self.labels[i] for i in indices], dtype=torch.long)  # (B,)
        return batch


def with_one_eos(row: list[int], eos_token_id: int, max_length: int) -> list[int]:
    """``row`` holding ``eos_token_id`` exactly once: as it is when it does (BART's and T5's tokenizers end a
    text with it), else without it and with one appended, within ``max_length`` tokens (a tokenizer whose end
    token is another, such as the WordPiece one of config-only models). BART's and T5's classification heads
    read the hidden state at the end-of-sequence token and refuse a batch whose rows hold different counts of
    it; memfit's estimate relies on each row holding exactly one (:func:`memfit.memory.mask_values.known_eos`)."""
    if row.count(eos_token_id) == 1:
        return row
    kept = [token for token in row if token != eos_token_id]
    return [*kept[:max_length - 1], eos_token_id]


def pad(rows: list[list[int]], pad_token_id: int) -> Batch:
    """``input_ids`` padded on the right to the longest row, and an ``attention_mask`` if any row is shorter.

    A batch without padding gets no mask: transformers then skips building one (an all-ones mask is the same
    as none), and the estimator, whose fake tensors transformers cannot read, traces exactly that step.
    """
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)  # (B, S)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, S)
    for position, row in enumerate(rows):
        input_ids[position, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[position, : len(row)] = 1
    if all(len(row) == width for row in rows):
        return {"input_ids": input_ids}
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def _read_image(item: ImageItem) -> np.ndarray:
    if isinstance(item, Path):
        from PIL import Image

        with Image.open(item) as image:
            return np.asarray(image.convert("RGB"))
    return item


@dataclass(frozen=True, slots=True)
class ImageEncoder:
    """Resizes images to the model's size and channel count, scaled to [-1, 1] (ViT's normalisation)."""

    images: list[ImageItem]
    labels: list[int]
    image_size: int
    num_channels: int

    @classmethod
    def build(cls, examples: ImageExamples, image_size: int, num_channels: int) -> ImageEncoder:
        return cls(images=examples.images, labels=list(examples.labels), image_size=image_size,
                   num_channels=num_channels)

    def __call__(self, indices: Sequence[int]) -> Batch:
        tensors = []
        for i in indices:
            pixels = torch.from_numpy(np.array(_read_image(self.images[i]), copy=True))  # (H, W, C) uint8
            if pixels.ndim == 2:
                pixels = pixels[..., None]
            image = pixels.permute(2, 0, 1).float().div(255.0)  # (C, H, W) in [0, 1]
            if image.shape[0] != self.num_channels:
                image = image.mean(dim=0, keepdim=True).expand(self.num_channels, -1, -1)
            size = (self.image_size, self.image_size)
            if tuple(image.shape[1:]) != size:
                image = F.interpolate(image[None], size=size, mode="bilinear", align_corners=False)[0]
            tensors.append(image.sub(0.5).div(0.5))
        labels = torch.tensor([self.labels[i] for i in indices], dtype=torch.long)  # (B,)
        return {"pixel_values": torch.stack(tensors), "labels": labels}  # (B, C, H, W)


def render(examples: CausalExamples, index: int, tokenizer: Any, completion: str | None = None) -> tuple[str, str]:
    """(prompt text, completion text) of one example, as the model reads them.

    Chat examples, and templated ones when the tokenizer has a chat template, go through the template: the
    prompt is the conversation up to the assistant's turn (with the generation prompt), the completion is
    the rest of the rendered conversation (the answer and the template's end-of-turn). Plain pairs are the
    two strings as they are, the completion followed by the tokenizer's end-of-sequence token.
    ``completion`` replaces the example's own (the candidates of accuracy scoring).
    """
    answer = examples.completions[index] if completion is None else completion
    prompt = examples.prompts[index]
    if examples.chat or (examples.templated and getattr(tokenizer, "chat_template", None)):
        turns = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        head = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        whole = tokenizer.apply_chat_template([*turns, {"role": "assistant", "content": answer}], tokenize=False)
        if whole.startswith(head):
            return head, whole[len(head):]
        return head, answer + (tokenizer.eos_token or "")
    text = prompt if isinstance(prompt, str) else "\n".join(turn["content"] for turn in prompt)
    if examples.templated:  # a question with no template to wrap it: the answer on its own line
        text += "\n"
    return text, answer + (tokenizer.eos_token or "")


def tokenize_pair(tokenizer: Any, prompt: str, completion: str, *, templated: bool) -> tuple[list[int], list[int]]:
    """Token ids of a rendered prompt (with the tokenizer's special tokens unless a template wrote them) and of
    its completion (none added)."""
    prompt_ids = tokenizer(prompt, add_special_tokens=not templated)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    return list(prompt_ids), list(completion_ids)


def fit_pair(prompt: list[int], completion: list[int], max_length: int) -> list[int]:
    """``prompt + completion`` in at most ``max_length`` tokens: the prompt is cut from the left (the end of a
    prompt, next to the answer, matters most). The caller has checked that the completion fits."""
    keep = max(1, max_length - len(completion))
    return prompt[-keep:] + completion


@dataclass(frozen=True, slots=True)
class CausalEncoder:
    """Tokenises every prompt and completion once; each micro-batch is padded to its own longest sequence.

    ``labels`` are already shifted: position t holds token t+1 when that token belongs to the completion,
    else -100, so the loss counts completion tokens only and :func:`memfit.step.item_count` counts them.
    With a closed set of completions, :meth:`choices` builds the batches that score each candidate.
    """

    sequences: list[list[int]]
    prompt_lengths: list[int]
    pad_token_id: int
    candidates: list[list[tuple[list[int], int]]]
    """Per example, each candidate completion as (prompt + candidate token ids, candidate's token count); empty
    without a closed set."""
    targets: list[int]
    """Per example, the index of its own completion among the candidates (empty without a closed set)."""

    @classmethod
    def build(cls, examples: CausalExamples, tokenizer: Any, max_length: int, *,
              choices: bool = True) -> CausalEncoder:
        """``choices=False``: no candidates (training batches never score them)."""
        templated = examples.chat or (examples.templated and bool(getattr(tokenizer, "chat_template", None)))
        sequences, prompt_lengths, candidates = [], [], []
        for index in range(len(examples)):
            prompt, completion = tokenize_pair(tokenizer, *render(examples, index, tokenizer), templated=templated)
            if len(completion) >= max_length:
                raise DataError(f"example {index + 1}'s completion alone is {len(completion)} tokens, and "
                                f"--max-length {max_length} must hold it and at least one prompt token; raise "
                                "--max-length or shorten the completion")
            sequence = fit_pair(prompt, completion, max_length)
            sequences.append(sequence)
            prompt_lengths.append(len(sequence) - len(completion))
            if choices and examples.label_names:
                options = [tokenize_pair(tokenizer, *render(examples, index, tokenizer, name), templated=templated)
                           for name in examples.label_names]
                candidates.append([(fit_pair(p, c, max_length), len(c)) for p, c in options])
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        return cls(sequences=sequences, prompt_lengths=prompt_lengths, pad_token_id=pad, candidates=candidates,
                   targets=list(examples.labels) if candidates else [])

    def __call__(self, indices: Sequence[int]) -> Batch:
        rows = [self.sequences[i] for i in indices]
        return shifted(rows, [self.prompt_lengths[i] for i in indices], self.pad_token_id)

    def choices(self, indices: Sequence[int]) -> Batch:
        """One row per (example, candidate), labels on the candidate's tokens, and ``choice_targets``: each
        example's own candidate index."""
        rows, prompts = [], []
        for i in indices:
            for tokens, completion_length in self.candidates[i]:
                rows.append(tokens)
                prompts.append(len(tokens) - completion_length)
        batch = shifted(rows, prompts, self.pad_token_id)
        batch["choice_targets"] = torch.tensor([self.targets[i] for i in indices], dtype=torch.long)  # (B,)
        return batch


def shifted(rows: list[list[int]], prompt_lengths: list[int], pad_token_id: int) -> Batch:
    """A padded batch whose ``labels`` at position t are token t+1 where it is a completion token, else -100."""
    batch = pad(rows, pad_token_id)
    labels = torch.full(batch["input_ids"].shape, -100, dtype=torch.long)  # (B, S)
    for position, (row, prompt_length) in enumerate(zip(rows, prompt_lengths, strict=True)):
        labels[position, : len(row)] = torch.tensor(completion_labels(row, prompt_length), dtype=torch.long)
    batch["labels"] = labels
    return batch


def completion_labels(sequence: list[int], prompt_length: int) -> list[int]:
    """One example's shifted labels: at position t, token t+1 where it is a completion token, else -100 (the
    last position predicts nothing: the example ends there)."""
    start = max(prompt_length - 1, 0)
    return [-100] * start + sequence[start + 1:] + [-100]
