"""Low-memory full fine-tuning: 16-bit weights with Kahan-summed updates and the optimizer step inside backward.

The step in backward is the ordinary step, bit for bit, where it can be (one micro-batch, no clipping); Kahan
keeps the small updates that plain bf16 rounds away; both are estimated to the byte against measured CPU runs;
what they cannot do is refused in one line each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from memfit.build import build_optimizer_for, build_with_techniques
from memfit.config import TrainConfig
from memfit.errors import ConfigError
from memfit.memory.estimate import Estimate, estimate, prepare_trace, run_steps
from memfit.models import resolve_model
from memfit.planner import Plan, load_plan, plan
from memfit.planner.allowed import Allowed
from memfit.techniques.optimizer_in_backward import InBackwardOptimizer
from memfit.techniques.precision import Precision
from tests.conftest import TINY_LLAMA, write_model_dir
from tests.helpers import NoPhases, in_process

SMALL_VOCAB = {**TINY_LLAMA, "vocab_size": 128}  # parameters, not logits, dominate the step


@pytest.fixture
def small_llama(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "llama", SMALL_VOCAB)


def _config(model: Path, **options: object) -> TrainConfig:
    values: dict[str, object] = {"model": str(model), "task": "causal-lm", "effective_batch": 4, "max_length": 32,
                                 "lr": 1e-3, "warmup_ratio": 0.0, **options}
    return TrainConfig(**values)  # type: ignore[arg-type]


def _trained(config: TrainConfig, steps: int = 3) -> dict[str, torch.Tensor]:
    """The weights after ``steps`` of the engine's own window and optimizer step on synthetic batches."""
    trace = prepare_trace(config, steps=steps)
    precision = Precision(trace.precision, "cpu")
    model = build_with_techniques(trace.spec, config, label_names=["0", "1"], pad_token_id=0, task=trace.task,
                                  low_dtype=precision.low_dtype, weights_dtype=precision.weights_dtype)
    windows = [[{name: torch.randint(0, 128, tensor.shape) if name == "input_ids" else tensor
                 for name, tensor in batch.items()} for batch in window] for window in trace.windows]
    run_steps(model, config, precision, windows, trace.window_items, device=torch.device("cpu"), phases=NoPhases())
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("options", [
    {"precision": "fp32"},
    {"precision": "bf16"},
    {"precision": "bf16-true"},
    {"precision": "bf16-true", "kahan": False},
    {"precision": "fp32", "optimizer": "adamw8bit"},
    {"precision": "fp32", "optimizer": "sgd"},
], ids=lambda options: "-".join(str(value) for value in options.values()))
def test_the_step_in_backward_equals_the_ordinary_step_bit_for_bit(small_llama: Path,
                                                                    options: dict[str, object]) -> None:
    ordinary = _config(small_llama, max_grad_norm=None, **options)
    released = dataclasses.replace(ordinary, optimizer_in_backward=True)
    before, after = _trained(ordinary), _trained(released)
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name
    initial = _trained(ordinary, steps=0)  # and the steps did change the weights
    assert all(not torch.equal(before[name], initial[name]) for name in before if "norm" not in name)


def test_kahan_keeps_the_updates_plain_bf16_rounds_away() -> None:
    """AdamW moves each weight by lr per step under a constant gradient; near 1.0 bf16 steps by 2^-8, so 1e-4 is
    rounded away every step without Kahan summation, and accumulates to 100 x 1e-4 with it (the weight plus
    its compensation)."""
    moved = {}
    for kahan in (False, True):
        model = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
        torch.nn.init.ones_(model.weight)
        config = TrainConfig(precision="bf16-true", kahan=kahan, lr=1e-4, weight_decay=0.0)
        optimizer = build_optimizer_for(model, config)
        for _ in range(100):
            model.weight.grad = torch.full_like(model.weight, 0.5)
            optimizer.step()
        weight = model.weight.detach().float()
        if kahan:  # what the last additions rounded away, held for the next one
            weight += optimizer.state[model.weight]["kahan_comp"].float()
        moved[kahan] = float(1.0 - weight.mean())
    assert moved[False] == 0.0
    assert moved[True] == pytest.approx(100 * 1e-4, rel=0.02)


@pytest.mark.parametrize("options", [
    {"precision": "bf16-true"},
    {"precision": "bf16-true", "kahan": False},
    {"precision": "bf16-true", "optimizer_in_backward": True, "max_grad_norm": None},
    {"precision": "bf16-true", "optimizer_in_backward": True, "max_grad_norm": None, "checkpointing": "full"},
    {"precision": "bf16-true", "optimizer_in_backward": True, "max_grad_norm": None, "optimizer": "adamw8bit"},
    {"precision": "fp32", "optimizer_in_backward": True, "max_grad_norm": None, "micro_batch_size": 4},
], ids=lambda options: "-".join(f"{key}={value}" for key, value in options.items()))
def test_estimates_equal_measured_cpu_steps(small_llama: Path, options: dict[str, object]) -> None:
    config = _config(small_llama, **options)
    predicted, measured = estimate(config), estimate(config, execute=True)
    assert predicted.breakdown == measured.breakdown
    assert predicted.peak_bytes == measured.peak_bytes


