"""memfit's planner for a model in memory, answered in Trainer's terms: ``TrainingArguments`` keyword
arguments, and the PEFT and quantisation configs when the plan trains adapters.

The planner (:func:`memfit.plan`) needs the model's architecture only: its config is written to a temporary
directory and planned like any local model directory, at the effective batch and length the user gives.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.config import TrainConfig
from memfit.devices import DeviceProfile, profile_for, resolve_device, resolve_profile
from memfit.errors import ConfigError
from memfit.planner import Plan, plan
from memfit.planner.allowed import NOTHING, Allowed
from memfit.planner.report import checkpointing_argument
from memfit.report import format_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerPlan:
    """What to give Trainer: ``training_arguments`` for ``TrainingArguments(output_dir=..., **them)``; when the
    plan chose LoRA, ``lora_config`` for ``peft.get_peft_model``, and for QLoRA ``quantization_config`` for
    ``from_pretrained(..., quantization_config=...)``; ``plan`` is memfit's full answer (its table, its
    verdict)."""

    training_arguments: dict[str, Any]
    lora_config: Any | None
    quantization_config: Any | None
    plan: Plan


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


def _task(model: Any) -> tuple[str, int]:
    base = _base_model(model)
    name = type(base).__name__
    if name.endswith("ForCausalLM"):
        return "causal-lm", 2
    return "classification", int(getattr(base.config, "num_labels", 2))


def plan_trainer_arguments(model: Any, *, budget: str | int, effective_batch: int, seq_len: int,
                           allow_lora: bool = False, allow_qlora: bool = False, allow: Allowed = NOTHING,
                           device: str | DeviceProfile | None = None,
                           precisions: tuple[str, ...] | None = None) -> TrainerPlan:
    """The fastest setup of ``model`` that fits ``budget`` at ``effective_batch`` samples of ``seq_len`` tokens
    per optimizer step, on ``device`` (a profile name such as ``"1080ti"``; default: where the model is), as
    Trainer arguments; ``precisions``: only those (default: fp32 and the device's low precision). A model that
    already carries LoRA adapters or a quantised base is planned with them (:func:`model_technique`). Raises
    :class:`~memfit.errors.ConfigError` with the planner's verdict when nothing fits. ``allow``: the planner's
    other opt-ins Trainer can run (8-bit states, freezing); 16-bit weights with Kahan summation, the step in
    backward and memory on the host have no Trainer setting and are refused."""
    if allow.bf16_true or allow.optimizer_in_backward or allow.offload:
        raise ConfigError("Trainer has no setting for 16-bit weights with Kahan summation, the optimizer step in "
                          "backward or memory on the host; plan without allow.bf16_true, optimizer_in_backward and "
                          "offload, or train with memfit train")
    allow = allow.union(Allowed(lora=allow_lora, qlora=allow_qlora))
    base = _base_model(model)
    profile = (device if isinstance(device, DeviceProfile) else resolve_profile(device) if device is not None
               else profile_for(resolve_device(next(base.parameters()).device.type)))
    task, num_labels = _task(model)
    with tempfile.TemporaryDirectory(prefix="memfit-plan-") as directory:
        config = base.config.to_dict()
        config.pop("quantization_config", None)  # the architecture only: the technique is memfit's setting
        config.setdefault("architectures", [type(base).__name__])
        (Path(directory) / "config.json").write_text(json.dumps(config))
        made = plan(TrainConfig(model=directory, task=task, max_length=seq_len, effective_batch=effective_batch,
                                **model_technique(model)),
                    device=profile, budget=budget, seq_len=seq_len, allow=allow,
                    num_labels=num_labels, suggest=False, precisions=precisions)
    with warnings.catch_warnings():  # its notes on wrapping the model are what the configs below do
        warnings.simplefilter("ignore")
        arguments = made.to_training_arguments()
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
                       plan=dataclasses.replace(made, config={**made.config, "model": type(base).__name__}))


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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        arguments = made.to_training_arguments()
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
    return "\n".join(lines)


def plan_for_trainer(trainer: Any, *, budget: int, profile: DeviceProfile, seq_len: int) -> str:
    """One clause for an over-budget Trainer: the arguments of a plan that fits at its effective batch and in
    its precision."""
    args = trainer.args
    effective = args.per_device_train_batch_size * args.gradient_accumulation_steps * max(1, args.world_size)
    try:
        precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
        made = plan_trainer_arguments(trainer.model, budget=budget, effective_batch=effective, seq_len=seq_len,
                                      device=profile, precisions=(precision,))
    except ConfigError as error:
        return f"no setup of this model fits at effective batch {effective}: {error}"
    keys = ("per_device_train_batch_size", "gradient_accumulation_steps", "fp16", "bf16", checkpointing_argument(),
            "optim")
    shown = ", ".join(f"{key}={made.training_arguments[key]!r}" for key in keys)
    peak = made.plan.chosen.predicted_peak_bytes if made.plan.chosen is not None else 0
    return f"a plan that fits (effective batch {effective} kept, {format_bytes(peak or 0)}): {shown}"
