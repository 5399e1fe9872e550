"""The bench's pieces: speed medians, the memory timeline, its config checks and its table."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from memfit.bench import ROW_KEYS, BenchConfig, BenchResult, Setup, markdown, speed_rounds, step_speeds
from memfit.engine import train
from memfit.errors import ConfigError
from memfit.memory.monitor import timeline_record
from tests.conftest import tiny_config


def write_metrics(path: Path, steps: list[tuple[float, int]]) -> Path:
    records = [{"type": "train", "step": index + 1, "step_seconds": seconds, "window_samples": samples}
               for index, (seconds, samples) in enumerate(steps)]
    records.insert(2, {"type": "eval", "accuracy": 0.5})
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_speed_is_the_median_of_full_windows_after_warm_up(tmp_path: Path) -> None:
    # two slow warm-up steps, then 0.5 / 0.25 / 1.0 s, and a short last window that must not count
    metrics = write_metrics(tmp_path / "metrics.jsonl", [(9.0, 8), (3.0, 8), (0.5, 8), (0.25, 8), (1.0, 8),
                                                         (0.01, 3)])
    per_sample, per_step, spread = step_speeds([metrics], effective_batch=8)
    assert per_step == 2.0  # 1 / median(0.5, 0.25, 1.0)
    assert per_sample == 16.0  # median(16, 32, 8)
    assert spread == 0.75  # quartiles 0.375 and 0.75 around the median 0.5


def test_speed_of_a_run_shorter_than_its_warm_up_uses_its_last_step(tmp_path: Path) -> None:
    metrics = write_metrics(tmp_path / "metrics.jsonl", [(4.0, 8), (2.0, 8)])
    assert step_speeds([metrics], effective_batch=8) == (4.0, 0.5, 0.0)


def test_speeds_pool_the_steady_steps_of_several_runs(tmp_path: Path) -> None:
    first = write_metrics(tmp_path / "a.jsonl", [(9.0, 8), (9.0, 8), (1.0, 8), (1.0, 8)])
    second = write_metrics(tmp_path / "b.jsonl", [(9.0, 8), (9.0, 8), (2.0, 8), (2.0, 8), (2.0, 8)])
    per_sample, per_step, _ = step_speeds([first, second], effective_batch=8)
    assert (per_sample, per_step) == (4.0, 0.5)  # each run's warm-up left out: median of 1, 1, 2, 2, 2


def test_speed_rounds_retime_each_setup_that_ran(tiny_bert: Path, reviews_csv: Path, tmp_path: Path) -> None:
    config = tiny_config(tiny_bert, reviews_csv, tmp_path / "runs" / "fp32", max_steps=None, overwrite=True)
    rows = [{"kind": "training", "error": None, "run_samples_per_second": 1.0, "samples_per_second": 1.0},
            {"kind": "training", "error": "does not fit", "samples_per_second": None}]
    setups = [Setup("fp32", "FP32 baseline", config, accuracy_neutral=True),
              Setup("low-ckpt", "BF16 + full checkpointing", None, accuracy_neutral=True, error="does not fit")]
    speed_rounds(setups, rows, rounds=1, steps=1, log=lambda line: None)
    timed = [json.loads(line) for line in (tmp_path / "runs" / "fp32" / "speed-1" / "metrics.jsonl").read_text()
             .splitlines() if '"train"' in line]
    assert len(timed) == 3  # 2 warm-up steps + 1 timed
    assert rows[0]["speed_rounds"] == 1 and rows[0]["samples_per_second"] == 8 / timed[-1]["step_seconds"]
    assert rows[1]["samples_per_second"] is None  # a setup that did not run is not timed


def test_timeline_reduction_keeps_the_peak_and_the_phase_order() -> None:
    events = [(value, "forward") for value in range(100)] + [(100 - value, "backward") for value in range(50)] + \
        [(10_000, "optimizer"), (5, None)]
    record = timeline_record(events, points=16)
    assert len(record["bytes"]) <= 16 and record["events"] == len(events)
    assert record["peak_bytes"] == max(record["bytes"]) == 10_000
    # 10 events per point: the last point holds the optimizer's 10,000 and a smaller "other" event
    assert [phase["name"] for phase in record["phases"]] == ["forward", "backward", "optimizer"]
    assert record["phases"][0]["start"] == 0 and record["phases"][-1]["end"] == len(record["bytes"])
    for before, after in zip(record["phases"], record["phases"][1:], strict=False):
        assert before["end"] == after["start"]


def test_a_run_records_the_memory_timeline_of_step_two(tiny_bert: Path, reviews_csv: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    # a loop step: step 2 holds the optimizer state and sets the peak (a fused step's first update allocates a
    # few bytes of its own, so its run can peak in step 1)
    summary = train(tiny_config(tiny_bert, reviews_csv, out, micro_batch_size=4, memory_timeline=True,
                                foreach=False),
                    console=Console(file=io.StringIO()))
    timeline = json.loads((out / "memory_timeline.json").read_text())
    assert timeline["step"] == 2 and timeline["device"] == "cpu"
    names = [phase["name"] for phase in timeline["phases"]]
    assert names.count("forward") == 2 and names.count("backward") == 2  # two micro-steps of 4
    assert names.index("backward") < names.index("optimizer")
    # step 2 already holds the optimizer state: its peak is the run's training peak
    training_peak = max(summary.peak_memory_by_phase[name] for name in ("forward", "backward", "optimizer"))
    assert timeline["peak_bytes"] == training_peak
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(record["window_samples"] == 8 and record["step_seconds"] > 0 for record in steps
               if record["type"] == "train")


@pytest.mark.parametrize(("options", "fragment"), [
    ({"device_profile": "1080ti", "emulate_budget": "1GiB"}, "give either --device-profile"),
    ({"device_profile": "cpu"}, "not a GPU profile"),
    ({"setups": ("int8",)}, "add fp32"),
    ({"emulate_budget": "lots"}, "is not a memory size"),
    ({"speed_rounds": -1}, "--speed-rounds must be >= 0"),
])
def test_bench_config_refuses_bad_options(options: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        BenchConfig(**options).validate()  # type: ignore[arg-type]


def test_quick_fills_only_the_counts_not_given() -> None:
    assert (BenchConfig().resolved_speed_rounds, BenchConfig(quick=True).resolved_speed_rounds) == (2, 0)
    assert BenchConfig(quick=True, speed_rounds=1).resolved_speed_rounds == 1
    assert (BenchConfig(quick=True).resolved().samples, BenchConfig(quick=True).resolved().val_samples) == (256, 200)
    assert BenchConfig(quick=True, samples=64).resolved().samples == 64
    assert BenchConfig(samples=None).resolved().samples is None


def test_a_failed_setup_is_a_row_that_says_why() -> None:
    row = dict.fromkeys(ROW_KEYS)
    row.update(setup="FP32 baseline", key="fp32", kind="training", accuracy_neutral=True,
               error="does not fit 1.0 MiB even at micro-batch 1")
    result = BenchResult(rows=[row], machine={"device": "cpu", "cpu_count": 2, "torch": "x", "date": "today"},
                         command="memfit bench", budget_bytes=2**20, budget_source="--emulate-budget")
    table = markdown(result)
    assert "| FP32 baseline | - |" in table and "does not fit 1.0 MiB even at micro-batch 1" in table
    assert result.to_dict()["accuracy_neutral_all_within"] is None  # nothing to judge