def test_the_breakdown_shows_what_each_technique_takes_away(tmp_path: Path) -> None:
    wide = write_model_dir(tmp_path / "wide", {**SMALL_VOCAB, "hidden_size": 256, "intermediate_size": 512})
    short = {"effective_batch": 1, "max_length": 8}  # the model's states, not its activations, set the peak
    mixed = estimate(_config(wide, precision="bf16", **short))
    true = estimate(_config(wide, precision="bf16-true", **short))
    released = estimate(_config(wide, precision="bf16-true", optimizer_in_backward=True, max_grad_norm=None,
                                **short))
    trained = true.trainable_parameters
    assert mixed.breakdown["optimizer_state"] > 8 * trained  # two fp32 moments (and step counters)
    assert true.breakdown["optimizer_state"] == 4 * trained  # two bf16 moments
    assert true.breakdown["kahan_compensation"] == 2 * trained  # one bf16 buffer
    assert true.breakdown["parameters"] < mixed.breakdown["parameters"]
    assert released.peak_bytes < true.peak_bytes
    assert released.breakdown["gradients"] < true.breakdown["gradients"]


def test_a_nonfinite_gradient_leaves_its_parameter_alone() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    optimizer = build_optimizer_for(model, TrainConfig(optimizer_in_backward=True, max_grad_norm=None, lr=0.1))
    assert isinstance(optimizer, InBackwardOptimizer)
    before = [parameter.detach().clone() for parameter in model.parameters()]
    model[1].weight.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    model(torch.ones(1, 2)).sum().backward()
    after = list(model.parameters())
    assert torch.equal(after[2], before[2])  # the NaN gradient's weight is unchanged
    assert not torch.equal(after[0], before[0])  # the others were updated
    assert all(parameter.grad is None for parameter in model.parameters())  # released
    assert optimizer.take_skipped() == [model[1].weight]


@pytest.mark.parametrize(("options", "message"), [
    ({"optimizer_in_backward": True}, "add --max-grad-norm none"),
    ({"optimizer_in_backward": True, "max_grad_norm": None, "micro_batch_size": 2},
     "cannot accumulate over 2 micro-batches; use --micro-batch-size 4"),
    ({"optimizer_in_backward": True, "max_grad_norm": None, "precision": "fp16"}, "fp16's loss scaler"),
    ({"kahan": True, "precision": "fp32"}, "use --precision bf16-true or drop --kahan"),
    ({"kahan": True, "precision": "bf16-true", "optimizer": "adamw8bit"}, "has no Kahan buffer"),
    ({"precision": "bf16-true", "distributed": "ddp", "world_size": 2}, "on several GPUs with --distributed fsdp"),
    ({"optimizer_in_backward": True, "max_grad_norm": None, "distributed": "ddp", "world_size": 2,
      "micro_batch_size": 2}, "use --distributed fsdp"),
])
def test_what_they_cannot_do_is_refused_in_one_line(options: dict[str, object], message: str) -> None:
    config = TrainConfig(effective_batch=4, **options)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=message):
        config.validate()


def test_bf16_true_is_refused_on_a_card_without_bf16_unless_forced(small_llama: Path, capsys: object) -> None:
    args = ["estimate", "--model", str(small_llama), "--seq-len", "16", "--batch-size", "1", "--device", "1080ti",
            "--precision", "bf16-true"]
    refused = in_process(args, capsys)
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and "no native bf16" in refused.stderr
    assert "--force-bf16" in refused.stderr
    assert in_process([*args, "--force-bf16"], capsys).returncode == 0


def test_bf16_true_weights_are_bf16_and_buffers_keep_their_dtype(small_llama: Path) -> None:
    config = _config(small_llama, precision="bf16-true")
    spec = resolve_model(config.model)
    model = build_with_techniques(spec, config, label_names=[], pad_token_id=0, task="causal-lm",
                                  low_dtype=torch.bfloat16, weights_dtype=torch.bfloat16)
    assert {parameter.dtype for parameter in model.parameters()} == {torch.bfloat16}
    assert any(buffer.dtype == torch.float32 for buffer in model.buffers())  # rotary frequencies


WIDE = {**SMALL_VOCAB, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2}


@pytest.fixture(scope="module")
def wide_plans(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Plan]:
    """Plans of a model whose states outweigh its activations, sharing their traces."""
    model = write_model_dir(tmp_path_factory.mktemp("plans") / "wide", WIDE)
    cache: dict[Any, Estimate] = {}

    def planned(budget: int, *, length: int = 16, batch: int = 4, precisions: tuple[str, ...] = ("fp32",),
                distributed: str = "none", **options: Any) -> Plan:
        config = TrainConfig(model=str(model), task="causal-lm", effective_batch=batch, max_length=length,
                             distributed=distributed)
        return plan(config, device="cpu", budget=budget, seq_len=length, cache=cache, margin=0.0,
                    precisions=precisions, **options)
    return planned


