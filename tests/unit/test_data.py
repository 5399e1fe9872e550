import gzip
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from memfit.data import Columns, ImageExamples, TextExamples, load_examples, split
from memfit.data.batches import ImageEncoder, TextEncoder, cut, window_order
from memfit.data.builtin import fashion_mnist, read_idx, rotten_tomatoes
from memfit.errors import DataError


def test_csv_columns_and_label_vocabulary(reviews_csv: Path) -> None:
    examples = load_examples(str(reviews_csv), columns=Columns(text="review", label="sentiment"))
    assert isinstance(examples, TextExamples)
    assert examples.label_names == ["neg", "pos"]
    assert len(examples) == 96 and examples.labels[0] == 1  # row 0 is positive


def test_missing_column_lists_the_columns(reviews_csv: Path) -> None:
    with pytest.raises(DataError, match="no column 'label' \\(--label-column\\); columns are: review, sentiment"):
        load_examples(str(reviews_csv), columns=Columns(text="review", label="label"))


def test_jsonl_integer_labels_sort_numerically(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"t{i}", "label": i % 3 * 5}) for i in range(9)))
    examples = load_examples(str(path), columns=Columns(text="text", label="label"))
    assert examples.label_names == ["0", "5", "10"]


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file or directory"):
        load_examples(str(tmp_path / "nope.csv"), columns=Columns(text="text", label="label"))
    empty = tmp_path / "empty.csv"
    empty.write_text("text,label\n")
    with pytest.raises(DataError, match="holds no rows"):
        load_examples(str(empty), columns=Columns(text="text", label="label"))


def test_split_is_seeded_and_disjoint(reviews_csv: Path) -> None:
    examples = load_examples(str(reviews_csv), columns=Columns(text="review", label="sentiment"))
    train_a, val_a = split(examples, val_fraction=0.25, seed=3)
    train_b, val_b = split(examples, val_fraction=0.25, seed=3)
    _, val_c = split(examples, val_fraction=0.25, seed=4)
    assert val_a.texts == val_b.texts and train_a.texts == train_b.texts
    assert val_a.texts != val_c.texts
    assert len(val_a) == 24 and len(train_a) == 72


def test_windows_cover_each_sample_once_per_epoch() -> None:
    all_windows = cut(window_order(37, seed=0, epoch=1), 8)  # the engine's windows: consecutive slices
    assert [len(w) for w in all_windows] == [8, 8, 8, 8, 5]
    assert sorted(i for w in all_windows for i in w) == list(range(37))
    assert window_order(37, seed=0, epoch=1) == window_order(37, seed=0, epoch=1)
    assert all_windows != cut(window_order(37, seed=0, epoch=2), 8)
    assert cut([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]


def test_text_encoder_pads_to_longest_in_batch() -> None:
    encoder = TextEncoder(input_ids=[[101, 5, 102], [101, 102], [101, 7, 8, 9, 102]], labels=[0, 1, 1],
                          pad_token_id=0)
    batch = encoder([0, 1])
    assert batch["input_ids"].tolist() == [[101, 5, 102], [101, 102, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert encoder([2])["input_ids"].shape == (1, 5)


def test_image_encoder_resizes_and_expands_channels() -> None:
    images = [np.full((8, 8, 1), 255, dtype=np.uint8), np.zeros((8, 8, 1), dtype=np.uint8)]
    encoder = ImageEncoder(images=list(images), labels=[0, 1], image_size=16, num_channels=3)
    batch = encoder([0, 1])
    assert batch["pixel_values"].shape == (2, 3, 16, 16)
    assert torch.allclose(batch["pixel_values"][0], torch.ones(3, 16, 16))
    assert torch.allclose(batch["pixel_values"][1], -torch.ones(3, 16, 16))


def test_image_folder(tmp_path: Path) -> None:
    from PIL import Image

    for name in ("cat", "dog"):
        (tmp_path / name).mkdir()
        for i in range(2):
            Image.new("RGB", (10, 12), color=(i * 100, 0, 0)).save(tmp_path / name / f"{i}.png")
    examples = load_examples(str(tmp_path), columns=Columns(text="text", label="label"))
    assert isinstance(examples, ImageExamples)
    assert examples.label_names == ["cat", "dog"] and examples.labels == [0, 0, 1, 1]
    batch = ImageEncoder.build(examples, image_size=8, num_channels=3)([0, 3])
    assert batch["pixel_values"].shape == (2, 3, 8, 8)


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    with gzip.open(path, "wb") as file:
        file.write(header + array.astype(np.uint8).tobytes())


def test_idx_reader_and_fashion_mnist_layout(tmp_path: Path) -> None:
    images = np.arange(2 * 28 * 28).reshape(2, 28, 28) % 256
    for prefix in ("train", "t10k"):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", np.array([3, 9]))
    assert read_idx(tmp_path / "train-images-idx3-ubyte.gz").tolist() == images.tolist()
    examples = fashion_mnist(tmp_path)
    assert len(examples) == 4 and examples.labels == [3, 9, 3, 9]
    assert examples.images[0].shape == (28, 28, 1)


def test_fashion_mnist_missing_names_the_package(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist"):
        fashion_mnist(tmp_path)


def test_rotten_tomatoes_drops_plot_rows() -> None:
    examples = rotten_tomatoes()
    assert examples.label_names == ["rotten", "fresh"]
    assert len(examples) == 4866  # 5,022 rows less 156 plot summaries
    assert sum(examples.labels) == 2455  # fresh


def test_digits_builtin() -> None:
    examples = load_examples("digits", columns=Columns(text="text", label="label"))
    assert isinstance(examples, ImageExamples) and len(examples) == 1797
    assert examples.images[0].dtype == np.uint8 and examples.images[0].shape == (8, 8, 1)
