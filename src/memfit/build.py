"""From a config to everything a step needs, validated before any work starts.

:func:`prepare` resolves the device, precision, model (config only) and data, and reports every problem
with all of them together. :func:`build_model_for` builds the model and applies the techniques in the
documented order; the engine and the estimator both build their step through it, so a prediction is of the
step that really runs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import nn

from memfit import data as datasets
from memfit import distributed
from memfit.config import TrainConfig
from memfit.data.batches import CausalEncoder, Encoder, ImageEncoder, TextEncoder
from memfit.data.packing import PackedEncoder, disable_cache, packing_problems
from memfit.data.seq2seq import Seq2SeqEncoder
from memfit.devices import Device, resolve_device
from memfit.errors import ConfigError, DataError, Problems
from memfit.models import (
    ModelSpec,
    build_model,
    check_compatible,
    decoder_input_shift,
    end_token_id,
    is_decoder_llm,
    is_encoder_decoder,
    load_tokenizer,
    resolve_model,
    task_problems,
)
from memfit.support import architecture_problems
from memfit.techniques.bf16_true import cast_parameters, uses_kahan
from memfit.techniques.checkpointing import apply_checkpointing
from memfit.techniques.freezing import apply_freezing
from memfit.techniques.lora import apply_lora, settle_as_stored
from memfit.techniques.offload_activations import activation_offload_problems
from memfit.techniques.optim import build_optimizer, optimizer_problems, step_kernels
from memfit.techniques.precision import Precision, resolve_precision
from memfit.techniques.quantized_base import quantize_base
from memfit.techniques.quantized_experts import quantize_experts


@dataclass(frozen=True, kw_only=True, slots=True)
class Prepared:
    """A validated run: what will be trained, on what, and how."""

    config: TrainConfig
    device: Device
    precision: Precision
    spec: ModelSpec
    train_examples: datasets.Examples
    val_examples: datasets.Examples
    tokenizer: Any
    """The text model's tokenizer; ``None`` for vision models."""
    task: str
    """``classification``, ``causal-lm`` or ``seq2seq`` (``auto`` resolved)."""
    causal_encoders: tuple[CausalEncoder, CausalEncoder] | None = None
    """Causal-LM runs: the training and validation examples tokenised (in :func:`prepare`, where a completion
    too long for ``--max-length`` is reported before anything is written)."""
    packed: PackedEncoder | None = None
    """``--packing``: the training examples packed into rows, the training encoder (:mod:`memfit.data.packing`)."""
    seq2seq_encoders: tuple[Seq2SeqEncoder, Seq2SeqEncoder] | None = None
    """seq2seq runs: the training and validation sources and targets tokenised (:mod:`memfit.data.seq2seq`)."""

    @property
    def label_names(self) -> list[str]:
        return self.train_examples.label_names

    @property
    def num_train_samples(self) -> int:
        """The samples the run's windows are cut from: the training examples, or the packed rows."""
        return len(self.packed) if self.packed is not None else len(self.train_examples)

    def encoder(self, examples: datasets.Examples) -> Encoder:
        if self.seq2seq_encoders is not None:
            return self.seq2seq_encoders[0 if examples is self.train_examples else 1]
        if self.causal_encoders is not None:
            if examples is self.train_examples:
                return self.packed if self.packed is not None else self.causal_encoders[0]
            return self.causal_encoders[1]
        if isinstance(examples, datasets.TextExamples):
            return TextEncoder.build(examples, self.tokenizer, self.config.max_length,
                                     eos_token_id=classification_eos(self.spec, self.task))
        assert isinstance(examples, datasets.ImageExamples), "causal-LM examples have their encoders"
        return ImageEncoder.build(examples, self.spec.image_size, self.spec.num_channels)


def device_problems(config: TrainConfig, device_kind: str | None) -> list[str]:
    """What the optimizer, the activation offload and the distributed strategy cannot do on a device of
    ``device_kind`` (when known)."""
    return [*optimizer_problems(config.optimizer, device_kind, offload=config.offload_optimizer),
            *activation_offload_problems(config.offload_activations, device_kind),
            *distributed.device_problems(config, device_kind)]


