"""Helpers shared by the tests: run the CLI, read a run's files, compare weights, a do-nothing phase tracker."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tests.conftest import load_weights


def memfit(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m memfit ARGS`` in a subprocess, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "memfit", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


def run_main(args: list[str], capsys: Any) -> tuple[int, str, str]:
    """``memfit ARGS`` in this process through :func:`memfit.cli.main`: (exit code, stdout, stderr)."""
    from memfit.cli import main

    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def in_process(args: list[str], capsys: Any, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``memfit ARGS`` through :func:`memfit.cli.main` in this process (in ``cwd``), as a completed process:
    the same exit code and stderr as the command's, without a new interpreter's start-up."""
    from memfit.cli import main

    with contextlib.chdir(cwd) if cwd is not None else contextlib.nullcontext():
        try:
            code = main(args)
        except SystemExit as exit_:  # the argument parser's own errors
            code = int(exit_.code or 0)
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(["memfit", *args], code, captured.out, captured.err)


def read_metrics(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl``, all of them or those of one ``type``."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if kind is None or line["type"] == kind]


def train_losses(run_dir: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(run_dir, "train")]


def assert_weights_close(run_dir: Path, ref_dir: Path, *, atol: float) -> None:
    """The saved models of two runs hold the same tensors, within ``atol`` (0: bit for bit)."""
    assert_tensors_close(load_weights(run_dir), load_weights(ref_dir), atol=atol)


def assert_tensors_close(tensors: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], *,
                         atol: float) -> None:
    assert tensors.keys() == reference.keys()
    for name in tensors:
        if atol == 0:
            assert torch.equal(tensors[name], reference[name]), name
        else:
            torch.testing.assert_close(tensors[name], reference[name], atol=atol, rtol=0, msg=name)


class NoPhases:
    """A phase tracker that records nothing (the step's ``phases`` argument where memory is not the point)."""

    def track(self, *tensors: torch.Tensor, category: str | None = None) -> None: ...

    def track_module(self, module: torch.nn.Module) -> None: ...

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def measured_and_estimated_phases(tmp_path: Path, config: Any, capsys: Any) -> tuple[dict[str, int], dict[str, int]]:
    """(the peak per phase ``memfit train`` measures for ``config``, the estimate's), for texts that fill
    ``--max-length`` (no micro-batch is padded)."""
    from memfit.memory.estimate import estimate

    path = tmp_path / "config.json"
    path.write_text(json.dumps({name: value for name, value in config.to_dict().items() if value is not None}))
    result = in_process(["train", "--config", str(path), "--json"], capsys)
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout)["peak_memory_by_phase"]
    predicted = estimate(config, padded=False)
    return {name: measured[name] for name in predicted.phases}, predicted.phases


HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_hub_cache(home: Path, repo_id: str, source: Path, *, files: tuple[str, ...] | None = None,
                    ref: str = "main", commit: str = HUB_COMMIT) -> Path:
    """The cache layout huggingface_hub writes: ``blobs/<sha>``, ``snapshots/<commit>/<file>`` linking to the blob,
    ``refs/<ref>`` holding the commit. ``files``: which of ``source``'s files are cached (all by default)."""
    folder = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (folder / "blobs").mkdir(exist_ok=True)
    for path in sorted(source.iterdir()):
        if files is not None and path.name not in files:
            continue
        blob = folder / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, blob)
        if not (snapshot / path.name).exists():
            (snapshot / path.name).symlink_to(Path("../../blobs") / blob.name)
    return snapshot
