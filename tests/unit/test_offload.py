"""The offloaded optimizer: the same update as the optimizer it wraps, its state off the card in the
estimate, and a planner opt-in that comes before anything that changes what is learned."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from memfit.config import TrainConfig
from memfit.errors import ConfigError
from memfit.memory.estimate import Estimate, estimate
from memfit.planner import Plan, plan
from memfit.planner.allowed import Allowed
from memfit.step import optimizer_step
from memfit.techniques.offload import OffloadedOptimizer
from memfit.techniques.optim import build_optimizer, build_scheduler
from tests.conftest import write_tiny_llm
from tests.unit.test_planner import PASCAL


class _NoPhases:
    def track(self, *tensors: torch.Tensor, category: str | None = None) -> None: ...

    def track_module(self, module: torch.nn.Module) -> None: ...

    def phase(self, name: str) -> Any:
        import contextlib

        return contextlib.nullcontext()


def _train(offload: bool, steps: int, *, resume_at: int | None = None) -> list[torch.Tensor]:
    """``steps`` clipped, scheduled AdamW steps of a small MLP; ``resume_at``: save the optimizer and the
    scheduler after that step and continue with new ones loaded from the saved state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))

    def build() -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        optimizer = build_optimizer(model, name="adamw", lr=1e-2, weight_decay=0.1, momentum=0.0, foreach=None,
                                    fused=True, offload=offload)
        return optimizer, build_scheduler(optimizer, total_steps=steps, warmup_ratio=0.25)

    optimizer, scheduler = build()
    assert isinstance(optimizer, OffloadedOptimizer) == offload
    trained = [(name, p) for name, p in model.named_parameters()]
    inputs = torch.randn(steps, 4, 8)
    for step in range(steps):
        loss = model(inputs[step]).pow(2).sum() * 10
        loss.backward()
        optimizer_step(optimizer, trained, loss.detach(), scaler=None, max_grad_norm=0.5, scheduler=scheduler,
                       phases=_NoPhases())
        if step + 1 == resume_at:
            saved = optimizer.state_dict(), scheduler.state_dict()
            optimizer, scheduler = build()
            optimizer.load_state_dict(saved[0])
            scheduler.load_state_dict(saved[1])
            if offload:  # the host copies and state are made at the next step, from the loaded ones
                assert isinstance(optimizer, OffloadedOptimizer) and optimizer.host is None
    return [p.detach().clone() for p in model.parameters()]


def test_the_offloaded_step_is_the_wrapped_optimizers_update_bit_for_bit() -> None:
    """Clipping, weight decay groups and the schedule's learning rate reach the host optimizer: the weights
    equal plain fused AdamW's after every step, also across a save and a resume."""
    plain = _train(False, 6)
    assert all(torch.equal(a, b) for a, b in zip(plain, _train(True, 6), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(plain, _train(True, 6, resume_at=3), strict=True))


def test_its_state_is_host_memory_in_the_estimate(tmp_path: Path) -> None:
    """On a CUDA target the optimizer state leaves the card; the host holds a copy of each trained weight,
    its gradient and AdamW's two moments (16 bytes per fp32 parameter, plus each one's step counter)."""
    model = write_tiny_llm(tmp_path / "llm")
    config = TrainConfig(model=str(model), max_length=16, effective_batch=2, micro_batch_size=1, task="causal-lm",
                         precision="fp32")
    kept = estimate(config, device=PASCAL, seq_len=16)
    offloaded = estimate(dataclasses.replace(config, offload_optimizer=True), device=PASCAL, seq_len=16)
    assert kept.breakdown["optimizer_state"] > 0 and offloaded.breakdown["optimizer_state"] == 0
    assert offloaded.peak_bytes < kept.peak_bytes and kept.host_bytes == 0
    from transformers import AutoConfig, AutoModelForCausalLM

    tensors = len(list(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).parameters()))
    assert offloaded.host_bytes == 16 * offloaded.trainable_parameters + 4 * tensors  # fp32 step counters
    with pytest.raises(ConfigError, match="drop --offload-optimizer"):
        estimate(dataclasses.replace(config, offload_optimizer=True), device="cpu", seq_len=16)
    with pytest.raises(ConfigError, match="use one or the other"):
        TrainConfig(offload_optimizer=True, optimizer="adamw8bit").validate()


def test_the_planner_offloads_before_changing_what_is_learned(tmp_path: Path) -> None:
    """Between what full fine-tuning needs with its optimizer on the card and with it on the host, the
    planner offloads when allowed, and otherwise names the opt-in that would fit."""
    model = write_tiny_llm(tmp_path / "llm", config={"hidden_size": 128, "intermediate_size": 256})
    config = TrainConfig(model=str(model), max_length=16, effective_batch=2, task="causal-lm")
    traces: dict[Any, Estimate] = {}

    def planned(budget: int, **options: Any) -> Plan:
        return plan(config, device=PASCAL, budget=int(budget / 0.95), seq_len=16, cache=traces,
                    precisions=("fp32",), **options)

    def need(offload: bool) -> int:
        setup = dataclasses.replace(config, micro_batch_size=1, checkpointing="full", precision="fp32",
                                    offload_optimizer=offload)
        return estimate(setup, device=PASCAL, seq_len=16).total_bytes

    between = (need(True) + need(False)) // 2
    offloaded = planned(between, allow=Allowed(offload=True, eight_bit_optimizer=True, freeze=True))
    chosen = offloaded.chosen
    assert chosen is not None and chosen.family.offload_optimizer and chosen.family.optimizer == "adamw"
    assert chosen.to_dict()["offload_optimizer"] is True and "on the host" in chosen.describe()
    assert "full fine-tuning needs at least" in offloaded.verdict and "--allow-offload would fit" in offloaded.verdict
    assert offloaded.to_config().offload_optimizer
    refused = planned(between, suggest=False)  # not allowed: nothing fits
    assert refused.chosen is None and "nothing fits" in refused.verdict
