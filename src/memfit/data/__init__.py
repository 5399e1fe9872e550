"""Datasets: built-in real data, CSV/JSONL files and image folders, split by a seeded permutation.

A dataset is a list of examples (texts or images) with integer labels and the names of those labels.
:func:`load_examples` reads one from ``--data``; :func:`split` holds out a validation share with a seeded
permutation so the same seed always gives the same split.
"""

from __future__ import annotations

from pathlib import Path

import torch

from memfit.data.builtin import BUILTIN, load_builtin
from memfit.data.examples import Examples, ImageExamples, TextExamples
from memfit.data.files import load_image_folder, load_table
from memfit.errors import DataError

__all__ = ["BUILTIN", "Examples", "ImageExamples", "TextExamples", "first", "load_examples", "split"]

def load_examples(data: str, *, text_column: str, label_column: str) -> Examples:
    """Read ``--data``: a built-in name, a ``.csv``/``.jsonl`` file, or an image folder."""
    loaded: Examples
    if data in BUILTIN:
        loaded = load_builtin(data)
    else:
        path = Path(data).expanduser()
        if not path.exists():
            raise DataError(f"--data {data}: no such file or directory "
                            f"(built-in datasets: {', '.join(BUILTIN)})")
        if path.is_dir():
            loaded = load_image_folder(path)
        elif path.suffix.lower() in (".csv", ".jsonl", ".json"):
            loaded = load_table(path, text_column=text_column, label_column=label_column)
        else:
            raise DataError(f"--data {data}: unsupported file type; use .csv, .jsonl or an image folder")
    if len(loaded) < 2:
        raise DataError(f"--data {data}: the dataset has {len(loaded)} usable example(s); "
                        "at least 2 are needed for a train/validation split")
    if len(set(loaded.labels)) < 2:
        raise DataError(f"--data {data}: every example has the same label; classification needs >= 2 classes")
    return loaded


def split(examples: Examples, *, val_fraction: float, seed: int) -> tuple[Examples, Examples]:
    """(train, validation) by a permutation seeded with ``seed``."""
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    num_val = min(max(1, round(len(order) * val_fraction)), len(order) - 1)
    return examples.subset(order[num_val:]), examples.subset(order[:num_val])


def first(examples: Examples, count: int | None) -> Examples:
    """The first ``count`` examples (all when ``None``)."""
    return examples if count is None or count >= len(examples) else examples.subset(list(range(count)))
