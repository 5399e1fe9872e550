"""The planner: monotonic in the budget, sane in its choices, exact where it says it is."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from memfit.config import TrainConfig
from memfit.devices import DeviceProfile
from memfit.errors import ConfigError
from memfit.memory.estimate import Estimate, estimate
from memfit.planner import Plan, load_plan, micro_batch_sizes, plan
from memfit.planner.allowed import Allowed
from memfit.report import format_bytes
from tests.conftest import write_model_dir

# Activations dominate this model's memory (small vocabulary, seq 64), so the budget decides the split.
ACTIVATION_BERT: dict[str, Any] = {
    "architectures": ["BertModel"], "model_type": "bert", "vocab_size": 256, "hidden_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 128,
    "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
}
# A Pascal-like card: fp16 runs at fp32's rate, no bf16, no tensor cores.
PASCAL = DeviceProfile(name="pascal", description="test Pascal card", memory_bytes=64 * 1024**2,
                       compute_capability=(6, 1), fp32_flops=11.3e12, fp16_flops=11.3e12, bf16_flops=0.0,
                       memory_bandwidth=484e9, tensor_cores=False)
BUDGETS = range(1_000_000, 4_000_001, 250_000)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("planner") / "activation-bert", ACTIVATION_BERT)


@pytest.fixture(scope="session")
def traces() -> dict[Any, Estimate]:
    return {}


def base(model_dir: Path, **overrides: Any) -> TrainConfig:
    return TrainConfig(**{"model": str(model_dir), "max_length": 64, "effective_batch": 8, **overrides})


def cpu_plan(model_dir: Path, traces: dict[Any, Estimate], budget: int, **options: Any) -> Plan:
    return plan(base(model_dir), device="cpu", budget=budget, seq_len=64, cache=traces, **options)


def measured(model_dir: Path, candidate: Any, device: str | DeviceProfile = "cpu") -> Estimate:
    """The chosen setup traced at its real accumulation (not the planner's two-micro-step window)."""
    config = candidate.family.configure(base(model_dir), micro_batch_size=candidate.micro_batch_size,
                                        effective_batch=8)
    return estimate(config, device=device, seq_len=64)


def test_micro_batch_sizes_cover_divisors_and_powers_of_two() -> None:
    assert micro_batch_sizes(32) == [32, 16, 8, 4, 2, 1]
    assert micro_batch_sizes(24) == [24, 12, 8, 6, 4, 3, 2, 1]
    assert micro_batch_sizes(31) == [31, 16, 8, 4, 2, 1]  # a remainder goes to a smaller last micro-step
    assert micro_batch_sizes(1) == [1]


def test_a_bigger_budget_never_gives_a_slower_plan(model_dir: Path, traces: dict[Any, Estimate]) -> None:
    speeds, setups = [], set()
    for budget in BUDGETS:
        chosen = cpu_plan(model_dir, traces, budget).chosen
        assert chosen is not None, budget
        speeds.append(chosen.predicted_samples_per_second)
        setups.add(chosen.describe())
    assert speeds == sorted(speeds)
    assert len(setups) >= 3  # the sweep crosses several choices, or it would prove nothing


def test_checkpointing_is_chosen_only_when_no_plain_setup_fits(model_dir: Path,
                                                               traces: dict[Any, Estimate]) -> None:
    kinds = set()
    for budget in BUDGETS:
        result = cpu_plan(model_dir, traces, budget)
        chosen = result.chosen
        assert chosen is not None
        kinds.add(chosen.family.checkpointing)
        if chosen.family.checkpointing == "none":
            continue
        # the same setup without checkpointing needs more than the budget allows ...
        plain = dataclasses.replace(chosen.family, checkpointing="none")
        config = plain.configure(base(model_dir), micro_batch_size=chosen.micro_batch_size, effective_batch=8)
        assert estimate(config, device="cpu", seq_len=64).total_bytes > result.usable_bytes
        # ... and every setup without it that fits (e.g. a smaller micro-batch) is predicted slower
        plain_fits = [c for c in result.candidates if c.fits and c.family.checkpointing == "none"]
        assert all(c.predicted_samples_per_second < chosen.predicted_samples_per_second for c in plain_fits)
    assert "none" in kinds and kinds - {"none"}


def test_the_chosen_peak_is_the_exact_trace_of_the_run(model_dir: Path, traces: dict[Any, Estimate]) -> None:
    for budget in (1_000_000, 1_750_000, 3_000_000):
        chosen = cpu_plan(model_dir, traces, budget).chosen
        assert chosen is not None and chosen.exact
        assert chosen.predicted_peak_bytes == measured(model_dir, chosen).total_bytes


def test_accumulation_beyond_two_micro_steps_adds_only_the_window_inputs(model_dir: Path) -> None:
    traces = [estimate(base(model_dir, micro_batch_size=2, effective_batch=window), device="cpu", seq_len=64)
              for window in (4, 8, 16)]
    inputs_per_sample = 2 * 64 * 8 + 8  # input_ids and attention_mask (int64, seq 64), one int64 label
    assert [t.peak_bytes - traces[0].peak_bytes for t in traces] == [0, 4 * inputs_per_sample,
                                                                     12 * inputs_per_sample]


def test_plain_fp32_is_chosen_where_fp16_is_no_faster(model_dir: Path, traces: dict[Any, Estimate]) -> None:
    result = plan(base(model_dir), device=PASCAL, seq_len=64, cache=traces)
    assert result.chosen is not None
    family = result.chosen.family
    assert (family.precision, family.checkpointing, result.chosen.micro_batch_size) == ("fp32", "none", 8)
    assert result.budget_bytes == PASCAL.memory_bytes
    # fp16 was not even traced: it cannot be faster here, which the table says
    fp16 = [c for c in result.candidates if c.family.precision == "fp16"]
    assert fp16 and all(c.fits is None and "cannot beat" in c.reason for c in fp16)


def test_every_exact_row_on_a_card_is_what_memfit_estimate_says(model_dir: Path) -> None:
    """A row marked exact on a CUDA profile is the trace ``memfit estimate`` makes of that setup, allocator
    reserve included: never the lean trace of the family's fit standing in for it."""
    # 4 MiB of the step's own, 20 MiB for the segment that holds the cuBLAS workspaces (2 x 8.1 + 1 MiB)
    result = plan(base(model_dir, effective_batch=16), device=PASCAL, seq_len=64, budget=26 * 1024**2)
    exact = [c for c in result.candidates if c.exact and c.accumulation_steps > 1]
    assert any(c.accumulation_steps == 2 for c in exact), "the budget must force accumulation 2"
    for candidate in exact:
        config = candidate.family.configure(base(model_dir, effective_batch=16),
                                            micro_batch_size=candidate.micro_batch_size, effective_batch=16)
        estimated = estimate(config, device=PASCAL, seq_len=64)
        # a window of two micro-steps is traced as it is; a longer one adds its other inputs to that trace
        assert estimated.peak_bytes == candidate.predicted_allocated_bytes
        if candidate.accumulation_steps == 2:
            assert estimated.total_bytes == candidate.predicted_peak_bytes


@pytest.mark.slow
def test_nothing_fits_names_the_smallest_need_and_the_opt_in(model_dir: Path, traces: dict[Any, Estimate]) -> None:
    result = cpu_plan(model_dir, traces, 600_000)
    assert result.chosen is None
    smallest = min(c.predicted_peak_bytes or 0 for c in result.candidates if c.family.accuracy_neutral and c.exact)
    assert "nothing fits" in result.verdict and "the smallest any allowed setup needs" in result.verdict
    assert "--allow-freeze (top-1) would fit" in result.verdict
    assert smallest > result.usable_bytes
    with pytest.raises(ConfigError, match="nothing fits"):
        result.to_config()
    frozen = cpu_plan(model_dir, traces, 600_000, allow=Allowed(freeze=True)).chosen
    assert frozen is not None and frozen.fits and not frozen.family.accuracy_neutral
    assert "--allow-freeze (embeddings) would fit" in result.verdict
    assert frozen.family.freeze == "embeddings"  # the least freezing that fits


def test_to_training_arguments_builds_hf_training_arguments(model_dir: Path, traces: dict[Any, Estimate],
                                                            tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    result = cpu_plan(model_dir, traces, 1_000_000)
    assert result.chosen is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        arguments = transformers.TrainingArguments(output_dir=str(tmp_path), **result.to_training_arguments())
    # the installed transformers' own names (what its first import pulls in may warn of torch's own deprecations)
    assert not [w for w in caught if "deprecated" in str(w.message) and "transformers" in w.filename]
    assert arguments.per_device_train_batch_size == result.chosen.micro_batch_size
    assert arguments.gradient_accumulation_steps == result.chosen.accumulation_steps
    assert (arguments.per_device_train_batch_size * arguments.gradient_accumulation_steps
            >= result.effective_batch)
    assert arguments.gradient_checkpointing == (result.chosen.family.checkpointing != "none")  # read: either name
    assert arguments.bf16 == (result.chosen.family.precision == "bf16") and not arguments.fp16


def test_a_saved_plan_gives_the_same_config(model_dir: Path, traces: dict[Any, Estimate], tmp_path: Path) -> None:
    result = cpu_plan(model_dir, traces, 1_250_000)
    result.save(tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    assert loaded.to_config() == result.to_config()
    assert loaded.chosen is not None and loaded.chosen.to_dict() == result.chosen.to_dict()  # type: ignore[union-attr]


def test_planning_inputs_are_checked(model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="--device cpu has no fixed memory"):
        plan(base(model_dir), device="cpu")
    with pytest.raises(ConfigError, match="--budget '11G' is not a memory size"):
        plan(base(model_dir), device="cpu", budget="11G")
    with pytest.raises(ConfigError, match="--precision fp16: not planned on host CPU"):
        plan(base(model_dir), device="cpu", budget="1GiB", precisions=("fp16",))


def test_train_device_may_name_a_gpu_profile_to_plan_for() -> None:
    import torch

    from memfit.devices import resolve_device

    TrainConfig(device="1080ti").validate()
    TrainConfig(device="a100-40gb").validate()  # an alias
    with pytest.raises(ConfigError, match="'gtx970' is not one of: auto, cpu, cuda, or a GPU profile"):
        TrainConfig(device="gtx970").validate()
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="--device 1080ti: no CUDA device"):
            resolve_device("1080ti")


PARAMETER_BERT = {**ACTIVATION_BERT, "vocab_size": 30522}  # parameters, gradients and AdamW state dominate


def test_with_two_gpus_the_plan_shards_only_when_a_replica_does_not_fit(tmp_path: Path) -> None:
    model = str(write_model_dir(tmp_path / "parameter-bert", PARAMETER_BERT))
    base = TrainConfig(model=model, max_length=32, effective_batch=8)
    roomy = plan(base, device="cpu", budget=64 * 1024**2, seq_len=32, gpus=2)
    assert roomy.chosen is not None and roomy.chosen.family.strategy == "ddp", roomy.verdict  # no gathers to pay
    replicas = [c.predicted_peak_bytes or 0 for c in roomy.candidates
                if c.family.strategy == "ddp" and c.predicted_peak_bytes is not None]
    tight = plan(base, device="cpu", budget=int((min(replicas) - 1) / 0.95), seq_len=32, gpus=2)
    assert tight.chosen is not None and tight.chosen.family.strategy == "fsdp", tight.verdict
    assert tight.chosen.exact and tight.chosen.predicted_peak_bytes is not None
    assert tight.chosen.predicted_peak_bytes <= tight.usable_bytes < min(replicas)
    assert not any(c.fits for c in tight.candidates if c.family.strategy == "ddp")
    assert tight.chosen.micro_batch_size * tight.chosen.accumulation_steps * 2 == tight.effective_batch == 8
    config = tight.to_config()
    assert (config.distributed, config.world_size, config.per_rank_batch) == ("fsdp", 2, 4)
    assert estimate(config, device="cpu", seq_len=32).total_bytes == tight.chosen.predicted_peak_bytes
    assert roomy.chosen.predicted_samples_per_second > tight.chosen.predicted_samples_per_second
    for row in [candidate.to_dict() for candidate in roomy.candidates + tight.candidates]:  # traced and pruned
        steps_per_second = row["predicted_optimizer_steps_per_second"]
        assert row["predicted_samples_per_second"] == pytest.approx(8 * steps_per_second), row  # the global batch


def test_plan_takes_the_effective_batch_of_its_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from memfit.cli import main

    model = write_model_dir(tmp_path / "bert", ACTIVATION_BERT)
    config = tmp_path / "run.toml"
    config.write_text(f'model = "{model}"\neffective_batch = 4\n')
    assert main(["plan", "--config", str(config), "--device", "cpu", "--budget", "64MiB", "--seq-len", "16",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["effective_batch"] == 4
    assert main(["plan", "--config", str(config), "--device", "cpu", "--budget", "64MiB", "--seq-len", "16",
                 "--effective-batch", "2", "--json"]) == 0  # a flag given overrides the file
    assert json.loads(capsys.readouterr().out)["effective_batch"] == 2


def _parameters(model: Path) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).parameters())


def _lora_traced(model: Path, device: str) -> int:
    """The least budget at which LoRA's least need is traced: its base in 16 bits (and the card's memory outside
    PyTorch) within the usable bytes."""
    from memfit.devices import resolve_profile

    return int((2 * _parameters(model) + resolve_profile(device).non_pytorch_bytes) / 0.95) + 2


@pytest.mark.slow
def test_lora_then_qlora_are_planned_in_order_of_fidelity_when_allowed(tmp_path: Path) -> None:
    """Weights dominate this model: full fine-tuning needs the most, LoRA less, LoRA on an NF4 base least.
    Each opt-in is taken only when the more faithful setups do not fit, and only if allowed."""
    from tests.conftest import write_tiny_llm

    model = write_tiny_llm(tmp_path / "llm", config={"hidden_size": 128, "intermediate_size": 256})
    config = TrainConfig(model=str(model), max_length=16, effective_batch=2, task="causal-lm")
    traces: dict[Any, Estimate] = {}

    def planned(budget: int, **options: Any) -> Plan:
        return plan(config, device="cpu", budget=int(budget / 0.95), seq_len=16, cache=traces, lora_rank=4,
                    precisions=("fp32",), **options)

    floor = 2 * _parameters(model) + 1  # a LoRA base in 16 bits alone is over any budget below
    below = planned(floor - 2)  # LoRA's least need is not traced: its base alone is over the budget
    assert f"--allow-lora (r=4) would not fit either: its base weights alone need at least " \
           f"{format_bytes(floor - 1)}" in below.verdict
    assert not any(c.family.technique == "lora" for c in below.candidates)
    probe = planned(floor)  # nothing fits: each technique's least need, traced exactly
    needs = {technique: min(c.predicted_peak_bytes or 0 for c in probe.candidates
                            if c.exact and c.family.technique == technique) for technique in ("full", "lora", "qlora")}
    assert needs["full"] > needs["lora"] > needs["qlora"]
    assert "--allow-lora (r=4) would not fit either: it needs at least" in probe.verdict

    between = (needs["lora"] + needs["full"]) // 2
    lora = planned(between, allow=Allowed(lora=True, qlora=True))
    assert lora.chosen is not None and lora.chosen.family.technique == "lora" and lora.chosen.fits
    assert lora.to_config().lora_rank == 4
    refused = planned(between)
    assert refused.chosen is None and "--allow-lora (r=4) would fit" in refused.verdict

    tight = (needs["qlora"] + needs["lora"]) // 2
    qlora_plan = planned(tight, allow=Allowed(lora=True, qlora=True))
    assert qlora_plan.chosen is not None and qlora_plan.chosen.family.technique == "qlora"
    assert qlora_plan.to_config().quantize_base == "nf4"
    assert "full fine-tuning needs at least" in qlora_plan.verdict
    row = qlora_plan.chosen.to_dict()
    assert (row["lora_rank"], row["quantize_base"], row["offload_optimizer"]) == (4, "nf4", False)


@pytest.mark.slow
def test_lora_and_qlora_are_planned_on_several_gpus(tmp_path: Path) -> None:
    """With --gpus 2 the adapters are planned replicated (DDP) and sharded (FSDP2) as full fine-tuning is: a
    LoRA is chosen where full fine-tuning fits on neither, its peak the per-rank estimate of the config it
    writes; an 8-bit optimizer is planned with DDP only (its step does not run on sharded parameters)."""
    from tests.conftest import write_tiny_llm

    model = write_tiny_llm(tmp_path / "llm", config={"hidden_size": 128, "intermediate_size": 256})
    config = TrainConfig(model=str(model), max_length=16, effective_batch=2, task="causal-lm")
    traces: dict[Any, Estimate] = {}

    def planned(budget: int, **options: Any) -> Plan:
        return plan(config, device="cpu", budget=int(budget / 0.95), seq_len=16, cache=traces, lora_rank=4,
                    precisions=("fp32",), gpus=2, **options)

    # nothing fits: the least need of each technique allowed
    probe = planned(1000, allow=Allowed(eight_bit_optimizer=True, lora=True, qlora=True), suggest=False)
    exact = [c for c in probe.candidates if c.exact]
    needs = {technique: min(c.predicted_peak_bytes or 0 for c in exact if c.family.technique == technique)
             for technique in ("full", "lora", "qlora")}
    assert needs["full"] > needs["lora"] > needs["qlora"]
    assert {c.family.strategy for c in exact if c.family.technique == "lora"} == {"ddp", "fsdp"}
    assert all(c.world_size == 2 for c in exact)
    eight_bit = {(c.family.technique, c.family.strategy) for c in exact if "8bit" in c.family.optimizer}
    assert eight_bit == {("full", "ddp"), ("lora", "ddp"), ("qlora", "ddp")}  # full fine-tuning's opt-in too

    made = planned((needs["lora"] + needs["full"]) // 2, allow=Allowed(lora=True))
    assert made.chosen is not None and made.chosen.family.technique == "lora" and made.chosen.world_size == 2
    run = made.to_config()
    assert (run.lora_rank, run.world_size, run.distributed) == (4, 2, made.chosen.family.strategy)
    assert estimate(run, device="cpu", seq_len=16).total_bytes == made.chosen.predicted_peak_bytes


@pytest.mark.slow
def test_the_fewest_gpus_are_those_a_budget_below_one_replicas_states_needs(tmp_path: Path) -> None:
    """Weights dominate this model: one GPU must hold every fp32 weight, gradient and AdamW state, 16 bytes per
    parameter, which by hand exceed the budget; two GPUs shard them (FSDP, which gathers two of its 8 layers at
    a time in backward). So full fine-tuning needs 2 GPUs and
    LoRA 1; LoRA is not chosen, full fine-tuning on 2 GPUs is, and its cell is the plan and the per-rank
    estimate of the config it writes."""
    from memfit.memory.depth import parameter_count
    from memfit.models import resolve_model
    from memfit.planner.gpu_count import plan_gpu_count
    from memfit.planner.request import PlanRequest
    from tests.conftest import write_tiny_llm

    model = write_tiny_llm(tmp_path / "llm", config={"hidden_size": 128, "intermediate_size": 256,
                                                               "num_hidden_layers": 8})
    parameters = parameter_count(resolve_model(str(model)), "causal-lm")
    budget = parameters * 14  # below one replica's 16 bytes per parameter (with the margin), above half of them
    request = PlanRequest(model=str(model), task="causal-lm", seq_len=16, effective_batch=2, device="cpu",
                          budget=f"{budget}B", precision="fp32", allow=Allowed(lora=True), lora_rank=4)
    traces: dict[Any, Any] = {}
    counted = plan_gpu_count(request, max_gpus=4, cache=traces)
    assert [(cell.technique, cell.gpus) for cell in counted.cells] == [
        ("full", 1), ("full", 2), ("lora", 1), ("lora", 2)]  # no count above the effective batch
    fewest = plan_gpu_count(request, max_gpus=4, cache=traces, fewest_only=True)  # each up to where it fits
    assert [(cell.technique, cell.gpus) for cell in fewest.cells] == [("full", 1), ("full", 2), ("lora", 1)]
    assert fewest.verdict() == counted.verdict()
    full, lora = counted.fewest("full"), counted.fewest("lora")
    assert full is not None and full.gpus == 2 and lora is not None and lora.gpus == 1
    one = counted.cells[0]
    assert not one.fits and one.least_bytes is not None and one.least_bytes > 16 * parameters > one.plan.usable_bytes
    assert counted.chosen is full and full.plan.chosen is not None
    assert full.plan.chosen.family.strategy == "fsdp" and full.plan.chosen.world_size == 2
    run = full.plan.to_config()
    assert estimate(run, device="cpu", seq_len=16).total_bytes == full.plan.chosen.predicted_peak_bytes
    assert counted.verdict().startswith("fewest GPUs: full fine-tuning: 2, LoRA r=4: 1; chosen: full fine-tuning on 2")
    row = counted.to_dict()
    assert row["fewest_gpus"] == {"full": 2, "lora": 1}
    assert row["chosen"]["command"].startswith("torchrun --nproc-per-node=2 -m memfit train")


def test_bitsandbytes_techniques_are_offered_only_where_its_kernels_run() -> None:
    from memfit.planner.choose import adapter_problem
    from memfit.planner.opt_ins import bitsandbytes_problem

    maxwell = dataclasses.replace(PASCAL, compute_capability=(5, 2), description="test Maxwell card")
    assert adapter_problem("qlora", PASCAL) is None and bitsandbytes_problem(PASCAL) is None  # a 1080 Ti: 6.1
    assert adapter_problem("lora", maxwell) is None  # PEFT alone runs anywhere
    problem = adapter_problem("qlora", maxwell)
    assert problem is not None and "compute capability 6.0" in problem and "5.2" in problem
    assert bitsandbytes_problem(maxwell) == problem


def test_a_causal_lm_whose_logits_do_not_fit_is_planned_with_a_chunked_loss(tmp_path: Path) -> None:
    """A large vocabulary over a long sequence: the logits and the loss's copies of them dominate, so even full
    checkpointing does not fit and the loss in chunks does; the plan says so, and its peak is what
    ``memfit estimate`` gives that setup."""
    from memfit.planner.families import LOSS_CHUNK
    from tests.conftest import write_tiny_llm

    model = write_tiny_llm(tmp_path / "llm", config={"vocab_size": 4096, "max_position_embeddings": 1024})
    config = TrainConfig(model=str(model), max_length=1024, effective_batch=2, task="causal-lm")
    traces: dict[Any, Estimate] = {}

    def planned(budget: int) -> Plan:
        return plan(config, device="cpu", budget=int(budget / 0.95), seq_len=1024, cache=traces,
                    precisions=("fp32",), suggest=False)

    probe = planned(1000)  # nothing fits: the least need is a chunked loss's
    least = min((c for c in probe.candidates if c.exact), key=lambda c: c.predicted_peak_bytes or 0)
    unchunked = estimate(dataclasses.replace(config, micro_batch_size=1, precision="fp32", checkpointing="full"),
                         device="cpu", seq_len=1024).total_bytes  # the leanest setup without chunks
    assert least.family.loss_chunk == LOSS_CHUNK and (least.predicted_peak_bytes or 0) < 0.8 * unchunked
    assert "loss in chunks of 256" in probe.verdict

    made = planned(((least.predicted_peak_bytes or 0) + unchunked) // 2)
    assert made.chosen is not None and made.chosen.family.loss_chunk == LOSS_CHUNK and made.chosen.exact
    run = made.to_config()
    assert run.loss_chunk == LOSS_CHUNK and run.checkpointing == "full"
    assert estimate(run, device="cpu", seq_len=1024).total_bytes == made.chosen.predicted_peak_bytes


@pytest.mark.slow
def test_a_lora_that_fits_only_in_16_bits_is_planned(tmp_path: Path) -> None:
    """LoRA's least need is traced at every precision: its base stored in bf16 needs less than in fp32, the
    slowest precision, so a budget between the two plans a 16-bit LoRA instead of saying it would not fit."""
    from tests.conftest import write_tiny_llm

    model = write_tiny_llm(tmp_path / "llm", config={"hidden_size": 256, "intermediate_size": 512})
    config = TrainConfig(model=str(model), max_length=16, effective_batch=2, task="causal-lm")
    traces: dict[Any, Estimate] = {}
    probe = plan(config, device="4090", budget=_lora_traced(model, "4090"), seq_len=16, cache=traces, lora_rank=4,
                 allow=Allowed(lora=True), suggest=False)  # LoRA's least need, nothing else
    needs: dict[str, int] = {}
    for candidate in probe.candidates:
        if candidate.exact and candidate.family.technique == "lora":
            precision, peak = candidate.family.precision, candidate.predicted_peak_bytes or 0
            needs[precision] = min(needs.get(precision, peak), peak)
    assert needs["bf16"] < needs["fp32"]
    between = (needs["bf16"] + needs["fp32"]) // 2
    made = plan(config, device="4090", budget=int(between / 0.95), seq_len=16, cache=traces, lora_rank=4,
                allow=Allowed(lora=True), suggest=False)
    assert made.chosen is not None and made.chosen.family.technique == "lora"
    assert made.chosen.family.precision in ("bf16", "fp16")


def test_where_the_weights_alone_do_not_fit_only_the_least_need_is_traced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's fp32 weights, gradients and AdamW state exceed the budget: the least any full fine-tuning needs
    (full checkpointing, micro-batch 1, each precision) is traced first, and as it does not fit no family is
    searched. The answer is the one the whole search gives, from fewer traces."""
    import memfit.planner.choose as choose
    from tests.conftest import write_tiny_llm

    config = TrainConfig(model=str(write_tiny_llm(tmp_path / "llm")), max_length=16, effective_batch=2,
                         task="causal-lm")
    quick = plan(config, device="cpu", budget=300_000, seq_len=16, suggest=False)
    monkeypatch.setattr(choose, "_states_exceed", lambda *args: False)
    searched = plan(config, device="cpu", budget=300_000, seq_len=16, suggest=False)
    assert quick.chosen is None and searched.chosen is None
    assert quick.verdict == searched.verdict and "the smallest any allowed setup needs" in quick.verdict
    assert quick.traces < searched.traces / 3
    assert {c.family.checkpointing for c in quick.candidates} == {"full"}


def test_an_opt_in_stage_searches_its_setups_without_a_chunked_loss_too() -> None:
    """A stage built on a least need found with the loss in chunks searches the same setups unchunked as well:
    the chunks are what the least needs, not what the fastest setup that fits must use."""
    from memfit.planner.families import CHECKPOINTING, Family
    from memfit.planner.opt_ins import _unchunked_too

    chunked = [Family(precision="fp32", checkpointing=c, kernels="fused", freeze="embeddings", loss_chunk=256)
               for c in CHECKPOINTING]
    searched = _unchunked_too(chunked, TrainConfig(task="causal-lm"), "causal-lm")
    assert [(f.checkpointing, f.loss_chunk) for f in searched] == [
        ("none", None), ("every-2", None), ("full", None), ("full", 256)]
    assert {f.freeze for f in searched} == {"embeddings"}
    own = TrainConfig(task="causal-lm", loss_chunk=128)  # the run's own chunks stay
    assert _unchunked_too(chunked, own, "causal-lm") == chunked


def test_opt_ins_whose_weights_alone_exceed_the_budget_are_not_traced(tmp_path: Path) -> None:
    """Every full fine-tuning opt-in keeps the weights the least need keeps: when those alone exceed the budget,
    the advice says so with their bytes and nothing of those opt-ins is traced."""
    from tests.conftest import write_tiny_llm

    model = write_tiny_llm(tmp_path / "llm")
    config = TrainConfig(model=str(model), max_length=16, effective_batch=2, task="causal-lm")
    traces: dict[Any, Estimate] = {}
    result = plan(config, device="cpu", budget=20_000, seq_len=16, cache=traces, precisions=("fp32",),
                  allow=Allowed(eight_bit_optimizer=True))
    least = estimate(dataclasses.replace(config, effective_batch=1), device="cpu", seq_len=16)  # the same weights
    weights = sum(least.breakdown[name] for name in ("parameters", "frozen_parameters", "quantized_weights"))
    assert result.chosen is None and 20_000 * 0.95 < weights
    assert f"--allow-8bit-optimizer would not fit either: its weights alone need {format_bytes(weights)}" \
        in result.verdict
    assert f"--allow-freeze (embeddings) would not fit either: its weights alone need {format_bytes(weights)}" \
        in result.verdict
    traced = [json.loads(key[0]) for key in traces]
    full = [c for c in traced if not c["lora_rank"]]
    assert full and not [c for c in full if "8bit" in c["optimizer"] or c["freeze_embeddings"]
                         or c["optimizer_in_backward"] or c["train_top_layers"]]
    assert [c for c in traced if c["lora_rank"]]  # the adapters store their weights otherwise: traced


@pytest.mark.slow
def test_families_that_checkpoint_less_than_a_least_need_that_does_not_fit_are_not_traced(tmp_path: Path) -> None:
    """A large vocabulary at 512 tokens: LoRA's least need fits with the loss in chunks and not without. The
    unchunked families that checkpoint less are then ruled out untraced, and rightly (traced here: over too)."""
    from tests.conftest import write_tiny_llm

    model = write_tiny_llm(tmp_path / "llm", config={"vocab_size": 4096, "max_position_embeddings": 1024})
    config = TrainConfig(model=str(model), max_length=512, effective_batch=2, task="causal-lm")
    traces: dict[Any, Estimate] = {}

    def planned(budget: int, **options: Any) -> Plan:
        return plan(config, device="cpu", budget=budget, seq_len=512, cache=traces, lora_rank=4,
                    precisions=("fp32",), **options)

    probe = planned(_lora_traced(model, "cpu"))
    needs = {c.family.loss_chunk: c.predicted_peak_bytes or 0 for c in probe.candidates
             if c.exact and c.family.technique == "lora" and c.family.checkpointing == "full"}
    full = min(c.predicted_peak_bytes or 0 for c in probe.candidates if c.exact and c.family.technique == "full")
    assert needs[256] < full < needs[None]
    budget = int((needs[256] + full) / 2 / 0.95)  # LoRA in chunks fits, full fine-tuning does not
    result = planned(budget, allow=Allowed(lora=True))
    assert result.chosen is not None and result.chosen.family.technique == "lora"
    assert result.chosen.family.loss_chunk == 256
    ruled_out = [c for c in result.candidates if c.fits is False and c.predicted_peak_bytes is None]
    assert {(c.family.checkpointing, c.family.loss_chunk) for c in ruled_out} == {("none", None), ("every-2", None)}
    assert all(c.reason == f"not traced: checkpointing full needs {format_bytes(needs[None])} at micro-batch 1"
               for c in ruled_out)
    for candidate in ruled_out:  # the rule holds: each needs more than the budget at its least micro-batch
        least = candidate.family.configure(config, micro_batch_size=1, effective_batch=2)
        assert estimate(least, device="cpu", seq_len=512).peak_bytes > result.usable_bytes


def test_a_shard_group_is_kept_by_the_sharded_families_only() -> None:
    """A plan for an HSDP run (--shard-group) also weighs replicas, which have no shard group."""
    from memfit.planner.families import Family

    base = TrainConfig(distributed="fsdp", world_size=4, shard_group=2)
    configs = {strategy: Family(precision="fp32", checkpointing="none", kernels="loop", strategy=strategy).configure(
        base, micro_batch_size=1, effective_batch=8) for strategy in ("ddp", "fsdp")}
    assert {strategy: config.shard_group for strategy, config in configs.items()} == {"ddp": None, "fsdp": 2}
    for config in configs.values():
        config.validate()



def test_a_plan_on_several_cards_offloads_only_on_a_card() -> None:
    """FSDP's CPU offload is searched on a card (within the run's own shard groups too), not on a CPU, and not
    for the machines' HSDP."""
    from memfit.devices import resolve_profile
    from memfit.planner.families import strategies

    def names(base: TrainConfig, profile: Any, per_node: int | None = None) -> list[str]:
        return [f"{strategy}/{group}" if group else strategy for strategy, group in strategies(base, profile, per_node)]

    card, cpu = resolve_profile("4090"), resolve_profile("cpu")
    assert names(TrainConfig(distributed="auto", world_size=2), card) == ["ddp", "fsdp", "fsdp-offload"]
    assert names(TrainConfig(distributed="auto", world_size=2), cpu) == ["ddp", "fsdp"]
    assert names(TrainConfig(distributed="fsdp", world_size=4, shard_group=2), card) == ["fsdp", "fsdp-offload"]
    whole = TrainConfig(distributed="fsdp", world_size=4, shard_group=4)  # one group of every rank: plain FSDP
    assert names(whole, card) == ["fsdp", "fsdp-offload"]
    # GPUs filling two machines: FSDP within each machine, replicated across them (HSDP), planned too
    assert names(TrainConfig(distributed="auto", world_size=8), card, 4) == ["ddp", "fsdp", "fsdp/4", "fsdp-offload"]
    assert names(TrainConfig(distributed="auto", world_size=4), card, 4) == ["ddp", "fsdp", "fsdp-offload"]  # one
    assert names(TrainConfig(distributed="fsdp", world_size=8, shard_group=2), card, 4) == ["fsdp", "fsdp-offload"]
    replicas = TrainConfig(distributed="fsdp", world_size=2, shard_group=1)  # groups of one: not emulated offloaded
    assert names(replicas, card) == ["fsdp"]
    with pytest.raises(ConfigError, match="--cpu-offload with --shard-group 1 is not estimated"):
        estimate(dataclasses.replace(replicas, cpu_offload=True), device=card, seq_len=16)


def test_a_family_whose_traced_least_need_does_not_fit_is_not_traced_again(tmp_path: Path) -> None:
    """A family whose micro-batch 1 was traced already (a stage's least need) and is over the budget gets no line:
    a larger micro-batch keeps more, so no split fits, and nothing more is traced. Over a budget it fits, that
    least need is its line's low point: one more trace, at its largest micro-batch with accumulation."""
    from memfit.devices import resolve_profile
    from memfit.planner.families import Family
    from memfit.planner.search import Search
    from tests.conftest import write_tiny_llm

    config = TrainConfig(model=str(write_tiny_llm(tmp_path / "llm")), max_length=16, effective_batch=8,
                         task="causal-lm")
    family = Family(precision="fp32", checkpointing="full", kernels="fused")
    cache: dict[Any, Estimate] = {}

    def search(usable: int) -> Search:
        return Search(config, resolve_profile("cpu"), usable_bytes=usable, seq_len=16, image_size=None,
                      num_labels=2, cache=cache)

    least = search(1).exact_candidate(family, 1)
    assert least.exact and least.predicted_peak_bytes is not None
    over = search(least.predicted_peak_bytes - 1)
    over.exact(family, 1)
    over.fit(family)
    assert len(cache) == 1 and list(over.candidates) == [(family, 1)]
    assert over.candidates[(family, 1)].fits is False
    fitting = search(least.predicted_peak_bytes)
    fitting.fit(family)
    assert len(cache) == 2  # the other point of its line
    line = fitting.lines[family]
    assert line.low is over.exact(family, 1) and line.high is not None and line.high.micro_batch_size == 4
    assert {micro for _, micro in fitting.candidates} == set(micro_batch_sizes(8))


def test_an_fsdp_split_without_accumulation_is_traced_where_the_accumulating_line_overstates_it(
        tmp_path: Path) -> None:
    """FSDP2 keeps unsharded gradients across a window's no-sync micro-steps; one micro-batch per window never
    holds them. A weights-heavy model on 2 GPUs whose budget fits only the split without accumulation: the plan
    traces that split rather than judge it from the line through accumulating windows, and chooses it."""
    from memfit.planner.request import PlanRequest
    from tests.conftest import write_tiny_llm

    model = write_tiny_llm(tmp_path / "llm", config={"hidden_size": 256, "intermediate_size": 1024,
                                                      "num_hidden_layers": 8})
    options = {"model": str(model), "task": "causal-lm", "max_length": 8, "precision": "fp32",
               "distributed": "fsdp", "world_size": 2}
    whole = estimate(TrainConfig(**options, effective_batch=4, micro_batch_size=2, checkpointing="none"),
                     device="cpu", seq_len=8)
    accumulating = estimate(TrainConfig(**options, effective_batch=4, micro_batch_size=1, checkpointing="full"),
                            device="cpu", seq_len=8)
    assert accumulating.total_bytes > whole.total_bytes  # the unsharded gradients outweigh a sample's activations
    request = PlanRequest(model=str(model), task="causal-lm", seq_len=8, effective_batch=4, device="cpu",
                          budget=f"{whole.total_bytes}B", margin=0.0, precision="fp32", gpus=2, distributed="fsdp")
    made = request.run()
    assert made.chosen is not None and (made.chosen.micro_batch_size, made.chosen.accumulation_steps) == (2, 1)
    assert made.chosen.exact and made.chosen.predicted_peak_bytes == whole.total_bytes


def test_a_family_checkpointing_less_than_a_least_need_near_the_budget_is_traced_at_micro_batch_1_first(
        tmp_path: Path) -> None:
    """Where the fully checkpointed least need takes half the budget or more, a family that checkpoints less is
    traced at micro-batch 1 first: over the budget there, that one trace shows no split fits (its line's two
    points are not traced). Far below the budget, its line is traced as before, at its largest micro-batches."""
    from memfit.devices import resolve_profile
    from memfit.planner.families import Family
    from memfit.planner.search import LOW_FIRST, Search
    from tests.conftest import write_tiny_llm

    config = TrainConfig(model=str(write_tiny_llm(tmp_path / "llm")), max_length=64, effective_batch=8,
                         task="causal-lm")
    leanest, plain = (Family(precision="fp32", checkpointing=c, kernels="fused") for c in ("full", "none"))
    def search(usable: int) -> Search:
        return Search(config, resolve_profile("cpu"), usable_bytes=usable, seq_len=64, image_size=None,
                      num_labels=2, cache={})

    probe = search(1 << 40)
    least, plain_least = (probe.exact_candidate(f, 1).predicted_peak_bytes or 0 for f in (leanest, plain))
    assert least < plain_least and least >= LOW_FIRST * (plain_least - 1)
    tight = search(plain_least - 1)
    tight.exact_candidate(leanest, 1)
    assert tight.low_first(plain) and tight.fit_requests(plain) == [tight.exact_request(plain, 1)]
    tight.fit(plain)
    assert len(tight.cache) == 2  # the leanest's least need and its own: no line point
    assert [micro for family, micro in tight.candidates if family == plain] == [1]
    assert tight.candidates[(plain, 1)].fits is False
    roomy = search(int(least / LOW_FIRST) + 1)
    roomy.exact_candidate(leanest, 1)
    assert not roomy.low_first(plain)
    assert roomy.fit_requests(plain) == [roomy.line_request(plain, micro) for micro in (4, 2)]
    roomy.fit(plain)
    assert (plain, 1, True, False) not in roomy.traces and roomy.lines[plain].low.micro_batch_size == 2
