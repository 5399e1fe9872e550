"""Encoder-decoder models through the real CLI: ``memfit train --task seq2seq`` of a tiny T5 (its own WordPiece
vocabulary, ending texts with its end-of-sequence token) then ``memfit generate`` from the run, and a tiny BART
(config only, the packaged WordPiece tokenizer) trained for classification; each run's measured peak per phase
is the estimate's, to the byte."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path
from typing import Any

import pytest
import transformers

from memfit import TrainConfig
from tests.conftest import FILLER, WORDS_BAD, WORDS_GOOD, write_pairs
from tests.helpers import in_process, measured_and_estimated_phases, read_metrics

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "review", "verdict", "yes", "no", ":", "?", ".", *FILLER,
         *WORDS_GOOD, *WORDS_BAD]
SEP = VOCAB.index("[SEP]")


def write_tiny_t5(path: Path) -> Path:
    """A tiny random-init T5 with a WordPiece vocabulary whose [SEP] is the model's end-of-sequence token (its
    config, as transformers writes it, has no decoder_start_token_id: T5 starts with its pad id)."""
    transformers.T5Config(vocab_size=len(VOCAB), d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2,
                          num_heads=2, d_kv=16, dropout_rate=0.0, eos_token_id=SEP,
                          pad_token_id=0).save_pretrained(str(path))
    (path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer",
                                                            "do_lower_case": True}))
    return path


def test_a_t5_seq2seq_run_learns_its_targets_and_generates_them(tmp_path: Path, capsys: Any) -> None:
    model, data, out = write_tiny_t5(tmp_path / "t5"), write_pairs(tmp_path / "pairs.jsonl", count=32), tmp_path / "run"
    result = in_process(["train", "--model", str(model), "--data", str(data), "--max-length", "24",
                         "--max-target-length", "4", "--effective-batch", "8", "--precision", "fp32", "--epochs",
                         "3", "--lr", "1e-2", "--eval-before", "--output-dir", str(out), "--json"], capsys)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["task"] == "seq2seq"  # auto: instruction data on an encoder-decoder
    evaluations = read_metrics(out, "eval")
    assert evaluations[-1]["loss"] < evaluations[0]["loss"] / 2  # it learned the targets' form
    assert None not in (summary["val_accuracy_before"], summary["val_accuracy"])  # scored on the yes/no set
    saved = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(out / "model"))
    assert type(saved).__name__ == "T5ForConditionalGeneration" and saved.config.decoder_start_token_id == 0
    generated = in_process(["generate", str(out), "--prompt", "review : the film is great . verdict ?",
                            "--max-new-tokens", "3"], capsys)
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.strip() in ("yes", "no")  # the target alone: no start, end or prompt tokens


def _long_pairs(path: Path) -> Path:
    """Sources longer than --max-length and targets longer than --max-target-length: every micro-batch is
    full width on both sides, the batch the estimate assumes with ``padded=False``."""
    rng = random.Random(0)
    path.write_text("".join(json.dumps({"prompt": " ".join(rng.choices(FILLER, k=30)),
                                        "completion": " ".join(rng.choices(WORDS_GOOD, k=12))}) + "\n"
                            for _ in range(24)))
    return path


def _long_reviews(path: Path) -> Path:
    rng = random.Random(0)
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["text", "label"])
        for index in range(24):
            writer.writerow([" ".join(rng.choices(FILLER, k=30)), "pos" if index % 2 else "neg"])
    return path


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_estimate_is_the_peak_of_a_t5_seq2seq_run(tmp_path: Path, capsys: Any, precision: str) -> None:
    config = TrainConfig(model=str(write_tiny_t5(tmp_path / "t5")), data=str(_long_pairs(tmp_path / "long.jsonl")),
                         max_length=16, max_target_length=6, effective_batch=8, micro_batch_size=4,
                         precision=precision, max_steps=2, device="cpu", output_dir=str(tmp_path / "run"))
    measured, predicted = measured_and_estimated_phases(tmp_path, config, capsys)
    assert measured == predicted


def test_a_config_only_bart_classification_run_is_its_estimated_peak(tmp_path: Path, capsys: Any) -> None:
    """BART's head needs one end-of-sequence token per text, which the packaged WordPiece tokenizer does not
    write: memfit appends it, and the trace answers the head's count as the real batch does."""
    model = tmp_path / "bart"
    transformers.BartConfig(vocab_size=30522, d_model=32, encoder_layers=1, decoder_layers=1,
                            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                            decoder_ffn_dim=64, max_position_embeddings=64).save_pretrained(str(model))
    config = TrainConfig(model=str(model), data=str(_long_reviews(tmp_path / "long.csv")), task="classification",
                         max_length=16, effective_batch=8, micro_batch_size=4, precision="fp32", max_steps=2,
                         device="cpu", output_dir=str(tmp_path / "run"))
    measured, predicted = measured_and_estimated_phases(tmp_path, config, capsys)
    assert measured == predicted
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["task"] == "classification" and summary["val_accuracy"] is not None
