"""The estimator: a fake-tensor trace of the engine's own step, exact against a real CPU run."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from memfit import TrainConfig
from memfit.build import build_optimizer_for
from memfit.errors import ConfigError
from memfit.memory.estimate import CATEGORIES, Estimate, estimate
from tests.conftest import TINY_BERT, TINY_GPT2, TINY_VIT, build_tiny_bert, write_model_dir

ARCHITECTURES = {"bert": {**TINY_BERT, "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1},
                 "gpt2": TINY_GPT2, "vit": {**TINY_VIT, "image_size": 16}}

# Each dimension of the grid is covered at least once, on every architecture for the defaults.
GRID: list[tuple[str, dict[str, Any]]] = [
    *((arch, {"precision": "fp32"}) for arch in ARCHITECTURES),
    *((arch, {"precision": "bf16", "checkpointing": "full"}) for arch in ARCHITECTURES),
    ("bert", {"precision": "bf16", "checkpointing": "every-n", "micro_batch_size": 2}),
    ("gpt2", {"precision": "fp32", "accumulation_steps": 4, "freeze_embeddings": True}),
    ("vit", {"precision": "bf16", "train_top_layers": 1, "optimizer": "sgd"}),
    ("bert", {"precision": "fp32", "foreach": True}),
    ("bert", {"precision": "fp32", "foreach": False, "max_grad_norm": None}),
    ("gpt2", {"precision": "bf16", "fused": True, "accumulation_steps": 2}),
    ("gpt2", {"precision": "bf16", "optimizer": "sgd", "momentum": 0.0, "micro_batch_size": 3}),
]


@pytest.mark.parametrize(("arch", "overrides"), GRID, ids=[f"{a}-{'-'.join(f'{k}={v}' for k, v in o.items())}"
                                                           for a, o in GRID])
def test_cpu_estimate_equals_a_real_cpu_run(tmp_path: Path, arch: str, overrides: dict[str, Any]) -> None:
    model = write_model_dir(tmp_path / arch, ARCHITECTURES[arch])
    config = TrainConfig(model=str(model), effective_batch=8, max_length=24, **overrides)
    predicted = estimate(config, device="cpu")
    measured = estimate(config, device="cpu", execute=True)
    assert predicted.peak_bytes == measured.peak_bytes
    assert predicted.phases == measured.phases
    assert predicted.breakdown == measured.breakdown
    assert sum(predicted.breakdown.values()) == predicted.peak_bytes
    assert predicted.breakdown["parameters"] > 0


def test_steady_state_needs_the_second_step(tmp_path: Path) -> None:
    model = write_model_dir(tmp_path / "bert", TINY_BERT)
    # a loop step: its peak has every gradient and state alive (a fused step peaks in backward instead)
    config = TrainConfig(model=str(model), effective_batch=8, max_length=24, precision="fp32", foreach=False)
    one, two = estimate(config, steps=1), estimate(config, steps=2)
    assert two.phases["forward"] > one.phases["forward"]  # AdamW's state is live in step 2's forward
    # exp_avg and exp_avg_sq per parameter, plus AdamW's fp32 step counter per parameter (host-side on CUDA)
    counters = 4 * sum(1 for _ in build_tiny_bert().parameters())
    assert two.breakdown["optimizer_state"] == 2 * two.breakdown["gradients"] + counters


def test_breakdown_follows_the_techniques(tmp_path: Path) -> None:
    model = write_model_dir(tmp_path / "bert", TINY_BERT)
    base = {"model": str(model), "effective_batch": 8, "max_length": 24, "precision": "fp32", "foreach": False}
    plain = estimate(TrainConfig(**base))
    frozen = estimate(TrainConfig(**base, train_top_layers=1))
    sgd = estimate(TrainConfig(**base, optimizer="sgd"))
    assert frozen.breakdown["gradients"] < plain.breakdown["gradients"] / 4
    assert sgd.breakdown["optimizer_state"] == plain.breakdown["gradients"]  # one momentum buffer each
    assert set(plain.breakdown) == set(CATEGORIES)


def test_cuda_target_rounds_blocks_and_checks_the_budget(tmp_path: Path) -> None:
    model = write_model_dir(tmp_path / "bert", TINY_BERT)
    config = TrainConfig(model=str(model), effective_batch=8, max_length=24, precision="auto", foreach=True)
    result = estimate(config, device="1080ti")
    assert result.precision == "fp16"  # auto on a card without native bf16
    assert result.peak_bytes % 512 == 0 and result.peak_reserved_bytes >= result.peak_bytes
    assert result.fits is True and result.headroom_bytes == (result.device_memory_bytes - result.total_bytes)
    assert result.peak_phase == "optimizer"
    assert result.breakdown["optimizer_state"] == 2 * result.breakdown["gradients"]  # step counters on the host
    assert estimate(config, device="a100-80").precision == "bf16"
    fused = estimate(TrainConfig(model=str(model), effective_batch=8, max_length=24, precision="fp16"),
                     device="1080ti")
    assert fused.config["fused"] is None and fused.peak_bytes < result.peak_bytes  # no foreach temporaries
    # a fused step keeps its step counters on the card, one 512-byte block each
    assert fused.breakdown["optimizer_state"] > 2 * result.breakdown["gradients"]


def test_the_default_step_is_fused_adamw_and_the_leanest(tmp_path: Path) -> None:
    model = write_model_dir(tmp_path / "bert", TINY_BERT)
    base = {"model": str(model), "effective_batch": 8, "max_length": 24, "precision": "fp32"}
    peaks = {name: estimate(TrainConfig(**base, **options)).peak_bytes
             for name, options in (("fused", {}), ("loop", {"foreach": False}), ("foreach", {"foreach": True}))}
    assert peaks["fused"] < min(peaks["loop"], peaks["foreach"])  # its update makes no parameter-sized temporaries
    optimizer = build_optimizer_for(build_tiny_bert(), TrainConfig(**base))
    assert optimizer.defaults["fused"] is True
    distributed = TrainConfig(**base, distributed="ddp", world_size=2)
    assert not build_optimizer_for(build_tiny_bert(), distributed).defaults["fused"]  # torch's default there


def test_fused_attention_keeps_no_scores_on_cuda_targets(tmp_path: Path) -> None:
    model = write_model_dir(tmp_path / "bert", {**TINY_BERT, "attention_probs_dropout_prob": 0.1})
    config = TrainConfig(model=str(model), effective_batch=8, max_length=128, precision="fp16",
                         force_cpu_fp16=True, optimizer="sgd", momentum=0.0)
    cpu = estimate(config, device="cpu")  # math path with dropout: S x S probabilities and masks saved
    gpu = estimate(config, device="t4")  # memory-efficient kernel: log-sum-exp only
    assert gpu.phases["forward"] - gpu.breakdown["workspaces"] < cpu.phases["forward"]


def test_cuda_targets_count_the_cublas_workspaces(tmp_path: Path) -> None:
    # measured on an H200 (benchmarks/cuda_workspace_probe.py): 32 MiB per thread that runs a matmul (the
    # Python thread, the autograd engine's), 1 MiB of cuBLASLt for a biased Linear's forward
    model = write_model_dir(tmp_path / "bert", TINY_BERT)
    config = TrainConfig(model=str(model), effective_batch=8, max_length=32, precision="fp32")
    assert estimate(config, device="cpu").breakdown["workspaces"] == 0
    assert estimate(config, device="h200").breakdown["workspaces"] == 65 * 2**20
    assert estimate(config, device="1080ti").breakdown["workspaces"] == 2 * (8 * 2**20 + 128 * 2**10) + 2**20
    recomputing = estimate(dataclasses.replace(config, checkpointing="full"), device="h200")
    assert recomputing.breakdown["workspaces"] == 66 * 2**20  # the recomputed forward runs on the backward thread
    assert sum(recomputing.breakdown.values()) == recomputing.peak_bytes


def test_big_models_are_estimated_without_their_memory() -> None:
    config = TrainConfig(model="bert-large", micro_batch_size=8, effective_batch=8, max_length=512,
                         precision="fp16", checkpointing="full")
    result = estimate(config, device="1080ti")
    assert result.breakdown["parameters"] > 1.2e9  # 335M fp32 parameters, never allocated here
    assert result.fits is True


def test_bad_estimate_inputs_are_reported_together(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        estimate(TrainConfig(model="bert-base", precision="bf16"), device="1080ti", seq_len=1024)
    problems = caught.value.problems
    assert any("no native bf16" in p for p in problems)
    assert any("--seq-len 1024 exceeds bert-base's 512 positions" in p for p in problems)
    with pytest.raises(ConfigError, match="is not a known device \\(known: 1080ti, 2080ti"):
        estimate(TrainConfig(), device="gtx480")
    with pytest.raises(ConfigError, match="does not divide into 16x16 patches"):
        estimate(TrainConfig(model="vit-base"), device="cpu", image_size=100)


def test_counting_flops_leaves_the_peak_alone_and_sees_the_recompute(tiny_bert: Path) -> None:
    def traced(checkpointing: str, count_flops: bool) -> Estimate:
        config = TrainConfig(model=str(tiny_bert), max_length=32, micro_batch_size=4, effective_batch=8,
                             checkpointing=checkpointing, precision="fp32")
        return estimate(config, device="1080ti", count_flops=count_flops)

    plain, counted = traced("full", False), traced("full", True)
    assert counted.peak_bytes == plain.peak_bytes and plain.flops is None
    none = traced("none", True)
    assert none.flops is not None and counted.flops is not None
    assert none.flops < counted.flops < 2 * none.flops  # checkpointing re-runs the forward: ~1/3 more


def test_the_traced_timeline_is_the_real_runs(tmp_path: Path) -> None:
    model = write_model_dir(tmp_path / "gpt2", TINY_GPT2)
    config = TrainConfig(model=str(model), effective_batch=4, micro_batch_size=2, max_length=24)
    predicted = estimate(config, device="cpu", timeline=True)
    measured = estimate(config, device="cpu", execute=True, timeline=True)
    assert predicted.timeline is not None and measured.timeline is not None
    # real kernels make a few temporaries that fake ones do not (more events, in other places), not a higher peak
    assert predicted.timeline["peak_bytes"] == measured.timeline["peak_bytes"] == predicted.peak_bytes
    phases = [phase["name"] for phase in predicted.timeline["phases"]]
    assert phases[:3] == ["other", "forward", "backward"] and phases.count("optimizer") == 2  # two steps
    assert {phase["name"] for phase in measured.timeline["phases"]} == set(phases)
    assert estimate(config, device="cpu").timeline is None  # only when asked: a plan's traces keep none


def test_a_shortened_traces_timeline_has_the_full_traces_events_and_peak(tmp_path: Path) -> None:
    from tests.conftest import write_tiny_llm

    model = write_tiny_llm(tmp_path / "llm", config={"num_hidden_layers": 6})
    config = TrainConfig(model=str(model), effective_batch=2, micro_batch_size=1, max_length=16)
    shortened = estimate(config, device="4090", timeline=True, steps=1)
    full = estimate(config, device="4090", timeline=True, exact_trace=True, steps=1)
    assert "replayed" in shortened.trace and full.trace == "full trace"
    assert shortened.timeline is not None and full.timeline is not None
    for key in ("events", "peak_bytes"):
        assert shortened.timeline[key] == full.timeline[key]
    assert shortened.timeline["peak_bytes"] == shortened.peak_bytes == full.peak_bytes


def test_an_fsdp_rank_frees_each_blocks_gathered_weights_after_using_them(tmp_path: Path) -> None:
    """FSDP2 frees a block's gathered weights in place (``storage.resize_(0)``) after its forward and backward:
    one more block adds its shard of the frozen base and its checkpointed input, not its whole gathered weights
    (counted as never freed, every block's would stay on the card for the whole step)."""
    from tests.conftest import TINY_LLAMA

    def rank(layers: int) -> Estimate:
        model = write_model_dir(tmp_path / f"llama{layers}", {
            **TINY_LLAMA, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": layers, "vocab_size": 64})
        config = TrainConfig(model=str(model), task="causal-lm", max_length=16, world_size=2, distributed="fsdp",
                             lora_rank=4, checkpointing="full")
        return estimate(config, device="cpu", seq_len=16, exact_trace=True)

    four, eight = rank(4), rank(8)
    shard = (eight.breakdown["frozen_parameters"] - four.breakdown["frozen_parameters"]) // 4  # a block's, per rank
    assert shard < (eight.peak_bytes - four.peak_bytes) // 4 < 2 * shard  # less than the block's weights gathered
