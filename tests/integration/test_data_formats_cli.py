"""Alpaca, ShareGPT, messages and prompt/completion data each train a tiny causal LM through the real CLI, and
the resolved-config table says which format was recognised."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FILLER, WORDS_BAD, WORDS_GOOD, write_tiny_llm
from tests.helpers import in_process


def _rows(data_format: str, count: int = 12) -> list[dict[str, Any]]:
    rng = random.Random(0)
    rows = []
    for index in range(count):
        words = " ".join([*rng.choices(FILLER, k=4), rng.choice(WORDS_GOOD if index % 2 == 0 else WORDS_BAD)])
        question, answer = f"review : {words} . verdict ?", "yes" if index % 2 == 0 else "no"
        rows.append({
            "alpaca": {"instruction": "verdict ?", "input": f"review : {words}", "output": answer},
            "sharegpt": {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]},
            "messages": {"messages": [{"role": "user", "content": question},
                                      {"role": "assistant", "content": answer}]},
            "prompt-completion": {"prompt": question, "completion": " " + answer},
        }[data_format])
    return rows


@pytest.mark.parametrize(("data_format", "shown"), [
    ("alpaca", "Alpaca (instruction/input/output)"), ("sharegpt", "ShareGPT (conversations of from/value turns)"),
    ("messages", "chat messages (role/content turns)"), ("prompt-completion", "prompt/completion")])
def test_each_instruction_format_trains_a_causal_lm(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch, data_format: str,
                                                    shown: str) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # the resolved-config table on one line per row
    model = write_tiny_llm(tmp_path / "llm")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in _rows(data_format)))
    result = in_process(["train", "--model", str(model), "--data", str(data), "--max-length", "32",
                         "--effective-batch", "4", "--max-steps", "2", "--precision", "fp32",
                         "--output-dir", str(tmp_path / "run")], capsys)
    assert result.returncode == 0, result.stderr
    assert f"{data} ({shown}): 11 train / 1 val" in result.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["task"] == "causal-lm" and summary["optimizer_steps"] == 2
