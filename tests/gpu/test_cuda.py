"""On a CUDA card: training, the estimate against the card's own allocator, OOM recovery with a real
``torch.OutOfMemoryError``. Marked ``gpu``: skipped where there is no CUDA device (``tests/conftest.py``);
``benchmarks/gpu_check.sh`` runs them with ``pytest -m gpu``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from memfit.devices import profile_for, resolve_device, torch_arch_problem
from memfit.engine import train
from memfit.memory.estimate import estimate
from tests.conftest import TINY_BERT, tiny_config, write_model_dir, write_reviews

pytestmark = pytest.mark.gpu

QUIET = Console(quiet=True)
# Activations and parameters big enough that the allocator's fixed costs (cuBLAS workspaces) are small beside them.
SMALL_BERT: dict[str, Any] = {**TINY_BERT, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                              "intermediate_size": 1024}
TRAINING_PHASES = ("forward", "backward", "optimizer")


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cuda")
    return write_model_dir(root / "bert", SMALL_BERT), write_reviews(root / "reviews.csv", count=256)


def test_the_installed_torch_has_kernels_for_this_card() -> None:
    device = resolve_device("cuda")
    assert device.compute_capability is not None
    assert torch_arch_problem(device.compute_capability, device.name) is None


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_cuda_run_peaks_where_the_estimate_says(task: tuple[Path, Path], tmp_path: Path, precision: str) -> None:
    model, data = task
    config = tiny_config(model, data, tmp_path / "run", device="cuda", precision=precision, effective_batch=32,
                         micro_batch_size=32, max_steps=4)
    summary = train(config, console=QUIET)
    assert summary.device.startswith(torch.cuda.get_device_name())
    measured = max(summary.peak_memory_by_phase[name] for name in TRAINING_PHASES)
    predicted = estimate(config, device=profile_for(resolve_device("cuda")), seq_len=32).peak_bytes
    # texts are padded per micro-batch, to at most 32 tokens: the run can only be at or below the estimate's
    # full-length batch, and not far below it with these reviews
    assert 0.7 * predicted <= measured <= 1.02 * predicted, (measured, predicted)


def test_a_real_cuda_oom_splits_the_micro_batch_and_keeps_the_effective_batch(task: tuple[Path, Path],
                                                                            tmp_path: Path) -> None:
    model, data = task
    roomy = train(tiny_config(model, data, tmp_path / "roomy", device="cuda", effective_batch=64,
                              micro_batch_size=64, max_steps=3), console=QUIET)
    half = train(tiny_config(model, data, tmp_path / "half", device="cuda", effective_batch=64,
                             micro_batch_size=32, max_steps=3), console=QUIET)
    budget = (roomy.peak_memory_bytes + half.peak_memory_bytes) // 2
    split = train(tiny_config(model, data, tmp_path / "split", device="cuda", effective_batch=64,
                              micro_batch_size=64, max_steps=3, emulate_budget=f"{budget}B"), console=QUIET)
    assert [event["action"] for event in split.oom_recoveries] == ["retry", "split"]
    assert (split.micro_batch_size, split.accumulation_steps, split.effective_batch_size) == (32, 2, 64)
    assert split.optimizer_steps == roomy.optimizer_steps == 3
