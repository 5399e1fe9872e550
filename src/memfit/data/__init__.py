"""Datasets: built-in real data, tables (files, Parquet folders, saved or Hub datasets) and image folders, split
by a seeded permutation.

A dataset is a list of examples (texts or images) with integer labels and the names of those labels.
:func:`load_examples` reads one from ``--data``; :func:`split` holds out a validation share with a seeded
permutation so the same seed always gives the same split.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from memfit.data.builtin import BUILTIN, CAUSAL_BUILTIN, load_builtin
from memfit.data.causal import as_instructions, instructions_from_rows
from memfit.data.examples import CausalExamples, Examples, ImageExamples, TextExamples
from memfit.data.files import labelled_from_rows, load_image_folder
from memfit.data.formats import instruction_format, matching_formats, unrecognised
from memfit.data.sources import TABLE_SUFFIXES, read_rows, table_kind
from memfit.errors import DataError

__all__ = ["BUILTIN", "CausalExamples", "Columns", "Examples", "ImageExamples", "TextExamples", "first",
           "load_examples", "split"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Columns:
    """How to read a table named by ``--data``: where it keeps each field (``--text-column`` ...
    ``--messages-column``), its format (``--data-format``, recognised when ``auto``), and for a Hub dataset or a
    saved ``DatasetDict`` which configuration and split (``--data-config``, ``--data-split``)."""

    text: str = "text"
    label: str = "label"
    prompt: str = "prompt"
    completion: str = "completion"
    messages: str = "messages"
    data_format: str = "auto"
    split: str = "train"
    subset: str | None = None


def holds_instructions(data: str, columns: Columns) -> bool:
    """Whether ``--data`` is instruction data (causal-LM fine-tuning) rather than labelled examples (a table
    that cannot be read counts as neither: loading it reports why)."""
    if data in BUILTIN:
        return data in CAUSAL_BUILTIN
    if table_kind(data) is None:
        return False
    try:
        return instruction_format(data, _rows(data, columns), columns, columns.data_format) is not None
    except DataError:
        return False


def load_examples(data: str, *, columns: Columns, task: str = "classification") -> Examples:
    """Read ``--data`` for ``task``: a built-in name, a table (:mod:`memfit.data.sources`: a file, a Parquet
    folder, a saved ``datasets`` directory, a Hub dataset), or an image folder. For ``causal-lm`` and
    ``seq2seq``, labelled texts become instruction pairs (:func:`memfit.data.causal.as_instructions`)."""
    causal = task in ("causal-lm", "seq2seq")
    if holds_instructions(data, columns) and not causal:
        raise DataError(f"--data {data} holds instruction pairs (prompt/completion, Alpaca, ShareGPT or messages); "
                        "train them with --task causal-lm (or seq2seq for an encoder-decoder model), or give "
                        "labelled data for classification")
    loaded = _read(data, columns, causal=causal)
    if causal and isinstance(loaded, TextExamples):
        loaded = replace(as_instructions(loaded), source_format=loaded.source_format)
    elif causal and isinstance(loaded, ImageExamples):
        raise DataError(f"--data {data} holds images; --task {task} trains on text")
    if len(loaded) < 2:
        raise DataError(f"--data {data}: the dataset has {len(loaded)} usable example(s); "
                        "at least 2 are needed for a train/validation split")
    if not isinstance(loaded, CausalExamples) and len(set(loaded.labels)) < 2:
        raise DataError(f"--data {data}: every example has the same label; classification needs >= 2 classes")
    return loaded


def _rows(data: str, columns: Columns) -> list[dict[str, Any]]:
    return read_rows(data, split=columns.split, subset=columns.subset)


def _read(data: str, columns: Columns, *, causal: bool) -> Examples:
    if data in BUILTIN:
        return load_builtin(data)
    kind = table_kind(data)
    path = Path(data).expanduser()
    if kind is None:
        if path.is_dir():
            return load_image_folder(path)
        if path.is_file():
            raise DataError(f"--data {data}: unsupported file type; use {', '.join(TABLE_SUFFIXES)}, a Parquet or "
                            "save_to_disk folder, or an image folder")
        raise DataError(f"--data {data}: no such file or directory, and not a Hub dataset id (built-in datasets: "
                        f"{', '.join(BUILTIN)})")
    rows = _rows(data, columns)
    found = instruction_format(data, rows, columns, columns.data_format)
    if found is not None:
        return instructions_from_rows(data, rows, found, columns)
    if causal and "text-label" not in matching_formats(rows[0], columns):
        raise unrecognised(data, rows[0], columns)
    return labelled_from_rows(data, rows, text_column=columns.text, label_column=columns.label)


def split(examples: Examples, *, val_fraction: float, seed: int) -> tuple[Examples, Examples]:
    """(train, validation) by a permutation seeded with ``seed``."""
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    num_val = min(max(1, round(len(order) * val_fraction)), len(order) - 1)
    return examples.subset(order[num_val:]), examples.subset(order[:num_val])


def first(examples: Examples, count: int | None) -> Examples:
    """The first ``count`` examples (all when ``None``)."""
    return examples if count is None or count >= len(examples) else examples.subset(list(range(count)))
