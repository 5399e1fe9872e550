"""Datasets: built-in real data, CSV/JSONL files and image folders, split by a seeded permutation.

A dataset is a list of examples (texts or images) with integer labels and the names of those labels.
:func:`load_examples` reads one from ``--data``; :func:`split` holds out a validation share with a seeded
permutation so the same seed always gives the same split.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from memfit.data.builtin import BUILTIN, CAUSAL_BUILTIN, load_builtin
from memfit.data.causal import as_instructions, first_row, is_causal_file, load_instructions
from memfit.data.examples import CausalExamples, Examples, ImageExamples, TextExamples
from memfit.data.files import load_image_folder, load_table
from memfit.errors import DataError

__all__ = ["BUILTIN", "CausalExamples", "Examples", "ImageExamples", "TextExamples", "first", "load_examples",
           "split"]

TABLE_SUFFIXES = (".csv", ".jsonl", ".json")


@dataclass(frozen=True, kw_only=True, slots=True)
class Columns:
    """Where a CSV/JSONL file keeps each field (``--text-column`` ... ``--messages-column``)."""

    text: str = "text"
    label: str = "label"
    prompt: str = "prompt"
    completion: str = "completion"
    messages: str = "messages"


def holds_instructions(data: str, columns: Columns) -> bool:
    """Whether ``--data`` is instruction data (causal-LM fine-tuning) rather than labelled examples."""
    if data in BUILTIN:
        return data in CAUSAL_BUILTIN
    path = Path(data).expanduser()
    return path.is_file() and path.suffix.lower() in TABLE_SUFFIXES and is_causal_file(
        path, prompt_column=columns.prompt, completion_column=columns.completion, messages_column=columns.messages)


def holds_labels(path: Path, columns: Columns) -> bool:
    """Whether a CSV/JSONL file's first row has a text and a label field (labelled classification data)."""
    first = first_row(path)
    return first is not None and columns.text in first and columns.label in first


def load_examples(data: str, *, columns: Columns, task: str = "classification") -> Examples:
    """Read ``--data`` for ``task``: a built-in name, a ``.csv``/``.jsonl`` file, or an image folder. For
    ``causal-lm``, labelled texts become instruction pairs (:func:`memfit.data.causal.as_instructions`)."""
    causal = task == "causal-lm"
    if holds_instructions(data, columns) and not causal:
        raise DataError(f"--data {data} holds instruction pairs (prompt/completion or messages); train them with "
                        "--task causal-lm, or give labelled data for classification")
    loaded = _read(data, columns, causal=causal)
    if causal and isinstance(loaded, TextExamples):
        loaded = as_instructions(loaded)
    elif causal and isinstance(loaded, ImageExamples):
        raise DataError(f"--data {data} holds images; --task causal-lm trains on text")
    if len(loaded) < 2:
        raise DataError(f"--data {data}: the dataset has {len(loaded)} usable example(s); "
                        "at least 2 are needed for a train/validation split")
    if not isinstance(loaded, CausalExamples) and len(set(loaded.labels)) < 2:
        raise DataError(f"--data {data}: every example has the same label; classification needs >= 2 classes")
    return loaded


def _read(data: str, columns: Columns, *, causal: bool) -> Examples:
    if data in BUILTIN:
        return load_builtin(data)
    path = Path(data).expanduser()
    if not path.exists():
        raise DataError(f"--data {data}: no such file or directory (built-in datasets: {', '.join(BUILTIN)})")
    if path.is_dir():
        return load_image_folder(path)
    if path.suffix.lower() not in TABLE_SUFFIXES:
        raise DataError(f"--data {data}: unsupported file type; use .csv, .jsonl or an image folder")
    if causal and (holds_instructions(data, columns) or not holds_labels(path, columns)):
        return load_instructions(path, prompt_column=columns.prompt, completion_column=columns.completion,
                                 messages_column=columns.messages)
    return load_table(path, text_column=columns.text, label_column=columns.label)


def split(examples: Examples, *, val_fraction: float, seed: int) -> tuple[Examples, Examples]:
    """(train, validation) by a permutation seeded with ``seed``."""
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    num_val = min(max(1, round(len(order) * val_fraction)), len(order) - 1)
    return examples.subset(order[num_val:]), examples.subset(order[:num_val])


def first(examples: Examples, count: int | None) -> Examples:
    """The first ``count`` examples (all when ``None``)."""
    return examples if count is None or count >= len(examples) else examples.subset(list(range(count)))
