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


def test_an_fp16_trainer_trains_under_memfits_callback(tmp_path: Path) -> None:
    """fp16 with Trainer's default ``max_grad_norm`` 1.0: the trace unscales through a GradScaler of its own, so
    neither its second window nor the run's first step finds the run's scaler already unscaled; the predicted
    peak is the card's measured one, within the tolerance of the test above."""
    transformers = pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    from memfit.integrations.transformers import KEYS, MemfitCallback

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    model = transformers.AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, 2048, (64,), generator=generator).tolist()} for _ in range(64)]

    def collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = torch.tensor([item["input_ids"] for item in items])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8,
                                          gradient_accumulation_steps=2, max_steps=3, logging_steps=1,
                                          report_to="none", save_strategy="no", disable_tqdm=True, fp16=True)
    assert args.max_grad_norm == 1.0
    callback = MemfitCallback()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                   data_collator=collate, callbacks=[callback])
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert trainer.state.global_step == 3 and all(set(KEYS) <= entry.keys() for entry in logged)
    errors = [entry["memfit/peak_error"] for entry in logged[1:]]
    assert all(abs(error) <= 0.1 for error in errors), errors
