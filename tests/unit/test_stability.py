"""Non-finite values never reach the weights or the optimizer state."""

from pathlib import Path

import pytest
import torch

import memfit.step
from memfit.engine import train
from memfit.errors import TrainingError
from memfit.techniques.stability import guarded_step
from tests.conftest import build_tiny_bert, tiny_config


def stepped_model(optimizer_name: str = "adamw") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_tiny_bert()
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer_name == "adamw"
                 else torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
    inputs = {"input_ids": torch.randint(1000, 2000, (4, 16)), "labels": torch.tensor([0, 1, 0, 1])}
    model(**inputs).loss.backward()
    optimizer.step()  # optimizer state now exists
    model(**inputs).loss.backward()  # fresh finite gradients for the guarded step
    return model, optimizer


def state_copy(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list]:
    params = [p.detach().clone() for p in model.parameters()]
    states = [{k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
              for p in model.parameters()]
    return params, states


def assert_unchanged(model: torch.nn.Module, optimizer: torch.optim.Optimizer, before: tuple) -> None:
    params, states = before
    for param, saved in zip(model.parameters(), params, strict=True):
        assert torch.equal(param, saved)
    for param, saved in zip(model.parameters(), states, strict=True):
        for key, value in saved.items():
            current = optimizer.state[param][key]
            if torch.is_tensor(value):
                assert torch.equal(current, value), key
            else:
                assert current == value, key


@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd"])
def test_nan_gradient_skips_update(optimizer_name: str) -> None:
    model, optimizer = stepped_model(optimizer_name)
    before = state_copy(model, optimizer)
    model.bert.encoder.layer[1].output.dense.weight.grad[0, 0] = float("nan")
    check = guarded_step(optimizer, list(model.named_parameters()), torch.tensor(0.7), scaler=None,
                         max_grad_norm=1.0)
    assert not check.applied and check.loss_finite and not check.grads_finite
    assert check.bad_parameters == ["bert.encoder.layer.1.output.dense.weight"]
    assert_unchanged(model, optimizer, before)


def test_nan_loss_skips_update() -> None:
    model, optimizer = stepped_model()
    before = state_copy(model, optimizer)
    check = guarded_step(optimizer, list(model.named_parameters()), torch.tensor(float("nan")), scaler=None,
                         max_grad_norm=None)
    assert not check.applied and not check.loss_finite
    assert_unchanged(model, optimizer, before)


def test_finite_step_applies_and_clips() -> None:
    model, optimizer = stepped_model("sgd")
    before = state_copy(model, optimizer)
    params = list(model.parameters())
    check = guarded_step(optimizer, list(model.named_parameters()), torch.tensor(0.7), scaler=None,
                         max_grad_norm=1e-3)
    assert check.applied and check.grad_norm > 1e-3
    clipped = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    assert clipped == pytest.approx(1e-3, rel=1e-3)
    assert not all(torch.equal(p, saved) for p, saved in zip(model.parameters(), before[0], strict=True))


def test_grad_scaler_skips_overflow_and_lowers_scale() -> None:
    model, optimizer = stepped_model()
    before = state_copy(model, optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.tensor(0.7))  # as the backward would have: the scaler is now in use
    model.classifier.weight.grad[0, 0] = float("inf")
    check = guarded_step(optimizer, list(model.named_parameters()), torch.tensor(0.7), scaler=scaler,
                         max_grad_norm=1.0)
    assert not check.grads_finite and check.loss_finite
    assert scaler.get_scale() == 512.0
    assert_unchanged(model, optimizer, before)


def test_run_stops_after_consecutive_nonfinite_steps(tiny_bert: Path, reviews_csv: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    real_loss_sum = memfit.step.loss_sum

    def poisoned(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        loss, logits = real_loss_sum(model, batch)
        return loss * float("nan"), logits

    monkeypatch.setattr(memfit.step, "loss_sum", poisoned)
    config = tiny_config(tiny_bert, reviews_csv, tmp_path / "run", max_steps=10, max_nonfinite_steps=3)
    with pytest.raises(TrainingError, match="stopped at step 3: 3 consecutive optimizer steps"):
        train(config)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert sum('"type": "skip"' in line for line in lines) == 3


def test_single_nan_step_is_skipped_and_logged(tiny_bert: Path, reviews_csv: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    real_loss_sum = memfit.step.loss_sum
    calls = {"count": 0}

    def poisoned_once(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        loss, logits = real_loss_sum(model, batch)
        calls["count"] += 1
        return (loss * float("nan") if calls["count"] == 2 else loss), logits

    monkeypatch.setattr(memfit.step, "loss_sum", poisoned_once)
    summary = train(tiny_config(tiny_bert, reviews_csv, tmp_path / "run", max_steps=3))
    assert summary.optimizer_steps == 2
    assert [skip["step"] for skip in summary.skipped_steps] == [2]
    assert summary.skipped_steps[0]["parameters"][0].startswith("bert.")


def test_fp16_on_cpu_when_forced_uses_the_scaler(tiny_bert: Path, reviews_csv: Path, tmp_path: Path) -> None:
    summary = train(tiny_config(tiny_bert, reviews_csv, tmp_path / "run", precision="fp16", force_cpu_fp16=True,
                                init_scale=2.0**40, max_steps=3))
    assert summary.precision == "fp16"
    # 2**40 overflows fp16 at once: the scaler skips and halves until the scale fits, and memfit does not stop.
    assert summary.skipped_steps and all(s["handled_by"] == "grad_scaler" for s in summary.skipped_steps)
