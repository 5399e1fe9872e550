"""Activation offload: which saved tensors move (not parameters, not small ones, each once), gradients bit for
bit the same, and the host bytes of the estimate equal to the bytes the hooks really copied.

The CLI refuses ``--offload-activations`` on a CPU device; these tests call the technique directly, or lift
the refusal, to check it on this machine's CPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch import nn

from memfit.config import TrainConfig
from memfit.engine import train
from memfit.memory.estimate import estimate
from memfit.memory.tracker import StorageTracker
from memfit.techniques.checkpointing import apply_checkpointing
from memfit.techniques.offload_activations import MIN_OFFLOAD_BYTES, ActivationOffload
from tests.conftest import TINY_BERT, TINY_LLAMA, load_weights, tiny_config, write_tiny_llm


class TwoHeads(nn.Module):
    """``x`` feeds two Linear layers (saved twice), then a GELU (its input and the sum saved)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.left, self.right = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.left(x) + self.right(x))


def _host_bytes_after_forward(model: nn.Module, x: torch.Tensor, offload: ActivationOffload) -> int:
    with StorageTracker() as tracker:
        offload.host_context = tracker.elsewhere
        with offload:
            y = model(x)
        host = tracker.host_bytes
        y.sum().backward()
        assert tracker.host_bytes == 0 and offload.live_bytes == 0  # freed with the graph
    return host


def test_parameters_stay_small_tensors_stay_and_a_tensor_saved_twice_is_copied_once() -> None:
    """The input is saved by both Linears (with their transposed weights, which stay); the GELU saves its
    input: two (8, 64) fp32 copies. The weights (16 KiB each) would dwarf that if they were copied."""
    torch.manual_seed(0)
    model = TwoHeads(64)
    x = torch.randn(8, 64)  # 2 KiB
    offload = ActivationOffload()
    assert _host_bytes_after_forward(model, x, offload) == 2 * x.nbytes == offload.peak_bytes
    small = torch.randn(2, 64)  # 512 bytes each: under the threshold, nothing moves
    assert small.nbytes < MIN_OFFLOAD_BYTES
    assert _host_bytes_after_forward(model, small, ActivationOffload()) == 0


def _hf_model(config: dict[str, Any], checkpointing: str) -> nn.Module:
    torch.manual_seed(0)
    hf_config = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    model = (transformers.AutoModelForCausalLM if config["model_type"] == "llama" else transformers.AutoModel
             ).from_config(hf_config)
    apply_checkpointing(model, mode=checkpointing, every=2)
    model.train()
    return model


def _gradients(model: nn.Module, context: Any, dtype: torch.dtype) -> list[torch.Tensor]:
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32), context:
        out = model(input_ids=ids)
        loss = (out.logits if hasattr(out, "logits") else out.last_hidden_state).float().pow(2).mean()
    loss.backward()
    return [p.grad for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("checkpointing", ["none", "full"])
@pytest.mark.parametrize(("config", "dtype"), [(TINY_LLAMA, torch.bfloat16), (TINY_BERT, torch.float32)],
                         ids=["llama-bf16", "bert-fp32"])
def test_gradients_are_bit_identical_and_the_host_holds_what_the_hooks_saved(
        config: dict[str, Any], dtype: torch.dtype, checkpointing: str) -> None:
    """Bit for bit the gradients without offloading, with and without checkpointing; the host copies are,
    to the byte, the distinct saved tensors of at least 1 KiB that are not parameters (recorded by plain
    saved-tensor hooks in the same forward)."""
    import contextlib

    plain = _gradients(_hf_model(config, checkpointing), contextlib.nullcontext(), dtype)
    saved: dict[tuple[Any, ...], int] = {}

    def record(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if not isinstance(base, nn.Parameter) and tensor.nbytes >= MIN_OFFLOAD_BYTES:
            key = (tensor.untyped_storage()._cdata, tensor.storage_offset(), tensor.shape, tensor.stride(),
                   tensor.dtype, tensor._version)
            saved[key] = tensor.nbytes
        return tensor

    _gradients(_hf_model(config, checkpointing), torch.autograd.graph.saved_tensors_hooks(record, lambda t: t),
               dtype)
    offload = ActivationOffload()
    with StorageTracker() as tracker:
        offload.host_context = tracker.elsewhere
        offloaded = _gradients(_hf_model(config, checkpointing), offload, dtype)
    assert len(plain) == len(offloaded) and all(torch.equal(a, b) for a, b in zip(plain, offloaded, strict=True))
    assert offload.peak_bytes == tracker.host_peak_bytes == sum(saved.values()) > 0
    assert offload.live_bytes == 0


@pytest.fixture
def lift_cpu_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a CPU run offload (the CLI refuses it there: nothing to gain), to measure it on this machine; the
    estimate and the engine both check the device through :func:`memfit.build.device_problems`."""
    import memfit.build

    monkeypatch.setattr(memfit.build, "activation_offload_problems", lambda enabled, kind: [])


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_the_estimate_is_the_measured_step_host_bytes_included(tmp_path: Path, lift_cpu_refusal: None,
                                                               checkpointing: str) -> None:
    """A fake trace and a real CPU run of the same steps with activations offloaded: the same peak, breakdown
    and host bytes, to the byte; the saved activations leave the device's breakdown for the host's."""
    model = write_tiny_llm(tmp_path / "llm")
    config = TrainConfig(model=str(model), max_length=32, effective_batch=2, micro_batch_size=1, task="causal-lm",
                         precision="fp32", checkpointing=checkpointing, offload_activations=True)
    predicted = estimate(config, seq_len=32)
    measured = estimate(config, seq_len=32, execute=True)
    assert (predicted.peak_bytes, predicted.breakdown) == (measured.peak_bytes, measured.breakdown)
    assert predicted.host_bytes == measured.host_bytes == predicted.host_breakdown["offloaded_activations"] > 0
    kept = estimate(dataclasses.replace(config, offload_activations=False), seq_len=32)
    assert kept.host_bytes == 0 and not any(kept.host_breakdown.values())
    assert predicted.breakdown["activations"] < kept.breakdown["activations"]


def test_the_engine_trains_the_same_weights_and_reports_the_host_bytes(tiny_bert: Path, reviews_csv: Path,
                                                                       tmp_path: Path,
                                                                       lift_cpu_refusal: None) -> None:
    """Through the real loop (on CPU, refusal lifted): the same weights bit for bit, and the summary reports
    the offloaded activations' host memory apart from the device's peak. (On CPU the monitor counts the host
    copies as live tensors too: the device side is checked by the estimate above.)"""
    plain = train(tiny_config(tiny_bert, reviews_csv, tmp_path / "plain", max_steps=2))
    offloaded = train(tiny_config(tiny_bert, reviews_csv, tmp_path / "offloaded", max_steps=2,
                                  offload_activations=True))
    assert plain.offloaded_activations_peak_bytes is None
    assert offloaded.offloaded_activations_peak_bytes is not None and offloaded.offloaded_activations_peak_bytes > 0
    ours, reference = load_weights(tmp_path / "offloaded"), load_weights(tmp_path / "plain")
    assert all(torch.equal(ours[name], reference[name]) for name in reference)
