"""User data: tables of text and label (rows from :mod:`memfit.data.sources`), and image folders with one
subfolder per class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memfit.data.examples import ImageExamples, TextExamples
from memfit.errors import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def label_vocabulary(values: list[Any]) -> list[str]:
    """Sorted label names; integer-looking labels sort numerically."""
    names = {str(value) for value in values}
    if all(name.lstrip("-").isdigit() for name in names):
        return sorted(names, key=int)
    return sorted(names)


def labelled_from_rows(data: str, rows: list[dict[str, Any]], *, text_column: str, label_column: str) -> TextExamples:
    """Texts and labels from a table's rows (the label names sorted, numerically when they are integers)."""
    if not rows:
        raise DataError(f"--data {data}: the table holds no rows")
    columns = list(rows[0].keys())
    missing = [(flag, name) for flag, name in (("--text-column", text_column), ("--label-column", label_column))
               if name not in columns]
    if missing:
        raise DataError([f"--data {data}: no column {name!r} ({flag}); columns are: {', '.join(columns)}"
                         for flag, name in missing])
    kept = [row for row in rows if str(row.get(text_column) or "").strip() and row.get(label_column) not in
            (None, "")]
    if not kept:
        raise DataError(f"--data {data}: no row has both a text and a label")
    names = label_vocabulary([row[label_column] for row in kept])
    index = {name: position for position, name in enumerate(names)}
    return TextExamples(texts=[str(row[text_column]) for row in kept],
                        labels=[index[str(row[label_column])] for row in kept], label_names=names,
                        source_format="text-label")


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
