"""``memfit train --budget`` with the planner's opt-ins, through the real CLI in-process on CPU: every opt-in
of ``memfit plan`` is taken, nothing-fits names the opt-in and the command that trains with it, a budgeted
LoRA run peaks where its plan said, and a card's QLoRA plan is dry-run and rehearsed here."""

from __future__ import annotations

import json
import random
import re
import shlex
from pathlib import Path

import pytest

from memfit.cli import build_parser, config_from_args
from memfit.config import TrainConfig
from memfit.memory.estimate import estimate
from memfit.planner import Candidate, Family, Plan
from memfit.planner.allowed import FLAGS, Allowed
from tests.conftest import FILLER, write_tiny_llm
from tests.helpers import in_process

WIDE = {"hidden_size": 256, "intermediate_size": 1024}
"""Blocks wide enough to dominate the tiny vocabulary's embeddings: LoRA then needs far less than full
fine-tuning (CPU, effective batch 2 of 16 tokens: full fine-tuning with any opt-in needs 19.7 MiB or more, LoRA
10.8 MiB, QLoRA 5.3 MiB)."""
TRAINING_PHASES = ("forward", "backward", "optimizer")


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The wide tiny LLM and prompts longer than --max-length (every row full: the plan's padded worst case is
    every step's)."""
    root = tmp_path_factory.mktemp("opt-ins")
    rng = random.Random(0)
    data = root / "long.jsonl"
    data.write_text("".join(json.dumps({"prompt": " ".join(rng.choices(FILLER, k=30)), "completion": " yes"}) + "\n"
                            for _ in range(32)))
    return write_tiny_llm(root / "llm", chat=False, config=WIDE), data


def train_args(task: tuple[Path, Path], out: Path, *extra: str) -> list[str]:
    model, data = task
    return ["train", "--model", str(model), "--data", str(data), "--max-length", "16", "--effective-batch", "2",
            "--max-steps", "2", "--eval-batch-size", "8", "--output-dir", str(out), *extra]


def test_train_takes_every_opt_in_plan_takes(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    for command in ("plan", "train"):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        assert set(re.findall(r"--allow-[a-z0-9-]+", capsys.readouterr().out)) == set(FLAGS.values()), command
    for name, flag in FLAGS.items():
        config = config_from_args(parser.parse_args(["train", "--budget", "1GiB", flag]))
        config.validate()
        assert config.opt_ins == (flag,)
        assert Allowed.of(config) == Allowed(**{name: True})


@pytest.mark.slow
def test_nothing_fits_names_the_opt_in_and_the_command_that_trains_with_it(
        task: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refused = in_process(train_args(task, tmp_path / "refused", "--budget", "17MiB", "--device", "cpu"), capsys)
    assert refused.returncode == 2
    lines = [line for line in refused.stderr.splitlines() if line.startswith("memfit:")]
    assert len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr
    line = lines[0]
    assert line.startswith("memfit: error: nothing fits 17.0 MiB")
    assert "--allow-optimizer-in-backward would not fit either" in line
    assert "--allow-lora (r=16) would fit: it needs at least" in line
    assert "; ;" not in line and not line.rstrip().endswith(";")
    _, command = line.split("; to train with the first: ")
    words = shlex.split(command)
    assert words[0] == "memfit" and words[-1] == "--allow-lora"
    assert words[1:-1] == train_args(task, tmp_path / "refused", "--budget", "17MiB", "--device", "cpu")
    assert not (tmp_path / "refused").exists()

    # the command it names trains LoRA, and peaks where the plan said (as a full fine-tuning plan does)
    trained = in_process([*words[1:], "--json"], capsys)
    assert trained.returncode == 0, trained.stderr
    summary = json.loads(trained.stdout)
    plan = summary["plan"]
    assert plan["technique"] == "LoRA r=16" and plan["allowed_by"] == ["--allow-lora"]
    assert summary["config"]["lora_rank"] == 16 and summary["trainable_parameters"] < summary["total_parameters"]
    assert "allowed by --allow-lora" in trained.stderr  # the resolved-config table's plan row
    measured = {phase: summary["peak_memory_by_phase"][phase] for phase in TRAINING_PHASES}
    assert max(measured.values()) <= plan["chosen"]["predicted_peak_bytes"] <= plan["usable_bytes"]
    # the plan prices a padded batch, the worst case; these rows are full, and the trace of full rows is exact
    run = TrainConfig(**{name: value for name, value in summary["config"].items() if name in TrainConfig().to_dict()})
    assert measured == estimate(run, device="cpu", padded=False).phases


@pytest.mark.slow
def test_a_cards_qlora_plan_dry_runs_and_rehearses_here(task: tuple[Path, Path], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The 1080 Ti's plan with --allow-qlora only: planned, shown, nothing written (--dry-run); then rehearsed on
    this CPU within the card's memory, to the end. On the card every setup needs its CUDA context and the
    allocator's blocks: 463 MiB (439.8 usable) leaves room for QLoRA (426 MiB) and none for full fine-tuning
    (452 MiB)."""
    args = train_args(task, tmp_path / "run", "--budget", "463MiB", "--device-profile", "1080ti", "--allow-qlora")
    dry = in_process([*args, "--dry-run", "--json"], capsys)
    assert dry.returncode == 0, dry.stderr
    planned = json.loads(dry.stdout)
    assert planned["plan"]["technique"] == "LoRA r=16 on a nf4 base"
    assert planned["plan"]["allowed_by"] == ["--allow-qlora"] and planned["plan"]["device"] == "1080ti"
    assert planned["config"]["quantize_base"] == "nf4" and planned["config"]["emulate_budget"] == "485490688B"
    assert "dry run: nothing written" in dry.stderr and "GeForce GTX 1080 Ti" in dry.stderr
    assert not (tmp_path / "run").exists()

    rehearsed = in_process([*args, "--json"], capsys)
    assert rehearsed.returncode == 0, rehearsed.stderr
    summary = json.loads(rehearsed.stdout)
    assert summary["optimizer_steps"] == 2 and summary["device"] == "cpu"
    assert summary["plan"]["chosen"] == planned["plan"]["chosen"]
    assert (summary["micro_batch_size"], summary["precision"]) == (planned["config"]["micro_batch_size"],
                                                                   planned["config"]["precision"])
    assert "rehearsing the plan for NVIDIA GeForce GTX 1080 Ti" in rehearsed.stderr


def test_trainer_plans_refuse_opt_ins_trainer_cannot_run() -> None:
    from memfit.errors import ConfigError
    from memfit.integrations.trainer_plan import plan_trainer_arguments

    for allow in (Allowed(bf16_true=True), Allowed(optimizer_in_backward=True)):
        with pytest.raises(ConfigError, match="Trainer has no setting for 16-bit weights"):
            plan_trainer_arguments(object(), budget="1GiB", effective_batch=8, seq_len=16, allow=allow)


def card_plan(family: Family) -> Plan:
    chosen = Candidate(family=family, micro_batch_size=2, accumulation_steps=1, predicted_peak_bytes=400 << 20,
                       predicted_allocated_bytes=300 << 20, peak_phase="backward", predicted_samples_per_second=1.0,
                       exact=True, fits=True)
    return Plan(chosen=chosen, candidates=[chosen], budget_bytes=11 << 30, usable_bytes=10 << 30, margin=0.05,
                device="1080ti", device_description="NVIDIA GeForce GTX 1080 Ti", model="m", effective_batch=2,
                sequence_length=16, image_size=None, verdict="fits", traces=1, seconds=0.0,
                opt_ins=("--allow-offload", "--allow-8bit-optimizer"))


def test_a_rehearsal_without_cuda_keeps_on_the_host_what_the_card_would_move_there() -> None:
    """A plan for the card that offloads (the optimizer, the activations, paged states) runs on a CPU as the
    same step with everything in host memory, within the card's memory; fp16 is allowed there."""
    from rich.console import Console

    from memfit.devices import resolve_device
    from memfit.planner.choose import rehearsal

    console = Console(record=True, width=200)
    for family in (Family(precision="fp16", checkpointing="none", kernels="fused", offload_optimizer=True),
                   Family(precision="fp32", checkpointing="full", kernels="loop", offload_activations=True,
                          optimizer="paged-adamw8bit")):
        made = card_plan(family)
        planned = made.to_config(base=TrainConfig(model="m", budget="11GiB", device_profile="1080ti",
                                                  allow_offload=True, allow_8bit_optimizer=True))
        run = rehearsal(planned, made, device=resolve_device("cpu"), console=console)
        assert not run.offload_optimizer and not run.offload_activations and run.optimizer in ("adamw", "adamw8bit")
        assert run.emulate_budget == f"{11 << 30}B" and run.force_cpu_fp16 == (family.precision == "fp16")
        assert run.opt_ins == () and run.device_profile is None and run.budget is None
        run.validate()  # what the rehearsal trains is a valid run
    assert "on the host as planned for the card: without CUDA everything is in host memory" in console.export_text()


def test_the_command_named_adds_only_what_the_run_lacks() -> None:
    from memfit.cli import with_command
    from memfit.errors import NothingFits

    error = NothingFits("nothing fits", (("--allow-optimizer-in-backward",),
                                         ("--allow-bf16-true", "--allow-8bit-optimizer")))
    words = ["train", "--budget", "1GiB", "--allow-optimizer-in-backward", "--dry-run"]
    line = with_command(error, words, given=("--allow-optimizer-in-backward",))
    assert line == ("nothing fits; to train with the first: memfit train --budget 1GiB --allow-optimizer-in-backward "
                    "--allow-bf16-true --allow-8bit-optimizer")
    assert with_command(NothingFits("nothing fits"), words, given=()) == "nothing fits"


def test_a_replica_of_a_budgeted_run_is_a_valid_run() -> None:
    from memfit.distributed import replica_config

    config = TrainConfig(budget="1GiB", allow_lora=True, device_profile="1080ti", distributed="auto", world_size=2,
                         effective_batch=8, micro_batch_size=None)
    replica = replica_config(config)
    replica.validate()
    assert replica.opt_ins == () and replica.device_profile is None
