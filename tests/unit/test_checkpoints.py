"""Checkpoints: atomic saves, corruption detection, what loads with weights_only, and what a resume refuses."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

import memfit.checkpoints
import memfit.windows
from memfit.checkpoints import MARKER, PROGRESS, STATE, WEIGHTS, complete_checkpoints, latest, load
from memfit.engine import train
from memfit.errors import CheckpointError, TrainingError
from memfit.memory.tracker import OUT_OF_MEMORY
from memfit.report import Summary
from tests.conftest import TINY_BERT, tiny_config, write_model_dir


def run(model: Path, data: Path, out: Path, console: Console | None = None, **overrides: Any) -> Summary:
    values = {"max_steps": 4, "save_every": 2, **overrides}
    return train(tiny_config(model, data, out, **values), console=console or Console(file=io.StringIO()))


def files(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*"))}


def test_a_checkpoint_holds_everything_and_all_but_weights_load_with_weights_only(tiny_bert: Path,
                                                                                reviews_csv: Path,
                                                                                tmp_path: Path) -> None:
    run(tiny_bert, reviews_csv, tmp_path / "run")
    assert [p.name for p in complete_checkpoints(tmp_path / "run")] == ["step-00000002", "step-00000004"]
    newest = latest(tmp_path / "run")
    assert newest is not None
    state = torch.load(newest / STATE, weights_only=True)
    assert set(state) == {"optimizer", "scheduler", "scaler", "rng", "rng_window_start", "order", "window_loss"}
    assert set(state["rng"]) == {"python", "numpy", "torch"}
    assert len(state["optimizer"]["state"]) > 0 and state["scheduler"]["last_epoch"] == 4
    progress = json.loads((newest / PROGRESS).read_text())
    assert progress["progress"]["step"] == 4 and progress["progress"]["micro_batch_size"] == 8
    assert progress["config"]["model"] == str(tiny_bert)
    assert progress["architecture"]["class"] == "BertForSequenceClassification"
    assert set(json.loads((newest / MARKER).read_text())["files"]) == {WEIGHTS, STATE, PROGRESS}


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint(tiny_bert: Path, reviews_csv: Path,
                                                                  tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    run(tiny_bert, reviews_csv, tmp_path / "run", max_steps=2)
    before = latest(tmp_path / "run")
    assert before is not None and before.name == "step-00000002"
    real_save = torch.save

    def disk_full(obj: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        real_save(obj, path, *args, **kwargs)
        Path(path).write_bytes(Path(path).read_bytes()[:100])  # half written
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(memfit.checkpoints.torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        run(tiny_bert, reviews_csv, tmp_path / "run", max_steps=4, resume="latest")
    monkeypatch.undo()
    assert latest(tmp_path / "run") == before  # the partial save is not a checkpoint
    assert [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert load(before).progress["step"] == 2
    resumed = run(tiny_bert, reviews_csv, tmp_path / "run", max_steps=4, resume="latest")
    assert resumed.resumed_from == str(before) and resumed.optimizer_steps == 4
    assert not [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(("damage", "message"), [
    ("truncate-state", "state.pt: truncated or changed"),
    ("flip-weights", "model.safetensors: corrupted (checksum mismatch)"),
    ("remove-marker", "the checkpoint is incomplete (no COMPLETE.json)"),
    ("remove-weights", "model.safetensors: missing from the checkpoint"),
])
def test_a_damaged_checkpoint_is_detected_and_named(damage: str, message: str, tiny_bert: Path,
                                                    reviews_csv: Path, tmp_path: Path) -> None:
    run(tiny_bert, reviews_csv, tmp_path / "run", max_steps=2)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000002"
    if damage == "truncate-state":
        (checkpoint / STATE).write_bytes((checkpoint / STATE).read_bytes()[:-10])
    elif damage == "flip-weights":
        data = bytearray((checkpoint / WEIGHTS).read_bytes())
        data[-5] ^= 0xFF
        (checkpoint / WEIGHTS).write_bytes(bytes(data))
    else:
        (checkpoint / (MARKER if damage == "remove-marker" else WEIGHTS)).unlink()
    with pytest.raises(CheckpointError) as caught:
        load(checkpoint)
    assert message in str(caught.value) and str(checkpoint) in str(caught.value)
    if damage != "remove-marker":
        assert "resume from an earlier checkpoint" in str(caught.value)


def test_a_checkpoint_from_another_model_is_refused_and_nothing_changes(tiny_bert: Path, reviews_csv: Path,
                                                                        tmp_path: Path) -> None:
    run(tiny_bert, reviews_csv, tmp_path / "run", max_steps=2)
    before = files(tmp_path / "run")
    wider = write_model_dir(tmp_path / "wider", {**TINY_BERT, "hidden_size": 64, "intermediate_size": 128})
    with pytest.raises(CheckpointError, match="the checkpoint is of another model") as caught:
        run(wider, reviews_csv, tmp_path / "run", max_steps=4, resume="latest")
    assert "BertForSequenceClassification" in str(caught.value) and "--model" in str(caught.value)
    assert files(tmp_path / "run") == before


def test_an_existing_output_dir_is_refused_unless_overwrite(tiny_bert: Path, reviews_csv: Path,
                                                            tmp_path: Path) -> None:
    first = run(tiny_bert, reviews_csv, tmp_path / "run", max_steps=2)
    (tmp_path / "run" / "notes.txt").write_text("mine")
    before = files(tmp_path / "run")
    with pytest.raises(CheckpointError, match="already holds files; choose a new --output-dir"):
        run(tiny_bert, reviews_csv, tmp_path / "run", max_steps=2)
    assert files(tmp_path / "run") == before
    again = run(tiny_bert, reviews_csv, tmp_path / "run", max_steps=2, overwrite=True)
    assert again.val_loss == first.val_loss
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3  # 2 steps + 1 evaluation: the old run's lines are gone, not appended to
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"  # only memfit's own files are replaced


def test_resume_with_a_changed_config_warns_with_both_values(tiny_bert: Path, reviews_csv: Path,
                                                             tmp_path: Path) -> None:
    run(tiny_bert, reviews_csv, tmp_path / "run", max_steps=2)
    console = Console(file=io.StringIO(), width=300)
    resumed = run(tiny_bert, reviews_csv, tmp_path / "run", console=console, max_steps=4, lr=2e-3,
                  resume="latest")
    output = console.file.getvalue()  # type: ignore[attr-defined]
    assert "changed config" in output and "lr: 0.001 -> 0.002" in output and "max_steps: 2 -> 4" in output
    assert "save_every" not in output and resumed.optimizer_steps == 4


def test_resume_latest_without_a_checkpoint_starts_fresh_and_a_missing_path_is_refused(
        tiny_bert: Path, reviews_csv: Path, tmp_path: Path) -> None:
    fresh = run(tiny_bert, reviews_csv, tmp_path / "run", max_steps=2, resume="latest", save_every=None)
    assert fresh.resumed_from is None and fresh.optimizer_steps == 2
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        run(tiny_bert, reviews_csv, tmp_path / "run", resume=str(tmp_path / "nowhere"))


def test_an_oom_reduced_micro_batch_stays_reduced_on_resume(tiny_bert: Path, reviews_csv: Path,
                                                            tmp_path: Path) -> None:
    wide = write_model_dir(tmp_path / "wide", {**TINY_BERT, "intermediate_size": 128})
    values = {"effective_batch": 16, "freeze_embeddings": True, "epochs": 1}
    full = run(wide, reviews_csv, tmp_path / "full", micro_batch_size=16, **values)
    half = run(wide, reviews_csv, tmp_path / "half", micro_batch_size=8, **values)
    budget = f"{(full.peak_memory_bytes + half.peak_memory_bytes) // 2}B"
    split = run(wide, reviews_csv, tmp_path / "run", micro_batch_size=16, max_steps=2, emulate_budget=budget,
                **values)
    assert split.micro_batch_size == 8 and len(split.oom_recoveries) == 2
    resumed = run(wide, reviews_csv, tmp_path / "run", micro_batch_size=16, max_steps=4, emulate_budget=budget,
                  resume="latest", **values)
    assert resumed.micro_batch_size == 8 and resumed.accumulation_steps == 2
    assert resumed.oom_recoveries == split.oom_recoveries  # no new OOM: it did not try 16 again


def test_micro_batch_one_that_does_not_fit_saves_a_checkpoint_before_stopping(
        tiny_bert: Path, reviews_csv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_accumulate = memfit.windows.accumulate_window
    calls = {"count": 0}

    def fails_from_step_three(*args: Any, **kwargs: Any) -> Any:
        calls["count"] += 1
        if calls["count"] > 2:
            raise OUT_OF_MEMORY("injected")
        return real_accumulate(*args, **kwargs)

    monkeypatch.setattr(memfit.windows, "accumulate_window", fails_from_step_three)
    with pytest.raises(TrainingError, match="step 3: out of memory with a micro-batch of 1") as caught:
        run(tiny_bert, reviews_csv, tmp_path / "run", micro_batch_size=1, save_every=None)
    newest = latest(tmp_path / "run")
    assert newest is not None and f"checkpoint saved to {newest}" in str(caught.value)
    assert load(newest).progress["step"] == 2 and load(newest).progress["offset"] == 16  # what was learned is kept
