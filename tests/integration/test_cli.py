"""Drive the real ``memfit`` CLI in a subprocess, as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from tests.conftest import TINY_BERT, write_model_dir
from tests.helpers import in_process, memfit, read_metrics

SUMMARY_KEYS = {"val_accuracy", "val_loss", "train_loss", "peak_memory_bytes", "peak_memory_by_phase",
                "samples_per_second", "optimizer_steps", "effective_batch_size", "micro_batch_size",
                "accumulation_steps", "precision", "checkpointing", "trainable_parameters", "total_parameters",
                "device", "config"}


def tiny_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", str(model), "--data", str(data), "--text-column", "review",
            "--label-column", "sentiment", "--max-length", "32", "--effective-batch", "8",
            "--max-steps", "4", "--log-every", "2", "--output-dir", str(out), *extra]


def test_train_writes_metrics_summary_and_a_loadable_model(tiny_bert: Path, reviews_csv: Path,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = memfit(*tiny_args(tiny_bert, reviews_csv, out, "--micro-batch-size", "4", "--precision", "bf16",
                               "--checkpointing", "full"))
    assert result.returncode == 0, result.stderr
    assert "resolved config" in result.stdout and "summary" in result.stdout
    assert "RANDOM INIT" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert (summary["micro_batch_size"], summary["accumulation_steps"], summary["optimizer_steps"]) == (4, 2, 4)
    assert summary["precision"] == "bf16" and summary["checkpointing"] == "full"
    assert set(summary["peak_memory_by_phase"]) >= {"forward", "backward", "optimizer"}
    assert all(summary["peak_memory_by_phase"][p] > 0 for p in ("forward", "backward", "optimizer"))
    assert summary["peak_memory_bytes"] == max(summary["peak_memory_by_phase"].values())
    records = read_metrics(out)
    assert [r["step"] for r in records if r["type"] == "train"] == [2, 4]
    assert [r["type"] for r in records].count("eval") == 1
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out / "model")
    assert model.config.id2label == {0: "neg", 1: "pos"}
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "model")
    logits = model(**tokenizer(["a great film"], return_tensors="pt")).logits
    assert logits.shape == (1, 2)


@pytest.mark.slow
def test_same_seed_same_losses(tiny_bert: Path, reviews_csv: Path, tmp_path: Path) -> None:
    losses = []
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        out = tmp_path / name
        assert memfit(*tiny_args(tiny_bert, reviews_csv, out, "--seed", seed)).returncode == 0
        losses.append([json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()])
    assert losses[0] == losses[1]
    assert losses[0] != losses[2]


def test_json_flag_prints_the_summary_on_stdout(tiny_bert: Path, reviews_csv: Path, tmp_path: Path) -> None:
    result = memfit(*tiny_args(tiny_bert, reviews_csv, tmp_path / "run", "--json"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["optimizer_steps"] == 4


def test_config_file_with_flag_override(tiny_bert: Path, reviews_csv: Path, tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(f'model = "{tiny_bert}"\ndata = "{reviews_csv}"\ntext-column = "review"\n'
                      'label-column = "sentiment"\neffective-batch = 8\nmax-steps = 2\nmax-length = 16\n'
                      'precision = "fp32"\n')
    result = memfit("train", "--config", str(config), "--max-steps", "3", "--output-dir", str(tmp_path / "r"),
                    "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["optimizer_steps"] == 3 and summary["config"]["max_length"] == 16


def test_vision_and_decoder_models_train(tiny_vit: Path, tiny_gpt2: Path, reviews_csv: Path,
                                         tmp_path: Path) -> None:
    vit = memfit("train", "--model", str(tiny_vit), "--data", "digits", "--effective-batch", "16",
                 "--max-steps", "3", "--precision", "fp32", "--train-top-layers", "1", "--output-dir",
                 str(tmp_path / "vit"), "--json")
    assert vit.returncode == 0, vit.stderr
    assert json.loads(vit.stdout)["trainable_parameters"] < json.loads(vit.stdout)["total_parameters"]
    gpt = memfit(*tiny_args(tiny_gpt2, reviews_csv, tmp_path / "gpt", "--checkpointing", "every-n", "--json"))
    assert gpt.returncode == 0, gpt.stderr
    assert json.loads(gpt.stdout)["checkpointing"] == "every-n"


def assert_clean_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


@pytest.mark.parametrize(("args", "fragments"), [
    (["train", "--bogus"], ["unrecognized arguments: --bogus"]),
    (["train", "--model", "bert-gigantic"], ["is not a preset, a local directory or a Hub id"]),
    (["train", "--model", "google/bert_uncased_L-2_H-128_A-2"], ["and HF_HUB_OFFLINE is set"]),
    (["train", "--precision", "fp16", "--device", "cpu"], ["about 20x slower", "--force-cpu-fp16"]),
    (["train", "--accumulation-steps", "0"], ["--accumulation-steps must be >= 1"]),
    (["train", "--train-top-layers", "9"], ["larger than minilm's 6 layers"]),
    (["train", "--data", "missing.csv"], ["no such file or directory"]),
    (["train", "--offload-optimizer", "--device", "cpu"], ["on a cpu device it is in host memory already"]),
])
def test_bad_input_fails_before_training(args: list[str], fragments: list[str], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert_clean_error(in_process(args, capsys, cwd=tmp_path), *fragments)
    assert not (tmp_path / "runs").exists()


def test_all_problems_are_reported_together(tmp_path: Path) -> None:
    result = memfit("train", "--precision", "fp16", "--device", "cpu", "--train-top-layers", "9",
                    "--max-length", "600", cwd=tmp_path)
    assert_clean_error(result, "20x slower", "larger than minilm's 6 layers", "exceeds the model's 512 positions")
    assert len(result.stderr.strip().splitlines()) == 3


def test_data_mistakes(tmp_path: Path, reviews_csv: Path, tiny_bert: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = in_process(["train", "--model", str(tiny_bert), "--data", str(reviews_csv), "--label-column", "stars"],
                        capsys)
    assert_clean_error(result, "no column 'stars' (--label-column)",
                       "columns are: review, sentiment")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert_clean_error(in_process(["train", "--data", str(empty)], capsys), "holds no rows")


def test_labels_that_do_not_match_the_head(tmp_path: Path, reviews_csv: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    config = transformers.BertConfig(**{**TINY_BERT, "num_labels": 3})
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(config).save_pretrained(tmp_path / "three")
    write_model_dir(tmp_path / "unused", TINY_BERT)
    result = in_process(["train", "--model", str(tmp_path / "three"), "--data", str(reviews_csv), "--text-column",
                         "review", "--label-column", "sentiment"], capsys)
    assert_clean_error(result, "has 2 labels", "classification head has 3")


def test_a_bad_budget_is_refused_before_anything_runs(tmp_path: Path) -> None:
    result = memfit("train", "--emulate-budget", "11G", "--output-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr.strip() == ("memfit: error: --emulate-budget '11G' is not a memory size; write a number "
                                     "and a unit, e.g. 300MiB or 11GiB (units: B, KB, MB, GB, TB, KiB, MiB, GiB, "
                                     "TiB)")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_every_command_prints_only_memfit_lines(tiny_bert: Path, reviews_csv: Path, tmp_path: Path) -> None:
    """No third-party notes (torchao's optional kernels, torch's pytree deprecations, transformers' warnings)
    reach the user: each command runs in a fresh process, where such notes are printed once at import."""
    run = tmp_path / "run"
    commands = [tiny_args(tiny_bert, reviews_csv, run, "--max-steps", "1"), ["quantize", str(run)],
                ["estimate", "--model", str(tiny_bert), "--seq-len", "16"],
                ["plan", "--model", str(tiny_bert), "--seq-len", "16", "--device", "1080ti", "--effective-batch", "4"]]
    for args in commands:
        result = memfit(*args)
        assert result.returncode == 0, result.stderr
        assert [line for line in result.stderr.splitlines() if not line.startswith("memfit")] == [], args[0]


def test_help_and_the_model_list_import_no_torch() -> None:
    """``memfit --help`` (and every command's help) and ``memfit models`` start without torch or transformers."""
    script = ("import sys\nfrom memfit.cli import build_parser, main\n"
              "parser = build_parser()\nparser.format_help()\n"
              "for command in ('train', 'estimate', 'plan', 'bench', 'quantize'):\n"
              "    try:\n        parser.parse_args([command, '--help'])\n    except SystemExit:\n        pass\n"
              "assert main(['models']) == 0\n"
              "print(sorted(name for name in ('torch', 'transformers') if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
