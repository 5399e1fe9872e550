"""A plan: the chosen setup, the ranked candidates and the verdict; saving and loading it, and turning it
into a training config or HF TrainingArguments."""

from __future__ import annotations

import dataclasses
import functools
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.config import TrainConfig, from_mapping
from memfit.errors import ConfigError
from memfit.planner.families import Candidate, Family
from memfit.planner.search import Search
from memfit.report import format_bytes


@functools.cache
def checkpointing_argument() -> str:
    """``TrainingArguments``' name for activation checkpointing in the installed transformers:
    ``activation_checkpointing`` where it exists (there the older ``gradient_checkpointing`` warns that it is
    deprecated), else ``gradient_checkpointing``."""
    try:
        from transformers import TrainingArguments
    except ImportError:
        return "activation_checkpointing"
    names = {item.name for item in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


@dataclass(kw_only=True, slots=True)
class Plan:
    chosen: Candidate | None
    candidates: list[Candidate]
    """Ranked: fitting setups by predicted speed, then the rest by predicted peak."""
    budget_bytes: int
    usable_bytes: int
    """The budget less the margin: what a setup's predicted peak must stay under."""
    margin: float
    device: str
    device_description: str
    model: str
    effective_batch: int
    sequence_length: int | None
    image_size: int | None
    verdict: str
    """One line: what was chosen and why, or why nothing fits and what would."""
    traces: int
    seconds: float
    config: dict[str, Any] = field(default_factory=dict)
    """The base training options the plan was made for (its own choices applied by :meth:`to_config`)."""
    fixes: list[tuple[str, ...]] = field(default_factory=list)
    """When nothing allowed fits: the opt-in flag sets under which a setup would, least change first."""
    opt_ins: tuple[str, ...] = ()
    """The ``--allow-*`` flags the plan was made with."""
    gpus_per_node: int | None = None
    """GPUs per machine where the plan's GPUs fill several (``None``: one machine)."""
    host_memory_bytes: int | None = None
    """One machine's host memory the plan checked offloaded bytes against (``None``: not checked)."""

    @property
    def allowed_by(self) -> tuple[str, ...]:
        """The opt-ins the chosen setup uses (none when it is accuracy-neutral or what the run itself asked)."""
        return tuple(flag for flag in self.chosen.family.opt_ins if flag in self.opt_ins) if self.chosen else ()

    def to_dict(self) -> dict[str, Any]:
        return {"chosen": self.chosen.to_dict() if self.chosen else None,
                "candidates": [candidate.to_dict() for candidate in self.candidates],
                "budget_bytes": self.budget_bytes, "usable_bytes": self.usable_bytes, "margin": self.margin,
                "device": self.device, "device_description": self.device_description, "model": self.model,
                "effective_batch": self.effective_batch, "sequence_length": self.sequence_length,
                "image_size": self.image_size, "verdict": self.verdict, "traces": self.traces,
                "seconds": self.seconds, "config": self.config, "fixes": [list(flags) for flags in self.fixes],
                "opt_ins": list(self.opt_ins), "gpus_per_node": self.gpus_per_node,
                "host_memory_bytes": self.host_memory_bytes}

    def summary(self) -> dict[str, Any]:
        """The chosen setup as planned, the budget and the verdict (what a run's summary keeps)."""
        return {"chosen": self.chosen.to_dict() if self.chosen else None, "budget_bytes": self.budget_bytes,
                "usable_bytes": self.usable_bytes, "device": self.device, "verdict": self.verdict,
                "technique": self.chosen.family.technique_label if self.chosen else None,
                "opt_ins": list(self.opt_ins), "allowed_by": list(self.allowed_by)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    def to_config(self, base: TrainConfig | None = None) -> TrainConfig:
        """The training config that runs the chosen setup (``base``: the plan's own options)."""
        if self.chosen is None:
            raise ConfigError(self.verdict)
        return self.config_of(self.chosen, base)

    def config_of(self, candidate: Candidate, base: TrainConfig | None = None) -> TrainConfig:
        """The training config that runs ``candidate``, one of :attr:`candidates`."""
        base = dataclasses.replace(base or from_mapping(self.config), budget=None, plan=None,
                                   device_profile=None).without_opt_ins()
        return candidate.family.configure(base, micro_batch_size=candidate.micro_batch_size,
                                          effective_batch=self.effective_batch)

    def to_training_arguments(self) -> dict[str, Any]:
        """Keyword arguments for ``transformers.TrainingArguments`` that run the chosen setup in HF Trainer.

        Activation checkpointing under the installed transformers' name (:func:`checkpointing_argument`); where
        it is ``activation_checkpointing``, an every-2 plan checkpoints the same layers through
        ``every_n_layers``; with the older ``gradient_checkpointing`` Trainer checkpoints every layer, so an
        every-2 plan becomes full checkpointing there (less memory, slower). A for-loop AdamW plan maps to
        fused AdamW, which keeps no gradient-sized temporaries either.
        Freezing and adapters are not training arguments: a plan that freezes or trains LoRA warns, and the
        caller freezes the model or wraps it with PEFT.
        """
        if self.chosen is None:
            raise ConfigError(self.verdict)
        family = self.chosen.family
        if family.freeze != "none":
            warnings.warn(f"the plan freezes {family.freeze}: freeze those parameters (requires_grad=False) "
                          "before building the Trainer", stacklevel=2)
        if family.lora_rank:
            base = " on an NF4 base (its BitsAndBytesConfig too)" if family.quantize_base == "nf4" else ""
            warnings.warn(f"the plan trains LoRA r={family.lora_rank} adapters{base}: "
                          "memfit.integrations.trainer_plan.plan_trainer_arguments returns their LoraConfig, "
                          "memfit plan --emit trainer prints it; apply it before building the Trainer", stacklevel=2)
        if family.loss_chunk:
            warnings.warn(f"the plan computes the loss in chunks of {family.loss_chunk} positions (memfit "
                          "--loss-chunk): Trainer computes it over the whole sequence, which needs more memory "
                          "than the plan's peak; train with memfit to keep it", stacklevel=2)
        if family.offload_optimizer:
            warnings.warn("the plan keeps the optimizer's state on the host: Trainer does that only through "
                          "DeepSpeed (ZeRO stage 2 with offload_optimizer device 'cpu'); or train with memfit "
                          "--offload-optimizer", stacklevel=2)
        if family.precision == "bf16-true" or family.optimizer_in_backward or family.offload_activations:
            what = "16-bit weights (--precision bf16-true)" if family.precision == "bf16-true" else \
                "the optimizer step inside backward (--optimizer-in-backward)" if family.optimizer_in_backward \
                else "the saved activations on the host (--offload-activations)"
            raise ConfigError(f"the plan trains with {what}, which Trainer has no setting for; train it with "
                              "memfit train --plan, or plan for Trainer without that opt-in")
        optim = {"adamw8bit": "adamw_bnb_8bit", "paged-adamw8bit": "paged_adamw_8bit",
                 "sgd": "sgd"}.get(family.optimizer) or (
            "adamw_torch" if family.kernels == "foreach" else "adamw_torch_fused")
        config = from_mapping(self.config)
        arguments: dict[str, Any] = {
            "per_device_train_batch_size": self.chosen.micro_batch_size,
            "gradient_accumulation_steps": self.chosen.accumulation_steps,
            "fp16": family.precision == "fp16", "bf16": family.precision == "bf16",
            checkpointing_argument(): family.checkpointing != "none", "optim": optim,
            "learning_rate": config.lr, "weight_decay": config.weight_decay,
            "max_grad_norm": config.max_grad_norm if config.max_grad_norm is not None else 0.0,
        }
        if family.checkpointing != "none":
            kwargs: dict[str, Any] = {"use_reentrant": False}
            if family.checkpointing == "every-2" and checkpointing_argument() == "activation_checkpointing":
                kwargs["every_n_layers"] = 2  # the same layers as memfit's (index % 2 == 0)
            arguments[f"{checkpointing_argument()}_kwargs"] = kwargs
        if self.device == "cpu":
            arguments["use_cpu"] = True
        return arguments


def load_plan(path: str | Path) -> Plan:
    """A plan saved by ``memfit plan --save`` (or :meth:`Plan.save`)."""
    file = Path(path)
    try:
        return plan_from_dict(json.loads(file.read_text()))
    except FileNotFoundError:
        raise ConfigError(f"--plan {path}: no such file; make one with memfit plan ... --save {path}") from None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"--plan {path}: not a plan saved by memfit plan --save ({error!r}); "
                          "make it again") from None


def plan_from_dict(raw: dict[str, Any]) -> Plan:
    """The plan :meth:`Plan.to_dict` wrote (its chosen setup; the other candidates are not kept)."""
    chosen = raw["chosen"]
    return Plan(chosen=_candidate(chosen) if chosen else None, candidates=[],
                **{name: raw[name] for name in ("budget_bytes", "usable_bytes", "margin", "device",
                                                 "device_description", "model", "effective_batch",
                                                 "sequence_length", "image_size", "verdict", "traces",
                                                 "seconds", "config")},
                fixes=[tuple(flags) for flags in raw.get("fixes", [])], opt_ins=tuple(raw.get("opt_ins", [])),
                gpus_per_node=raw.get("gpus_per_node"), host_memory_bytes=raw.get("host_memory_bytes"))


def _candidate(raw: dict[str, Any]) -> Candidate:
    kernels = raw.get("kernels") or ("foreach" if raw["foreach"] else "loop")  # plans saved before "kernels"
    label = raw["optimizer"]  # "adamw-fused", "adamw-loop-kahan in backward", "paged-adamw8bit", ...
    optimizer = next((name for name in ("paged-adamw8bit", "adamw8bit") if label.startswith(name)),
                     label.split("-")[0])
    family = Family(precision=raw["precision"], checkpointing=raw["checkpointing"], kernels=kernels,
                    freeze=raw["freeze"], optimizer=optimizer,
                    strategy=raw.get("distributed", "none"), shard_group=raw.get("shard_group"),
                    lora_rank=raw.get("lora_rank", 0),
                    quantize_base=raw.get("quantize_base", "none"),
                    offload_optimizer=raw.get("offload_optimizer", False), loss_chunk=raw.get("loss_chunk"),
                    kahan=raw.get("kahan", False), optimizer_in_backward=raw.get("optimizer_in_backward", False),
                    drops_clipping=raw.get("drops_clipping", False),
                    offload_activations=raw.get("offload_activations", False), packing=raw.get("packing", False),
                    reduce_every=raw.get("reduce_every_micro_step", False))
    return Candidate(family=family, micro_batch_size=raw["micro_batch_size"],
                     accumulation_steps=raw["accumulation_steps"], predicted_peak_bytes=raw["predicted_peak_bytes"],
                     predicted_allocated_bytes=raw["predicted_allocated_bytes"], peak_phase=raw["peak_phase"],
                     predicted_samples_per_second=raw["predicted_samples_per_second"], exact=raw["exact"],
                     fits=raw["fits"], reason=raw["reason"], relative_speed=raw["relative_speed"],
                     world_size=raw.get("world_size", 1), trainable_parameters=raw.get("trainable_parameters", 0),
                     parameters=raw.get("parameters", 0), predicted_host_bytes=raw.get("predicted_host_bytes", 0))


def rank_candidates(search: Search, chosen: Candidate | None, *, allowed: Callable[[Family], bool]) -> list[Candidate]:
    traced = list(search.candidates.values())
    fitting = sorted((c for c in traced if c.fits and allowed(c.family)), key=lambda c: -c.predicted_samples_per_second)
    rest = sorted((c for c in traced if c not in fitting), key=lambda c: c.predicted_peak_bytes or 0)
    runner_up = next((c for c in fitting if c is not chosen), None) if chosen is not None else None
    reference = chosen.predicted_samples_per_second if chosen else None
    for candidate in fitting + rest:
        if not allowed(candidate.family):
            candidate.reason = (f"{'fits' if candidate.fits else 'does not fit'}; opt-in, needs "
                                f"{candidate.family.opt_in}")
        elif candidate is chosen:
            candidate.reason = "chosen: fastest that fits" + (
                " (an opt-in: changes what is learned)" if not candidate.family.accuracy_neutral else
                " (an opt-in: host memory, slower steps)" if candidate.family.opt_in else "")
        elif candidate is runner_up:
            candidate.reason = "runner-up"
        elif candidate.fits:
            candidate.reason = "fits, slower"
        elif (candidate.predicted_peak_bytes or 0) <= search.usable:  # the card holds it, the host does not
            host = search.host_per_node(candidate.family, candidate.predicted_host_bytes)
            candidate.reason = (f"host: needs {format_bytes(host)} per machine, over "
                                f"{format_bytes(search.host_memory or 0)}")
        else:
            candidate.reason = f"over {format_bytes(search.usable)} usable"
    pruned = []
    for family in search.considered:
        if family in search.lines or family.reduce_every:  # the latter: listed as its twin
            continue
        proof = search.ruled_out.get(family)
        bound = search.lower_bound_seconds(family)
        # samples of all ranks, as above; a family ruled out before any like it was traced: its proof's speed
        best_case = search.global_batch / bound if bound > 0 or proof is None else proof.predicted_samples_per_second
        reason = "not traced: cannot beat the chosen" if proof is None else (
            f"not traced: checkpointing {proof.family.checkpointing} needs "
            f"{format_bytes(proof.predicted_peak_bytes or 0)} at micro-batch {proof.micro_batch_size}")
        pruned.append(Candidate(family=family, micro_batch_size=search.effective, accumulation_steps=1,
                                predicted_peak_bytes=None, predicted_allocated_bytes=None, peak_phase=None,
                                predicted_samples_per_second=best_case, exact=False,
                                fits=None if proof is None else False, reason=reason,
                                world_size=search.ranks(family)))
    ranked = fitting + rest + pruned
    for candidate in ranked:
        if reference:
            candidate.relative_speed = candidate.predicted_samples_per_second / reference
    return ranked


def verdict_line(chosen: Candidate | None, smallest: Candidate | None, advice: list[str], usable: int,
                 budget: int, margin: float, *, host: int = 0, host_memory: int | None = None) -> str:
    """``host``: the host memory one machine holds for ``chosen`` (stated where it offloads; ``host_memory``:
    what it was checked against)."""
    where = f"{format_bytes(budget)} ({format_bytes(usable)} usable with the {margin:.0%} margin)"
    if chosen is not None:
        why = ""
        if smallest is not None:  # an opt-in was needed: what the more faithful setups needed
            why = " (" + "; ".join([f"full fine-tuning needs at least "
                                    f"{format_bytes(smallest.predicted_peak_bytes or 0)}", *advice]) + ")"
        held = f" of {format_bytes(host_memory)}" if host_memory is not None else ""
        on_host = f" and {format_bytes(host)}{held} host memory per machine" if host else ""
        return (f"{chosen.describe()} fits {where}: needs {format_bytes(chosen.predicted_peak_bytes or 0)}"
                f"{on_host}, predicted {chosen.predicted_samples_per_second:.1f} samples/s{why}")
    assert smallest is not None
    if host_memory is not None and (smallest.predicted_peak_bytes or 0) <= usable:  # the card holds it: the host not
        card = format_bytes(smallest.predicted_peak_bytes or 0)
        return "; ".join([f"nothing fits {format_bytes(host_memory)} of host memory per machine: the setup that "
                          f"needs least on the card ({smallest.describe()}, {card}) keeps {format_bytes(host)} there",
                          *advice])
    return "; ".join([f"nothing fits {where}: the smallest any allowed setup needs is "
                      f"{format_bytes(smallest.predicted_peak_bytes or 0)} ({smallest.describe()})", *advice])
