"""User data: CSV/JSONL tables of text and label, and image folders with one subfolder per class."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from memfit.data.examples import ImageExamples, TextExamples
from memfit.errors import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix.lower() == ".csv":
        with path.open(newline="", encoding="utf-8") as file:
            return list(csv.DictReader(file))
    rows = []
    with path.open(encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise DataError(f"--data {path}: line {number} is not JSON ({error.msg})") from None
    return rows


def label_vocabulary(values: list[Any]) -> list[str]:
    """Sorted label names; integer-looking labels sort numerically."""
    names = {str(value) for value in values}
    if all(name.lstrip("-").isdigit() for name in names):
        return sorted(names, key=int)
    return sorted(names)


def load_table(path: Path, *, text_column: str, label_column: str) -> TextExamples:
    rows = _read_rows(path)
    if not rows:
        raise DataError(f"--data {path}: the file holds no rows")
    columns = list(rows[0].keys())
    missing = [(flag, name) for flag, name in (("--text-column", text_column), ("--label-column", label_column))
               if name not in columns]
    if missing:
        raise DataError([f"--data {path}: no column {name!r} ({flag}); columns are: {', '.join(columns)}"
                         for flag, name in missing])
    kept = [row for row in rows if str(row.get(text_column) or "").strip() and row.get(label_column) not in
            (None, "")]
    if not kept:
        raise DataError(f"--data {path}: no row has both a text and a label")
    names = label_vocabulary([row[label_column] for row in kept])
    index = {name: position for position, name in enumerate(names)}
    return TextExamples(texts=[str(row[text_column]) for row in kept],
                        labels=[index[str(row[label_column])] for row in kept], label_names=names)


def load_image_folder(path: Path) -> ImageExamples:
    classes = sorted(child.name for child in path.iterdir() if child.is_dir())
    if not classes:
        raise DataError(f"--data {path}: an image folder needs one subfolder per class")
    images: list[Path] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        files = sorted(file for file in (path / name).iterdir() if file.suffix.lower() in IMAGE_SUFFIXES)
        images.extend(files)
        labels.extend([label] * len(files))
    if not images:
        raise DataError(f"--data {path}: no image files ({', '.join(IMAGE_SUFFIXES)}) in its class folders")
    return ImageExamples(images=list(images), labels=labels, label_names=classes)
