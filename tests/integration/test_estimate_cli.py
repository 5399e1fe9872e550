"""``memfit estimate`` and ``memfit devices`` through the real CLI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from memfit import TrainConfig
from memfit.memory.estimate import estimate
from tests.conftest import TINY_BERT, write_model_dir, write_tiny_llm
from tests.helpers import memfit, run_main

JSON_KEYS = {"peak_bytes", "peak_reserved_bytes", "non_pytorch_bytes", "breakdown", "phases", "device", "fits",
             "config", "seconds"}


def test_json_estimate_is_the_api_estimate_and_train_flags_mean_the_same(tmp_path: Path) -> None:
    model = write_model_dir(tmp_path / "tiny", TINY_BERT)  # a config.json alone is enough
    result = memfit("estimate", "--model", str(model), "--device", "t4", "--seq-len", "48", "--batch-size", "4",
                    "--precision", "fp16", "--checkpointing", "every-n", "--checkpoint-every", "2",
                    "--train-top-layers", "2", "--optimizer", "sgd", "--json")
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert JSON_KEYS <= printed.keys()
    config = TrainConfig(model=str(model), micro_batch_size=4, effective_batch=4, precision="fp16",
                         checkpointing="every-n", checkpoint_every=2, train_top_layers=2, optimizer="sgd")
    expected = estimate(config, device="t4", seq_len=48)
    assert (printed["peak_bytes"], printed["peak_reserved_bytes"]) == (expected.peak_bytes,
                                                                       expected.peak_reserved_bytes)
    assert printed["breakdown"] == expected.breakdown and printed["phases"] == expected.phases
    assert printed["config"]["train_top_layers"] == 2 and printed["device"] == "t4"
    assert printed["fits"] is True and printed["non_pytorch_bytes"] > 0


def test_the_headline_question_gets_a_table(tmp_path: Path) -> None:
    result = memfit("estimate", "--model", "bert-large", "--batch-size", "8", "--seq-len", "512", "--precision",
                    "fp16", "--checkpointing", "full", "--optimizer", "adamw", "--device", "1080ti")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for row in ("parameters", "gradients", "optimizer state", "activations", "peak allocated", "peak reserved"):
        assert row in out
    # fused AdamW (the default) keeps no gradient-sized temporaries: the peak is backward's, not the step's
    assert "peak per phase: forward" in out and "(peak in backward)" in out
    assert "fits in 11.0 GiB: needs" in out and "headroom" in out


def test_bad_estimates_exit_2_with_one_line_each(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["--device", "gtx480"], "is not a known device (known: 1080ti, 2080ti"),
        (["--model", "bert-base", "--seq-len", "1024"], "--seq-len 1024 exceeds bert-base's 512 positions"),
        (["--model", "vit-base", "--image-size", "100"], "does not divide into 16x16 patches"),
        (["--model", str(empty)], "no config.json in"),
        (["--model", "bert-huge"], "presets: minilm, bert-base"),
    ]
    result = memfit("estimate", *cases[0][0])  # as a user runs it: the exit code and stderr of the process
    assert result.returncode == 2 and cases[0][1] in result.stderr and "Traceback" not in result.stderr
    assert all(line.startswith("memfit: error: ") for line in result.stderr.strip().splitlines())
    for flags, message in cases[1:]:  # the rest through the same main(), in this process
        code, _, err = run_main(["estimate", *flags], capsys)
        assert code == 2, (flags, err)
        assert message in err and "Traceback" not in err
        assert all(line.startswith("memfit: error: ") for line in err.strip().splitlines()), flags


def test_devices_lists_every_profile() -> None:
    result = memfit("devices")
    assert result.returncode == 0
    for name in ("1080ti", "2080ti", "t4", "v100-16", "v100-32", "3060", "3090", "4090", "a100-40", "a100-80",
                 "l4", "h100", "h200", "cpu"):
        assert f"│ {name} " in result.stdout


def test_help_and_devices_start_without_importing_torch() -> None:
    """Importing torch takes seconds: ``memfit --help`` never needs it, nor ``memfit devices`` without a driver."""
    import subprocess
    import sys

    commands = [["--help"]] + ([["devices"]] if not Path("/proc/driver/nvidia").exists() else [])
    for command in commands:
        result = subprocess.run([sys.executable, "-X", "importtime", "-m", "memfit", *command], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                    if line.startswith("import time:")}
        assert "memfit.cli" in imported and "torch" not in imported, command


def test_the_validation_harness_measures_what_the_estimate_predicts(tmp_path: Path) -> None:
    """benchmarks/validate_estimator.py's measurement, run on CPU: what a GPU run compares against."""
    import importlib.util

    path = Path(__file__).parents[2] / "benchmarks" / "validate_estimator.py"
    spec = importlib.util.spec_from_file_location("validate_estimator", path)
    assert spec is not None and spec.loader is not None
    harness = importlib.util.module_from_spec(spec)
    sys.modules["validate_estimator"] = harness  # dataclasses look their module up
    spec.loader.exec_module(harness)
    cpu = harness.resolve_profile("cpu")
    cases = harness.tiny_grid(tmp_path)
    assert {case.checkpointing for case in cases} == {"none", "full"}
    for case in cases[:2] + cases[-1:]:
        row = harness.row(case, cpu, harness.measure(case, cpu, harness.torch.device("cpu")))
        assert row["measured_allocated_bytes"] == row["predicted_allocated_bytes"] > 0
        assert row["allocated_error_percent"] == 0.0
    assert "unmeasured" in harness.markdown([harness.row(cases[0], harness.resolve_profile("t4"), None)])


def test_full_length_texts_estimate_the_unpadded_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A grouped-query decoder keeps less without padding (no mask, K/V not repeated per head)."""
    model = write_tiny_llm(tmp_path / "llm")
    args = ["estimate", "--model", str(model), "--batch-size", "4", "--seq-len", "64", "--precision", "bf16", "--json"]
    padded, unpadded = (json.loads(run_main([*args, *extra], capsys)[1]) for extra in ([], ["--full-length"]))
    assert unpadded["peak_bytes"] < padded["peak_bytes"]
    config = TrainConfig(model=str(model), micro_batch_size=4, effective_batch=4, max_length=64, precision="bf16")
    assert unpadded["peak_bytes"] == estimate(config, padded=False).peak_bytes
    assert padded["peak_bytes"] == estimate(config).peak_bytes
