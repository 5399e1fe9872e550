"""FSDP's gradients reduced in every micro-step of a window (``--reduce-every-micro-step``), so they stay
sharded between micro-steps: the estimate by hand, the cost model by hand, the plan that needs it and the
command it prints, and the one line that refuses it with DDP."""

from __future__ import annotations

import dataclasses
import json
import shlex
from typing import Any

import pytest

from memfit.cli import config_from_args, main
from memfit.commands import train_command
from memfit.config import TrainConfig
from memfit.devices import resolve_profile
from memfit.memory.estimate import estimate
from memfit.options import build_parser
from memfit.planner import plan
from memfit.planner.families import Family, with_sharded_gradients
from memfit.planner.report import plan_from_dict
from memfit.planner.speed import StepCost, step_seconds
from tests.conftest import TINY_LLAMA, write_model_dir

WIDE_LLAMA: dict[str, Any] = {**TINY_LLAMA, "vocab_size": 64, "hidden_size": 64, "intermediate_size": 256,
                              "num_hidden_layers": 4}
"""Blocks whose weights outweigh one sample's activations at 64 tokens, so their gradients matter."""
SEQ = 64


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_model_dir(tmp_path_factory.mktemp("sharded-gradients") / "wide", WIDE_LLAMA))


def fsdp(model: str, **options: Any) -> TrainConfig:
    settings: dict[str, Any] = {"effective_batch": 16, "micro_batch_size": 1, "distributed": "fsdp", **options}
    return TrainConfig(model=model, task="causal-lm", max_length=SEQ, world_size=2, **settings)


def test_reduced_in_every_micro_step_each_rank_keeps_only_its_shard_of_the_gradients(wide: str) -> None:
    every = estimate(fsdp(wide, reduce_every_micro_step=True), device="cpu", seq_len=SEQ)
    last = estimate(fsdp(wide), device="cpu", seq_len=SEQ)
    # fp32 gradients of every trained parameter, halved over 2 ranks (each dimension 0 here is even)
    assert every.breakdown["gradients"] == 4 * every.trainable_parameters // 2
    assert every.peak_bytes < last.peak_bytes  # the last-only run accumulates unsharded gradients meanwhile


def test_auto_estimates_its_replica_without_the_fsdp_option(wide: str) -> None:
    """``--distributed auto`` on a card weighs one replica (one process's run) first: the option is FSDP's."""
    config = fsdp(wide, distributed="auto", reduce_every_micro_step=True)
    assert estimate(config, device="4090", seq_len=SEQ).distributed in ("ddp", "fsdp")


def test_the_planner_searches_both_ways_of_reducing_unless_the_run_chose() -> None:
    families = [Family(precision="bf16", checkpointing="full", kernels="foreach", strategy=strategy)
                for strategy in ("ddp", "fsdp", "fsdp-offload")]
    searched = with_sharded_gradients(families, TrainConfig())
    assert searched == [*families, *(dataclasses.replace(f, reduce_every=True) for f in families[1:])]
    chosen = with_sharded_gradients(families, TrainConfig(distributed="fsdp", reduce_every_micro_step=True))
    assert chosen == [families[0], *(dataclasses.replace(f, reduce_every=True) for f in families[1:])]
    # a window of one micro-batch per rank reduces in its only backward: the twins' setup, one trace for both
    every = dataclasses.replace(families[1], reduce_every=True)
    base = TrainConfig(world_size=2)
    assert not every.configure(base, micro_batch_size=4, effective_batch=8).reduce_every_micro_step
    assert every.configure(base, micro_batch_size=2, effective_batch=8).reduce_every_micro_step
    assert every.configure(base, micro_batch_size=4, effective_batch=8) == \
        families[1].configure(base, micro_batch_size=4, effective_batch=8)


