"""memfit's planner for a model in memory, answered in Trainer's terms: ``TrainingArguments`` keyword
arguments, and the PEFT and quantisation configs when the plan trains adapters.

The planner (:func:`memfit.plan`) needs the model's architecture only: its config is written to a temporary
directory and planned like any local model directory, at the effective batch and length the user gives (one
process's share of it: Trainer's batch arguments are per device). Only what Trainer runs is advised: where
the plan chose memfit's loss in chunks (``--loss-chunk``) the fastest fitting setup without them is advised,
or none; a LoRA plan under 16-bit precision says to store the frozen base in that dtype (as memfit's own run
does); and a Trainer's plan is re-checked on the Trainer's own step (:func:`plan_for_trainer`). Causal LMs
and sequence or image classifiers are planned; masked-LM, sequence-to-sequence and vision-language models are
refused in one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.config import TrainConfig
from memfit.devices import DeviceProfile, profile_for, resolve_device, resolve_profile
from memfit.errors import ConfigError
from memfit.models import is_mixture_of_experts
from memfit.planner import Plan, plan
from memfit.planner.allowed import NOTHING, Allowed
from memfit.planner.report import checkpointing_argument
from memfit.report import format_bytes

if TYPE_CHECKING:
    from memfit.integrations.trainer_step import StepSetup

UNPLANNED_HEADS = {"ForMaskedLM": "masked-LM", "ForConditionalGeneration": "sequence-to-sequence or vision-language",
                   "ForSeq2SeqLM": "sequence-to-sequence"}
"""Heads memfit does not plan (their loss and outputs are not a causal LM's or a classifier's), by name ending."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerPlan:
    """What to give Trainer: ``training_arguments`` for ``TrainingArguments(output_dir=..., **them)``; when the
    plan chose LoRA, ``lora_config`` for ``peft.get_peft_model``, and for QLoRA ``quantization_config`` for
    ``from_pretrained(..., quantization_config=...)``; ``frozen_dtype``: when a LoRA plan trains in 16-bit
    precision, the dtype (``"bfloat16"``, ``"float16"``) to store the frozen base in after ``get_peft_model``
    (``memfit.techniques.lora.store_frozen(model, torch.bfloat16)``), as the plan's peak assumes; ``plan`` is
    memfit's full answer for one process (its table, its verdict)."""

    training_arguments: dict[str, Any]
    lora_config: Any | None
    quantization_config: Any | None
    plan: Plan
    frozen_dtype: str | None = None


