"""Tables in the shapes people publish (Alpaca, ShareGPT, messages, prompt/completion, text/label), from files,
Parquet folders, ``save_to_disk`` directories and Hub datasets in a hand-built cache, offline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from memfit.data import CausalExamples, Columns, TextExamples, load_examples
from memfit.data.formats import matching_formats
from memfit.errors import DataError

ALPACA = [{"instruction": "Name a colour", "input": "", "output": "red"},
          {"instruction": "Add the numbers", "input": "1 and 2", "output": "3"},
          {"instruction": "Name a fruit", "input": "", "output": "apple"}]
SHAREGPT = [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                               {"from": "gpt", "value": "Hello"}]},
            {"conversations": [{"from": "human", "value": "Bye"}, {"from": "gpt", "value": "Goodbye"}]}]
MESSAGES = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}] * 2
PAIRS = [{"prompt": "Hi", "completion": " Hello"}, {"prompt": "Bye", "completion": " Goodbye"}]


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _causal(data: Path | str, **columns: Any) -> CausalExamples:
    loaded = load_examples(str(data), columns=Columns(**columns), task="causal-lm")
    assert isinstance(loaded, CausalExamples)
    return loaded


def test_an_alpaca_json_array_becomes_instruction_pairs(tmp_path: Path) -> None:
    path = tmp_path / "alpaca_data.json"
    path.write_text(json.dumps(ALPACA, indent=2))  # Alpaca's own file is one JSON array
    examples = _causal(path)
    assert examples.source_format == "alpaca" and examples.templated and not examples.chat
    assert examples.prompts == ["Name a colour", "Add the numbers\n\n1 and 2", "Name a fruit"]
    assert examples.completions == ["red", "3", "apple"]


def test_sharegpt_turns_become_a_chat_with_roles(tmp_path: Path) -> None:
    examples = _causal(_jsonl(tmp_path / "sharegpt.jsonl", SHAREGPT))
    assert examples.source_format == "sharegpt" and examples.chat
    assert examples.prompts[0] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert examples.completions == ["Hello", "Goodbye"]


def test_messages_and_prompt_completion_are_recognised(tmp_path: Path) -> None:
    assert _causal(_jsonl(tmp_path / "chat.jsonl", MESSAGES)).source_format == "messages"
    assert _causal(_jsonl(tmp_path / "pairs.jsonl", PAIRS)).source_format == "prompt-completion"


def test_an_unknown_sharegpt_speaker_is_named(tmp_path: Path) -> None:
    rows = [{"conversations": [{"from": "narrator", "value": "Once"}, {"from": "gpt", "value": "upon"}]}] * 2
    with pytest.raises(DataError, match="row 1: unknown speaker 'narrator'"):
        _causal(_jsonl(tmp_path / "odd.jsonl", rows))


def test_a_table_that_fits_two_formats_asks_for_data_format(tmp_path: Path) -> None:
    rows = [{**ALPACA[0], "prompt": "p", "completion": "c"}] * 2
    path = _jsonl(tmp_path / "both.jsonl", rows)
    with pytest.raises(DataError) as caught:
        _causal(path)
    assert caught.value.problems == [
        f"--data {path}: the columns fit Alpaca (instruction/input/output) and prompt/completion; columns found: "
        "instruction, input, output, prompt, completion; choose one with --data-format (alpaca, sharegpt, messages, "
        "prompt-completion)"]
    assert _causal(path, data_format="prompt-completion").completions == ["c", "c"]
    assert _causal(path, data_format="alpaca").completions == ["red", "red"]


def test_unknown_columns_name_what_was_found_and_the_flags(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "odd.jsonl", [{"question": "q", "answer": "a"}] * 2)
    with pytest.raises(DataError) as caught:
        _causal(path)
    (line,) = caught.value.problems
    assert line.startswith(f"--data {path}: no known format in its columns found: question, answer (known: Alpaca")
    assert line.endswith("name the columns with --prompt-column/--completion-column, --messages-column or "
                         "--text-column/--label-column")
    assert _causal(path, prompt="question", completion="answer").completions == ["a", "a"]
    with pytest.raises(DataError, match=r"--data-format sharegpt needs ShareGPT .* columns; columns found: question"):
        _causal(path, data_format="sharegpt")


def test_a_configured_messages_column_may_hold_sharegpt_turns() -> None:
    row = {"dialog": SHAREGPT[0]["conversations"]}
    assert matching_formats(row, Columns(messages="dialog")) == ["sharegpt"]
    assert matching_formats(MESSAGES[0], Columns()) == ["messages"]


def test_parquet_files_and_folders_load(tmp_path: Path) -> None:
    import pyarrow
    import pyarrow.parquet

    folder = tmp_path / "parquet"
    folder.mkdir()
    for index, rows in enumerate((ALPACA[:2], ALPACA[2:])):
        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), folder / f"part-{index}.parquet")
    assert _causal(folder).completions == ["red", "3", "apple"]
    labelled = load_examples(str(folder / "part-0.parquet"),  # a format forced: classification of Alpaca rows
                             columns=Columns(text="instruction", label="output", data_format="text-label"))
    assert isinstance(labelled, TextExamples) and labelled.label_names == ["3", "red"]


def test_a_save_to_disk_directory_loads_with_its_split(tmp_path: Path) -> None:
    import datasets

    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(ALPACA),
                                   "test": datasets.Dataset.from_list(ALPACA[:2])})
    splits.save_to_disk(str(tmp_path / "saved"))
    assert len(_causal(tmp_path / "saved")) == 3
    assert len(_causal(tmp_path / "saved", split="test")) == 2
    with pytest.raises(DataError, match="no split 'validation' \\(splits: train, test\\); set --data-split"):
        _causal(tmp_path / "saved", split="validation")
    datasets.Dataset.from_list(SHAREGPT).save_to_disk(str(tmp_path / "one"))
    assert _causal(tmp_path / "one").source_format == "sharegpt"


def write_hub_dataset(home: Path, repo_id: str, files: dict[str, list[dict[str, Any]]]) -> Path:
    """A dataset repository in the Hub cache layout (``datasets--org--name``), files stored in the snapshot."""
    commit = "fedcba9876543210fedcba9876543210fedcba98"
    folder = home / "hub" / ("datasets--" + repo_id.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    for name, rows in files.items():
        path = folder / "snapshots" / commit / name
        path.parent.mkdir(parents=True, exist_ok=True)
        _jsonl(path, rows)
    return folder


def test_a_hub_dataset_loads_from_the_cache_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_hub_dataset(tmp_path / "hf-home", "tiny-org/alpaca-mini",
                      {"data/train.jsonl": ALPACA, "data/test.jsonl": ALPACA[:2]})
    examples = _causal("tiny-org/alpaca-mini")
    assert examples.source_format == "alpaca" and examples.completions == ["red", "3", "apple"]
    assert len(_causal("tiny-org/alpaca-mini", split="test")) == 2
    with pytest.raises(DataError) as caught:
        _causal("tiny-org/alpaca-mini", split="validation")
    assert caught.value.problems == ["--data tiny-org/alpaca-mini: Unknown split \"validation\". Should be one of "
                                     "['train', 'test'].; set --data-split or --data-config"]
    with pytest.raises(DataError) as missing:
        _causal("tiny-org/not-cached")
    assert missing.value.problems == ["--data tiny-org/not-cached: not in the local cache, and HF_HUB_OFFLINE is "
                                      "set; unset HF_HUB_OFFLINE to download it, or pass a local file"]


def test_bom_files_edited_files_and_mistyped_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "alpaca.json"
    path.write_text("\ufeff" + json.dumps(ALPACA[:2]), encoding="utf-8")  # a BOM, as Excel and PowerShell write
    assert _causal(path).completions == ["red", "3"]
    path.write_text(json.dumps(ALPACA), encoding="utf-8")  # the same file edited: read again
    assert _causal(path).completions == ["red", "3", "apple"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    with pytest.raises(DataError, match="no such file or directory, and not a Hub dataset id"):
        _causal("data/train.csv")  # a typo of a local path is not looked up on the Hub


def test_a_broken_save_to_disk_directory_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "state.json").write_text("{}")
    with pytest.raises(DataError, match="not a dataset saved with save_to_disk"):
        _causal(tmp_path / "broken")


def test_class_labels_keep_their_names_and_trailing_user_turns_are_dropped(tmp_path: Path) -> None:
    import datasets

    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["neg", "pos"])})
    datasets.Dataset.from_dict({"text": ["bad", "good", "fine"], "label": [0, 1, 1]},
                               features=features).save_to_disk(str(tmp_path / "saved"))
    labelled = load_examples(str(tmp_path / "saved"), columns=Columns())
    assert isinstance(labelled, TextExamples) and labelled.label_names == ["neg", "pos"]
    rows = [{"conversations": [*SHAREGPT[1]["conversations"], {"from": "human", "value": "Thanks"}]}] * 2
    assert _causal(_jsonl(tmp_path / "tail.jsonl", rows)).completions == ["Goodbye", "Goodbye"]
