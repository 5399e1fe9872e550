"""The real pretrained SmolLM2-135M-Instruct (packaged GGUF, converted once into the cache): it answers, and
its rotten-tomatoes-sft examples render through its own chat template."""

from pathlib import Path

import pytest

from memfit import TrainConfig
from memfit.build import prepare
from memfit.generate import generate
from memfit.models import resolve_model

pytestmark = pytest.mark.slow


def test_smollm2_is_a_pretrained_llama_that_answers(tmp_path: Path) -> None:
    spec = resolve_model("smollm2-135m")
    assert spec.is_pretrained and spec.num_layers == 30 and spec.hf_config.model_type == "llama"
    assert "Paris" in generate("smollm2-135m", "What is the capital of France?", max_new_tokens=12)
    prepared = prepare(TrainConfig(model="smollm2-135m", data="rotten-tomatoes-sft", max_length=128,
                                   train_samples=8, val_samples=8, device="cpu"))
    assert prepared.task == "causal-lm" and prepared.label_names == ["rotten", "fresh"]
    assert prepared.causal_encoders is not None
    train_encoder, val_encoder = prepared.causal_encoders
    assert not train_encoder.candidates and len(val_encoder.candidates[0]) == 2  # only validation scores them
    text = prepared.tokenizer.decode(train_encoder.sequences[0])
    assert text.startswith("<|im_start|>") and "Is this movie review fresh" in text and "<|im_start|>assistant" in text
