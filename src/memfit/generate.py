"""``memfit generate``: a greedy completion from a fine-tuned causal LM (or a pretrained LLM preset), or the
target a fine-tuned seq2seq model (T5, BART) writes for a source.

A LoRA run saves its adapter (PEFT's format) rather than a full model: generating from it loads the merged
model that ``--merge`` wrote beside it, else rebuilds the base the run trained (the model it names, built as
the run built it: the same pretrained weights, or the same seeded random init) and merges the adapter in.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

from memfit.errors import ConfigError

ADAPTER_CONFIG = "adapter_config.json"


def model_directory(source: str) -> Path:
    """A run dir (its ``model``, or a LoRA run's ``model/merged``), an adapter dir, a model dir, or an LLM preset
    that ships weights."""
    path = Path(source).expanduser()
    for directory in (path / "model" / "merged", path / "merged", path / "model", path):
        if (directory / "config.json").is_file() or (directory / ADAPTER_CONFIG).is_file():
            return directory
    from memfit.models import resolve_model

    spec = resolve_model(source, weights=True, log=_log)
    if spec.weights_dir is None:
        raise ConfigError(f"{source}: a preset without weights generates noise; give a run dir or a model dir")
    return spec.weights_dir


def generate(source: str, prompt: str, *, max_new_tokens: int = 64, raw: bool = False) -> str:
    """The greedy completion of ``prompt`` (one user turn through the chat template, unless ``raw`` or the
    tokenizer has none); for a seq2seq model, the target it writes for ``prompt`` as its source."""
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1 (got {max_new_tokens})")
    from memfit.quiet import quiet_imports

    quiet_imports()
    import memfit.models  # noqa: F401  (offline, quiet transformers: no hub, no progress bars)

    directory = model_directory(source)
    import torch
    import transformers

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
            model = adapted_model(directory, tokenizer.pad_token_id) if (directory / ADAPTER_CONFIG).is_file() \
                else language_model(directory)
    except (ValueError, OSError) as error:
        raise ConfigError(f"{source}: not a causal LM or seq2seq model memfit can load "
                          f"({str(error).splitlines()[0]}); give the run dir of a --task causal-lm or seq2seq "
                          "run") from None
    model.eval()
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    if encoder_decoder:  # the source as the run's encoder read it (memfit.data.seq2seq): no template
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    elif not raw and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    written = output[0, ids.shape[1]:].tolist()  # a decoder-only model's output starts with the prompt
    if encoder_decoder:  # an encoder-decoder's with its start token; it ends with the model's end token
        written = [token for token in output[0].tolist() if token not in control_ids(model.config)]
    return str(tokenizer.decode(written, skip_special_tokens=True)).strip()


def control_ids(config: Any) -> set[int]:
    """An encoder-decoder's start, end and pad ids, from its config: a tokenizer borrowed by a config-only
    model (memfit's packaged WordPiece) does not know them as special."""
    names = ("decoder_start_token_id", "eos_token_id", "pad_token_id")
    return {value for value in (getattr(config, name, None) for name in names) if isinstance(value, int)}


def language_model(directory: Path) -> Any:
    """The saved model of a causal-LM or seq2seq run (an encoder-decoder config: the seq2seq head)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(directory), trust_remote_code=False)
    auto_class = transformers.AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) \
        else transformers.AutoModelForCausalLM
    return auto_class.from_pretrained(str(directory), trust_remote_code=False)


def adapted_model(adapter_dir: Path, pad_token_id: int | None) -> Any:
    """The causal LM of a LoRA run: its base, built as the run built it, with the adapter merged in."""
    from memfit.build import build_base
    from memfit.techniques.lora import merge_adapter

    base_name, seed, task = adapter_run(adapter_dir)
    if task not in ("causal-lm", "seq2seq"):
        raise ConfigError(f"{adapter_dir}: the adapter of a {task} run, not a causal LM or seq2seq model; give the "
                          "run dir of a --task causal-lm or seq2seq run")
    spec = base_spec(adapter_dir, base_name)
    if spec.weights_dir is None and not (adapter_dir.parent / "summary.json").is_file():
        raise ConfigError(f"{adapter_dir}: its base {base_name} has no pretrained weights, and the run's seed (in "
                          "its summary.json) is not beside it to rebuild the random init; give the run dir")
    base = build_base(spec, seed=seed, label_names=[], pad_token_id=pad_token_id, task=task)
    return merge_adapter(adapter_dir, base)


def adapter_run(adapter_dir: Path) -> tuple[str, int, str]:
    """(base model, seed, task) of the run that saved the adapter: its ``summary.json`` beside the adapter,
    else the base PEFT recorded (the default seed, a causal LM)."""
    from memfit.config import TrainConfig

    try:
        summary = json.loads((adapter_dir.parent / "summary.json").read_text())
        return str(summary["config"]["model"]), int(summary["config"]["seed"]), str(summary["task"])
    except (OSError, ValueError, KeyError, TypeError):
        adapter = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
        return str(adapter.get("base_model_name_or_path") or ""), TrainConfig().seed, "causal-lm"


def base_spec(adapter_dir: Path, base_name: str) -> Any:
    """The base model's :class:`~memfit.models.ModelSpec`, or one line saying why it cannot be found here."""
    from memfit.models import resolve_model

    try:
        return resolve_model(base_name, weights=True, log=_log)
    except ConfigError as error:
        raise ConfigError(f"{adapter_dir}: the LoRA adapter's base model cannot be loaded ({error.problems[0]}); "
                          "run generate where the run was trained, or train with --merge for a standalone "
                          "model") from None


def _log(line: str) -> None:
    print(f"memfit: {line}", file=sys.stderr)