def prepare(config: TrainConfig, *, log: Callable[[str], None] | None = None) -> Prepared:
    """Validate ``config`` against the device, the model and the data; raise once with every problem.
    ``log`` hears of slow one-time work (converting a packaged model)."""
    config.validate()
    problems = Problems()
    device = problems.collect(lambda: resolve_device(config.device))
    precision_name = config.precision
    if device is not None:
        precision_name, precision_problems = resolve_precision(config.precision, device,
                                                               force_cpu_fp16=config.force_cpu_fp16,
                                                               force_bf16=config.force_bf16)
        problems.lines.extend(precision_problems)
    problems.lines.extend(device_problems(config, device.kind if device is not None else None))
    spec = problems.collect(lambda: resolve_model(config.model, weights=True, log=log))
    task = resolve_task(config, spec)
    problems.lines.extend(packing_problems(config.packing, task, spec.hf_config if spec is not None else None))
    if spec is not None:
        problems.lines.extend(task_fit_problems(config, spec, task))
    data_problems = Problems()
    examples = data_problems.collect(lambda: datasets.load_examples(config.data, columns=config.columns, task=task))
    tokenizer = None
    if spec is not None:
        problems.lines.extend(depth_problems(config, spec))
        problems.lines.extend(architecture_problems(spec.hf_config))
        if spec.modality == "text":
            tokenizer = problems.collect(lambda: load_tokenizer(spec))
            vocab = len(tokenizer) if tokenizer is not None else None
            problems.lines.extend(check_compatible(spec, max_length=config.max_length, vocab_size=vocab))
            problems.lines.extend(eos_problems(spec, task, tokenizer))
    if spec is not None and examples is not None:
        data_problems.lines.extend(_head_problems(config, spec, examples))
    if problems or data_problems:  # data-only mistakes are a DataError, anything else a ConfigError
        raise (ConfigError if problems else DataError)(problems.lines + data_problems.lines)
    assert device is not None and spec is not None and examples is not None
    train_examples, val_examples = datasets.split(examples, val_fraction=config.val_fraction, seed=config.seed)
    train_examples = datasets.first(train_examples, config.train_samples)
    val_examples = datasets.first(val_examples, config.val_samples)
    encoders = pairs = None
    if isinstance(train_examples, datasets.CausalExamples) and isinstance(val_examples, datasets.CausalExamples):
        if task == "seq2seq":
            pairs = seq2seq_encoders(config, spec, tokenizer, train_examples, val_examples)
        else:
            encoders = causal_encoders(config, tokenizer, train_examples, val_examples)
    packed = PackedEncoder.build(encoders[0], config.max_length, seed=config.seed) \
        if config.packing and encoders is not None else None
    return Prepared(config=config, device=device, precision=Precision(precision_name, device.kind), spec=spec,
                    train_examples=train_examples, val_examples=val_examples, tokenizer=tokenizer, task=task,
                    causal_encoders=encoders, packed=packed, seq2seq_encoders=pairs)


def resolve_task(config: TrainConfig, spec: ModelSpec | None) -> str:
    """``--task auto``: for instruction data, seq2seq on an encoder-decoder model and causal-LM fine-tuning on
    any other; causal-LM fine-tuning for decoder LLMs; else classification."""
    if config.task != "auto":
        return config.task
    if datasets.holds_instructions(config.data, config.columns):
        return "seq2seq" if spec is not None and is_encoder_decoder(spec) else "causal-lm"
    if spec is not None and is_decoder_llm(spec):
        return "causal-lm"
    return "classification"


def task_fit_problems(config: TrainConfig, spec: ModelSpec, task: str) -> list[str]:
    """The model against the task (:func:`memfit.models.task_problems`), and ``--max-target-length``, which
    only a seq2seq run has."""
    problems = task_problems(spec, task)
    if config.max_target_length is not None and task != "seq2seq":
        problems.append(f"--max-target-length is the target length of --task seq2seq, and this run is {task}: "
                        "drop it")
    limit = getattr(spec.hf_config, "max_position_embeddings", None)
    if task == "seq2seq" and config.max_target_length is not None and limit is not None and \
            config.max_target_length > limit:
        problems.append(f"--max-target-length {config.max_target_length} exceeds the model's {limit} positions; "
                        f"use at most {limit}")
    return problems


def classification_eos(spec: ModelSpec, task: str) -> int | None:
    """The end-of-sequence id that every text of an encoder-decoder's classification run holds exactly once
    (BART's and T5's heads read the hidden state there; :func:`memfit.data.batches.with_one_eos`), else
    ``None``."""
    return end_token_id(spec) if task == "classification" and is_encoder_decoder(spec) else None


