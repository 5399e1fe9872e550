"""Crash-safe run checkpoints, exact resume, and a clean stop on SIGTERM/SIGINT.

(Not to be confused with gradient checkpointing, :mod:`memfit.techniques.checkpointing`.)

A checkpoint is a directory ``<output>/checkpoints/step-00000012`` (``...-micro-3`` when a signal stopped the
run inside an accumulation window) holding:

- ``model.safetensors``: every weight of the model (of a LoRA run: the trained parameters only, the adapters
  and a classification head; the frozen base is rebuilt from its source, bit for bit, on resume);
- ``grads.safetensors``: the gradients accumulated so far, only in a mid-window checkpoint;
- ``state.pt``: optimizer, scheduler and GradScaler state, the random states (python, numpy, torch, cuda),
  the epoch's sample order and the window's partial loss. Plain tensors and containers: it loads with
  ``torch.load(weights_only=True)``;
- ``progress.json``: the data position (epoch, samples consumed in the epoch, micro-steps done in the
  window), the step counters, the logged history, the OOM-adjusted micro-batch, the resolved config and the
  model's architecture;
- ``COMPLETE.json``, written last: the size and SHA-256 of every other file.

A distributed run (:mod:`memfit.distributed`) saves with ``torch.distributed.checkpoint`` instead: ``dcp/``
holds the model and optimizer state, each rank writing its own shards (FSDP) or rank 0 the replicated
tensors (DDP), ``rng-<rank>.pt`` each rank's random state, and rank 0 writes the rest and the marker once
every rank has finished. Such a checkpoint resumes under any number of ranks and either strategy: the
loader reshards (the windows are global, so the data position carries over exactly; only the random streams
of ranks that did not exist restart). It needs a filesystem every rank sees (one machine, or a shared one).

Writing is atomic: everything goes to a hidden temporary directory, each file is fsynced, the marker is
written last, then the directory is renamed into place and its parent fsynced. A directory without the
marker, or whose files do not match it, is never resumed from; a run killed mid-save leaves the previous
checkpoint as the newest complete one.

Trade-off: a save costs one write (and one read back, for the checksums) of the weights and optimizer state,
about 3x the fp32 parameter bytes for AdamW; ``--save-every`` sets how often that cost is paid.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file, save_model

from memfit.config import OPT_INS
from memfit.errors import CheckpointError
from memfit.techniques.lora import is_lora
from memfit.techniques.optimizer_in_backward import InBackwardOptimizer

DIRECTORY = "checkpoints"
WEIGHTS = "model.safetensors"
GRADS = "grads.safetensors"
STATE = "state.pt"
SHARDED = "dcp"
PROGRESS = "progress.json"
MARKER = "COMPLETE.json"
FORMAT = 1
NOT_LEARNING = ("output_dir", "resume", "overwrite", "save_every", "keep_last", "log_every", "device_profile",
                "reduce_every_micro_step", *OPT_INS)
"""Config fields that change nothing that is learned: no warning when they differ on resume."""


@dataclass(kw_only=True)
class Checkpoint:
    """A loaded checkpoint: ``state`` is what ``state.pt`` held, ``weights`` and ``grads`` are tensors."""

    path: Path
    progress: dict[str, Any]
    """What ``progress.json`` holds: the run's state (:class:`memfit.run_state.RunState`), the OOM-adjusted batch
    sizes and events, the length of ``metrics.jsonl`` at the save."""
    config: dict[str, Any]
    architecture: dict[str, Any]
    state: dict[str, Any]
    weights: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    world_size: int = 1
    """Ranks of the run that wrote it."""
    trainable_only: bool = False
    """``weights`` holds only the trained parameters (a LoRA run: the frozen base is rebuilt from its source)."""

    @property
    def sharded(self) -> bool:
        """Written by a distributed run: model and optimizer state are in ``dcp/``."""
        return (self.path / SHARDED).is_dir()

    def rank_rng(self, rank: int) -> dict[str, Any] | None:
        """The random state rank ``rank`` saved (``None`` when the saving run had fewer ranks)."""
        file = self.path / f"rng-{rank}.pt"
        return torch.load(file, weights_only=True) if file.is_file() else None

    def load_sharded(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Load model and optimizer state into the (wrapped) model of any number of ranks, resharding."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load

        optimizers = _sharded_optimizers(optimizer, saving=False)
        model_state, optimizer_state = get_state_dict(model, optimizers)
        states: dict[str, Any] = optimizer_state["state"]  # type: ignore[assignment]  # (keyed by name)
        unsaved = _unsaved_states(states, self.path / SHARDED) if isinstance(optimizer, InBackwardOptimizer) else []
        for name in unsaved:  # a step in backward's parameter that had no state yet: none to read, none after
            states[name] = {}
        load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(self.path / SHARDED))
        set_state_dict(model, optimizers, model_state_dict=model_state, optim_state_dict=optimizer_state)
        if isinstance(optimizer, InBackwardOptimizer):
            optimizer.loaded_per_parameter()

    def load_weights(self, model: torch.nn.Module) -> None:
        """Copy the saved weights into ``model`` (whose architecture :func:`check_architecture` accepted).

        The file stores a tensor shared by two names (tied embeddings) once; the other name is filled through
        the sharing, so only such names may be missing.
        """
        missing, unexpected = model.load_state_dict(self.weights, strict=False)
        assert not unexpected, unexpected
        if self.trainable_only:
            lost = [name for name, p in model.named_parameters() if p.requires_grad and name not in self.weights]
        else:
            tensors = model.state_dict()
            loaded = {tensors[name].untyped_storage().data_ptr() for name in self.weights}
            lost = [name for name in missing if tensors[name].untyped_storage().data_ptr() not in loaded]
        if lost:
            raise CheckpointError(f"{self.path / WEIGHTS}: has no values for {', '.join(lost[:3])}; delete "
                                  f"{self.path} and resume from an earlier checkpoint")


def architecture(model: torch.nn.Module) -> dict[str, Any]:
    """What a checkpoint must match to load: the model class and every tensor's name and shape."""
    shapes = {name: list(tensor.shape) for name, tensor in model.state_dict().items()}
    return {"class": type(model).__name__, "tensors": shapes,
            "parameters": sum(p.numel() for p in model.parameters())}


