"""The kinds of dataset memfit trains on: texts or images with integer labels, and instruction pairs."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Union

import numpy as np

ImageItem = Union[np.ndarray, Path]  # noqa: UP007 (a runtime alias, Python 3.10)


@dataclass(frozen=True, kw_only=True, slots=True)
class TextExamples:
    texts: list[str]
    labels: list[int]
    label_names: list[str]
    source_format: str = ""
    """The table format it was read from (:mod:`memfit.data.formats`); empty for built-in data."""

    def subset(self, indices: list[int]) -> TextExamples:
        return replace(self, texts=[self.texts[i] for i in indices], labels=[self.labels[i] for i in indices])

    def __len__(self) -> int:
        return len(self.labels)


@dataclass(frozen=True, kw_only=True, slots=True)
class ImageExamples:
    images: list[ImageItem]
    """Each an ``(H, W, C)`` uint8 array or the path of an image file, read when batched."""
    labels: list[int]
    label_names: list[str]

    def subset(self, indices: list[int]) -> ImageExamples:
        return replace(self, images=[self.images[i] for i in indices], labels=[self.labels[i] for i in indices])

    def __len__(self) -> int:
        return len(self.labels)


Message = dict[str, str]
"""One chat turn: ``{"role": ..., "content": ...}``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CausalExamples:
    """Instruction pairs for causal-LM fine-tuning (:mod:`memfit.data.causal`)."""

    prompts: list[str] | list[list[Message]]
    """Each a plain prompt, or (``chat``) the conversation's turns before the answer."""
    completions: list[str]
    """What the model learns to write; the loss is on these tokens only."""
    chat: bool
    """Prompts are turns, rendered with the tokenizer's chat template (which it must have)."""
    templated: bool
    """Render with the chat template when the tokenizer has one (a plain prompt as one user turn)."""
    label_names: list[str]
    """The closed set of completions, when they form one (accuracy is scored on it); else empty."""
    labels: list[int]
    """Each example's index into ``label_names``; empty without a closed set."""
    source_format: str = ""
    """The table format it was read from (:mod:`memfit.data.formats`); empty for built-in data."""

    def subset(self, indices: list[int]) -> CausalExamples:
        prompts: list[Any] = [self.prompts[i] for i in indices]
        return replace(self, prompts=prompts, completions=[self.completions[i] for i in indices],
                       labels=[self.labels[i] for i in indices] if self.labels else [])

    def __len__(self) -> int:
        return len(self.completions)


Examples = Union[TextExamples, ImageExamples, CausalExamples]  # noqa: UP007 (a runtime alias, Python 3.10)


