"""Plans whose GPUs fill several machines (``--gpus-per-node``) and whose offloaded bytes must fit each
machine's host memory (``--host-memory``): the cost model by hand, the launch command, the search."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from memfit.cli import config_from_args, main
from memfit.commands import launch_line, train_command
from memfit.config import TrainConfig
from memfit.devices import resolve_profile
from memfit.errors import ConfigError
from memfit.memory.estimate import estimate
from memfit.options import build_parser
from memfit.planner import plan
from memfit.planner.speed import EFFICIENCY, StepCost, step_seconds
from memfit.report import format_bytes
from tests.conftest import write_model_dir

PARAMETER_BERT: dict[str, Any] = {
    "architectures": ["BertModel"], "model_type": "bert", "vocab_size": 30522, "hidden_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 128,
    "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
}  # parameters, gradients and AdamW state dominate
COST = StepCost(flops_per_sample=1e9, ops_per_micro_step=0, ops_per_optimizer_step=0, trainable_parameters=10**6,
                parameters=10**6)


def _compute_and_update(profile: Any, world: int) -> float:
    """A step's time without its communication: FLOPs of 8 samples, and the AdamW update of the rank's share."""
    return 8 * 1e9 / (profile.fp32_flops * EFFICIENCY) + 10**6 * 32 / profile.memory_bandwidth / world


def test_traffic_that_crosses_machines_runs_at_the_network_bandwidth() -> None:
    card = dataclasses.replace(resolve_profile("a100-80"), link_bandwidth=100e9, node_bandwidth=10e9)
    gradients, gathered = 4e6, 2 * 4e6  # fp32 gradients; one window's gathers in forward and backward

    def seconds(strategy: str, **machines: Any) -> float:
        return step_seconds(COST, card, "fp32", effective_batch=8, accumulation_steps=1, strategy=strategy,
                            world_size=8, **machines)

    one_machine = _compute_and_update(card, 1) + 2 * 7 / 8 * gradients / 100e9
    assert seconds("ddp") == pytest.approx(one_machine)
    assert seconds("ddp", per_node=4) == pytest.approx(one_machine - 2 * 7 / 8 * gradients * (1 / 100e9 - 1 / 10e9))
    flat = _compute_and_update(card, 8) + 7 / 8 * (gathered + gradients) / 10e9  # every gather crosses
    assert seconds("fsdp", per_node=4) == pytest.approx(flat)
    # HSDP: gathers and reduce-scatters inside a machine, each rank's gradient shard all-reduced across the two
    # machines, whose network the machine's four ranks share
    hybrid = _compute_and_update(card, 4) + 3 / 4 * (gathered + gradients) / 100e9 \
        + 2 * 1 / 2 * (gradients / 4) / (10e9 / 4)
    assert seconds("fsdp", per_node=4, shard_group=4) == pytest.approx(hybrid)
    assert seconds("fsdp", per_node=4, shard_group=4) < seconds("fsdp", per_node=4)


def test_a_launch_over_several_machines_is_one_command_run_on_each() -> None:
    assert launch_line(8, 4) == ('torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d '
                                 '"--rdzv-endpoint=${MASTER_ADDR}:29500" --rdzv-id=memfit -m memfit')
    assert launch_line(4, 4) == launch_line(4) == "torchrun --nproc-per-node=4 -m memfit"  # one machine
    assert launch_line(1, 4) == "memfit"
    config = TrainConfig(model="bert-base", distributed="fsdp", world_size=8, shard_group=4, effective_batch=16)
    words = shlex.split(train_command(config, 4))
    assert words[:7] == ["torchrun", "--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d",
                         "--rdzv-endpoint=${MASTER_ADDR}:29500", "--rdzv-id=memfit", "-m"]  # the shell expands it
    parsed = config_from_args(build_parser().parse_args(words[words.index("train"):]))
    assert parsed.to_dict() == {**config.to_dict(), "world_size": 1}  # torchrun's launch sets it


@pytest.mark.slow
def test_across_a_slow_network_the_plan_shards_within_each_machine(tmp_path: Path) -> None:
    """Four ranks on two machines whose network is a thousand times slower than the link inside each: DDP
    all-reduces every gradient across it, FSDP gathers every weight across it; HSDP sends only each rank's
    gradient shard, so it is chosen. On one machine, with nothing to gather, DDP is."""
    model = str(write_model_dir(tmp_path / "parameter-bert", PARAMETER_BERT))
    slow = dataclasses.replace(resolve_profile("cpu"), node_bandwidth=resolve_profile("cpu").link_bandwidth / 1000)
    base = TrainConfig(model=model, max_length=32, effective_batch=4)
    traces: dict[Any, Any] = {}
    one = plan(base, device=slow, budget="64MiB", seq_len=32, gpus=4, precisions=("fp32",), cache=traces)
    assert one.chosen is not None and one.chosen.family.strategy == "ddp", one.verdict
    two = plan(base, device=slow, budget="64MiB", seq_len=32, gpus=4, precisions=("fp32",), cache=traces,
               gpus_per_node=2)
    assert two.chosen is not None and two.chosen.family.shard_group == 2, two.verdict
    assert two.chosen.describe().startswith("hsdp (groups of 2), micro-batch 1 x 1 per rank")
    config = two.to_config()
    assert (config.distributed, config.world_size, config.shard_group) == ("fsdp", 4, 2)
    assert estimate(config, device=slow, seq_len=32).total_bytes == two.chosen.predicted_peak_bytes
    assert plan_from_json(two).gpus_per_node == 2
    ddp = next(c for c in two.candidates if c.family.strategy == "ddp" and c.exact)
    assert ddp.fits and ddp.predicted_samples_per_second < two.chosen.predicted_samples_per_second


def plan_from_json(made: Any) -> Any:
    from memfit.planner.report import plan_from_dict

    return plan_from_dict(json.loads(json.dumps(made.to_dict())))


@pytest.mark.slow
def test_what_the_ranks_of_a_machine_offload_must_fit_its_host_memory(tmp_path: Path) -> None:
    """FSDP with CPU offload on two cards: each rank keeps its shards and optimizer state on the host, so one
    machine holding both ranks needs twice one rank's host bytes during the step, and before it rank 0 builds
    the whole fp32 model (it reads for both: the other rank receives its host shards): the larger of the two
    must fit. Two machines of one GPU need one rank's."""
    model = str(write_model_dir(tmp_path / "parameter-bert", PARAMETER_BERT))
    base = TrainConfig(model=model, max_length=32, effective_batch=2, distributed="fsdp", cpu_offload=True)
    traces: dict[Any, Any] = {}

    def planned(**options: Any) -> Any:
        return plan(base, device="a100-80", budget="2GiB", seq_len=32, gpus=2, precisions=("fp32",),
                    cache=traces, **options)

    unchecked = planned()
    chosen = unchecked.chosen
    assert chosen is not None and chosen.family.strategy == "fsdp-offload" and chosen.exact
    per_rank = chosen.predicted_host_bytes
    assert per_rank == estimate(unchecked.to_config(), device="a100-80", seq_len=32).host_bytes > 0
    assert f"and {format_bytes(2 * per_rank)} host memory per machine" in unchecked.verdict  # unchecked: the step's
    loading = 4 * chosen.parameters  # one rank's fp32 build
    assert estimate(unchecked.to_config(), device="a100-80", seq_len=32).load_host_bytes == loading
    need = max(2 * per_rank, loading)
    exactly = planned(host_memory=need)
    assert exactly.chosen is not None and exactly.chosen.family == chosen.family
    assert f"{format_bytes(need)} of {format_bytes(need)} host memory" in exactly.verdict
    short = planned(host_memory=need - 1)
    assert short.chosen is None, short.verdict
    assert short.verdict.startswith(f"nothing fits {format_bytes(need - 1)} of host memory per machine: "
                                    f"the setup that needs least on the card ({chosen.describe()}, "
                                    f"{format_bytes(chosen.predicted_peak_bytes or 0)}) keeps "
                                    f"{format_bytes(need)} there"), short.verdict
    held = [c for c in short.candidates if c.exact and c.family.opt_in is None and c.predicted_peak_bytes is not None
            and c.predicted_peak_bytes <= short.usable_bytes]  # the card holds them, the host does not
    reasons = [c.reason for c in held]
    assert held and reasons == [f"host: needs {format_bytes(max(2 * c.predicted_host_bytes, 2 * loading))} per "
                                f"machine, over {format_bytes(need - 1)}" for c in held], reasons
    apart = planned(host_memory=max(per_rank, loading), gpus_per_node=1)  # one rank per machine
    assert apart.chosen is not None and apart.chosen.family == chosen.family