@pytest.mark.slow
def test_the_planner_reaches_for_the_step_in_backward_then_16_bit_weights_then_8_bit_states(
        wide_plans: Callable[..., Plan], tmp_path: Path) -> None:
    need = wide_plans(2 * 10**9).chosen.predicted_peak_bytes  # type: ignore[union-attr]
    nothing = wide_plans(int(0.85 * need))
    assert nothing.chosen is None
    assert "--allow-optimizer-in-backward would fit" in nothing.verdict  # the least change first

    released = wide_plans(int(0.85 * need), allow=Allowed(optimizer_in_backward=True, bf16_true=True))
    chosen = released.chosen
    assert chosen is not None and chosen.family.optimizer_in_backward and chosen.family.precision == "fp32"
    assert chosen.accumulation_steps == 1 and chosen.family.drops_clipping
    assert chosen.to_dict()["optimizer_in_backward"] is True and chosen.to_dict()["weights_precision"] == "fp32"
    run = released.to_config()
    assert run.optimizer_in_backward and run.max_grad_norm is None and run.resolved_accumulation_steps == 1
    released.save(tmp_path / "plan.json")  # what memfit train --plan trains: the same setup
    assert load_plan(tmp_path / "plan.json").to_config() == run
    assert estimate(run, device="cpu", seq_len=16).total_bytes == chosen.predicted_peak_bytes  # exact

    stacked_plan = wide_plans(int(0.4 * need), allow=Allowed(optimizer_in_backward=True, bf16_true=True,
                                                             eight_bit_optimizer=True))
    stacked = stacked_plan.chosen
    assert stacked is not None and stacked.family.precision == "bf16-true"
    assert stacked.family.optimizer == "adamw8bit" and not stacked.family.kahan
    assert stacked.to_dict()["weights_precision"] == "bf16"
    stacked_plan.save(tmp_path / "stacked.json")
    assert load_plan(tmp_path / "stacked.json").to_config() == stacked_plan.to_config()

    asked = wide_plans(2 * 10**9, precisions=("bf16-true",)).chosen  # asked for: no opt-in of the plan's
    assert asked is not None and asked.family.kahan and asked.reason.startswith("chosen")


def test_the_step_in_backward_is_accepted_under_fsdp_and_refused_under_ddp_by_the_planner_too() -> None:
    TrainConfig(effective_batch=4, micro_batch_size=2, optimizer_in_backward=True, max_grad_norm=None,
                distributed="fsdp", world_size=2).validate()  # each rank steps its shards


@pytest.mark.slow
def test_on_two_fsdp_ranks_the_planner_steps_each_shard_in_backward_where_nothing_else_fits(
        wide_plans: Callable[..., Plan]) -> None:
    """Two FSDP ranks, a budget under the least any accumulating setup needs: the step in backward (a window of
    one micro-batch per rank, no gradients kept) fits, is chosen, and its run's estimate is the plan's peak."""
    need = wide_plans(2 * 10**9, gpus=2, distributed="fsdp").chosen.predicted_peak_bytes  # type: ignore[union-attr]
    budget = int(0.93 * need)
    nothing = wide_plans(budget, gpus=2, distributed="fsdp")
    assert nothing.chosen is None and "--allow-optimizer-in-backward would fit" in nothing.verdict
    released = wide_plans(budget, gpus=2, distributed="fsdp", allow=Allowed(optimizer_in_backward=True))
    chosen = released.chosen
    assert chosen is not None and chosen.family.optimizer_in_backward and chosen.family.strategy == "fsdp"
    run = released.to_config()
    assert (run.distributed, run.world_size, run.per_rank_batch, run.resolved_accumulation_steps) == ("fsdp", 2, 2, 1)
    assert run.optimizer_in_backward and run.max_grad_norm is None
    assert estimate(run, device="cpu", seq_len=16).total_bytes == chosen.predicted_peak_bytes
    replicated = wide_plans(budget, gpus=2, distributed="ddp", allow=Allowed(optimizer_in_backward=True))
    assert replicated.candidates and not any(c.family.optimizer_in_backward for c in replicated.candidates)


def test_the_planner_says_which_effective_batch_the_step_in_backward_fits(wide_plans: Callable[..., Plan]) -> None:
    budget = 22_000_000
    made = wide_plans(budget, length=128, batch=8, allow=Allowed(optimizer_in_backward=True), suggest=False)
    assert made.chosen is None
    assert "full fine-tuning would fit at an effective batch of at most 2 with the optimizer step in " \
           "backward, which cannot accumulate" in made.verdict

    def need(batch: int) -> int:  # the window in one micro-batch, fully checkpointed
        config = TrainConfig(model=made.model, task="causal-lm", effective_batch=batch, max_length=128,
                             precision="fp32", checkpointing="full", optimizer_in_backward=True, max_grad_norm=None)
        return estimate(config, device="cpu", seq_len=128).total_bytes

    assert need(2) <= budget < need(4)
