"""Models named by Hugging Face Hub id (``org/name`` or ``org/name@revision``), local cache first.

memfit reads the Hub the way transformers does, with one difference in order: the local cache is looked at
*first*, so a model that is already there resolves without a network request (and with ``HF_HUB_OFFLINE=1``
nothing else is tried). What is fetched depends on the command:

- estimating and planning need the configuration only: ``config.json``, plus the generation and tokenizer
  configs when the repository has them (kilobytes, never weights);
- training and generating need the full snapshot: configs, tokenizer files and the weights as safetensors
  (``*.bin`` pickles are never downloaded, since loading them runs code).

Online, missing files are downloaded with huggingface_hub's progress bars on stderr. Every failure (offline
and not cached, gated without a token, no such repository or revision, no safetensors weights) is one
:class:`~memfit.errors.ConfigError` line that names the fix. The cache location and offline mode are read
from the environment at each call (``HF_HUB_CACHE``, ``HF_HOME``, ``HF_HUB_OFFLINE``), so setting them in a
running process works too.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.errors import ConfigError

CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer_config.json")
"""What an estimate or a plan reads: the architecture, and what the task needs to know of the tokenizer."""
SNAPSHOT_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja")
"""What training reads: configs, tokenizer files and safetensors weights (no pickled ``*.bin``)."""
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")
LOGIN_FIX = "log in with `hf auth login` or set HF_TOKEN"


@dataclass(frozen=True, slots=True)
class HubModel:
    """A Hub repository and the revision asked for (a branch, a tag or a commit hash)."""

    repo_id: str
    revision: str

    @property
    def label(self) -> str:
        return self.repo_id if self.revision == "main" else f"{self.repo_id}@{self.revision}"


def parse_hub_id(name: str) -> HubModel | None:
    """``org/name[@revision]`` as a :class:`HubModel`; ``None`` for anything else (presets, paths)."""
    if name.startswith((".", "/", "~")):
        return None
    match = HUB_ID.fullmatch(name)
    if match is None:
        return None
    return HubModel(repo_id=match["repo"], revision=match["revision"] or "main")


def is_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as set now, read the way huggingface_hub reads it."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def cache_dir() -> Path:
    """The Hub cache as the environment names it now: ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub`` or ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return cache_home / "huggingface" / "hub"


def resolve(model: HubModel, *, weights: bool) -> Path:
    """The snapshot directory holding what is needed (``weights``: the full snapshot, else the configs)."""
    cached = cached_snapshot(model)
    if cached is not None and _complete(cached, weights=weights):
        return cached
    if is_offline():
        raise ConfigError(_offline_message(model, cached, weights=weights))
    with _hub_errors(model):
        path = Path(_download(model, weights=weights))
    if not _complete(path, weights=weights):
        what = ("safetensors weights and tokenizer files (memfit does not load pickled *.bin files)" if weights
                else "config.json")
        raise ConfigError(f"--model {model.label}: the repository has no {what}; pass a local model directory "
                          "instead")
    return path


def _download(model: HubModel, *, weights: bool) -> str:
    from huggingface_hub import snapshot_download

    from memfit.quiet import hub_progress_bars

    patterns = list(SNAPSHOT_PATTERNS if weights else CONFIG_FILES)
    bars = hub_progress_bars(True)  # a download is long work: show it (on stderr), then restore what was set
    try:
        return str(snapshot_download(model.repo_id, revision=model.revision, allow_patterns=patterns,
                                     cache_dir=cache_dir()))
    finally:
        hub_progress_bars(bars)


def cached_snapshot(model: HubModel, *, kind: str = "model") -> Path | None:
    """The cached snapshot folder of the revision (a ref such as ``main``, or a commit hash), if any; ``kind``:
    ``model`` or ``dataset`` repositories."""
    folder = _repo_folder(model.repo_id, kind)
    ref = folder / "refs" / model.revision
    commit = ref.read_text().strip() if ref.is_file() else model.revision
    snapshot = folder / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.txt", "vocab.json", "spiece.model",
                   "sentencepiece.bpe.model", "preprocessor_config.json")
