"""The two kinds of dataset memfit trains on: texts or images, each with integer labels."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Union

import numpy as np

ImageItem = Union[np.ndarray, Path]  # noqa: UP007 (a runtime alias, Python 3.10)


@dataclass(frozen=True, kw_only=True, slots=True)
class TextExamples:
    texts: list[str]
    labels: list[int]
    label_names: list[str]

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


Examples = Union[TextExamples, ImageExamples]  # noqa: UP007 (a runtime alias, Python 3.10)


