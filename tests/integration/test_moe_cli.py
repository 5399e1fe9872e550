"""Mixture-of-experts decoders trained through the real CLI on the CPU: the measured peak of each phase equals
the estimate (texts that fill --max-length, so no micro-batch is padded), and the MoE presets estimate."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from memfit import TrainConfig
from tests.conftest import FILLER, TINY_MOE, write_tiny_llm
from tests.helpers import in_process, measured_and_estimated_phases


def write_long_pairs(path: Path, count: int = 16) -> Path:
    rng = random.Random(0)
    path.write_text("".join(json.dumps({"prompt": " ".join(rng.choices(FILLER, k=30)), "completion": " yes"}) + "\n"
                            for _ in range(count)))
    return path


# (Mixtral's run is the unit tests' real CPU step: transformers loads a Llama tokenizer for any mixtral directory,
# whatever its tokenizer_config names, and these tests' tokenizer is a WordPiece vocabulary)
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_a_moe_run_peaks_where_the_estimate_says(tmp_path: Path, family: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    model = write_tiny_llm(tmp_path / family, chat=False, config={**TINY_MOE[family], "tie_word_embeddings": False})
    config = TrainConfig(model=str(model), data=str(write_long_pairs(tmp_path / "long.jsonl")), max_length=16,
                         effective_batch=4, micro_batch_size=2, precision="bf16", max_steps=2, device="cpu",
                         output_dir=str(tmp_path / "run"))
    measured, predicted = measured_and_estimated_phases(tmp_path, config, capsys)
    assert measured == predicted


def test_a_moe_preset_is_estimated_with_every_expert_on_the_card(capsys: pytest.CaptureFixture[str]) -> None:
    result = in_process(["estimate", "--model", "olmoe-1b-7b", "--seq-len", "128", "--batch-size", "1",
                         "--lora-rank", "16", "--precision", "bf16", "--device", "4090", "--json"], capsys)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    # allenai/OLMoE-1B-7B-0924: 64 experts in each of 16 layers; the adapters train
    assert document["parameters"] - document["trainable_parameters"] == 6_919_161_856
    assert document["breakdown"]["frozen_parameters"] > 12 * 2**30  # every expert's weights, in bf16
