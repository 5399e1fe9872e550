"""What a run will do, in words: the resolved config's rows (shown before training), and :func:`dry_run`, which
plans and checks a budgeted run and shows them without building or training anything."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from memfit.build import Prepared, prepare
from memfit.config import TrainConfig
from memfit.errors import ConfigError
from memfit.planner import Plan, plan_for_run
from memfit.quiet import quiet_transformers
from memfit.report import config_table, format_bytes
from memfit.techniques.bf16_true import uses_kahan
from memfit.techniques.optim import step_kernels


@dataclass(frozen=True, slots=True)
class DryRun:
    """What :func:`memfit.train` would run: the planned config, and the plan that chose it."""

    config: TrainConfig
    plan: Plan | None

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "plan": self.plan.summary() if self.plan is not None else None}


def prepare_planned(config: TrainConfig, console: Console) -> tuple[Prepared, Plan | None]:
    """The validated run; with ``--budget``/``--plan``, of the config the planner chose."""
    prepared = prepare(config)
    if not config.plans:
        return prepared, None
    planned, plan = plan_for_run(prepared, console)
    return prepare(planned), plan


@quiet_transformers()
def dry_run(config: TrainConfig, *, console: Console | None = None) -> DryRun:
    """Plan ``config`` (``budget``, ``plan`` or ``device_profile``) and check the model, the data and every
    option as :func:`memfit.train` would, show the resolved config, and stop: nothing is built, trained or
    written (a model too large for this machine can be planned for its card)."""
    console = console or Console(stderr=True)
    if not config.plans:
        raise ConfigError("--dry-run stops after the plan; add --budget SIZE, --plan PLAN_JSON or --device-profile "
                          "GPU (memfit estimate predicts a setup you fix yourself)")
    prepared, plan = prepare_planned(config, console)
    assert plan is not None and plan.chosen is not None
    output = prepared.config.output_dir or "runs/<timestamp>"
    rows = config_rows(prepared, f"{output} (dry run: nothing written)", plan.chosen.trainable_parameters,
                       plan.chosen.parameters, plan)
    if not plan.chosen.parameters:  # a plan saved before plans kept their parameter counts
        rows = [(name, "not recorded in this plan" if name == "parameters" else value) for name, value in rows]
    console.print(config_table(rows, title="memfit train --dry-run: resolved config"))
    return DryRun(config=prepared.config, plan=plan)


def kernels_label(config: TrainConfig) -> str:
    """How the optimizer step runs: ``fused``, ``foreach``, ``loop``, or torch's default."""
    if uses_kahan(config.kahan, precision=config.precision, optimizer=config.optimizer):
        return "foreach" if config.foreach else "loop"
    foreach, fused = step_kernels(config.optimizer, foreach=config.foreach, fused=config.fused,
                                  distributed=config.distributed != "none")
    return "fused" if fused else {True: "foreach", False: "loop", None: "torch default"}[foreach]


def adapters_label(config: TrainConfig, precision: str) -> str:
    """LoRA's rank, scaling, targets and the base's storage, in words; ``none`` without adapters."""
    if not config.lora_rank:
        return "none"
    alpha = config.lora_alpha if config.lora_alpha is not None else 2 * config.lora_rank
    base = {"none": precision, "nf4": "4-bit NF4",
            "int8": "8-bit"}[config.quantize_base]
    return (f"LoRA r={config.lora_rank} alpha {alpha:g} dropout {config.lora_dropout:g} on "
            f"{config.lora_targets or 'every Linear of the blocks'}; frozen base {base}"
            f"{', merged copy saved' if config.merge else ''}")


