"""Shared fixtures: tiny random-init models (HF configs only, no weights) and tiny datasets."""

from __future__ import annotations

import csv
import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

# No test touches the network: the Hub is offline for the suite and every CLI it starts (tests of Hub ids build
# a cache by hand in a temporary HF_HOME). Set before huggingface_hub is imported: it reads this once.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="memfit-tests-hf-home-")  # an empty cache, not the developer's

import pytest
import torch
import transformers

from memfit.config import TrainConfig

if os.environ.get("PYTEST_XDIST_WORKER"):  # one thread per worker (and per CLI it starts): no oversubscription
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    os.environ["MEMFIT_TRACE_WORKERS"] = "1"  # the planner's traces one at a time too (tests that fork say so)

TINY_BERT: dict[str, Any] = {
    "architectures": ["BertModel"], "model_type": "bert", "vocab_size": 30522, "hidden_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 128,
    "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "type_vocab_size": 2,
}
TINY_GPT2: dict[str, Any] = {
    "architectures": ["GPT2Model"], "model_type": "gpt2", "vocab_size": 30522, "n_embd": 32, "n_layer": 2,
    "n_head": 2, "n_positions": 128, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
}
TINY_VIT: dict[str, Any] = {
    "architectures": ["ViTModel"], "model_type": "vit", "image_size": 8, "patch_size": 4, "num_channels": 1,
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
    "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
}

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}
TINY_MOE: dict[str, dict[str, Any]] = {
    # tiny mixture-of-experts decoders (4 experts, 2 per token), the shapes of the published configs' families
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
                "num_experts_per_tok": 2},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 8, "decoder_sparse_step": 1,
                  "mlp_only_layers": []},
    "gpt_oss": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_local_experts": 4,
                "num_experts_per_tok": 2, "head_dim": 8, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"]},
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_shared_experts": 1, "n_group": 2,
                    "topk_group": 1, "first_k_dense_replace": 1, "num_key_value_heads": 4, "kv_lora_rank": 8,
                    "q_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8,
                    "head_dim": 4, "rope_scaling": None},
}
CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} [end] {% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")

WORDS_GOOD = ["great", "wonderful", "moving", "sharp", "funny", "brilliant", "warm"]
WORDS_BAD = ["dull", "boring", "tedious", "flat", "messy", "weak", "lifeless"]
FILLER = ["the", "film", "is", "a", "story", "that", "with", "its", "cast", "and", "plot"]


def write_model_dir(path: Path, config: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def tiny_bert(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "tiny-bert", TINY_BERT)


@pytest.fixture
def tiny_gpt2(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "tiny-gpt2", TINY_GPT2)


@pytest.fixture
def tiny_vit(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "tiny-vit", TINY_VIT)


def write_reviews(path: Path, count: int = 96, seed: int = 0) -> Path:
    """A learnable toy sentiment CSV whose texts vary in length (so padding varies per micro-batch)."""
    rng = random.Random(seed)
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["review", "sentiment"])
        for index in range(count):
            positive = index % 2 == 0
            words = rng.choices(FILLER, k=rng.randint(2, 14))
            words.insert(rng.randrange(len(words) + 1), rng.choice(WORDS_GOOD if positive else WORDS_BAD))
            writer.writerow([" ".join(words), "pos" if positive else "neg"])
    return path


def write_long_text_task(root: Path) -> tuple[Path, Path]:
    """A small-vocabulary BERT (activations dominate its memory) and 48 texts at or just under 32 tokens, so
    each micro-batch is full width with some padding: the batch the estimator and the planner assume."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *FILLER, *WORDS_GOOD, *WORDS_BAD]
    model = write_model_dir(root / "model", {**TINY_BERT, "vocab_size": len(vocab), "num_hidden_layers": 2})
    (model / "vocab.txt").write_text("\n".join(vocab) + "\n")
    data = root / "long.csv"
    rng = random.Random(0)
    with data.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["review", "sentiment"])
        for index in range(48):
            words = rng.choices(FILLER, k=40 if index % 4 < 2 else 28)  # 32 tokens after truncation, or 30
            words.insert(rng.randrange(8), rng.choice(WORDS_GOOD if index % 2 == 0 else WORDS_BAD))
            writer.writerow([" ".join(words), "pos" if index % 2 == 0 else "neg"])
    return model, data


def write_tiny_llm(path: Path, *, chat: bool = True, config: dict[str, Any] | None = None) -> Path:
    """A tiny random-init Llama causal LM with its own WordPiece tokenizer (and a chat template)."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[", "]", "user", "assistant", "end", "review",
             "verdict", "yes", "no", ":", "?", ".", *FILLER, *WORDS_GOOD, *WORDS_BAD]
    write_model_dir(path, {**TINY_LLAMA, "vocab_size": len(vocab), **(config or {})})
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer_config: dict[str, Any] = {"tokenizer_class": "BertTokenizer", "do_lower_case": True}
    if chat:
        tokenizer_config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


def write_pairs(path: Path, count: int = 48, *, chat: bool = False, seed: int = 0) -> Path:
    """Instruction pairs as JSONL: a review and its verdict (``yes``/``no``), prompt/completion or messages."""
    rng = random.Random(seed)
    with path.open("w") as file:
        for index in range(count):
            positive = index % 2 == 0
            words = rng.choices(FILLER, k=rng.randint(2, 12))
            words.insert(rng.randrange(len(words) + 1), rng.choice(WORDS_GOOD if positive else WORDS_BAD))
            prompt, answer = f"review : {' '.join(words)} . verdict ?", "yes" if positive else "no"
            row: dict[str, Any] = ({"messages": [{"role": "user", "content": prompt},
                                                 {"role": "assistant", "content": answer}]} if chat
                                   else {"prompt": prompt, "completion": " " + answer})
            file.write(json.dumps(row) + "\n")
    return path


@pytest.fixture
def reviews_csv(tmp_path: Path) -> Path:
    return write_reviews(tmp_path / "reviews.csv")


def tiny_config(model: Path, data: Path, output_dir: Path, **overrides: Any) -> TrainConfig:
    values: dict[str, Any] = {
        "model": str(model), "data": str(data), "text_column": "review", "label_column": "sentiment",
        "max_length": 32, "effective_batch": 8, "epochs": 1, "max_steps": 3, "precision": "fp32",
        "output_dir": str(output_dir), "log_every": 1, "lr": 1e-3, "seed": 0,
    }
    values.update(overrides)
    return TrainConfig(**values)


def load_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from memfit.hub import read_weights

    adapter = run_dir / "model" / "adapter_model.safetensors"  # a LoRA run saves its adapter
    return load_file(str(adapter)) if adapter.is_file() else read_weights(run_dir / "model")


def build_tiny_bert(num_labels: int = 2, **overrides: Any) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.BertConfig(**{**TINY_BERT, **overrides}, num_labels=num_labels)
    return transformers.BertForSequenceClassification(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` need a CUDA device: skipped, with the reason shown, where there is none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run with -m gpu on a machine that has one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