"""One of these makes a snapshot's tokenizer (or a vision model's image processor) usable for training."""


def _complete(snapshot: Path, *, weights: bool) -> bool:
    if not (snapshot / "config.json").is_file():
        return False
    if not weights:
        return True
    has_tokenizer = any((snapshot / name).is_file() for name in TOKENIZER_FILES)
    return safetensors_files(snapshot) is not None and has_tokenizer


def safetensors_files(directory: Path) -> list[Path] | None:
    """The safetensors weight files of a model directory, every shard of its index present; else ``None``."""
    import json

    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        return None
    shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
    paths = [directory / shard for shard in shards]
    return paths if paths and all(path.is_file() for path in paths) else None


def read_weights(directory: Path) -> dict[str, Any]:
    """Every tensor of a model directory's safetensors weights (one file, or every shard of its index)."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for path in safetensors_files(directory) or []:
        tensors.update(load_file(str(path)))
    return tensors


def _offline_message(model: HubModel, cached: Path | None, *, weights: bool) -> str:
    need = "its weights (safetensors) or tokenizer files" if weights else "its config.json"
    if cached is not None:
        where = f"the cached snapshot {cached} lacks {need}"
    elif revisions := _cached_revisions(model.repo_id):
        where = f"revision {model.revision!r} is not in the local cache (cached: {', '.join(revisions)})"
    else:
        where = f"it is not in the local cache {cache_dir()} (and no local directory has that name)"
    return (f"--model {model.label}: {where}, and HF_HUB_OFFLINE is set; unset HF_HUB_OFFLINE to download it, "
            "or pass a local model directory")


def _repo_folder(repo_id: str, kind: str = "model") -> Path:
    return cache_dir() / (f"{kind}s--" + repo_id.replace("/", "--"))


def _cached_revisions(repo_id: str) -> list[str]:
    refs = _repo_folder(repo_id) / "refs"
    return sorted(str(path.relative_to(refs)) for path in refs.rglob("*") if path.is_file())


@contextlib.contextmanager
def _hub_errors(model: HubModel) -> Iterator[None]:
    """huggingface_hub's exceptions as one line each that names the fix."""
    from huggingface_hub import errors

    name = f"--model {model.label}"
    try:
        yield
    except errors.GatedRepoError:
        raise ConfigError(f"{name}: the repository is gated; accept its terms on huggingface.co/{model.repo_id} "
                          f"and {LOGIN_FIX}") from None
    except errors.RepositoryNotFoundError:
        raise ConfigError(f"{name}: no such repository on the Hub (or it is private: {LOGIN_FIX}); a local model "
                          "directory works too") from None
    except errors.RevisionNotFoundError:
        raise ConfigError(f"{name}: the repository has no revision {model.revision!r}; name a branch, a tag or a "
                          f"commit of {model.repo_id}") from None
    except errors.LocalEntryNotFoundError as error:  # the Hub could not be reached, and the cache lacks it
        raise ConfigError(f"{name}: the Hub cannot be reached ({_first_line(error)}) and the local cache lacks it; "
                          "connect, or pass a local model directory") from None
    except (errors.HfHubHTTPError, OSError) as error:
        raise ConfigError(f"{name}: download failed ({_first_line(error)}); try again, or pass a local model "
                          "directory") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def cached_models() -> list[dict[str, Any]]:
    """The models in the local Hub cache: repository, revisions (refs), size on disk, whether weights are there."""
    hub = cache_dir()
    if not hub.is_dir():
        return []
    found = []
    for folder in sorted(hub.glob("models--*")):
        snapshots = [path for path in (folder / "snapshots").glob("*") if (path / "config.json").is_file()]
        if not snapshots:
            continue
        repo_id = folder.name.removeprefix("models--").replace("--", "/", 1)
        files = {path.resolve() for snapshot in snapshots for path in snapshot.rglob("*") if path.is_file()}
        size = sum(path.stat().st_size for path in files)
        found.append({"repo_id": repo_id, "revisions": _cached_revisions(repo_id),
                      "bytes": size, "weights": any(safetensors_files(path) for path in snapshots)})
    return found
