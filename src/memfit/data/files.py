"""User data: CSV/JSONL tables of text and label, and image folders with one subfolder per class."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from memfit.data.examples import ImageExamples, TextExamples
from memfit.errors import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def read_rows(path: Path) -> list[dict[str, Any]]:
    try:
        return _read_csv(path) if path.suffix.lower() == ".csv" else _read_jsonl(path)
    except UnicodeDecodeError as error:
        raise DataError(f"--data {path}: not UTF-8 text (byte 0x{error.object[error.start]:02x} at offset "
                        f"{error.start}); re-save the file as UTF-8") from None
    except OSError as error:
        raise DataError(f"--data {path}: cannot read it ({error.strerror}); check the path and its "
                        "permissions") from None


def _read_csv(path: Path) -> list[dict[str, Any]]:
    with path.open(newline="", encoding="utf-8") as file:
        reader = csv.DictReader(file)
        rows = []
        for row in reader:
            if None in row:  # more fields than the header names
                raise DataError(f"--data {path}: line {reader.line_num} has more fields than the header's "
                                f"{len(reader.fieldnames or [])}; quote texts that contain commas")
            rows.append(row)
        return rows


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"--data {path}: line {number} is not JSON ({error.msg}); write one JSON "
                                "object per line") from None
            if not isinstance(row, dict):
                raise DataError(f"--data {path}: line {number} is a JSON {type(row).__name__}, not an object; "
                                'write one object per line, e.g. {"text": "...", "label": "pos"}')
            rows.append(row)
    return rows


def label_vocabulary(values: list[Any]) -> list[str]:
    """Sorted label names; integer-looking labels sort numerically."""
    names = {str(value) for value in values}
    if all(name.lstrip("-").isdigit() for name in names):
        return sorted(names, key=int)
    return sorted(names)


def load_table(path: Path, *, text_column: str, label_column: str) -> TextExamples:
    rows = read_rows(path)
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
    for image in images:  # headers only: a broken file fails here, not in the middle of training
        _check_image(image)
    return ImageExamples(images=list(images), labels=labels, label_names=classes)


def _check_image(path: Path) -> None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise DataError(f"--data: cannot read image {path} ({str(error).splitlines()[0] or type(error).__name__}); "
                        "remove or replace the file") from None