def config_rows(prepared: Prepared, output_dir: Path | str, trainable: int, total: int,
                plan: Plan | None = None) -> list[tuple[str, str]]:
    """The resolved config, as (name, value) rows for the console (with the plan that chose it, if any)."""
    config = prepared.config
    checkpointing = config.checkpointing + (f" (N={config.checkpoint_every})"
                                            if config.checkpointing == "every-n" else "")
    freezing = ", ".join(filter(None, ["embeddings" if config.freeze_embeddings else "",
                                       f"all but top {config.train_top_layers} layers"
                                       if config.train_top_layers else ""])) or "none"
    kahan = uses_kahan(config.kahan, precision=prepared.precision.name, optimizer=config.optimizer)
    return [
        ("model", f"{config.model} ({type(prepared.spec.hf_config).__name__}, {prepared.spec.num_layers} layers, "
                  f"{'pretrained' if prepared.spec.is_pretrained else 'random init'})"),
        ("data", f"{data_label(prepared)}: {len(prepared.train_examples)} train / {len(prepared.val_examples)} val"
                 f"{labels_label(prepared.label_names)}"
                 f"{'' if prepared.packed is None else f'; packed into {len(prepared.packed)} rows of '}"
                 f"{'' if prepared.packed is None else f'{config.max_length} tokens (a sample is a row)'}"),
        ("device", prepared.device.describe()),
        ("batch", f"effective {config.effective_batch} = micro {config.resolved_micro_batch_size} x "
                  f"{config.resolved_accumulation_steps} accumulation steps"),
        ("precision", f"{prepared.precision.name}"
                      f"{' (auto)' if config.precision == 'auto' else ''}"
                      f"{' + GradScaler' if prepared.precision.uses_scaler else ''}"
                      f"{' + Kahan-summed updates' if kahan else ''}"),
        ("checkpointing", checkpointing),
        ("freezing", freezing),
        ("adapters", adapters_label(config, prepared.precision.name)),
        ("parameters", f"{trainable:,} trainable of {total:,} "
                       f"({format_bytes(4 * total)} in fp32)"),
        ("optimizer", f"{config.optimizer} lr {config.lr:g}, weight decay {config.weight_decay:g}, "
                      f"step {kernels_label(config)}"
                      f"{' per parameter inside backward' if config.optimizer_in_backward else ''}, "
                      f"clip {config.max_grad_norm if config.max_grad_norm is not None else 'off'}"),
        ("schedule", f"{config.epochs} epoch(s), max steps {config.max_steps or '-'}, seed {config.seed}, "
                     f"max length {config.max_length}"
                     f"{f', target length {config.target_length}' if prepared.task == 'seq2seq' else ''}"),
        *([("plan", plan_label(plan))] if plan is not None and plan.chosen is not None else []),
        ("output", str(output_dir)),
    ]


def data_label(prepared: Prepared) -> str:
    """``--data`` with its configuration and split when chosen, and the table format recognised in it."""
    from memfit.data.formats import DESCRIPTIONS

    config = prepared.config
    chosen = [f"config {config.data_config}"] if config.data_config else []
    chosen += [f"split {config.data_split}"] if config.data_split != "train" else []
    source_format = getattr(prepared.train_examples, "source_format", "")
    shape = [DESCRIPTIONS[source_format]] if source_format else []
    details = ", ".join([*chosen, *shape])
    return f"{config.data} ({details})" if details else config.data


def labels_label(names: list[str]) -> str:
    """``", 2 labels (neg, pos)"``; nothing for open-ended completions."""
    if not names:
        return ""
    return f", {len(names)} labels ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"


def plan_label(plan: Plan) -> str:
    """The planned technique, the opt-ins that allowed it, and its predicted peak against the budget."""
    assert plan.chosen is not None
    family = plan.chosen.family
    allowed = f", allowed by {' '.join(plan.allowed_by)}" if plan.allowed_by else \
        " (accuracy-neutral)" if family.accuracy_neutral else ""
    return (f"{family.technique_label}{allowed}; predicted peak {format_bytes(plan.chosen.predicted_peak_bytes or 0)}"
            f" of {format_bytes(plan.usable_bytes)} usable on {plan.device_description}")
