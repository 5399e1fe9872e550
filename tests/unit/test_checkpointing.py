"""Checkpointing recomputes instead of storing: same gradients, lower activation peak."""

import pytest
import torch
from torch import nn

from memfit.memory import StorageTracker
from memfit.techniques.checkpointing import apply_checkpointing
from memfit.techniques.freezing import apply_freezing
from tests.conftest import build_tiny_bert


def batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(1000, 2000, (16, 128), generator=generator),
            "labels": torch.tensor([0, 1] * 8)}


def run(mode: str, *, freeze_embeddings: bool = False) -> tuple[dict[str, torch.Tensor], int]:
    model = build_tiny_bert(num_hidden_layers=4)
    model.train()
    apply_freezing(model, freeze_embeddings=freeze_embeddings, train_top_layers=None)
    apply_checkpointing(model, mode=mode, every=2)
    with StorageTracker() as tracker:
        tracker.track_module(model)
        inputs = batch()
        tracker.track(*inputs.values())
        start = tracker.live_bytes
        model(**inputs).loss.backward()
        activation_peak = tracker.peak_bytes - start
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}, activation_peak


@pytest.mark.parametrize("mode", ["full", "every-n"])
def test_same_gradients_and_lower_peak(mode: str) -> None:
    reference, reference_peak = run("none")
    grads, peak = run(mode)
    assert grads.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-5, atol=1e-6, msg=name)
    assert peak < reference_peak


def test_full_saves_more_than_every_n() -> None:
    _, every_peak = run("every-n")
    _, full_peak = run("full")
    assert full_peak < every_peak


def test_gradients_flow_with_frozen_embeddings() -> None:
    reference, _ = run("none", freeze_embeddings=True)
    grads, _ = run("full", freeze_embeddings=True)
    assert not any(name.startswith("bert.embeddings") for name in grads)
    lowest_layer = "bert.encoder.layer.0.attention.self.query.weight"
    assert lowest_layer in grads and grads[lowest_layer].abs().sum() > 0
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-5, atol=1e-6, msg=name)


class Stack(nn.Module):
    """A plain nn.Module with repeated blocks in a ModuleList (no transformers involved)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                                    for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def test_plain_module_list_is_wrapped() -> None:
    results = {}
    for mode in ("none", "full"):
        model = Stack()
        apply_checkpointing(model, mode=mode, every=2)
        x = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
        with StorageTracker() as tracker:
            tracker.track_module(model)
            tracker.track(x)
            start = tracker.live_bytes
            model(x).square().sum().backward()
            results[mode] = (tracker.peak_bytes - start, [p.grad.clone() for p in model.parameters()])
    assert results["full"][0] < results["none"][0]
    for plain, checkpointed in zip(results["none"][1], results["full"][1], strict=True):
        torch.testing.assert_close(checkpointed, plain)
