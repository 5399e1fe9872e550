"""Gradient accumulation is exact: micro-batches of a window give the gradient of the whole window."""

from pathlib import Path

import pytest
import torch

from memfit.build import build_model_for, prepare
from memfit.data.batches import cut
from memfit.engine import train
from memfit.memory import StorageTracker
from memfit.step import accumulate_window, item_count
from memfit.techniques.precision import Precision
from tests.conftest import load_weights, tiny_config
from tests.helpers import NoPhases


def window_gradients(config_dir: Path, csv: Path, tmp_path: Path,
                     micro: int) -> tuple[dict[str, torch.Tensor], set[int]]:
    prepared = prepare(tiny_config(config_dir, csv, tmp_path / "unused"))
    model = build_model_for(prepared)
    encoder = prepared.encoder(prepared.train_examples)
    window = list(range(8))
    batches = [encoder(chunk) for chunk in cut(window, micro)]
    widths = {batch["input_ids"].shape[1] for batch in batches}
    with StorageTracker() as tracker:
        accumulate_window(model, batches, sum(item_count(batch) for batch in batches),
                          precision=prepared.precision, scaler=None, device=torch.device("cpu"), phases=tracker)
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}, widths


@pytest.mark.parametrize("micro", [2, 3])
def test_micro_batches_match_one_big_batch(tiny_bert: Path, reviews_csv: Path, tmp_path: Path, micro: int) -> None:
    reference, _ = window_gradients(tiny_bert, reviews_csv, tmp_path, 8)
    accumulated, widths = window_gradients(tiny_bert, reviews_csv, tmp_path, micro)
    assert len(widths) > 1, "the micro-batches must be padded to different lengths for this test to mean much"
    assert reference.keys() == accumulated.keys()
    for name in reference:
        torch.testing.assert_close(accumulated[name], reference[name], rtol=1e-6, atol=1e-6, msg=name)


def test_engine_accumulation_gives_same_weights(tiny_bert: Path, reviews_csv: Path, tmp_path: Path) -> None:
    """Through the real loop: SGD steps with micro 2 x 4 and with micro 3 (3+3+2) equal micro 8 x 1."""
    common = {"optimizer": "sgd", "momentum": 0.0, "weight_decay": 0.0, "lr": 0.5, "max_steps": 2,
              "max_grad_norm": None, "warmup_ratio": 0.0}
    runs = {}
    for micro in (8, 2, 3):
        config = tiny_config(tiny_bert, reviews_csv, tmp_path / f"m{micro}", micro_batch_size=micro, **common)
        summary = train(config)
        assert summary.accumulation_steps == {8: 1, 2: 4, 3: 3}[micro]
        runs[micro] = load_weights(tmp_path / f"m{micro}")
    initial = build_model_for(prepare(tiny_config(tiny_bert, reviews_csv, tmp_path / "x"))).state_dict()
    assert not torch.equal(runs[8]["classifier.weight"], initial["classifier.weight"])
    for micro in (2, 3):
        for name, tensor in runs[8].items():
            torch.testing.assert_close(runs[micro][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_partial_last_window_counts_only_its_samples(tiny_bert: Path, reviews_csv: Path, tmp_path: Path) -> None:
    # 96 rows, 10 % validation -> 86 training samples -> windows of 8: ten full and one of 6.
    config = tiny_config(tiny_bert, reviews_csv, tmp_path / "run", max_steps=None, epochs=1)
    summary = train(config)
    assert summary.train_samples == 86
    assert summary.optimizer_steps == 11
    assert summary.epochs_completed == 1


class TokenTagger(torch.nn.Module):
    """A token-level head: logits (B, S, C); padding positions carry the label -100."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, input_ids: torch.Tensor) -> object:
        return type("Output", (), {"logits": self.head(self.embed(input_ids))})()


def test_token_level_loss_is_normalised_by_the_window_token_count() -> None:
    """accumulate_window divides every micro-batch's summed loss by the window's token count: one batch and
    two very unequal micro-batches give the same gradient and the same window loss."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (4, 6), generator=generator)
    labels = torch.randint(0, 3, (4, 6), generator=generator)
    labels[0, 2:] = -100  # sequences of very different lengths
    labels[3, 5:] = -100
    full = {"input_ids": ids, "labels": labels}
    halves = [{"input_ids": ids[:1], "labels": labels[:1]}, {"input_ids": ids[1:], "labels": labels[1:]}]
    grads, losses = [], []
    for batches in ([full], halves):
        model = TokenTagger()
        total = sum(item_count(batch) for batch in batches)
        assert total == 24 - 4 - 1
        loss, done = accumulate_window(model, batches, total, precision=Precision("fp32", "cpu"), scaler=None,
                                       device=torch.device("cpu"), phases=NoPhases())
        assert done == len(batches)
        grads.append([p.grad.clone() for p in model.parameters()])
        losses.append(loss)
    whole_model = TokenTagger()
    mean_loss = torch.nn.functional.cross_entropy(whole_model(ids).logits.reshape(-1, 3), labels.reshape(-1))
    torch.testing.assert_close(losses[0], mean_loss.detach())  # the mean over the window's tokens
    torch.testing.assert_close(losses[1], losses[0])
    for whole, accumulated in zip(*grads, strict=True):
        torch.testing.assert_close(accumulated, whole, rtol=1e-6, atol=1e-7)