def test_reducing_every_micro_step_costs_one_reduce_scatter_per_micro_step() -> None:
    card = resolve_profile("a100-80")
    cost = StepCost(flops_per_sample=1e9, ops_per_micro_step=0, ops_per_optimizer_step=0,
                    trainable_parameters=10**6, parameters=10**6)

    def seconds(**options: Any) -> float:
        return step_seconds(cost, card, "fp32", effective_batch=8, accumulation_steps=4, strategy="fsdp",
                            world_size=2, **options)

    gradients = 4e6  # fp32; a ring reduce-scatter over 2 ranks moves half of them
    assert seconds(reduce_every=True) - seconds() == pytest.approx(3 * gradients / 2 / card.link_bandwidth)
    # HSDP, 4 ranks in groups of 2: the reduce-scatter inside a group per micro-step, the shard's all-reduce
    # across the groups once per window either way
    hsdp = [step_seconds(cost, card, "fp32", effective_batch=8, accumulation_steps=4, strategy="fsdp", world_size=4,
                         shard_group=2, reduce_every=every) for every in (False, True)]
    assert hsdp[1] - hsdp[0] == pytest.approx(3 * gradients / 2 / card.link_bandwidth)


@pytest.mark.slow
def test_the_plan_reduces_every_micro_step_where_only_that_fits(wide: str) -> None:
    """3.7 MB on 2 ranks, effective batch 16 at 64 tokens: only micro-batch 1 with full checkpointing comes near,
    and it fits only with its gradients sharded between the 8 micro-steps of a window."""
    made = plan(TrainConfig(model=wide, task="causal-lm", max_length=SEQ, effective_batch=16), device="cpu",
                seq_len=SEQ, budget="3.7MB", gpus=2, precisions=("fp32",))
    chosen = made.chosen
    assert chosen is not None and chosen.family.reduce_every and chosen.accumulation_steps == 8, made.verdict
    assert "gradients reduced every micro-step" in made.verdict
    config = made.to_config()
    assert config.reduce_every_micro_step
    assert estimate(config, device="cpu", seq_len=SEQ).total_bytes == chosen.predicted_peak_bytes
    # the same setup reducing in the last micro-step only is over the budget
    last = estimate(dataclasses.replace(config, reduce_every_micro_step=False), device="cpu", seq_len=SEQ)
    assert last.total_bytes > made.usable_bytes >= (chosen.predicted_peak_bytes or 0)
    words = shlex.split(train_command(config))
    assert "--reduce-every-micro-step" in words
    parsed = config_from_args(build_parser().parse_args(words[words.index("train"):]))
    assert parsed.to_dict() == {**config.to_dict(), "world_size": 1}  # torchrun's launch sets it
    saved = plan_from_dict(json.loads(json.dumps(made.to_dict())))
    assert saved.chosen is not None and saved.chosen.family == chosen.family


def test_reducing_every_micro_step_with_ddp_is_one_line(wide: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model", wide, "--task", "causal-lm", "--distributed", "ddp", "--world-size", "2",
                 "--reduce-every-micro-step", "--json"]) == 2
    captured = capsys.readouterr()
    assert "--reduce-every-micro-step keeps FSDP's gradients sharded" in captured.err and captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err


@pytest.mark.slow
def test_bf16_weights_on_several_cards_are_planned_sharded_on_the_cards(wide: str) -> None:
    """bf16-true on 2 GPUs: FSDP on the cards or offloaded to the host, never replicated by DDP (refused); the
    fastest keeps its shards on the cards, and the plan's estimate is the chosen setup's."""
    made = plan(TrainConfig(model=wide, task="causal-lm", max_length=SEQ, effective_batch=16, distributed="fsdp"),
                device="4090", seq_len=SEQ, gpus=2, precisions=("bf16-true",))
    assert made.chosen is not None and made.chosen.family.strategy == "fsdp", made.verdict
    assert {c.family.strategy for c in made.candidates} == {"fsdp", "fsdp-offload"}
    config = made.to_config()
    assert (config.precision, config.distributed, config.cpu_offload) == ("bf16-true", "fsdp", False)
    assert estimate(config, device="4090", seq_len=SEQ).total_bytes == made.chosen.predicted_peak_bytes
