"""``memfit train --packing`` end to end through the CLI entry point: packed rows are the run's samples, the
validation stays per example, the summary says so, and the estimate is the peak of the real packed run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from memfit import TrainConfig
from memfit.memory.estimate import estimate
from tests.conftest import write_pairs, write_tiny_llm
from tests.helpers import read_metrics, run_main


def test_a_packed_run_windows_over_rows_and_its_estimate_is_its_peak(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    model, data = write_tiny_llm(tmp_path / "llm"), write_pairs(tmp_path / "chat.jsonl", count=96, chat=True)
    out = tmp_path / "run"
    config = TrainConfig(model=str(model), data=str(data), max_length=32, effective_batch=8, micro_batch_size=4,
                         precision="bf16", epochs=2, lr=3e-3, packing=True, eval_before=True, log_every=1,
                         output_dir=str(out), device="cpu")
    code, _, err = run_main(["train", "--model", str(model), "--data", str(data), "--max-length", "32",
                             "--effective-batch", "8", "--micro-batch-size", "4", "--precision", "bf16",
                             "--epochs", "2", "--lr", "3e-3", "--packing", "--eval-before", "--log-every", "1",
                             "--output-dir", str(out), "--device", "cpu"], capsys)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["packing"] is True
    rows, examples = summary["packed_rows"], summary["train_examples"]
    assert summary["train_samples"] == rows and examples == 86 and rows < examples  # several examples a row
    assert summary["optimizer_steps"] == 2 * math.ceil(rows / 8)  # the windows are cut from the rows
    assert summary["examples_per_second"] == pytest.approx(summary["samples_per_second"] * examples / rows)
    assert {line["window_samples"] for line in read_metrics(out, "train")} <= {8, rows % 8}
    evaluations = read_metrics(out, "eval")
    assert summary["val_samples"] == 10 and summary["val_accuracy"] is not None  # per example, unpacked
    assert evaluations[-1]["loss"] < evaluations[0]["loss"]  # it learned the completions
    # real packed rows (an example split over two rows among them) against the trace of synthetic ones
    predicted = estimate(config)
    measured = {name: summary["peak_memory_by_phase"][name] for name in predicted.phases}
    for name, value in predicted.phases.items():
        assert abs(value - measured[name]) <= 0.005 * measured[name], (name, value, measured[name])
    assert measured == predicted.phases  # in fact to the byte


@pytest.mark.parametrize("command", ["train", "estimate"])
def test_packing_classification_data_is_one_line(tmp_path: Path, reviews_csv: Path, command: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    model, out = write_tiny_llm(tmp_path / "llm"), tmp_path / "never"
    args = [command, "--model", str(model), "--data", str(reviews_csv), "--text-column", "review",
            "--label-column", "sentiment", "--task", "classification", "--packing"]
    code, _, err = run_main([*args, "--output-dir", str(out)] if command == "train" else args, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--packing packs causal-LM examples" in lines[0] and "Traceback" not in err
    assert not out.exists()