def format_mismatch(checkpoint: Checkpoint) -> str:
    """Why a checkpoint cannot resume in this kind of run (single-process vs distributed)."""
    if checkpoint.sharded:
        return (f"--resume {checkpoint.path}: it was written by a distributed run ({checkpoint.world_size} ranks, "
                f"{checkpoint.config.get('distributed')}); resume it with --distributed ddp or fsdp (under torchrun "
                "for more than one rank)")
    return (f"--resume {checkpoint.path}: it was written by a single-process run; resume it without --distributed "
            "(or start the distributed run in a new --output-dir)")


def describe_architecture(arch: dict[str, Any]) -> str:
    return f"{arch['class']}, {arch['parameters']:,} parameters in {len(arch['tensors'])} tensors"


def check_architecture(checkpoint: Checkpoint, model: torch.nn.Module, model_option: str) -> None:
    """Refuse a checkpoint whose tensors do not match ``model``'s names and shapes."""
    current = architecture(model)
    if current != checkpoint.architecture:
        raise CheckpointError(f"--resume {checkpoint.path}: the checkpoint is of another model "
                              f"({describe_architecture(checkpoint.architecture)}) than --model {model_option} "
                              f"({describe_architecture(current)}); resume with the model and labels it was "
                              "trained with, or start a fresh run in a new --output-dir")


RUN_FILES = ("metrics.jsonl", "summary.json", "plan.json", "memory_timeline.json", "model", DIRECTORY)


def resume_checkpoint(output_dir: Path, *, resume: str | None, overwrite: bool) -> Checkpoint | None:
    """The checkpoint to continue from, or ``None`` for a fresh run; refuses to clobber an existing run."""
    if resume is None:
        if output_dir.is_dir() and any(output_dir.iterdir()) and not overwrite:
            raise CheckpointError(f"--output-dir {output_dir} already holds files; choose a new --output-dir, "
                                  "continue the run there with --resume, or replace it with --overwrite")
        return None
    path = latest(output_dir) if resume == "latest" else Path(resume)
    return None if path is None else load(path)


def clear_run(output_dir: Path) -> None:
    """Remove what an earlier run wrote into ``output_dir`` (and nothing else), for a fresh start."""
    for name in RUN_FILES:
        target = output_dir / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()


