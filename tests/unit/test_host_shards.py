"""FSDP2's CPU offload in a per-rank estimate: the shards, their gradients and the optimizer on the host, the card
keeping only what a layer's all-gather and reduce-scatter need while they run."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from memfit import TrainConfig
from memfit.memory.estimate import estimate
from tests.conftest import TINY_LLAMA, write_model_dir

RANKS = 2


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("offload") / "llama", {**TINY_LLAMA, "vocab_size": 64})


def padded_shard_bytes(model: Path) -> int:
    """One rank's fp32 shards as FSDP2 pads them: each parameter's first dimension split over the ranks, rounded
    up (counted from the model's shapes, not from the trace)."""
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    return sum(math.ceil(p.shape[0] / RANKS) * (p.numel() // p.shape[0]) * 4 for p in built.parameters())


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_shards_gradients_and_optimizer_live_on_the_host(llama: Path, precision: str) -> None:
    config = TrainConfig(model=str(llama), task="causal-lm", max_length=16, world_size=RANKS, distributed="fsdp",
                         precision=precision)
    plain = estimate(config, device="4090", seq_len=16)
    offloaded = estimate(dataclasses.replace(config, cpu_offload=True), device="4090", seq_len=16)
    assert plain.breakdown["parameters"] > 0 and plain.breakdown["optimizer_state"] > 0
    assert offloaded.breakdown["parameters"] == offloaded.breakdown["optimizer_state"] == 0
    assert offloaded.breakdown["gradients"] == 0
    host = offloaded.host_breakdown
    shards = padded_shard_bytes(llama)
    assert host["offloaded_parameters"] == host["offloaded_gradients"] == shards
    assert host["offloaded_optimizer"] >= 2 * shards  # AdamW's two states, beside the step's temporaries
    assert offloaded.host_bytes == sum(host.values())
    assert offloaded.peak_bytes < plain.peak_bytes
    # the optimizer's ops run on the host, and cost their launches as the card's do
    assert offloaded.phase_ops["optimizer"] == plain.phase_ops["optimizer"] > 0


def test_the_shards_are_made_on_the_host_never_all_on_the_card(tmp_path: Path) -> None:
    """FSDP2 with CPU offload makes each shard on the host: the card's peak is a phase's, and no moment before the
    step holds the rank's shards of the whole model (eight blocks, a step that gathers two); the host holds the
    shards, nothing of the model they were made from."""
    model = write_model_dir(tmp_path / "llama", {**TINY_LLAMA, "hidden_size": 256, "intermediate_size": 1024,
                                                 "num_hidden_layers": 8, "vocab_size": 64})
    config = TrainConfig(model=str(model), task="causal-lm", max_length=8, effective_batch=2, micro_batch_size=1,
                         world_size=2, distributed="fsdp", cpu_offload=True, checkpointing="full")
    result = estimate(config, device="1080ti", seq_len=8)
    assert result.peak_bytes == max(result.phases.values())
    assert result.host_breakdown["offloaded_parameters"] == padded_shard_bytes(model)


def test_bf16_weights_offloaded_keep_their_shards_gradients_and_kahan_state_in_bf16_on_the_host(llama: Path) -> None:
    """bf16-true with CPU offload: the host holds bf16 shards and gradient shards (half of fp32's), AdamW's two
    states and the Kahan buffer in bf16; the card holds no state, and each layer's gradients, reduced in fp32,
    are cast to bf16 on the card before they move (both live there at the cast)."""
    config = TrainConfig(model=str(llama), task="causal-lm", max_length=16, world_size=RANKS, distributed="fsdp",
                         precision="bf16-true", cpu_offload=True)
    result = estimate(config, device="4090", seq_len=16)
    host, shards = result.host_breakdown, padded_shard_bytes(llama) // 2
    assert result.breakdown["parameters"] == result.breakdown["optimizer_state"] == result.breakdown["gradients"] == 0
    assert host["offloaded_parameters"] == host["offloaded_gradients"] == shards
    assert host["offloaded_optimizer"] >= 3 * shards  # two moments and the compensation, beside temporaries
    fp32 = estimate(dataclasses.replace(config, precision="bf16"), device="4090", seq_len=16).host_breakdown
    assert host["offloaded_optimizer"] < fp32["offloaded_optimizer"]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_hsdp_keeps_every_all_reduced_output_on_the_card_until_the_backward_ends(tmp_path: Path,
                                                                                optimizer: str) -> None:
    """HSDP (4 ranks, groups of 2) with CPU offload: each layer's reduced gradients are all-reduced across the
    groups and move to the host, while FSDP2 keeps the all-reduced output on the card until the backward ends:
    the backward's peak is over plain FSDP's over 2 ranks (the same shards), and the optimizer's step is the same
    on both, on the host (SGD's momentum as AdamW's states). One micro-step per rank: no unsharded gradients
    accumulate on the card across micro-steps."""
    model = write_model_dir(tmp_path / "llama", {**TINY_LLAMA, "hidden_size": 256, "intermediate_size": 1024,
                                                 "num_hidden_layers": 8, "vocab_size": 64})
    config = TrainConfig(model=str(model), task="causal-lm", max_length=8, effective_batch=2, micro_batch_size=1,
                         world_size=2, distributed="fsdp", cpu_offload=True, precision="fp32", optimizer=optimizer)
    hsdp = dataclasses.replace(config, world_size=4, shard_group=2, effective_batch=4)
    plain, hybrid = estimate(config, device="4090", seq_len=8), estimate(hsdp, device="4090", seq_len=8)
    shards = padded_shard_bytes(model)
    assert hybrid.host_breakdown["offloaded_parameters"] == hybrid.host_breakdown["offloaded_gradients"] == shards
    assert hybrid.host_breakdown == plain.host_breakdown
    assert hybrid.phases["optimizer"] == plain.phases["optimizer"]
    assert hybrid.phases["backward"] > plain.phases["backward"]
    exact = estimate(hsdp, device="4090", seq_len=8, exact_trace=True)
    assert (exact.peak_bytes, exact.phases, exact.host_breakdown) == (hybrid.peak_bytes, hybrid.phases,
                                                                     hybrid.host_breakdown)
