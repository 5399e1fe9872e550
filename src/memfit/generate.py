"""``memfit generate``: a greedy completion from a fine-tuned causal LM (or a pretrained LLM preset)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from memfit.errors import ConfigError


def model_directory(source: str) -> Path:
    """A run dir (its ``model``), a model dir, or an LLM preset that ships weights."""
    path = Path(source).expanduser()
    if (path / "model" / "config.json").is_file():
        return path / "model"
    if (path / "config.json").is_file():
        return path
    from memfit.models import resolve_model

    spec = resolve_model(source, log=lambda line: print(f"memfit: {line}", file=sys.stderr))
    if spec.weights_dir is None:
        raise ConfigError(f"{source}: a preset without weights generates noise; give a run dir or a model dir")
    return spec.weights_dir


def generate(source: str, prompt: str, *, max_new_tokens: int = 64, raw: bool = False) -> str:
    """The greedy completion of ``prompt`` (one user turn through the chat template, unless ``raw`` or the
    tokenizer has none)."""
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
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
            model = transformers.AutoModelForCausalLM.from_pretrained(str(directory))
    except (ValueError, OSError) as error:
        raise ConfigError(f"{source}: not a causal LM memfit can load ({str(error).splitlines()[0]}); give the "
                          "run dir of a --task causal-lm run") from None
    model.eval()
    if not raw and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return str(tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True)).strip()
