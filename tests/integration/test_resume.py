"""Kill a real training process at exact and random moments, resume it in a fresh one: nothing changes.

Each variant trains once uninterrupted (the reference), once in a subprocess that is stopped part-way, and
once more in a fresh subprocess with ``--resume``. The per-step losses, learning rates, gradient norms,
evaluations and final weights must be bit-for-bit those of the reference, and the windows of samples the two
processes committed must be the reference's sequence: nothing skipped, nothing repeated.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import memfit.windows
from memfit.checkpoints import complete_checkpoints
from memfit.cli import main
from tests.conftest import TINY_BERT, write_model_dir, write_pairs, write_reviews, write_tiny_llm
from tests.helpers import assert_weights_close, read_metrics

pytestmark = pytest.mark.slow  # a minute or more of CPU: outside make test-fast

DRIVER = Path(__file__).with_name("interrupt_driver.py")
TIMING = ("samples_per_second", "step_seconds", "memory_bytes", "peak_memory_bytes", "rss_bytes")
VARIANTS = {  # name: (extra options, interruption, expected exit code of the interrupted process)
    # every variant but the step in backward accumulates two micro-batches per window; SIGKILL after a
    # checkpoint, bf16, frozen layers
    "bf16-frozen": (["--precision", "bf16", "--freeze-embeddings", "--train-top-layers", "1"], "kill:7",
                    -signal.SIGKILL),
    "during-save": ([], "save:2", -signal.SIGKILL),
    # dropout: its RNG state resumes from a partial window's checkpoint
    "sigterm-mid-window": (["--dropout-model"], "term:5", 128 + signal.SIGTERM),
    "sigint-at-window-end": ([], "int:6", 128 + signal.SIGINT),
    "causal-lm": (["--causal-model", "--precision", "bf16"], "kill:7", -signal.SIGKILL),
    # packed rows are the samples: the epochs' orders of rows resume, a window stopped part-way continues
    "causal-lm-packed-sigterm-mid-window": (["--causal-model", "--packing"], "term:5", 128 + signal.SIGTERM),
    # 16-bit weights with Kahan buffers, each parameter updated in backward (one micro-batch per window)
    "bf16-true-in-backward": (["--causal-model", "--precision", "bf16-true", "--optimizer-in-backward",
                               "--max-grad-norm", "none", "--micro-batch-size", "8"], "kill:7", -signal.SIGKILL),
    # LoRA adapters (with dropout: its RNG too) on an NF4 base; checkpoints of the trained parameters only, the
    # frozen base rebuilt bit for bit on resume
    "qlora-sigterm-mid-window": (["--causal-model", "--precision", "bf16", "--lora-rank", "4", "--lora-dropout",
                                  "0.1", "--quantize-base", "nf4"], "term:5", 128 + signal.SIGTERM),
}
MARKERS = ("--dropout-model", "--causal-model")


def train_args(model: Path, data: Path, out: Path, extra: list[str]) -> list[str]:
    return ["train", "--model", str(model), "--data", str(data), "--text-column", "review", "--label-column",
            "sentiment", "--max-length", "32", "--effective-batch", "8", "--micro-batch-size", "4",
            "--precision", "fp32", "--epochs", "2", "--max-steps", "14", "--lr", "1e-3", "--log-every", "1",
            "--save-every", "2", "--keep-last", "2", "--output-dir", str(out), *extra]


def driver(args: list[str], *, interrupt: str = "", probe: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "INTERRUPT": interrupt, "PROBE": str(probe)}
    return subprocess.run([sys.executable, str(DRIVER), *args], capture_output=True, text=True, env=env,
                          timeout=600)


class References:
    """Uninterrupted runs, one per set of options, made on first use and shared by the tests of this module:
    (the run's directory, the probe file of its windows)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs: dict[tuple[str, ...], tuple[Path, Path]] = {}

    def get(self, model: Path, data: Path, extra: list[str]) -> tuple[Path, Path]:
        key = (str(model), str(data), *extra)
        if key not in self.runs:
            out = self.root / f"ref-{len(self.runs)}"
            probe = self.root / f"ref-{len(self.runs)}.probe"
            real_cut = memfit.windows.cut

            def cut(indices: Any, size: int) -> Any:
                if isinstance(indices, list):
                    with probe.open("a") as file:
                        file.write(json.dumps(indices) + "\n")
                return real_cut(indices, size)

            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(memfit.windows, "cut", cut)
                assert main(train_args(model, data, out, extra)) == 0
            self.runs[key] = (out, probe)
        return self.runs[key]


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> References:
    return References(tmp_path_factory.mktemp("references"))


def records(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    train = [{k: v for k, v in line.items() if k not in TIMING} for line in read_metrics(run_dir, "train")]
    return train, read_metrics(run_dir, "eval")


def windows(probe: Path) -> list[list[int]]:
    return [json.loads(line) for line in probe.read_text().splitlines()] if probe.exists() else []


def assert_same_run(run_dir: Path, ref_dir: Path) -> None:
    train, evals = records(run_dir)
    ref_train, ref_evals = records(ref_dir)
    assert [r["step"] for r in train] == list(range(1, 15))
    assert train == ref_train  # losses, learning rates and gradient norms, step by step, bit for bit
    assert evals == ref_evals
    assert_weights_close(run_dir, ref_dir, atol=0)


def assert_same_samples(first: Path, second: Path, ref: Path, resumed_step: int) -> None:
    killed, resumed, uninterrupted = windows(first), windows(second), windows(ref)
    assert len(uninterrupted) == 14
    # the committed windows: the first process's up to the checkpoint, then the second process's
    assert killed[:resumed_step] + resumed == uninterrupted
    assert killed[resumed_step:] == uninterrupted[resumed_step:len(killed)]  # in-flight work, redone


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"plain": write_model_dir(root / "bert", TINY_BERT),
            "dropout": write_model_dir(root / "bert-dropout", {**TINY_BERT, "hidden_dropout_prob": 0.1,
                                                               "attention_probs_dropout_prob": 0.1}),
            "data": write_reviews(root / "reviews.csv"),
            "llm": write_tiny_llm(root / "llm"), "pairs": write_pairs(root / "pairs.jsonl", count=96, chat=True)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_interrupt_and_resume_is_exact(variant: str, models: dict[str, Path], references: References,
                                       tmp_path: Path) -> None:
    extra, interrupt, expected_code = VARIANTS[variant]
    model, reviews_csv = models["dropout" if "--dropout-model" in extra else "plain"], models["data"]
    if "--causal-model" in extra:  # a causal LM on chat data: token-level loss over the window's completions
        model, reviews_csv = models["llm"], models["pairs"]
    extra = [option for option in extra if option not in MARKERS]
    ref_dir, ref_probe = references.get(model, reviews_csv, extra)

    run_dir = tmp_path / "run"
    args = train_args(model, reviews_csv, run_dir, extra)
    first = driver(args, interrupt=interrupt, probe=tmp_path / "first.probe")
    assert first.returncode == expected_code, first.stderr
    if expected_code > 0:  # a signal memfit handled: a clean message saying how to continue
        assert "Traceback" not in first.stderr
        assert "checkpoint saved to" in first.stderr and "--resume" in first.stderr, first.stderr
    if variant == "during-save":  # the half-written save is there but is not a checkpoint
        assert [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
        assert [p.name for p in complete_checkpoints(run_dir)] == ["step-00000002"]
    if variant == "sigterm-mid-window":
        assert [p.name for p in complete_checkpoints(run_dir)][-1] == "step-00000002-micro-1"

    second = driver([*args, "--resume"], probe=tmp_path / "second.probe")
    assert second.returncode == 0, second.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    resumed_step = int(Path(summary["resumed_from"]).name.split("-")[1])
    assert_same_run(run_dir, ref_dir)
    assert_same_samples(tmp_path / "first.probe", tmp_path / "second.probe", ref_probe, resumed_step)
    assert len(complete_checkpoints(run_dir)) == 2  # --keep-last 2
    if "--lora-rank" in extra:  # the adapters alone: the frozen base is not in the checkpoint
        from safetensors.torch import load_file

        saved = load_file(str(complete_checkpoints(run_dir)[-1] / "model.safetensors"))
        assert saved and all(".lora_A." in name or ".lora_B." in name for name in saved), list(saved)
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]


def test_sigkill_at_a_random_moment(models: dict[str, Path], references: References, tmp_path: Path) -> None:
    """Wall-clock kill: wherever it lands (a step, a save, an evaluation), the resumed run is the same."""
    args = train_args(models["dropout"], models["data"], tmp_path / "run", [])
    ref_dir, ref_probe = references.get(models["dropout"], models["data"], [])
    env = {**os.environ, "PROBE": str(tmp_path / "first.probe")}
    process = subprocess.Popen([sys.executable, str(DRIVER), *args], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not complete_checkpoints(tmp_path / "run") and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(random.Random(os.getpid()).uniform(0.0, 0.5))
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    second = driver([*args, "--resume"], probe=tmp_path / "second.probe")
    assert second.returncode == 0, second.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    resumed_step = int(Path(summary["resumed_from"]).name.split("-")[1])
    assert_same_run(tmp_path / "run", ref_dir)
    assert_same_samples(tmp_path / "first.probe", tmp_path / "second.probe", ref_probe, resumed_step)
