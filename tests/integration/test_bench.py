"""``memfit bench`` through the real CLI: a tiny matrix under an emulated budget, on CPU."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from memfit.config import TrainConfig
from memfit.memory.estimate import estimate
from tests.conftest import write_long_text_task
from tests.helpers import memfit

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("bench")]
# its tests share one run (session-scoped: never rebuilt when
# another module's tests run between them on the same worker)

REQUIRED = {"setup", "accuracy_neutral", "micro_batch_size", "accumulation_steps", "peak_memory_bytes",
            "predicted_peak_bytes", "samples_per_second", "optimizer_steps_per_second", "val_accuracy",
            "accuracy_delta_points", "memory_ratio"}
SETUPS = ("fp32", "low-accum4", "low-ckpt-top", "int8", "plan")
PNG = b"\x89PNG\r\n\x1a\n"


def fp32_peak(model: Path, micro: int) -> int:
    config = TrainConfig(model=str(model), max_length=32, effective_batch=8, micro_batch_size=micro,
                         precision="fp32")
    return estimate(config, device="cpu").total_bytes


@pytest.fixture(scope="session")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, int]:
    root = tmp_path_factory.mktemp("bench")
    model, data = write_long_text_task(root)
    budget = (fp32_peak(model, 8) + fp32_peak(model, 4)) // 2  # fp32 fits at micro 4, not at 8
    out = root / "bench"
    result = memfit("bench", "--model", str(model), "--data", str(data), "--text-column", "review",
                    "--label-column", "sentiment", "--max-length", "32", "--effective-batch", "8", "--lr", "1e-3",
                    "--emulate-budget", f"{budget}B", "--margin", "0", "--speed-rounds", "0", "--setups", *SETUPS,
                    "--output-dir", str(out), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), out, budget


def rows(payload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["key"]: row for row in payload["rows"]}


def test_every_setup_has_a_row_with_the_required_keys(bench: tuple[dict[str, Any], Path, int]) -> None:
    payload, _, budget = bench
    assert [row["key"] for row in payload["rows"]] == list(SETUPS)
    assert {"rows", "machine", "command"} <= payload.keys() and payload["command"].startswith("memfit bench")
    assert payload["budget_bytes"] == budget
    for row in payload["rows"]:
        assert REQUIRED <= row.keys(), row["setup"]
        assert row["error"] is None, row
    by_key = rows(payload)
    assert [by_key[key]["accuracy_neutral"] for key in SETUPS] == [True, True, False, False, True]


def test_the_baseline_is_the_largest_fp32_micro_batch_that_fits(bench: tuple[dict[str, Any], Path, int]) -> None:
    baseline = rows(bench[0])["fp32"]
    assert (baseline["micro_batch_size"], baseline["accumulation_steps"], baseline["precision"]) == (4, 2, "fp32")
    assert baseline["memory_ratio"] == 1.0 and baseline["accuracy_delta_points"] == 0.0


def test_training_rows_keep_the_effective_batch_and_fit_the_budget(bench: tuple[dict[str, Any], Path, int]) -> None:
    payload, _, budget = bench
    baseline = rows(payload)["fp32"]
    for row in payload["rows"]:
        if row["kind"] != "training":
            continue
        micro, steps = row["micro_batch_size"], row["accumulation_steps"]
        assert micro * steps >= 8 > micro * (steps - 1), row["setup"]
        assert row["peak_memory_bytes"] <= budget, row["setup"]
        # texts are 30-32 tokens: the measured peak is the estimate's (at 32) within 2 %
        assert abs(row["peak_memory_bytes"] - row["predicted_peak_bytes"]) <= 0.02 * row["predicted_peak_bytes"]
        assert row["memory_ratio"] == round(row["peak_memory_bytes"] / baseline["peak_memory_bytes"], 3)
        assert row["samples_per_second"] > 0 and row["optimizer_steps_per_second"] > 0
    accumulated = rows(payload)["low-accum4"]
    assert (accumulated["precision"], accumulated["micro_batch_size"], accumulated["accumulation_steps"]) == \
        ("bf16", 2, 4)
    frozen = rows(payload)["low-ckpt-top"]
    assert frozen["checkpointing"] == "full" and frozen["trainable_parameters"] < baseline["trainable_parameters"]


def test_int8_row_quantizes_the_baseline(bench: tuple[dict[str, Any], Path, int]) -> None:
    payload, out, _ = bench
    int8, baseline = rows(payload)["int8"], rows(payload)["fp32"]
    assert int8["kind"] == "inference" and int8["micro_batch_size"] is None
    assert 0 < int8["peak_memory_bytes"] < baseline["peak_memory_bytes"]
    assert int8["accuracy_delta_points"] == round(100 * (int8["val_accuracy"] - baseline["val_accuracy"]), 2)
    assert (out / "runs" / "int8" / "quantization.json").is_file()


def test_outputs_table_csv_json_plots_and_timelines(bench: tuple[dict[str, Any], Path, int]) -> None:
    payload, out, _ = bench
    table = (out / "bench.md").read_text()
    for row in payload["rows"]:
        assert f"| {row['setup']}" in table
    with (out / "bench.csv").open() as file:
        assert [line["key"] for line in csv.DictReader(file)] == list(SETUPS)
    assert json.loads((out / "bench.json").read_text())["rows"] == payload["rows"]
    for plot in ("bench_memory_speed.png", "bench_timelines.png"):
        assert (out / plot).read_bytes().startswith(PNG)
    for key in ("fp32", "low-accum4", "plan"):
        timeline = json.loads((out / "runs" / key / "memory_timeline.json").read_text())
        names = [phase["name"] for phase in timeline["phases"]]
        assert {"forward", "backward", "optimizer"} <= set(names)
        assert names.index("forward") < names.index("backward") < names.index("optimizer")
        assert timeline["peak_bytes"] == max(timeline["bytes"]) <= rows(payload)[key]["peak_memory_bytes"]
