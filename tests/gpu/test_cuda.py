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
from tests.conftest import TINY_BERT, tiny_config, write_long_text_task, write_model_dir

pytestmark = pytest.mark.gpu

QUIET = Console(quiet=True)
# Activations and parameters big enough that the allocator's fixed costs (cuBLAS workspaces) are small beside them.
SMALL_BERT: dict[str, Any] = {**TINY_BERT, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                              "intermediate_size": 1024}
TRAINING_PHASES = ("forward", "backward", "optimizer")


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """SMALL_BERT with its own small vocabulary (no packaged tokenizer needed) and 48 texts of about 32 tokens."""
    root = tmp_path_factory.mktemp("cuda")
    tiny, data = write_long_text_task(root)
    vocab = (tiny / "vocab.txt").read_text()
    model = write_model_dir(root / "small-bert", {**SMALL_BERT, "vocab_size": len(vocab.split())})
    (model / "vocab.txt").write_text(vocab)
    return model, data


def test_the_installed_torch_has_kernels_for_this_card() -> None:
    device = resolve_device("cuda")
    assert device.compute_capability is not None
    assert torch_arch_problem(device.compute_capability, device.name) is None


@pytest.mark.parametrize(("precision", "offload"), [("fp32", False), ("bf16", False), ("fp32", True)])
def test_a_cuda_run_peaks_where_the_estimate_says(task: tuple[Path, Path], tmp_path: Path, precision: str,
                                                  offload: bool) -> None:
    """Also with the optimizer offloaded to the host: its state is no longer on the card."""
    model, data = task
    config = tiny_config(model, data, tmp_path / "run", device="cuda", precision=precision, effective_batch=16,
                         micro_batch_size=16, max_steps=2, offload_optimizer=offload)
    summary = train(config, console=QUIET)
    assert summary.device.startswith(torch.cuda.get_device_name())
    measured = max(summary.peak_memory_by_phase[name] for name in TRAINING_PHASES)
    predicted = estimate(config, device=profile_for(resolve_device("cuda")), seq_len=32).peak_bytes
    # the texts fill (or nearly fill) the 32 tokens the estimate assumes; the validation grid of
    # benchmarks/validate_estimator.py measures the error per setup on bigger models
    assert 0.9 * predicted <= measured <= 1.1 * predicted, (measured, predicted)


def test_a_real_cuda_oom_splits_the_micro_batch_and_keeps_the_effective_batch(task: tuple[Path, Path],
                                                                            tmp_path: Path) -> None:
    model, data = task

    def run(name: str, micro: int, **options: Any) -> Any:
        return train(tiny_config(model, data, tmp_path / name, device="cuda", effective_batch=16,
                                 micro_batch_size=micro, max_steps=2, **options), console=QUIET)

    roomy, quarter = run("roomy", 16), run("quarter", 4)
    # the cap is on reserved memory (the allocator checks it when it asks CUDA for a segment): halfway between
    # what micro-batches of 16 and of 4 reserve, each from an empty cache, leaves a margin on both sides
    assert quarter.peak_reserved_bytes < roomy.peak_reserved_bytes, (quarter.peak_reserved_bytes,
                                                                      roomy.peak_reserved_bytes)
    budget = (roomy.peak_reserved_bytes + quarter.peak_reserved_bytes) // 2
    split = run("split", 16, emulate_budget=f"{budget}B")  # a real torch.OutOfMemoryError from the allocator
    actions = [event["action"] for event in split.oom_recoveries]
    assert actions[:2] == ["retry", "split"] and set(actions[2:]) <= {"split"}, actions
    assert split.micro_batch_size <= 8 and split.micro_batch_size * split.accumulation_steps == 16
    assert split.effective_batch_size == 16 and split.optimizer_steps == roomy.optimizer_steps == 2