def _base_model(model: Any) -> Any:
    """The transformers model under a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def model_technique(model: Any) -> dict[str, Any]:
    """memfit's settings for what ``model`` already carries: PEFT LoRA adapters (rank, alpha, dropout, target
    names) and a bitsandbytes-quantised base (4-bit: ``nf4``, 8-bit: ``int8``), so that a plan for it keeps its
    technique. A regular-expression ``target_modules`` plans adapters on every Linear of the blocks."""
    settings: dict[str, Any] = {}
    configs = getattr(model, "peft_config", None)
    lora: Any = configs.get(getattr(model, "active_adapter", "default")) if isinstance(configs, dict) else None
    rank = int(getattr(lora, "r", None) or 0)
    if rank:
        settings.update(lora_rank=rank, lora_alpha=float(lora.lora_alpha),
                        lora_dropout=float(lora.lora_dropout))
        if isinstance(lora.target_modules, (set, list, tuple)):
            # peft resolves "all-linear" to full module names; memfit takes the last names
            settings["lora_targets"] = ",".join(sorted({name.rsplit(".", 1)[-1] for name in lora.target_modules}))
    kinds = {type(module).__name__ for module in _base_model(model).modules()}
    if "Linear4bit" in kinds:
        settings["quantize_base"] = "nf4"
    elif "Linear8bitLt" in kinds:
        settings["quantize_base"] = "int8"
    return settings


def _mixture_of_experts(model: Any) -> bool:
    """Whether ``model`` (an object, or a name resolved from its config) routes tokens to experts."""
    if isinstance(model, str):
        from memfit.models import resolve_model

        return is_mixture_of_experts(resolve_model(model).hf_config)
    return is_mixture_of_experts(getattr(_base_model(model), "config", None))


def model_task(model: Any) -> tuple[str, int]:
    """memfit's task for ``model`` and its number of labels; :class:`~memfit.errors.ConfigError` (one line) for
    a head memfit does not plan: masked LM, sequence-to-sequence, vision-language."""
    base = _base_model(model)
    name = type(base).__name__
    config = base.config
    kind = next((kind for ending, kind in UNPLANNED_HEADS.items() if name.endswith(ending)), None)
    if getattr(config, "vision_config", None) is not None and getattr(config, "text_config", None) is not None:
        kind = "vision-language"
    elif getattr(config, "is_encoder_decoder", False):
        kind = "sequence-to-sequence"
    if kind is not None:
        raise ConfigError(f"{name} is a {kind} model: memfit plans causal LMs and sequence or image classifiers, "
                          "not its head (its Trainer step is still predicted and measured)")
    if name.endswith("ForCausalLM"):
        return "causal-lm", 2
    return "classification", int(getattr(config, "num_labels", 2))


def plan_trainer_arguments(model: Any, *, budget: str | int, effective_batch: int, seq_len: int,
                           allow_lora: bool = False, allow_qlora: bool = False, allow: Allowed = NOTHING,
                           device: str | DeviceProfile | None = None,
                           precisions: tuple[str, ...] | None = None, world_size: int = 1) -> TrainerPlan:
    """The fastest setup of ``model`` (a model object, or a name: a preset, a local directory or a Hub id, planned
    from its config alone before anything is loaded) that fits ``budget`` at ``effective_batch`` samples of
    ``seq_len`` tokens per optimizer step, on ``device`` (a profile name such as ``"1080ti"``; default: where the
    model is), as Trainer arguments; ``precisions``: only those (default: fp32 and the device's low precision).
    ``world_size``: the data-parallel processes that share ``effective_batch`` (Trainer's batch arguments are
    each process's: they are planned for ``effective_batch / world_size``). A model that
    already carries LoRA adapters or a quantised base is planned with them (:func:`model_technique`). Raises
    :class:`~memfit.errors.ConfigError` with the planner's verdict when nothing fits. ``allow``: the planner's
    other opt-ins Trainer can run (8-bit states, freezing); 16-bit weights with Kahan summation, the step in
    backward and memory on the host have no Trainer setting and are refused."""
    if allow.bf16_true or allow.optimizer_in_backward or allow.offload:
        raise ConfigError("Trainer has no setting for 16-bit weights with Kahan summation, the optimizer step in "
                          "backward or memory on the host; plan without allow.bf16_true, optimizer_in_backward and "
                          "offload, or train with memfit train")
    allow = allow.union(Allowed(lora=allow_lora, qlora=allow_qlora))
    if allow_qlora and _mixture_of_experts(model):
        raise ConfigError("a mixture-of-experts model's experts stay in 16 bits under Trainer's 4-bit loading "
                          "(BitsAndBytesConfig quantises Linear layers), while memfit's QLoRA stores them in NF4: "
                          "plan with allow_lora, or train QLoRA with memfit train")
    per_process = per_device_batch(effective_batch, world_size)
    if device is None and isinstance(model, str):
        raise ConfigError(f"{model}: name the card to plan for (device='1080ti', or another profile of memfit devices)")
    with _model_directory(model) as (directory, task, num_labels, name):
        profile = (device if isinstance(device, DeviceProfile) else resolve_profile(device) if device is not None
                   else profile_for(resolve_device(next(_base_model(model).parameters()).device.type)))
        technique = {} if isinstance(model, str) else model_technique(model)
        made = plan(TrainConfig(model=directory, task=task, max_length=seq_len, effective_batch=per_process,
                                **technique),
                    device=profile, budget=budget, seq_len=seq_len, allow=allow,
                    num_labels=num_labels, suggest=False, precisions=precisions)
    made = for_trainer(made)
    arguments = trainer_arguments(made)
    lora_settings, quantization_settings = adapter_settings(made, task)
    lora = quantization = None
    if lora_settings is not None:
        from peft import LoraConfig

        lora = LoraConfig(**lora_settings)
    if quantization_settings is not None:
        import torch
        from transformers import BitsAndBytesConfig

        quantization = BitsAndBytesConfig(**{**quantization_settings, "bnb_4bit_compute_dtype": getattr(
            torch, quantization_settings["bnb_4bit_compute_dtype"])})
    return TrainerPlan(training_arguments=arguments, lora_config=lora, quantization_config=quantization,
                       plan=dataclasses.replace(made, config={**made.config, "model": name}),
                       frozen_dtype=frozen_dtype(made))


@contextlib.contextmanager
def _model_directory(model: Any) -> Iterator[tuple[str, str, int, str]]:
    """(what ``--model`` the planner reads, the task, its labels, the model's name) for a model object (its
    architecture written to a temporary ``config.json``) or a name memfit resolves (a preset, a local directory,
    a Hub id: its configs only, from the local cache first)."""
    if isinstance(model, str):
        from memfit.models import is_decoder_llm, resolve_model

        spec = resolve_model(model)
        yield model, "causal-lm" if is_decoder_llm(spec) else "classification", 2, model
        return
    base = _base_model(model)
    task, num_labels = model_task(model)
    with tempfile.TemporaryDirectory(prefix="memfit-plan-") as directory:
        config = base.config.to_dict()
        config.pop("quantization_config", None)  # the architecture only: the technique is memfit's setting
        config.setdefault("architectures", [type(base).__name__])
        (Path(directory) / "config.json").write_text(json.dumps(config))
        yield directory, task, num_labels, type(base).__name__


def per_device_batch(effective_batch: int, world_size: int) -> int:
    """Each of ``world_size`` data-parallel processes' share of ``effective_batch`` samples per optimizer step:
    what Trainer's per-device arguments (micro-batch x accumulation) must multiply to."""
    if world_size < 1 or effective_batch % world_size:
        raise ConfigError(f"effective batch {effective_batch} does not split evenly over {world_size} processes; "
                          f"give a multiple of {world_size}")
    return effective_batch // world_size


def for_trainer(made: Plan) -> Plan:
    """``made`` as Trainer can run it. Trainer computes the loss over the whole sequence: a plan that chose
    memfit's loss in chunks gets the fastest fitting setup without them (among the ones it traced and allows);
    :class:`~memfit.errors.ConfigError` when only chunks fit."""
    chosen = made.chosen
    if chosen is None or not chosen.family.loss_chunk:
        return made
    runnable = next((candidate for candidate in made.candidates if candidate.fits and not candidate.family.loss_chunk
                     and set(candidate.family.opt_ins) <= set(made.opt_ins)), None)
    if runnable is None:
        raise ConfigError(f"only memfit's loss in chunks of {chosen.family.loss_chunk} positions fits "
                          f"({chosen.describe()}): Trainer computes the loss over the whole sequence; train with "
                          "memfit train --budget, or give a larger budget")
    return dataclasses.replace(made, chosen=runnable, verdict=f"{made.verdict}; for Trainer, which computes the "
                               f"loss over the whole sequence: {runnable.describe()}")


def trainer_arguments(made: Plan) -> dict[str, Any]:
    """The ``TrainingArguments`` keyword arguments of a plan Trainer runs (:func:`for_trainer`)."""
    with warnings.catch_warnings():  # its notes on wrapping the model: the configs of the plan do that
        warnings.simplefilter("ignore")
        return made.to_training_arguments()


def frozen_dtype(made: Plan) -> str | None:
    """The dtype a LoRA plan in 16-bit precision stores the frozen base in (``None``: no LoRA, or fp32)."""
    family = made.chosen.family if made.chosen is not None else None
    if family is None or not family.lora_rank:
        return None
    return {"bf16": "bfloat16", "fp16": "float16"}.get(family.precision)


def adapter_settings(made: Plan, task: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The keyword arguments of ``peft.LoraConfig`` and ``transformers.BitsAndBytesConfig`` (its compute dtype
    by name) for the plan's adapters, or ``None`` for either that the plan does not use."""
    family = made.chosen.family if made.chosen is not None else None
    if family is None or not family.lora_rank:
        return None, None
    lora = {"r": family.lora_rank, "lora_alpha": 2 * family.lora_rank, "target_modules": "all-linear",
            "task_type": "CAUSAL_LM" if task == "causal-lm" else "SEQ_CLS"}
    if family.quantize_base != "nf4":
        return lora, None
    return lora, {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                  "bnb_4bit_compute_dtype": {"bf16": "bfloat16", "fp16": "float16"}.get(family.precision, "float32")}


def trainer_snippet(made: Plan) -> str:
    """The plan as Python for an existing Trainer script (``memfit plan --emit trainer``)."""
    task = made.config.get("task", "classification")
    made = for_trainer(made)
    arguments = trainer_arguments(made)
    lines = [f"# memfit plan for {made.model} on {made.device_description}: {made.verdict}", "import transformers",
             "", "arguments = transformers.TrainingArguments(", '    output_dir="out",',
             *(f"    {name}={value!r}," for name, value in arguments.items()), ")"]
    lora, quantization = adapter_settings(made, task)
    if quantization is not None:
        settings = ", ".join(f"{k}={v!r}" for k, v in quantization.items() if k != "bnb_4bit_compute_dtype")
        lines += ["", "import torch", f"quantization_config = transformers.BitsAndBytesConfig({settings}, "
                  f"bnb_4bit_compute_dtype=torch.{quantization['bnb_4bit_compute_dtype']})",
                  "# load the base model with from_pretrained(..., quantization_config=quantization_config)"]
    if lora is not None:
        settings = ", ".join(f"{k}={v!r}" for k, v in lora.items())
        lines += ["", "import peft", f"model = peft.get_peft_model(model, peft.LoraConfig({settings}))"]
    dtype = frozen_dtype(made)
    if dtype is None:
        lines += ["", "# the plan keeps float32 weights: load the model with from_pretrained(..., "
                  "dtype=torch.float32)", "# (transformers keeps a checkpoint's own dtype, a Hub LLM's bfloat16)"]
    else:
        lines += ["# the plan stores the frozen base in 16 bits (its adapters train in float32), as memfit's run does",
                  "import torch", "from memfit.techniques.lora import store_frozen", "",
                  f"store_frozen(model, torch.{dtype})"]
    return "\n".join(lines)


def plan_for_trainer(trainer: Any, *, budget: int, profile: DeviceProfile, seq_len: int,
                     recheck: bool = True) -> str:
    """One clause for an over-budget Trainer: the arguments of a plan that fits at its effective batch (over
    all its processes) and in its precision, checked on the Trainer's own step (``recheck``), or why there is
    none."""
    args = trainer.args
    world_size = max(1, args.world_size)
    effective = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
    kept = f"effective batch {effective} kept" + (f" over {world_size} processes" if world_size > 1 else "")
    try:
        model_task(trainer.model)
        precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
        made = plan_trainer_arguments(trainer.model, budget=budget, effective_batch=effective, seq_len=seq_len,
                                      device=profile, precisions=(precision,), world_size=world_size)
    except ConfigError as error:
        return f"no plan for it at effective batch {effective}: {error}"
    keys = ("per_device_train_batch_size", "gradient_accumulation_steps", "fp16", "bf16", checkpointing_argument(),
            "optim")
    shown = ", ".join(f"{key}={made.training_arguments[key]!r}" for key in keys)
    from memfit.integrations.trainer_step import frozen_weights, trace_trainer_step

    if made.frozen_dtype is not None and frozen_weights(trainer.model):
        shown += f", the frozen base stored in {made.frozen_dtype} (memfit.techniques.lora.store_frozen)"
    peak = made.plan.chosen.predicted_peak_bytes if made.plan.chosen is not None else 0
    if not recheck:
        return f"a plan that fits ({kept}, {format_bytes(peak or 0)}): {shown}"
    try:
        traced = trace_trainer_step(trainer, profile, step_setup(made)).total_bytes
    except Exception as error:  # the plan stands, unchecked: say so
        return f"a plan ({kept}, {format_bytes(peak or 0)} planned; not checked on this Trainer's step: " \
               f"{type(error).__name__}): {shown}"
    if traced > budget:
        return (f"memfit's plan ({shown}) needs {format_bytes(traced)} in this Trainer's own step, over the budget "
                f"too: no setup memfit plans fits this Trainer at {kept}")
    return f"a plan that fits ({kept}, {format_bytes(traced)} in this Trainer's step): {shown}"


def step_setup(made: TrainerPlan) -> StepSetup:
    """The plan's setup as :class:`~memfit.integrations.trainer_step.StepSetup`, to trace on a Trainer."""
    import torch

    from memfit.integrations.trainer_step import StepSetup

    arguments = made.training_arguments
    name = checkpointing_argument()
    every = int(arguments.get(f"{name}_kwargs", {}).get("every_n_layers", 1)) if arguments[name] else None
    return StepSetup(micro_batch_size=arguments["per_device_train_batch_size"],
                     accumulation_steps=arguments["gradient_accumulation_steps"], optim=arguments["optim"],
                     checkpoint_every=every,
                     frozen_dtype=getattr(torch, made.frozen_dtype) if made.frozen_dtype is not None else None)