def test_machines_and_host_memory_that_cannot_be_planned_are_one_line_each(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = str(write_model_dir(tmp_path / "parameter-bert", PARAMETER_BERT))
    common = ["plan", "--model", model, "--device", "cpu", "--budget", "64MiB", "--seq-len", "16",
              "--effective-batch", "8"]
    cases = {("--gpus", "6", "--gpus-per-node", "4"): "--gpus 6 does not fill machines of --gpus-per-node 4: give "
                                                       "a multiple of 4 (e.g. --gpus 8)",
             ("--gpus", "2", "--gpus-per-node", "0"): "--gpus-per-node must be >= 1 (got 0)",
             ("--gpus", "2", "--host-memory", "lots"): "--host-memory 'lots' is not a memory size",
             ("--max-gpus", "4", "--gpus-per-node", "0"): "--gpus-per-node must be >= 1 (got 0)",
             ("--device", "NO_BANDWIDTH"): "device nobandwidth has no memory_bandwidth"}
    bare = tmp_path / "bare.toml"
    bare.write_text('name = "nobandwidth"\nmemory_bytes = 1073741824\nfp32_flops = 1e12\nbf16_flops = 1e12\n')
    for options, message in cases.items():
        assert main([*common, *(str(bare) if word == "NO_BANDWIDTH" else word for word in options)]) == 2
        captured = capsys.readouterr()
        assert message in captured.err and captured.out == "" and "Traceback" not in captured.err
        assert len(captured.err.strip().splitlines()) == 1, captured.err
    with pytest.raises(ConfigError, match="--gpus 6 does not fill machines"):
        plan(TrainConfig(model=model, effective_batch=8), device="cpu", budget="64MiB", gpus=6, gpus_per_node=4)


@pytest.mark.slow
def test_the_saved_plan_of_several_machines_says_the_launch_of_each(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A profile file's ``node_bandwidth`` is read, and the plan saved for two machines of two GPUs prints the
    torchrun command to run on each, whose world size ``memfit train --plan`` then expects."""
    from memfit.planner import load_plan

    model = str(write_model_dir(tmp_path / "parameter-bert", PARAMETER_BERT))
    cpu = resolve_profile("cpu")
    profile = tmp_path / "slow.toml"
    profile.write_text(f'name = "slow"\nmemory_bytes = 0\nfp32_flops = {cpu.fp32_flops}\n'
                       f"bf16_flops = {cpu.bf16_flops}\nmemory_bandwidth = {cpu.memory_bandwidth}\n"
                       f"link_bandwidth = {cpu.link_bandwidth}\nnode_bandwidth = {cpu.link_bandwidth / 1000}\n")
    assert resolve_profile(str(profile)).node_bandwidth == cpu.link_bandwidth / 1000
    saved = tmp_path / "plan.json"
    assert main(["plan", "--model", model, "--device", str(profile), "--budget", "64MiB", "--seq-len", "32",
                 "--effective-batch", "4", "--precision", "fp32", "--gpus", "4", "--gpus-per-node", "2",
                 "--save", str(saved)]) == 0
    out = capsys.readouterr().out
    assert ('train with: torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d '
            f'"--rdzv-endpoint=${{MASTER_ADDR}}:29500" --rdzv-id=memfit -m memfit train --plan {saved}') in out
    made = load_plan(saved)
    assert made.gpus_per_node == 2 and made.chosen is not None and made.chosen.family.shard_group == 2


def test_the_host_memory_of_loading_counts_each_build_on_the_machine(tmp_path: Path) -> None:
    """A checkpoint saved in bf16: full fine-tuning builds it in fp32, a LoRA base under mixed precision stays as
    saved; under FSDP rank 0 alone builds it, with DDP or a 4-bit base every rank does."""
    import torch
    import transformers

    from memfit.models import resolve_model
    from memfit.rank0_load import load_host_bytes
    from tests.conftest import write_tiny_llm

    model = write_tiny_llm(tmp_path / "llm")
    saved = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model))
    saved.to(torch.bfloat16).save_pretrained(model)
    parameters = sum(p.numel() for p in saved.parameters())
    spec = resolve_model(str(model))

    def loading(strategy: str, low: torch.dtype | None = None, **options: Any) -> int:
        config = TrainConfig(model=str(model), task="causal-lm", distributed=strategy, world_size=2, **options)
        return load_host_bytes(config, spec, "causal-lm", low, strategy=strategy, ranks=2)

    assert loading("fsdp") == 4 * parameters  # rank 0 alone, fp32
    assert loading("ddp") == 2 * 4 * parameters  # a replica each
    assert loading("ddp", torch.bfloat16, lora_rank=4) == 2 * 2 * parameters  # the base as saved
    assert loading("fsdp", torch.bfloat16, lora_rank=4) == 2 * parameters
    assert loading("fsdp", torch.bfloat16, lora_rank=4, quantize_base="nf4") == 2 * parameters  # rank 0 quantises
    assert loading("ddp", torch.bfloat16, lora_rank=4, quantize_base="nf4") == 2 * 2 * parameters  # each replica
    assert loading("fsdp", cpu_offload=True) == 4 * parameters  # offloaded shards: rank 0 still reads for all
    config = TrainConfig(model=str(model), task="causal-lm", distributed="ddp", world_size=2, effective_batch=2,
                         max_length=16, precision="fp32")
    assert estimate(config, device="cpu", seq_len=16).load_host_bytes == 2 * 4 * parameters


def test_a_rank_receiving_offloaded_shards_makes_them_on_the_host_and_its_buffers_on_the_card() -> None:
    """Under --cpu-offload a rank that built on ``meta`` allocates its shards where FSDP2 keeps them, the host,
    never all on the card at once; its buffers (rotary frequencies) on the card, where the forward reads them.
    The "card" here is the meta device: what lands there was not made on the host."""
    import torch

    from memfit.rank0_load import _allocate

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        model[1].register_buffer("inv_freq", torch.ones(2), persistent=False)
    _allocate(model, torch.device("meta"), offload=True)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert [b.device.type for b in model.buffers()] == ["meta"]
    assert "1.inv_freq" not in model.state_dict()  # still not persistent
    _allocate(model, torch.device("cpu"), offload=False)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cpu"}


def test_offloaded_activations_cost_what_their_samples_save_whatever_the_split() -> None:
    """The host traffic of offloaded activations is per sample (traced at any micro-batch, a line's low point
    being micro-batch 1): a window of 8 samples moves the same bytes in 1 or 8 micro-steps."""
    card = resolve_profile("4090")
    offloaded = dataclasses.replace(COST, offloaded_bytes_per_sample=1e6)
    for steps in (1, 8):
        added = step_seconds(offloaded, card, "fp32", effective_batch=8, accumulation_steps=steps) \
            - step_seconds(COST, card, "fp32", effective_batch=8, accumulation_steps=steps)
        assert added == pytest.approx(2 * 8 * 1e6 / card.host_bandwidth)
