"""Every architecture transformers ships, tried: a tiny config of each, estimated or refused in one line.

For each ``model_type`` in transformers' causal-LM, sequence-classification and image-classification auto maps
(plus its sequence-to-sequence map's encoder-decoders), :func:`tiny_config` builds a config from the class's own
defaults, shrunk to two blocks of width 64 (per-layer lists cut to two layers of different kinds, so a hybrid
keeps one of each). :func:`sweep` estimates one step of each on the CPU profile, in this process. Each outcome is
``estimated``, ``refused`` (memfit's one-line error: :class:`memfit.support.UnsupportedModel` or another
:class:`~memfit.errors.MemfitError`), or ``no tiny config``: the shrunk config does not run a plain forward in
transformers itself (or cannot be made), so it says nothing about memfit. Anything else is a traceback, which
tests/integration/test_sweep.py fails on.

    python -m memfit.sweep --write docs/architectures.md
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.models.auto import modeling_auto

from memfit.config import TrainConfig
from memfit.errors import MemfitError
from memfit.quiet import quiet_transformers

SMALL: dict[str, Any] = {
    "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "n_layers": 2, "encoder_layers": 2, "decoder_layers": 2,
    "num_decoder_layers": 2, "hidden_size": 64, "n_embd": 64, "d_model": 64, "intermediate_size": 128,
    "n_inner": 128, "d_ff": 128, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "num_attention_heads": 4,
    "n_head": 4, "num_heads": 4, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "d_kv": 16, "rotary_dim": 8, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "moe_intermediate_size": 32, "num_experts_per_tok": 2, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_head_dim": 16, "attn_layer_period": 2, "attn_layer_offset": 1,
    "expert_layer_period": 2, "expert_layer_offset": 1, "full_attention_interval": 2, "attn_layer_indices": [1],
    "first_k_dense_replace": 1,
}
"""Two blocks of width 64: the sizes a tiny config takes where its class has the field."""
LATENT_ATTENTION: dict[str, Any] = {"num_key_value_heads": 4, "head_dim": 8, "qk_rope_head_dim": 8,
                                    "qk_nope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 16}
"""Multi-head latent attention (DeepSeek's): as many K/V heads as query heads, its own head sizes."""
TASKS: dict[str, dict[str, Any]] = {"causal-lm": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
         "classification": modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
         "image-classification": modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
         "seq2seq": modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES}
OUTCOMES = ("estimated", "refused", "no tiny config")
TRACEBACK = "traceback"
"""Not an outcome memfit allows: an error that is not one of memfit's lines (tests/integration/test_sweep.py)."""


@dataclass(frozen=True, slots=True)
class SweepRow:
    model_type: str
    task: str
    """The task the architecture was estimated for: ``causal-lm``, ``seq2seq`` or ``classification``."""
    outcome: str
    detail: str
    """The peak bytes estimated, or the one line of the refusal, or why there is no tiny config."""


def model_types() -> list[str]:
    """Every model_type of the causal-LM, sequence-classification and image-classification maps, and the
    encoder-decoders of the sequence-to-sequence map that also have a sequence-classification head."""
    names = set(TASKS["causal-lm"]) | set(TASKS["classification"]) | set(TASKS["image-classification"])
    return sorted(names | (set(TASKS["seq2seq"]) & set(TASKS["classification"])))


def task_for(model_type: str) -> str:
    """Decoders as causal LMs, encoder-decoders as seq2seq, the rest as classifiers (text or image)."""
    if model_type in TASKS["seq2seq"]:
        return "seq2seq"
    return "causal-lm" if model_type in TASKS["causal-lm"] else "classification"


def tiny_config(model_type: str) -> transformers.PretrainedConfig:
    """The config class's defaults, two blocks of width 64 (sub-configs too), per-layer lists of two layers."""
    config_class = transformers.CONFIG_MAPPING[model_type]
    defaults = config_class()
    values = _shrunk(defaults.to_dict())
    for name in getattr(defaults, "sub_configs", None) or {}:
        sub = getattr(defaults, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            values[name] = {**sub.to_dict(), **_shrunk(sub.to_dict())}
    config = config_class(**values)
    architecture = _architecture(model_type)
    if architecture is not None:
        config.architectures = [architecture]
    return config


def _shrunk(defaults: dict[str, Any]) -> dict[str, Any]:
    # only where the default is of the same kind (Swin's num_heads is a list per stage: kept)
    values = {name: value for name, value in SMALL.items()
              if name in defaults and (defaults[name] is None or type(defaults[name]) is type(value))}
    if defaults.get("n_group"):  # group-limited routing: 4 experts in 2 groups
        values.update(n_group=2, topk_group=1)
    if "kv_lora_rank" in defaults:
        values.update({name: value for name, value in LATENT_ATTENTION.items() if name in defaults})
    for name, value in defaults.items():
        if isinstance(value, list) and (name.endswith("layer_types") or name == "block_types") and value:
            others = [kind for kind in value if kind != value[0]]
            values[name] = [value[0], others[0] if others else value[0]]
    return values


def _architecture(model_type: str) -> str | None:
    for mapping in (TASKS["causal-lm"], TASKS["seq2seq"], TASKS["classification"], TASKS["image-classification"]):
        name = mapping.get(model_type)
        if name:
            return name[0] if isinstance(name, tuple | list) else str(name)
    return None


def sweep(names: Iterable[str] | None = None) -> Iterator[SweepRow]:
    """Each architecture's outcome, in this process (a temporary directory per config)."""
    from memfit.memory.estimate import estimate

    with tempfile.TemporaryDirectory() as root, quiet_transformers(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names if names is not None else model_types():
            yield _one(name, Path(root), estimate)


def _one(name: str, root: Path, estimate: Any) -> SweepRow:
    task = task_for(name)
    try:
        config = tiny_config(name)
        config.save_pretrained(root / name)
    except Exception as error:  # the class's own validation refuses its shrunk defaults
        return SweepRow(name, task, "no tiny config", _first_line(error))
    if task == "seq2seq" and not getattr(config, "is_encoder_decoder", False):
        task = "causal-lm" if name in TASKS["causal-lm"] else "classification"  # a decoder in the seq2seq map
    train_config = TrainConfig(model=str(root / name), task="classification" if task == "classification" else task,
                               effective_batch=2, max_length=16, precision="fp32")
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            # one optimizer step: what an architecture's code can refuse runs in it (forward, backward, the
            # step); the second step of memfit estimate repeats the same code with the state in place
            result = estimate(train_config, seq_len=16, image_size=None, steps=1)
    except MemfitError as error:
        problem = _plain_forward_problem(config, task)
        if problem is not None:
            return SweepRow(name, task, "no tiny config", problem)
        return SweepRow(name, task, "refused", error.problems[0])
    except Exception as error:  # a traceback a user would see: reported, never hidden
        return SweepRow(name, task, TRACEBACK, _first_line(error))
    return SweepRow(name, task, "estimated", str(result.peak_bytes))


def _plain_forward_problem(config: transformers.PretrainedConfig, task: str) -> str | None:
    """Why the tiny config does not run a plain forward and backward in transformers, or ``None`` if it does."""
    try:
        model, inputs = _plain_model(config, task)
        output = model(**inputs)
        tensor = output.logits if getattr(output, "logits", None) is not None else output[0]
        tensor.float().sum().backward()
    except Exception as error:
        return _first_line(error)
    return None


def _plain_model(config: transformers.PretrainedConfig, task: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    model_type = config.model_type
    if task == "classification" and model_type not in TASKS["classification"]:  # an image classifier
        model = transformers.AutoModelForImageClassification.from_config(config)
        size = getattr(config, "image_size", None) or getattr(getattr(config, "vision_config", None),
                                                               "image_size", 224)
        size = size[0] if isinstance(size, list | tuple) else int(size or 224)
        channels = int(getattr(config, "num_channels", 3) or 3)
        return model, {"pixel_values": torch.randn(2, channels, size, size)}
    ids = torch.randint(3, 60, (2, 16))
    if task == "seq2seq":
        return transformers.AutoModelForSeq2SeqLM.from_config(config), {"input_ids": ids, "decoder_input_ids": ids}
    auto = transformers.AutoModelForCausalLM if task == "causal-lm" else transformers.AutoModelForSequenceClassification
    return auto.from_config(config), {"input_ids": ids}


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    line = f"{type(error).__name__}: {first}" if first else type(error).__name__
    return line if len(line) <= 120 else line[:117] + "..."


def markdown(rows: list[SweepRow]) -> str:
    """The generated architecture list: counts per outcome and task, then one table per outcome."""
    lines = ["# Architectures", "",
             "<!-- generated by `python -m memfit.sweep --write docs/architectures.md`; do not edit -->", "",
             f"Every `model_type` of transformers {transformers.__version__}'s causal-LM, sequence-classification "
             "and image-classification auto maps (and the encoder-decoders of its sequence-to-sequence map), as a "
             "tiny config (the class's defaults, two blocks of width 64) estimated for one optimizer step on the CPU "
             "(forward, backward and the step; memfit estimate's second step repeats that code). "
             "*Estimated*: memfit traces the real step (exact on CPU). *Refused*: memfit says why in one line "
             "instead (`memfit: error: <model_type>: not supported yet (...)`). *No tiny config*: the shrunk "
             "defaults do not run a plain forward in transformers itself, so they say nothing either way; the "
             "architecture may well work at its published sizes.", "",
             "| task | estimated | refused | no tiny config |", "|---|---:|---:|---:|"]
    for task in ("causal-lm", "seq2seq", "classification"):
        counts = [sum(1 for row in rows if row.task == task and row.outcome == outcome) for outcome in OUTCOMES]
        lines.append(f"| {task} | " + " | ".join(str(count) for count in counts) + " |")
    totals = [sum(1 for row in rows if row.outcome == outcome) for outcome in OUTCOMES]
    lines.append("| all | " + " | ".join(str(count) for count in totals) + " |")
    for outcome in OUTCOMES:
        chosen = [row for row in rows if row.outcome == outcome]
        lines += ["", f"## {outcome.capitalize()} ({len(chosen)})", ""]
        if outcome == "estimated":
            for task in ("causal-lm", "seq2seq", "classification"):
                names = [f"`{row.model_type}`" for row in chosen if row.task == task]
                lines.append(f"- **{task}** ({len(names)}): {', '.join(names)}")
            continue
        lines += ["| model_type | task | why |", "|---|---|---|"]
        lines += [f"| `{row.model_type}` | {row.task} | {row.detail.replace('|', '/')} |" for row in chosen]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memfit.sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="write the markdown list here (default: print it)")
    parser.add_argument("model_types", nargs="*", help="only these (default: every one)")
    args = parser.parse_args(argv)
    rows = list(sweep(args.model_types or None))
    failures = [row for row in rows if row.outcome == TRACEBACK]
    if failures:
        for row in failures:
            print(f"{row.model_type} ({row.task}): {row.detail}")
        return 1
    text = markdown(rows)
    if args.write is not None:
        args.write.write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
