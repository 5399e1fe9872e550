"""int8 quantization of a tiny fine-tuned text model: smaller, same predictions, reloads exactly."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch import nn

from memfit.build import prepare
from memfit.cli import main
from memfit.engine import train
from memfit.errors import ConfigError
from memfit.quantize import (
    evaluate_logits,
    load_fp32,
    load_quantized,
    quantize_model,
    run_eval,
    run_quantize,
    source_config,
)
from tests.conftest import FILLER, TINY_BERT, WORDS_BAD, WORDS_GOOD, tiny_config, write_model_dir

REPORT_KEYS = {"backend", "method", "fp32", "int8", "size_ratio", "accuracy_delta_points", "prediction_agreement",
               "max_abs_logit_diff"}
SIDE_KEYS = {"size_bytes", "val_accuracy", "latency_ms_batch1", "latency_ms_batch8"}


@pytest.fixture
def trained_run(tmp_path: Path, reviews_csv: Path) -> Path:
    """A text model whose own small vocabulary keeps the embeddings small: Linear layers hold most weights."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *FILLER, *WORDS_GOOD, *WORDS_BAD]
    model = write_model_dir(tmp_path / "small-vocab", {**TINY_BERT, "vocab_size": len(vocab), "hidden_size": 64,
                                                       "intermediate_size": 256, "num_hidden_layers": 2})
    (model / "vocab.txt").write_text("\n".join(vocab) + "\n")
    config = tiny_config(model, reviews_csv, tmp_path / "run", max_steps=30, epochs=5, val_fraction=0.5)
    train(config, console=Console(file=io.StringIO()))
    return tmp_path / "run"


def test_int8_shrinks_the_model_keeps_its_predictions_and_reloads(trained_run: Path) -> None:
    report = run_quantize(str(trained_run), backend="torchao")
    assert REPORT_KEYS <= report.keys() and SIDE_KEYS <= report["fp32"].keys() <= report["int8"].keys()
    assert report["backend"] == "torchao" and report["method"] == "int8-dynamic"
    assert report["size_ratio"] >= 2.0 and report["memory_ratio"] >= 2.0
    assert report["prediction_agreement"] >= 0.98
    assert 0 < report["max_abs_logit_diff"] < 0.5  # int8 moves the logits a little, not at all would be fp32
    out = Path(report["output_dir"])
    assert out == trained_run / "model-int8-dynamic"
    assert json.loads((out / "quantize.json").read_text()) == report

    _, config = source_config(str(trained_run), data=None)
    prepared = prepare(config)
    fresh = load_fp32(prepared)
    quantize_model(fresh, "int8-dynamic")
    reloaded = load_quantized(out)
    # the saved int8 model is the quantized model, bit for bit
    encoder, count = prepared.encoder(prepared.val_examples), len(prepared.val_examples)
    assert torch.equal(evaluate_logits(reloaded, encoder, count).logits, evaluate_logits(fresh, encoder, count).logits)
    assert run_eval(str(out))["val_accuracy"] == report["int8"]["val_accuracy"]
    assert run_eval(str(trained_run))["val_accuracy"] == report["fp32"]["val_accuracy"]


def test_without_torchao_it_falls_back_to_torch_ao_and_says_so(trained_run: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao -> ImportError
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    report = run_quantize(str(trained_run), backend="torchao", output_dir=str(trained_run / "fallback"))
    assert report["backend"] == "torch.ao" and report["prediction_agreement"] >= 0.98
    assert report["size_ratio"] >= 2.0
    assert run_eval(str(trained_run / "fallback"))["val_accuracy"] == report["int8"]["val_accuracy"]
    with pytest.raises(ConfigError, match="needs torchao"):
        quantize_model(nn.Sequential(nn.Linear(4, 4)), "int8-weight-only")


def test_a_model_without_linear_layers_is_refused() -> None:
    with pytest.raises(ConfigError, match="has no Linear layers"):
        quantize_model(nn.Sequential(nn.Conv1d(2, 2, 3)), "int8-dynamic")


def test_train_quantize_writes_the_report(tmp_path: Path, reviews_csv: Path, tiny_bert: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["train", "--model", str(tiny_bert), "--data", str(reviews_csv), "--text-column", "review",
                 "--label-column", "sentiment", "--max-length", "32", "--max-steps", "2", "--effective-batch", "8",
                 "--output-dir", str(tmp_path / "run"), "--quantize"])
    assert code == 0
    report = json.loads((tmp_path / "run" / "model-int8-dynamic" / "quantize.json").read_text())
    assert report["backend"] == "onnxruntime" and "predictions agree on" in capsys.readouterr().out  # the default


def test_onnxruntime_int8_is_whole_model_int8_keeps_the_predictions_and_reloads(trained_run: Path) -> None:
    report = run_quantize(str(trained_run), backend="onnxruntime", output_dir=str(trained_run / "onnx"))
    assert REPORT_KEYS <= report.keys() and report["backend"] == "onnxruntime"
    assert report["memory_ratio"] >= 3.0  # every weight int8, the embedding tables too
    assert report["size_ratio"] >= 2.0  # the file also holds the graph: ~100 KB, which a real model's weights dwarf
    assert report["prediction_agreement"] >= 0.98 or report["kept_fp32"]  # else one family of layers stays fp32
    assert abs(report["accuracy_delta_points"]) <= 5.0 and 0 < report["max_abs_logit_diff"] < 0.5
    out = trained_run / "onnx"
    assert sorted(path.name for path in out.iterdir()) == [
        "config.json", "model.onnx", "quantization.json", "quantize.json", "tokenizer.json", "tokenizer_config.json"]
    _, config = source_config(str(trained_run), data=None)
    prepared = prepare(config)
    encoder, count = prepared.encoder(prepared.val_examples), len(prepared.val_examples)
    reloaded = evaluate_logits(load_quantized(out), encoder, count)
    assert reloaded.accuracy == report["int8"]["val_accuracy"] == run_eval(str(out))["val_accuracy"]
    with pytest.raises(ConfigError, match="runs int8-dynamic only"):
        run_quantize(str(trained_run), method="int8-weight-only", backend="onnxruntime")
