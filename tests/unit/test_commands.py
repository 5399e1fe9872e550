"""The ``memfit train`` command printed for a setup (``memfit serve``'s "what to run") parses back into that
setup, through the command line's own parser."""

from __future__ import annotations

import shlex

import pytest

from memfit.cli import config_from_args
from memfit.commands import train_command
from memfit.config import TrainConfig
from memfit.options import build_parser
from memfit.planner.families import Family

BASE = TrainConfig(model="llama-3.2-1b", task="causal-lm", max_length=512, effective_batch=16, lr=2e-5)
FAMILIES = {
    "plain": Family(precision="fp32", checkpointing="none", kernels="fused"),
    "every-2-foreach": Family(precision="fp16", checkpointing="every-2", kernels="foreach"),
    "chunked-loop": Family(precision="bf16", checkpointing="full", kernels="loop", loss_chunk=256),
    "lora": Family(precision="fp16", checkpointing="full", kernels="fused", lora_rank=16),
    "qlora-8bit": Family(precision="bf16", checkpointing="full", kernels="loop", lora_rank=8, quantize_base="nf4",
                         optimizer="adamw8bit"),
    "frozen": Family(precision="fp32", checkpointing="none", kernels="fused", freeze="top-4"),
    "embeddings": Family(precision="fp32", checkpointing="none", kernels="fused", freeze="embeddings"),
    "offloaded": Family(precision="fp16", checkpointing="full", kernels="loop", offload_optimizer=True),
    "low-memory": Family(precision="bf16-true", checkpointing="full", kernels="loop", kahan=True,
                         optimizer_in_backward=True, drops_clipping=True, offload_activations=True,
                         optimizer="paged-adamw8bit"),
    "fsdp-offload": Family(precision="bf16", checkpointing="full", kernels="foreach", strategy="fsdp-offload"),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_train_command_parses_back_into_the_setup(name: str) -> None:
    family = FAMILIES[name]
    base = TrainConfig(**{**BASE.to_dict(), "world_size": 4 if family.ranks else 1})
    config = family.configure(base, micro_batch_size=2, effective_batch=16)
    words = shlex.split(train_command(config))
    if family.ranks:  # launched by torchrun, which sets the world size
        assert words[:4] == ["torchrun", "--nproc-per-node=4", "-m", "memfit"]
        words = words[4:]
    else:
        assert words[0] == "memfit"
        words = words[1:]
    parsed = config_from_args(build_parser().parse_args(words))
    expected = {**config.to_dict(), "world_size": 1}  # torchrun's launch sets it (memfit.distributed)
    assert parsed.to_dict() == expected


def test_a_default_setup_needs_no_options() -> None:
    assert train_command(TrainConfig()) == "memfit train"
