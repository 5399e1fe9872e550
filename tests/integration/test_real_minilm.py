"""The real pretrained MiniLM on real Rotten Tomatoes snippets (about half a minute on 2 CPU cores)."""

from pathlib import Path

import pytest

from memfit import TrainConfig, train
from memfit.devices import cpu_has_native_bf16

pytestmark = pytest.mark.slow


def test_minilm_learns_rotten_tomatoes(tmp_path: Path) -> None:
    config = TrainConfig(train_samples=640, val_samples=200, max_length=48, effective_batch=32,
                         micro_batch_size=16, lr=1e-4, output_dir=str(tmp_path / "run"))
    summary = train(config)
    assert summary.precision == ("bf16" if cpu_has_native_bf16() else "fp32")  # auto on CPU
    assert summary.optimizer_steps == 20 and summary.accumulation_steps == 2
    assert summary.val_accuracy >= 0.65  # chance is 0.5; the full default run reaches ~0.78
    assert summary.trainable_parameters == summary.total_parameters == 22_713_986
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()
