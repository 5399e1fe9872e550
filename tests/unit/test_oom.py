"""Out-of-memory recovery, exercised for real: an emulated budget on CPU and injected OOMs."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

import memfit.step
import memfit.windows
from memfit.config import TrainConfig
from memfit.engine import train
from memfit.errors import ConfigError, TrainingError
from memfit.memory.tracker import OUT_OF_MEMORY, StorageTracker
from memfit.report import Summary
from memfit.techniques import stability
from memfit.units import parse_bytes
from tests.conftest import TINY_BERT, load_weights, tiny_config, write_model_dir, write_pairs, write_tiny_llm
from tests.helpers import read_metrics, run_main

QUIET = Console(file=io.StringIO())


@pytest.fixture
def wide_bert(tmp_path: Path) -> Path:
    """Frozen embeddings and a wider FFN make activations, which a micro-batch split shrinks, dominate."""
    return write_model_dir(tmp_path / "bert", {**TINY_BERT, "intermediate_size": 128})


def run(model: Path, data: Path, out: Path, **overrides: Any) -> Summary:
    values = {"effective_batch": 16, "freeze_embeddings": True, "epochs": 3, "max_steps": None, **overrides}
    return train(tiny_config(model, data, out, **values), console=QUIET)


def test_parse_bytes_is_strict() -> None:
    assert parse_bytes("300MiB", option="--x") == 300 * 1024**2
    assert parse_bytes("1.5 GB", option="--x") == 1_500_000_000
    assert parse_bytes("11gib", option="--x") == 11 * 1024**3
    for bad in ("300", "11G", "12 parsecs", "-5MiB", "MiB", "0.1B"):
        with pytest.raises(ConfigError):
            parse_bytes(bad, option="--x")


def test_the_budget_raises_a_real_oom_at_the_allocation_that_crosses_it() -> None:
    weight, inputs = torch.randn(100, 100, requires_grad=True), torch.randn(64, 100)
    with StorageTracker(budget_bytes=100_000) as tracker:
        tracker.track(weight, category="parameters")  # 40,000 bytes
        hidden = inputs @ weight  # 25,600 bytes
        with pytest.raises(OUT_OF_MEMORY, match="tried to allocate 40,000 bytes with 65,600 of 100,000"):
            torch.zeros(100, 100)
        assert tracker.live_bytes == 65_600  # the refused storage was never counted
        del hidden


def test_a_budget_split_keeps_the_effective_batch_and_learns_the_same(wide_bert: Path, reviews_csv: Path,
                                                                     tmp_path: Path) -> None:
    full = run(wide_bert, reviews_csv, tmp_path / "full", micro_batch_size=16)
    half = run(wide_bert, reviews_csv, tmp_path / "half", micro_batch_size=8)
    budget = (full.peak_memory_bytes + half.peak_memory_bytes) // 2
    split = run(wide_bert, reviews_csv, tmp_path / "split", micro_batch_size=16, emulate_budget=f"{budget}B")
    actions = [(e["action"], e["old_micro_batch_size"], e["new_micro_batch_size"]) for e in split.oom_recoveries]
    assert actions == [("retry", 16, 16), ("split", 16, 8)]  # one retry at the same size, then the split
    assert split.oom_recoveries[0]["memory_bytes"] > 0
    assert (split.micro_batch_size, split.accumulation_steps, split.effective_batch_size) == (8, 2, 16)
    assert split.optimizer_steps == full.optimizer_steps and split.peak_memory_bytes <= budget
    assert_params(load_weights(tmp_path / "split"), load_weights(tmp_path / "full"), exact=False)
    events = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [e["action"] for e in events if e["type"] == "oom"] == ["retry", "split"]
    assert json.loads((tmp_path / "split" / "summary.json").read_text())["oom_recoveries"] == split.oom_recoveries


def test_an_oom_mid_backward_restarts_the_window_exactly(wide_bert: Path, reviews_csv: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    clean = run(wide_bert, reviews_csv, tmp_path / "clean", micro_batch_size=8, epochs=1)
    real_loss_sum = memfit.step.loss_sum
    calls = {"forward": 0, "raised": 0}

    def fail_in_backward(grad: torch.Tensor) -> torch.Tensor:
        calls["raised"] += 1
        raise OUT_OF_MEMORY("injected in backward")

    def second_micro_step_of_step_two(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        calls["forward"] += 1
        if calls["forward"] != 4:
            return real_loss_sum(model, batch)
        def watch(module: torch.nn.Module, args: Any, output: Any) -> None:
            (output if isinstance(output, torch.Tensor) else output[0]).register_hook(fail_in_backward)

        # layer 0's output is reached late in backward: the layers above have added to .grad already
        handle = model.bert.encoder.layer[0].register_forward_hook(watch)
        try:
            return real_loss_sum(model, batch)
        finally:
            handle.remove()

    monkeypatch.setattr(memfit.step, "loss_sum", second_micro_step_of_step_two)
    retried = run(wide_bert, reviews_csv, tmp_path / "retried", micro_batch_size=8, epochs=1)
    assert calls["raised"] == 1
    assert [(e["step"], e["action"]) for e in retried.oom_recoveries] == [(2, "retry")]
    assert clean.oom_recoveries == [] and retried.val_loss == clean.val_loss
    # the partial gradients were dropped and the window ran again on the same samples: bit for bit the same
    assert_params(load_weights(tmp_path / "retried"), load_weights(tmp_path / "clean"), exact=True)


def assert_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *, exact: bool) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if exact:
            assert torch.equal(a[name], b[name]), name
        else:  # splitting changes the order of the gradient sums: equal up to rounding, not bit for bit
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5, msg=name)  # a lost sample: ~lr (1e-3)


def test_an_oom_storm_loses_no_sample_and_learns_the_same(wide_bert: Path, reviews_csv: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    full = run(wide_bert, reviews_csv, tmp_path / "full", micro_batch_size=16, epochs=4)
    half = run(wide_bert, reviews_csv, tmp_path / "half", micro_batch_size=8, epochs=4)
    budget = (full.peak_memory_bytes + half.peak_memory_bytes) // 2
    real_loss_sum = memfit.step.loss_sum
    calls = {"count": 0}

    def stormy(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        calls["count"] += 1
        if calls["count"] % 3 == 0:  # every third micro-step, on top of the budget's own OOMs
            raise OUT_OF_MEMORY("injected")
        return real_loss_sum(model, batch)

    monkeypatch.setattr(memfit.step, "loss_sum", stormy)
    storm = run(wide_bert, reviews_csv, tmp_path / "storm", micro_batch_size=16, epochs=4,
                emulate_budget=f"{budget}B")
    injected = [e for e in storm.oom_recoveries if e["message"] == "injected"]
    assert len(injected) >= 20 and len({e["step"] for e in injected}) >= 15
    assert any(e["message"].startswith("emulated budget") for e in storm.oom_recoveries)
    assert storm.effective_batch_size == 16 and storm.optimizer_steps == full.optimizer_steps
    assert storm.micro_batch_size < 16 and storm.micro_batch_size * storm.accumulation_steps >= 16
    # a dropped or repeated sample would move the weights far more than summation order does
    assert_params(load_weights(tmp_path / "storm"), load_weights(tmp_path / "full"), exact=False)


def test_micro_batch_one_that_still_fails_stops_with_the_memory_needed(wide_bert: Path, reviews_csv: Path,
                                                                      tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def always(*args: Any, **kwargs: Any) -> Any:
        raise OUT_OF_MEMORY("injected")

    monkeypatch.setattr(memfit.windows, "accumulate_window", always)  # the run's, not the estimator's
    with pytest.raises(TrainingError, match=r"step 1: out of memory with a micro-batch of 1 \(injected\); "
                                            r"a micro-batch of 1 needs [0-9.]+ MiB \(memfit estimate\)"):
        run(wide_bert, reviews_csv, tmp_path / "run", micro_batch_size=4, emulate_budget="64MiB")


def test_other_errors_propagate_unchanged(wide_bert: Path, reviews_csv: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """After the first step (where a failure of the model's own code is an architecture memfit does not support,
    said in one line: memfit.support), an error that is not out of memory goes through OOM recovery as it is."""
    real_loss_sum = memfit.step.loss_sum
    calls = {"count": 0}

    def broken(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        calls["count"] += 1
        if calls["count"] > 4:  # after step 1's micro-batches
            raise ValueError("not a memory problem")
        return real_loss_sum(model, batch)

    monkeypatch.setattr(memfit.step, "loss_sum", broken)
    with pytest.raises(ValueError, match="not a memory problem"):
        run(wide_bert, reviews_csv, tmp_path / "run")
    assert calls["count"] > 4


def test_an_eval_oom_halves_only_the_eval_batch(wide_bert: Path, reviews_csv: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    real_loss_sum = memfit.windows.loss_sum
    calls = {"count": 0}

    def eval_fails_once(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        calls["count"] += 1
        if calls["count"] == 1:
            raise OUT_OF_MEMORY("injected")
        return real_loss_sum(model, batch)

    monkeypatch.setattr(memfit.windows, "loss_sum", eval_fails_once)  # the run's own evaluation
    summary = run(wide_bert, reviews_csv, tmp_path / "run", micro_batch_size=8, epochs=1, eval_batch_size=8)
    assert [(e["phase"], e["old_eval_batch_size"], e["new_eval_batch_size"]) for e in summary.oom_recoveries] == [
        ("eval", 8, 4)]
    assert (summary.micro_batch_size, summary.accumulation_steps) == (8, 2)  # training untouched
    monkeypatch.undo()
    clean = run(wide_bert, reviews_csv, tmp_path / "clean", micro_batch_size=8, epochs=1, eval_batch_size=8)
    assert clean.oom_recoveries == [] and summary.train_loss == clean.train_loss
    # the whole validation set was evaluated once, in halves: the same accuracy, the same loss up to summation
    assert summary.val_accuracy == clean.val_accuracy
    assert summary.val_loss == pytest.approx(clean.val_loss, rel=1e-6)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_a_causal_lm_split_keeps_the_window_and_its_token_normalisation(tmp_path: Path, packing: bool) -> None:
    """A causal LM's loss is normalised by the window's completion tokens: split into micro-batches after an
    OOM, the window is the same samples and the same tokens, so the run learns what the unsplit one does.
    Packed (``--packing``), the window's samples are packed rows, split the same way."""
    model, data = write_tiny_llm(tmp_path / "llm", chat=True), write_pairs(tmp_path / "chat.jsonl", count=64, chat=True)

    def causal(out: str, **overrides: Any) -> Summary:
        config = TrainConfig(model=str(model), data=str(data), max_length=32, effective_batch=16, epochs=1,
                             precision="fp32", lr=1e-3, output_dir=str(tmp_path / out), device="cpu",
                             packing=packing, **overrides)
        return train(config, console=QUIET)

    full = causal("full", micro_batch_size=16)
    half = causal("half", micro_batch_size=8)
    split = causal("split", micro_batch_size=16,
                   emulate_budget=f"{(full.peak_memory_bytes + half.peak_memory_bytes) // 2}B")
    assert [e["action"] for e in split.oom_recoveries] == ["retry", "split"]
    assert (split.micro_batch_size, split.accumulation_steps) == (8, 2)
    assert_params(load_weights(tmp_path / "split"), load_weights(tmp_path / "half"), exact=True)
    assert_params(load_weights(tmp_path / "split"), load_weights(tmp_path / "full"), exact=False)


