"""Where a table of examples comes from, read into rows (one dict per example).

- a file: CSV, JSON Lines, a JSON array of objects (Alpaca's own ``alpaca_data.json``), or Parquet;
- a folder of Parquet files (read in name order, as one table);
- a directory written by `datasets`' ``save_to_disk`` (a ``DatasetDict``: ``--data-split`` picks the split);
- a Hub dataset id (``org/name[@revision]``), read with ``datasets.load_dataset``: the local Hugging Face
  cache first (a snapshot already there loads without a network request; ``HF_HUB_OFFLINE`` is honoured),
  downloaded with progress bars when missing and online. ``--data-config`` names its configuration and
  ``--data-split`` its split.

A Parquet file needs ``pyarrow``; the last two need the ``datasets`` package (``pip install 'memfit[datasets]'``).
Rows are read once per process (the task is decided from them, then the examples are made from them).
"""

from __future__ import annotations

import contextlib
import csv
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memfit.errors import DataError

TABLE_SUFFIXES = (".csv", ".jsonl", ".json", ".parquet")
INSTALL_DATASETS = "pip install 'memfit[datasets]'"


def table_kind(data: str) -> str | None:
    """``file``, ``parquet-folder``, ``saved`` (``save_to_disk``) or ``hub`` for a table; ``None`` for anything
    else (an image folder, a missing path)."""
    from memfit.hub import parse_hub_id

    path = Path(data).expanduser()
    if path.is_file():
        return "file" if path.suffix.lower() in TABLE_SUFFIXES else None
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            return "saved"
        return "parquet-folder" if any(path.glob("*.parquet")) else None
    first_part = Path(data.split("/", 1)[0]).expanduser()
    local_looking = path.suffix.lower() in TABLE_SUFFIXES or first_part.is_dir()  # a mistyped path, not a Hub id
    return "hub" if parse_hub_id(data) is not None and not local_looking else None


def read_rows(data: str, *, split: str = "train", subset: str | None = None) -> list[dict[str, Any]]:
    """The rows of the table ``data`` names (a copy of the list; the rows themselves are shared)."""
    path = Path(data).expanduser()
    stamp = (path.stat().st_mtime_ns, path.stat().st_size) if path.is_file() else None  # an edited file is reread
    return list(_rows(data, split, subset, stamp))


@functools.lru_cache(maxsize=4)
def _rows(data: str, split: str, subset: str | None, stamp: tuple[int, int] | None) -> tuple[dict[str, Any], ...]:
    kind = table_kind(data)
    path = Path(data).expanduser()
    if kind == "file":
        return tuple(_read_file(path))
    if kind == "parquet-folder":
        return tuple(row for file in sorted(path.glob("*.parquet")) for row in _read_parquet(file))
    if kind == "saved":
        return tuple(_read_saved(data, path, split))
    assert kind == "hub", f"not a table: {data}"
    return tuple(_read_hub(data, split, subset))


def _read_file(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".csv":
            return _read_csv(path)
        if suffix == ".parquet":
            return _read_parquet(path)
        if suffix == ".json" and _starts_with(path, "["):
            return _read_json_array(path)
        return _read_jsonl(path)
    except UnicodeDecodeError as error:
        raise DataError(f"--data {path}: not UTF-8 text (byte 0x{error.object[error.start]:02x} at offset "
                        f"{error.start}); re-save the file as UTF-8") from None
    except OSError as error:
        raise DataError(f"--data {path}: cannot read it ({error.strerror or error}); check the path and its "
                        "permissions") from None


def _starts_with(path: Path, character: str) -> bool:
    with path.open(encoding="utf-8-sig") as file:
        return file.read(4096).lstrip().startswith(character)


def _read_csv(path: Path) -> list[dict[str, Any]]:
    with path.open(newline="", encoding="utf-8-sig") as file:
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
    with path.open(encoding="utf-8-sig") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"--data {path}: line {number} is not JSON ({error.msg}); write one JSON "
                                "object per line, or one JSON array of objects") from None
            if not isinstance(row, dict):
                raise DataError(f"--data {path}: line {number} is a JSON {type(row).__name__}, not an object; "
                                'write one object per line, e.g. {"text": "...", "label": "pos"}')
            rows.append(row)
    return rows


