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

from memfit.data.examples import ImageExamples, ImageItem, TextExamples

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
    def build(cls, examples: TextExamples, tokenizer: Any, max_length: int) -> TextEncoder:
        encoded = tokenizer(examples.texts, truncation=True, max_length=max_length)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        return cls(input_ids=list(encoded["input_ids"]), labels=list(examples.labels), pad_token_id=pad)

    def __call__(self, indices: Sequence[int]) -> Batch:
        batch = pad([self.input_ids[i] for i in indices], self.pad_token_id)
        batch["labels"] = torch.tensor([self.labels[i] for i in indices], dtype=torch.long)  # (B,)
        return batch


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