def save(output_dir: Path, *, model: torch.nn.Module, state: dict[str, Any], progress: dict[str, Any],
         config: dict[str, Any], keep_last: int, grads: dict[str, torch.Tensor] | None = None) -> Path:
    """Write one checkpoint atomically, then keep only the newest ``keep_last``; returns its path."""
    root = output_dir / DIRECTORY
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{progress['step']:08d}" + (f"-micro-{progress['micro_steps_done']}" if grads else "")
    final = root / name
    temporary = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    trainable_only = is_lora(model)  # the frozen base is rebuilt from its source on resume
    if trainable_only:
        save_file({name: p.detach().contiguous() for name, p in model.named_parameters() if p.requires_grad},
                  str(temporary / WEIGHTS))
    else:
        save_model(model, str(temporary / WEIGHTS))
    if grads:
        save_file({key: value.contiguous() for key, value in grads.items()}, str(temporary / GRADS))
    torch.save(state, temporary / STATE)
    payload = {"format": FORMAT, "progress": progress, "config": config,
               "architecture": architecture(model), "weights": "trainable" if trainable_only else "all"}
    (temporary / PROGRESS).write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    _complete(temporary, final)
    _prune(root, keep_last=keep_last, keep=final)
    return final


def save_sharded(output_dir: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 state: dict[str, Any], progress: dict[str, Any], config: dict[str, Any],
                 model_architecture: dict[str, Any],
                 keep_last: int, rank: int, world_size: int, rng: dict[str, Any]) -> Path:
    """A distributed run's checkpoint, written by every rank together (a collective); returns its path.

    ``state`` holds what every rank has alike (scheduler, scaler, data order); rank 0 writes it.
    ``model_architecture`` is :func:`architecture` of the model before it was wrapped.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save as save_shards

    root = output_dir / DIRECTORY
    name = f"step-{progress['step']:08d}"
    final = root / name
    temporary = root / f".tmp-{name}-sharded"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir()
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, _sharded_optimizers(optimizer, saving=True))
    save_shards({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(temporary / SHARDED))
    torch.save(rng, temporary / f"rng-{rank}.pt")
    dist.barrier()  # every rank's files are written
    if rank == 0:
        torch.save(state, temporary / STATE)
        payload = {"format": FORMAT, "progress": progress, "config": config,
                   "architecture": model_architecture, "world_size": world_size}
        (temporary / PROGRESS).write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
        _complete(temporary, final)
        _prune(root, keep_last=keep_last, keep=final)
    dist.barrier()  # no rank goes on (or exits) before the checkpoint is in place
    return final


def _sharded_optimizers(optimizer: torch.optim.Optimizer, *,
                        saving: bool) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
    """What torch's distributed state dicts read and write: the optimizer, or a step in backward's optimizers
    of one parameter each (their states keyed by the parameters' names, as one optimizer's are)."""
    if isinstance(optimizer, InBackwardOptimizer):
        return optimizer.parameter_optimizers(saving=saving)
    return optimizer


def _unsaved_states(states: dict[str, Any], directory: Path) -> list[str]:
    """The parameters (by name) whose optimizer state the checkpoint in ``directory`` does not hold: saved
    empty (a step in backward's parameter not yet updated)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    prefix = "optimizer.state."
    saved = {key[len(prefix):].rsplit(".", 1)[0] for key in FileSystemReader(str(directory)).read_metadata()
             .state_dict_metadata if key.startswith(prefix)}
    return [name for name in states if name not in saved]


def _complete(temporary: Path, final: Path) -> None:
    """Checksum every file into the marker, written last, then move the directory into place atomically."""
    files = {}
    for file in sorted(path for path in temporary.rglob("*") if path.is_file()):
        _fsync(file)
        files[str(file.relative_to(temporary))] = {"bytes": file.stat().st_size, "sha256": _sha256(file)}
    (temporary / MARKER).write_text(json.dumps({"format": FORMAT, "files": files}, indent=1) + "\n")
    _fsync(temporary / MARKER)
    for directory in sorted({path.parent for path in temporary.rglob("*")}, reverse=True):
        _fsync(directory)
    root, name = final.parent, final.name
    if final.exists():  # the same step saved twice (periodic + final): swap, never leave a gap
        stale = root / f".old-{name}-{os.getpid()}"
        final.rename(stale)
        temporary.rename(final)
        shutil.rmtree(stale)
    else:
        temporary.rename(final)
    _fsync(root)


def _prune(root: Path, *, keep_last: int, keep: Path) -> None:
    """Drop leftovers of interrupted saves and all but the newest ``keep_last`` complete checkpoints."""
    for leftover in root.glob(".*-step-*"):
        if not leftover.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(leftover, ignore_errors=True)
    complete = complete_checkpoints(root.parent)
    for old in complete[:-keep_last]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Checkpoint directories with their completion marker, oldest first (by step, then micro-step)."""
    root = output_dir / DIRECTORY
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if path.name.startswith(".") or not (path / MARKER).is_file():
            continue
        try:
            progress = json.loads((path / PROGRESS).read_text())["progress"]
            found.append(((progress["step"], progress["micro_steps_done"]), path))
        except (OSError, ValueError, KeyError):
            continue  # unreadable: load() names the problem if the user points at it
    return [path for _, path in sorted(found)]


def latest(output_dir: Path) -> Path | None:
    complete = complete_checkpoints(output_dir)
    return complete[-1] if complete else None


def load(path: Path) -> Checkpoint:
    """Read and verify a checkpoint; every problem is a :class:`CheckpointError` naming the file."""
    if not path.is_dir():
        raise CheckpointError(f"--resume {path}: no such checkpoint directory; give a directory under "
                              f"<output-dir>/{DIRECTORY}/, or --resume alone for the newest one")
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(f"--resume {path}: the checkpoint is incomplete (no {MARKER}); it was being written "
                              "when the run stopped. Use --resume alone to take the newest complete one")
    try:
        expected = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError):
        raise CheckpointError(f"{marker}: the completion marker is corrupted; delete {path} and resume from an "
                              "earlier checkpoint") from None
    for name, facts in expected.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing from the checkpoint; delete {path} and resume from an earlier "
                                  "checkpoint")
        size = file.stat().st_size
        if size != facts["bytes"]:
            raise CheckpointError(f"{file}: truncated or changed ({size:,} bytes, {facts['bytes']:,} written); "
                                  f"delete {path} and resume from an earlier checkpoint")
        if _sha256(file) != facts["sha256"]:
            raise CheckpointError(f"{file}: corrupted (checksum mismatch); delete {path} and resume from an "
                                  "earlier checkpoint")
    payload = json.loads((path / PROGRESS).read_text())
    if payload.get("format") != FORMAT:
        raise CheckpointError(f"{path / PROGRESS}: checkpoint format {payload.get('format')} is not {FORMAT}; "
                              "resume it with the memfit version that wrote it")
    try:
        state = torch.load(path / STATE, weights_only=True)
    except Exception as error:  # checksum matched, so this is a file memfit did not write
        raise CheckpointError(f"{path / STATE}: cannot be read ({str(error).splitlines()[0]}); delete {path} and "
                              "resume from an earlier checkpoint") from None
    sharded = (path / SHARDED).is_dir()
    return Checkpoint(path=path, progress=payload["progress"], config=payload["config"],
                      architecture=payload["architecture"], state=state,
                      weights={} if sharded else load_file(str(path / WEIGHTS)),
                      grads=load_file(str(path / GRADS)) if (path / GRADS).is_file() else {},
                      world_size=int(payload.get("world_size", 1)),
                      trainable_only=payload.get("weights") == "trainable")


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``"name: saved -> current"`` for every learning-relevant option that differs."""
    return [f"{name}: {saved.get(name)!r} -> {current.get(name)!r}"
            for name in sorted(set(saved) | set(current))
            if name not in NOT_LEARNING and saved.get(name) != current.get(name)]


def rng_state(device: torch.device) -> dict[str, Any]:
    """Python, NumPy, torch (and this CUDA device's) random states, as weights_only-loadable values."""
    name, keys, position, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"name": name, "keys": np.asarray(keys).tolist(), "pos": int(position),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = state["numpy"]
    keys = numpy["keys"]  # a list of ints (a tensor in checkpoints of earlier versions)
    np.random.set_state((numpy["name"], np.asarray(keys.tolist() if isinstance(keys, torch.Tensor) else keys,
                                                   dtype=np.uint32), numpy["pos"], numpy["has_gauss"],
                         numpy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class StopSignals:
    """Turns the first SIGTERM/SIGINT into a request the loop honours at the next micro-step boundary.

    A second signal of either kind gets the default behaviour back (SIGINT: KeyboardInterrupt; SIGTERM: the
    process ends). Only the main thread can install handlers; elsewhere this does nothing.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def requested(self) -> bool:
        return self.received is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self.received is not None:
            self._restore()
            signal.raise_signal(number)
            return
        self.received = number

    def _restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignals]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        for number in (signal.SIGTERM, signal.SIGINT):
            self._previous[number] = signal.signal(number, self._handle)
        try:
            yield self
        finally:
            self._restore()