def fail_fused_step(monkeypatch: pytest.MonkeyPatch, *, call: int, after_update: bool = False) -> None:
    """The ``call``-th fused AdamW kernel (one per parameter group and step, after the step has made the state it
    creates lazily) raises an OOM; ``after_update``: once it has updated its parameters. Every other call runs."""
    monkeypatch.setattr(torch, "_fused_adamw_", failing(torch._fused_adamw_, call=call, after=after_update))


def failing(function: Any, *, call: int, after: bool = False) -> Any:
    """``function``, except that its ``call``-th call raises an OOM (``after``: once it has run)."""
    calls = {"count": 0}

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls["count"] += 1
        if calls["count"] != call:
            return function(*args, **kwargs)
        if after:
            function(*args, **kwargs)
        raise OUT_OF_MEMORY("injected")

    return wrapped


def cli_train(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", str(model), "--data", str(data), "--text-column", "review", "--label-column",
            "sentiment", "--max-length", "32", "--effective-batch", "8", "--micro-batch-size", "4", "--precision",
            "fp32", "--max-steps", "4", "--lr", "1e-3", "--log-every", "1", "--output-dir", str(out), *extra]


@pytest.mark.parametrize("step", [1, 3], ids=["made-state", "norm"])
def test_an_optimizer_step_oom_saves_the_run_before_it_and_resumes_exactly(
        tmp_path: Path, reviews_csv: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        step: int) -> None:
    """Step 1: the OOM comes after AdamW made the moments of the first parameter group (and counted their step),
    none of which the checkpoint holds. Step 3: the gradient norm's OOM, before the update; the state of two
    steps is saved as it was."""
    model = write_model_dir(tmp_path / "bert", TINY_BERT)
    assert run_main(cli_train(model, reviews_csv, tmp_path / "clean"), capsys)[0] == 0
    if step == 1:
        fail_fused_step(monkeypatch, call=1)
    else:
        monkeypatch.setattr(stability, "gradient_norm", failing(stability.gradient_norm, call=step))
    code, _, err = run_main(cli_train(model, reviews_csv, tmp_path / "run"), capsys)
    saved = tmp_path / "run" / "checkpoints" / f"step-{step - 1:08d}"
    assert (code, err) == (1, f"memfit: error: step {step}: out of memory in the optimizer step (injected); the run "
                              f"before that step is saved to {saved}: continue with --resume once the step fits "
                              "(--no-foreach, or free the device's memory), or start again with a leaner optimizer: "
                              "--offload-optimizer (CUDA), --optimizer adamw8bit, LoRA (--lora-rank), "
                              "--train-top-layers, or a smaller model (memfit plan)\n")
    assert run_main(cli_train(model, reviews_csv, tmp_path / "run", "--resume"), capsys)[0] == 0
    assert_params(load_weights(tmp_path / "run"), load_weights(tmp_path / "clean"), exact=True)
    losses = [[(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / name, "train")]
              for name in ("run", "clean")]
    assert losses[0] == losses[1]


def test_an_optimizer_step_oom_after_an_update_stops_without_a_checkpoint(
        tmp_path: Path, reviews_csv: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = write_model_dir(tmp_path / "bert", TINY_BERT)
    fail_fused_step(monkeypatch, call=3, after_update=True)  # step 2: its first group updated, then the OOM
    code, _, err = run_main(cli_train(model, reviews_csv, tmp_path / "run", "--save-every", "1"), capsys)
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("memfit: error: step 2: out of memory in the optimizer step (injected); no checkpoint of "
                          "the run before it can be saved (it had updated part of the model): resume from the last "
                          "--save-every one, or start again, with a leaner optimizer: --offload-optimizer")
    assert [path.name for path in (tmp_path / "run" / "checkpoints").iterdir()] == ["step-00000001"]
