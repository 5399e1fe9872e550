"""``memfit plan`` and ``memfit train --budget/--plan`` through the real CLI, on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.config import TrainConfig
from memfit.memory.estimate import estimate
from tests.conftest import write_long_text_task
from tests.helpers import in_process, memfit

pytestmark = pytest.mark.slow  # a minute or more of CPU: outside make test-fast

PLAN_KEYS = {"chosen", "candidates", "budget_bytes", "device"}
CHOSEN_KEYS = {"micro_batch_size", "accumulation_steps", "precision", "checkpointing", "optimizer",
               "predicted_peak_bytes", "predicted_samples_per_second"}
TRAINING_PHASES = ("forward", "backward", "optimizer")


@pytest.fixture(scope="session")
def task(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_long_text_task(tmp_path_factory.mktemp("plan-task"))


def train_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", str(model), "--data", str(data), "--text-column", "review", "--label-column",
            "sentiment", "--max-length", "32", "--effective-batch", "8", "--max-steps", "3", "--eval-batch-size",
            "2", "--device", "cpu", "--output-dir", str(out), *extra]


def tight_budget(model: Path) -> int:
    """A budget no setup without accumulation and checkpointing fits (the plan must use one of them)."""
    whole = [estimate(TrainConfig(model=str(model), max_length=32, effective_batch=8, precision=precision),
                      device="cpu", seq_len=32).total_bytes for precision in ("fp32", "bf16")]
    return int((min(whole) - 1) / 0.95)


def test_train_with_a_budget_stays_within_it_and_matches_the_plan(task: tuple[Path, Path], tmp_path: Path) -> None:
    model, data = task
    budget = tight_budget(model)
    out = tmp_path / "run"
    result = memfit(*train_args(model, data, out, "--budget", f"{budget}B", "--json"))
    assert result.returncode == 0, result.stderr
    assert "plan: micro-batch" in result.stderr  # the plan is printed before training
    summary = json.loads(result.stdout)
    assert summary["accumulation_steps"] > 1 or summary["checkpointing"] != "none"
    assert summary["effective_batch_size"] == 8
    planned = summary["plan"]["chosen"]
    assert (summary["micro_batch_size"], summary["accumulation_steps"]) == (planned["micro_batch_size"],
                                                                          planned["accumulation_steps"])
    measured = max(summary["peak_memory_by_phase"][phase] for phase in TRAINING_PHASES)
    assert summary["peak_memory_bytes"] <= budget
    assert abs(measured - planned["predicted_peak_bytes"]) <= 0.01 * planned["predicted_peak_bytes"]
    assert json.loads((out / "plan.json").read_text())["chosen"] == planned


def test_plan_json_saves_a_plan_that_train_uses(task: tuple[Path, Path], tmp_path: Path) -> None:
    model, data = task
    budget = tight_budget(model)
    plan_file = tmp_path / "plan.json"
    result = memfit("plan", "--model", str(model), "--seq-len", "32", "--effective-batch", "8", "--device", "cpu",
                    "--budget", f"{budget}B", "--json", "--save", str(plan_file))
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert PLAN_KEYS <= plan.keys() and CHOSEN_KEYS <= plan["chosen"].keys()
    assert plan["budget_bytes"] == budget and plan["device"] == "cpu"
    assert plan["chosen"]["predicted_peak_bytes"] <= 0.95 * budget
    assert all({"fits", "reason"} <= candidate.keys() for candidate in plan["candidates"])
    assert any(candidate["fits"] is False for candidate in plan["candidates"])  # the budget rejected some
    assert json.loads(plan_file.read_text())["chosen"] == plan["chosen"]

    trained = memfit(*train_args(model, data, tmp_path / "run", "--plan", str(plan_file), "--json"))
    assert trained.returncode == 0, trained.stderr
    summary = json.loads(trained.stdout)
    chosen = plan["chosen"]
    assert (summary["micro_batch_size"], summary["accumulation_steps"], summary["precision"]) == (
        chosen["micro_batch_size"], chosen["accumulation_steps"], chosen["precision"])


def test_nothing_fits_is_one_clear_answer(task: tuple[Path, Path], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    model, data = task
    planned = in_process(["plan", "--model", str(model), "--seq-len", "32", "--effective-batch", "8", "--device",
                          "cpu", "--budget", "100KiB", "--precision", "fp32"], capsys)
    assert planned.returncode == 1
    assert "memfit: nothing fits: 100.0 KiB" in planned.stderr and "the smallest any allowed setup needs" in \
        planned.stderr
    trained = memfit(*train_args(model, data, tmp_path / "run", "--budget", "100KiB", "--precision", "fp32"))
    assert trained.returncode == 2
    lines = [line for line in trained.stderr.splitlines() if line.startswith("memfit:")]  # not torchao's noise
    assert len(lines) == 1 and lines[0].startswith("memfit: error: nothing fits") and "Traceback" not in \
        trained.stderr
    assert not (tmp_path / "run").exists()


def test_max_gpus_prints_each_count_the_fewest_gpus_and_saves_the_chosen_plan(
        task: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every count up to --max-gpus is planned and shown; with a budget one GPU meets, the fewest is 1 and the
    saved plan is that one GPU's, which memfit train --plan reads."""
    model, _ = task
    saved = tmp_path / "plan.json"
    result = in_process(["plan", "--model", str(model), "--seq-len", "32", "--effective-batch", "8", "--device",
                         "cpu", "--budget", "64MiB", "--precision", "fp32", "--max-gpus", "2", "--save",
                         str(saved)], capsys)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # as printed, less the console's wrapping
    assert "on up to 2 x host CPU, effective batch 8 over all GPUs" in text and "budget 64.0 MiB per GPU" in text
    assert "fewest GPUs: full fine-tuning: 1; chosen: full fine-tuning on 1 GPU(s)" in text
    assert "│ 2 │ ddp, micro-batch" in text  # the 2-GPU row: its own setup
    assert "train with: memfit train " in text
    assert json.loads(saved.read_text())["chosen"]["world_size"] == 1