def eos_problems(spec: ModelSpec, task: str, tokenizer: Any) -> list[str]:
    """A tokenizer that pads with the end-of-sequence token would put more of it into every padded row than
    an encoder-decoder's classification head allows."""
    eos = classification_eos(spec, task)
    if eos is None or tokenizer is None or tokenizer.pad_token_id != eos:
        return []
    return [f"--model {spec.name}: its tokenizer pads with the end-of-sequence token (id {eos}), which the "
            "classification head of an encoder-decoder finds once per text; give the tokenizer a pad token of its "
            "own (tokenizer_config.json)"]


def seq2seq_encoders(config: TrainConfig, spec: ModelSpec, tokenizer: Any, train: datasets.CausalExamples,
                     val: datasets.CausalExamples) -> tuple[Seq2SeqEncoder, Seq2SeqEncoder]:
    """The training and validation sources and targets, the decoder inputs made by the model's own shift."""
    shift = decoder_input_shift(spec, tokenizer.pad_token_id)
    made = [Seq2SeqEncoder.build(examples, tokenizer, max_length=config.max_length,
                                 target_length=config.target_length, eos_token_id=end_token_id(spec), shift=shift,
                                 choices=examples is val)  # only the validation examples score candidates
            for examples in (train, val)]
    return made[0], made[1]


def causal_encoders(config: TrainConfig, tokenizer: Any, train: datasets.CausalExamples,
                    val: datasets.CausalExamples) -> tuple[CausalEncoder, CausalEncoder]:
    if (train.chat or val.chat) and not getattr(tokenizer, "chat_template", None):
        raise DataError(f"--data {config.data} holds chat messages but --model {config.model}'s tokenizer has no "
                        "chat template; use an instruct model's tokenizer, or write prompt/completion pairs")
    encoders = []
    for name, examples in (("training", train), ("validation", val)):
        try:  # only the validation examples score candidate completions
            encoders.append(CausalEncoder.build(examples, tokenizer, config.max_length, choices=examples is val))
        except DataError as error:
            raise DataError(f"--data {config.data}: {name} {error.problems[0]}") from None
    return encoders[0], encoders[1]


def depth_problems(config: TrainConfig, spec: ModelSpec) -> list[str]:
    if config.train_top_layers is not None and is_encoder_decoder(spec):
        return [f"--train-top-layers counts one stack of blocks, and {spec.name} has an encoder and a decoder; "
                "drop it (or train LoRA adapters on both: --lora-rank)"]
    if config.train_top_layers is not None and config.train_top_layers > spec.num_layers:
        return [f"--train-top-layers {config.train_top_layers} is larger than {spec.name}'s "
                f"{spec.num_layers} layers; use 1..{spec.num_layers}"]
    return []


def _head_problems(config: TrainConfig, spec: ModelSpec, examples: datasets.Examples) -> list[str]:
    problems: list[str] = []
    if isinstance(examples, datasets.CausalExamples):
        return problems
    is_text = isinstance(examples, datasets.TextExamples)
    if is_text != (spec.modality == "text"):
        kinds = ("text", "image") if is_text else ("image", "text")
        problems.append(f"--data {config.data} holds {kinds[0]}s but --model {config.model} is a "
                        f"{spec.modality} model; pair text data with a text model, images with a vision model")
    if spec.head_labels is not None and spec.head_labels != len(examples.label_names):
        problems.append(f"--data {config.data} has {len(examples.label_names)} labels "
                        f"({', '.join(examples.label_names[:5])}) but --model {config.model}'s classification "
                        f"head has {spec.head_labels}; use matching data or a model without a head")
    return problems


def build_model_for(prepared: Prepared, *, weights: bool = True) -> nn.Module:
    """The model of a prepared run, with its techniques applied; ``weights=False``: its structure alone, from
    the config (the same modules; what :mod:`memfit.rank0_load` builds on the meta device)."""
    pad = prepared.tokenizer.pad_token_id if prepared.tokenizer is not None else None
    return build_with_techniques(prepared.spec, prepared.config, label_names=prepared.label_names,
                                 pad_token_id=pad, task=prepared.task, low_dtype=prepared.precision.low_dtype,
                                 weights_dtype=prepared.precision.weights_dtype, weights=weights)