def _read_json_array(path: Path) -> list[dict[str, Any]]:
    try:
        rows = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as error:
        raise DataError(f"--data {path}: not JSON ({error.msg} at line {error.lineno}); write one JSON array of "
                        "objects, or one object per line") from None
    bad = next((index for index, row in enumerate(rows) if not isinstance(row, dict)), None)
    if bad is not None:
        raise DataError(f"--data {path}: item {bad} of the array is a JSON {type(rows[bad]).__name__}, not an "
                        "object; write an array of objects")
    return list(rows)


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet
    except ModuleNotFoundError:
        raise DataError(f"--data {path}: reading Parquet needs pyarrow: {INSTALL_DATASETS}") from None
    try:
        return list(pyarrow.parquet.read_table(path).to_pylist())
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"--data {path}: not a Parquet file memfit can read ({_first_line(error)})") from None


def _datasets() -> Any:
    try:
        import datasets
    except ModuleNotFoundError:
        raise DataError(f"--data: a Hub dataset or a save_to_disk directory needs the datasets package: "
                        f"{INSTALL_DATASETS}") from None
    return datasets


@contextlib.contextmanager
def _quiet_datasets(datasets: Any, *, bars: bool) -> Iterator[None]:
    """datasets' log lines off while memfit reads, and its progress bars unless something is downloaded;
    both restored after (a user's own datasets code keeps its settings)."""
    verbosity = datasets.logging.get_verbosity()
    bars_before = datasets.is_progress_bar_enabled()
    datasets.logging.set_verbosity_error()
    (datasets.enable_progress_bars if bars else datasets.disable_progress_bars)()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        (datasets.enable_progress_bars if bars_before else datasets.disable_progress_bars)()


def _read_saved(data: str, path: Path, split: str) -> list[dict[str, Any]]:
    datasets = _datasets()
    try:
        with _quiet_datasets(datasets, bars=False):
            loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as error:  # FileNotFoundError for a directory that is not a whole dataset
        raise DataError(f"--data {data}: not a dataset saved with save_to_disk ({_first_line(error)}); save it "
                        "again, or pass its files") from None
    if hasattr(loaded, "keys"):  # a DatasetDict
        if split not in loaded:
            raise DataError(f"--data {data}: no split {split!r} (splits: {', '.join(loaded)}); set --data-split")
        loaded = loaded[split]
    return _named_rows(loaded)


def _read_hub(data: str, split: str, subset: str | None) -> list[dict[str, Any]]:
    """A Hub dataset: its cached snapshot when there is one (loaded as a local folder, no request), else
    ``load_dataset`` on the id (its own cache first; a download when online)."""
    from memfit.hub import cached_snapshot, is_offline, parse_hub_id

    repository = parse_hub_id(data)
    assert repository is not None
    datasets = _datasets()
    snapshot = cached_snapshot(repository, kind="dataset")
    source = str(snapshot) if snapshot is not None else repository.repo_id
    revision = None if snapshot is not None else repository.revision
    try:
        with _quiet_datasets(datasets, bars=snapshot is None and not is_offline()):
            loaded = datasets.load_dataset(source, subset, split=split, revision=revision)
    except ValueError as error:  # an unknown split or configuration: datasets names the ones there are
        raise DataError(f"--data {data}: {_first_line(error)}; set --data-split or --data-config") from None
    except datasets.exceptions.DatasetNotFoundError:
        raise DataError(f"--data {data}: no such dataset on the Hub (or it is private or gated: log in with "
                        "`hf auth login` or set HF_TOKEN); a local file or directory works too") from None
    except (ConnectionError, OSError) as error:
        if is_offline():
            raise DataError(f"--data {data}: not in the local cache, and HF_HUB_OFFLINE is set; unset "
                            "HF_HUB_OFFLINE to download it, or pass a local file") from None
        raise DataError(f"--data {data}: cannot load it ({_first_line(error)}); try again, or pass a local "
                        "file") from None
    return _named_rows(loaded)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _named_rows(dataset: Any) -> list[dict[str, Any]]:
    """A ``datasets`` dataset's rows, class labels by name (``ClassLabel`` columns hold their index)."""
    import datasets

    names = {column: feature.names for column, feature in dataset.features.items()
             if isinstance(feature, datasets.ClassLabel)}
    rows = list(dataset.to_list())
    for row in rows:
        for column, labels in names.items():
            if isinstance(row.get(column), int) and 0 <= row[column] < len(labels):
                row[column] = labels[row[column]]
    return rows