def build_base_for(prepared: Prepared) -> transformers.PreTrainedModel:
    """The model of a prepared run as built before any technique (the same seed: the same random init)."""
    pad = prepared.tokenizer.pad_token_id if prepared.tokenizer is not None else None
    return build_base(prepared.spec, seed=prepared.config.seed, label_names=prepared.label_names, pad_token_id=pad,
                      task=prepared.task)


def build_base(spec: ModelSpec, *, seed: int, label_names: list[str], pad_token_id: int | None,
               task: str, weights: bool = True) -> transformers.PreTrainedModel:
    """The model, seeded, its embeddings tied where the config says so (a no-op where already tied: a
    fake-tensor trace skips init_weights, which is where transformers ties them). ``weights=False``: its
    structure alone (:func:`memfit.models.build_model`)."""
    torch.manual_seed(seed)
    model = build_model(spec, label_names=label_names, pad_token_id=pad_token_id, task=task, weights=weights)
    model.tie_weights()
    return model


def build_with_techniques(spec: ModelSpec, config: TrainConfig, *, label_names: list[str],
                          pad_token_id: int | None, task: str = "classification",
                          low_dtype: torch.dtype | None = None,
                          weights_dtype: torch.dtype | None = None, weights: bool = True) -> nn.Module:
    """Build the model and apply the techniques in order: fp32 weights -> quantise the base -> freeze ->
    checkpointing -> LoRA -> 16-bit weights (mixed precision is a context). ``low_dtype``: the run's 16-bit
    dtype (``None`` under fp32), the compute dtype of quantised layers and the storage of LoRA's frozen weights.
    ``weights_dtype``: every remaining fp32 parameter stored in it (``bf16-true``). ``weights=False``: the
    model's structure, its weights not read (:mod:`memfit.rank0_load`)."""
    model: nn.Module = build_base(spec, seed=config.seed, label_names=label_names, pad_token_id=pad_token_id,
                                  task=task, weights=weights)
    if not loads_as_saved(config, low_dtype):
        settle_as_stored(model, None)  # a checkpoint (or a config) in bf16, a Hub LLM's: the fp32 weights trained
    disable_cache(model)  # a training forward needs no KV cache (see disable_cache)
    quantize_base(model, config.quantize_base, low_dtype or torch.float32)
    if config.quantize_base == "nf4":  # a mixture-of-experts block's stacked expert weights too
        quantize_experts(model, low_dtype or torch.float32)
    apply_freezing(model, freeze_embeddings=config.freeze_embeddings, train_top_layers=config.train_top_layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        apply_checkpointing(model, mode=config.checkpointing, every=config.checkpoint_every)
    if config.lora_rank:
        targets = tuple(name.strip() for name in (config.lora_targets or "").split(",") if name.strip())
        model = apply_lora(model, rank=config.lora_rank, alpha=config.lora_alpha, dropout=config.lora_dropout,
                           targets=targets, train_top_layers=config.train_top_layers, frozen_dtype=low_dtype)
    if loads_as_saved(config, low_dtype):
        settle_as_stored(model, low_dtype)  # a 16-bit checkpoint's trained head and norms in fp32, as an fp32 load's
    if weights_dtype is not None:
        cast_parameters(model, weights_dtype)
    return model


def loads_as_saved(config: TrainConfig, low_dtype: torch.dtype | None) -> bool:
    """Whether a run keeps its weights in the dtype they are saved in: a LoRA base stored in 16 bits anyway
    (mixed precision); every other run trains fp32 weights, upcast from a 16-bit checkpoint."""
    return bool(config.lora_rank) and low_dtype is not None


def build_optimizer_for(model: nn.Module, config: TrainConfig, *,
                        foreach_default: bool | None = None) -> torch.optim.Optimizer:
    """The run's optimizer; ``foreach_default`` stands in for torch's own default when ``config.foreach`` is
    unset (a trace on CPU for a CUDA target must pick what torch would pick on the card)."""
    foreach, fused = step_kernels(config.optimizer, foreach=config.foreach, fused=config.fused,
                                  distributed=config.distributed != "none")
    kahan = uses_kahan(config.kahan, precision=config.precision, optimizer=config.optimizer)
    if foreach is None and not fused and not kahan:  # torch-optimi's own default is memfit's: the loop
        foreach = foreach_default
    return build_optimizer(model, name=config.optimizer, lr=config.lr, weight_decay=config.weight_decay,
                           momentum=config.momentum, foreach=foreach, fused=fused and not kahan,
                           offload=config.offload_optimizer, kahan=kahan,
                           in_backward=config.optimizer_in_backward)
