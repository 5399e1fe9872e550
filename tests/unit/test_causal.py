"""Causal-LM fine-tuning: instruction data, the shifted completion-only labels, and exact estimates for decoder
families (the trace equals real CPU steps)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from memfit import TrainConfig
from memfit.build import prepare, resolve_task
from memfit.data import Columns, load_examples
from memfit.data.batches import CausalEncoder, pad
from memfit.errors import DataError
from memfit.memory.estimate import Estimate, estimate
from memfit.models import LLM_PRESET_CONFIGS, resolve_model
from tests.conftest import write_model_dir, write_pairs, write_tiny_llm

DECODER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "vocab_size": 512, "max_position_embeddings": 128}
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_key_value_heads": 2, **DECODER},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "num_key_value_heads": 2, **DECODER},
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "num_key_value_heads": 2,
                **DECODER},
    "phi3": {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "num_key_value_heads": 4,
             "pad_token_id": 0, **DECODER},
    "gemma2": {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "num_key_value_heads": 2,
               "head_dim": 8, "sliding_window": 16, **DECODER},
    "gpt-neox": {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], **DECODER},
    "gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 32, "n_layer": 2, "n_head": 4,
             "vocab_size": 512, "n_positions": 128},
}
# every family in fp32 at micro-batch 4 (padded); micro-batch 1 (never padded) and bf16 with checkpointing on
# the grouped-query families, tied embeddings (gemma2, gpt2) and a parallel-block one (gpt-neox)
GRID = [*((family, "fp32", "none", 4) for family in FAMILIES),
        *((family, "fp32", "none", 1) for family in ("llama", "phi3")),
        *((family, "bf16", "full", 4) for family in ("qwen2", "gemma2", "gpt2", "gpt-neox")),
        ("mistral", "bf16", "full", 1)]


@pytest.mark.parametrize(("family", "precision", "checkpointing", "micro"), GRID,
                         ids=[f"{f}-{p}-{c}-mb{m}" for f, p, c, m in GRID])
def test_decoder_estimates_equal_real_cpu_steps(tmp_path: Path, family: str, precision: str, checkpointing: str,
                                                micro: int) -> None:
    model = write_model_dir(tmp_path / family, FAMILIES[family])
    config = TrainConfig(model=str(model), task="causal-lm", effective_batch=8, micro_batch_size=micro,
                         max_length=32, precision=precision, checkpointing=checkpointing)
    predicted, measured = estimate(config), estimate(config, execute=True)
    # micro-batch 1 is never padded: its checkpointed forward skips the causal mask in the trace as in the real
    # step, because the trace answers transformers' value questions as the real step does (memory.mask_values)
    assert predicted.breakdown == measured.breakdown
    assert predicted.peak_bytes == measured.peak_bytes
    assert predicted.phases == measured.phases


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_decoder_bodies_with_a_classification_head_are_exact(tmp_path: Path, family: str) -> None:
    head = {**FAMILIES[family], "architectures": [FAMILIES[family]["architectures"][0].replace(
        "ForCausalLM", "ForSequenceClassification")], "pad_token_id": 0}
    model = write_model_dir(tmp_path / family, head)
    for padded in (True, False):  # an unpadded batch takes the mask-free branch in both
        config = TrainConfig(model=str(model), effective_batch=8, max_length=32, precision="bf16")
        predicted = estimate(config, padded=padded)
        assert predicted.phases == estimate(config, execute=True, padded=padded).phases


def test_tied_embeddings_are_one_parameter_in_the_trace(tmp_path: Path) -> None:
    tied = write_model_dir(tmp_path / "tied", {**FAMILIES["llama"], "tie_word_embeddings": True})
    untied = write_model_dir(tmp_path / "untied", {**FAMILIES["llama"], "tie_word_embeddings": False})
    config = TrainConfig(model=str(tied), task="causal-lm", effective_batch=4, max_length=16, precision="fp32")
    table = DECODER["vocab_size"] * DECODER["hidden_size"] * 4
    same = TrainConfig(**{**config.to_dict(), "model": str(untied)})
    assert estimate(same).breakdown["parameters"] - estimate(config).breakdown["parameters"] == table


def test_instruction_pairs_and_chat_become_causal_examples(tmp_path: Path) -> None:
    pairs = load_examples(str(write_pairs(tmp_path / "pairs.jsonl")), columns=Columns(), task="causal-lm")
    chat = load_examples(str(write_pairs(tmp_path / "chat.jsonl", chat=True)), columns=Columns(), task="causal-lm")
    assert len(pairs) == len(chat) == 48
    assert pairs.label_names == [" no", " yes"] and chat.label_names == ["no", "yes"]  # type: ignore[union-attr]
    assert isinstance(chat.prompts[0], list) and chat.prompts[0][0]["role"] == "user"  # type: ignore[union-attr]


def test_auto_task_follows_the_data_and_the_model(tmp_path: Path, reviews_csv: Path) -> None:
    llm = write_tiny_llm(tmp_path / "llm")
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    bert = write_model_dir(tmp_path / "bert", {"model_type": "bert", "architectures": ["BertModel"]})
    assert resolve_task(TrainConfig(model=str(bert), data=str(pairs)), resolve_model(str(bert))) == "causal-lm"
    assert resolve_task(TrainConfig(model=str(bert), data=str(reviews_csv)), resolve_model(str(bert))) == \
        "classification"
    assert resolve_task(TrainConfig(model=str(llm), data=str(reviews_csv)), resolve_model(str(llm))) == "causal-lm"
    assert resolve_task(TrainConfig(model="llama-3.2-1b"), resolve_model("llama-3.2-1b")) == "causal-lm"


def test_labels_are_the_completion_tokens_shifted_and_the_prompt_is_cut_from_the_left(tmp_path: Path) -> None:
    llm = write_tiny_llm(tmp_path / "llm", chat=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(llm))
    examples = load_examples(str(write_pairs(tmp_path / "pairs.jsonl")), columns=Columns(), task="causal-lm")
    encoder = CausalEncoder.build(examples, tokenizer, max_length=8)  # type: ignore[arg-type]
    batch = encoder([0, 1])
    completion = tokenizer(" yes", add_special_tokens=False)["input_ids"]
    row, labels = batch["input_ids"][0], batch["labels"][0]
    assert row.shape[0] <= 8 and row[-len(completion):].tolist() == completion  # the completion is whole
    kept = labels[labels != -100].tolist()
    assert kept == completion and labels[-1] == -100
    scored = (labels != -100).nonzero().flatten()
    assert torch.equal(labels[scored], row[scored + 1])  # position t is labelled with token t + 1
    assert scored.tolist() == list(range(row.shape[0] - len(completion) - 1, row.shape[0] - 1))


def test_a_batch_without_padding_carries_no_mask() -> None:
    assert set(pad([[1, 2], [3, 4]], 0)) == {"input_ids"}
    padded = pad([[1, 2], [3]], 0)
    assert padded["attention_mask"].tolist() == [[1, 1], [1, 0]]


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize(("rows", "message"), [
    ([{"prompt": "a", "answer": "b"}] * 4, "no column 'completion'"),
    ([{"messages": []}] * 4, "'messages' is empty"),
    ([{"messages": [{"role": "user", "content": "a"}]}] * 4, "the last turn must be the assistant's"),
    ([{"prompt": "a", "completion": ""}] * 4, "empty 'completion'"),
])
def test_bad_instruction_files_say_what_to_fix(tmp_path: Path, rows: list[dict[str, Any]], message: str) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError, match=message):
        load_examples(str(path), columns=Columns(), task="causal-lm")


def test_a_completion_longer_than_max_length_and_chat_without_template_are_refused(tmp_path: Path) -> None:
    plain = write_tiny_llm(tmp_path / "plain", chat=False)
    long = _write_jsonl(tmp_path / "long.jsonl", [{"prompt": "review", "completion": " yes" * 20}] * 4)
    with pytest.raises(DataError, match="completion alone is 20 tokens"):
        prepare(TrainConfig(model=str(plain), data=str(long), max_length=16, device="cpu"))
    chat = write_pairs(tmp_path / "chat.jsonl", chat=True)
    with pytest.raises(DataError, match="no chat template"):
        prepare(TrainConfig(model=str(plain), data=str(chat), device="cpu"))


def test_llm_presets_have_their_published_sizes() -> None:
    expected = {"llama-3.2-1b": 1.236, "llama-3.1-8b": 8.03, "qwen2.5-0.5b": 0.494, "qwen2.5-7b": 7.616,
                "qwen2.5-32b": 32.764, "llama-3.1-70b": 70.554,  # the safetensors' counts (32.8 B, 70.6 B)
                "mistral-7b": 7.248, "phi-3.5-mini": 3.821, "gemma-2-2b": 2.614, "smollm2-1.7b": 1.711,
                # mixture-of-experts: every expert counted (OLMoE 6.9 B, DeepSeek-V2-Lite 15.7 B, gpt-oss 20.9 B,
                # Qwen3-30B-A3B 30.5 B, Mixtral 46.7 B as published)
                "olmoe-1b-7b": 6.919, "deepseek-v2-lite": 15.706, "gpt-oss-20b": 20.915, "qwen3-30b-a3b": 30.532,
                "mixtral-8x7b": 46.703}
    for name, billions in expected.items():
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(LLM_PRESET_CONFIGS[name]())
        assert round(sum(p.numel() for p in model.parameters()) / 1e9, 3) == billions, name


def test_a_chunked_loss_is_the_same_loss_and_gradients_in_less_memory(tmp_path: Path) -> None:
    from memfit.step import loss_sum
    from memfit.techniques.chunked_loss import chunked_loss_sum

    hf_config = {**FAMILIES["llama"], "vocab_size": 4096}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**{
        key: value for key, value in hf_config.items() if key not in ("model_type", "architectures")}))
    labels = torch.randint(0, 4096, (2, 24))
    labels[:, :10] = -100  # a prompt
    batch = {"input_ids": torch.randint(0, 4096, (2, 24)), "labels": labels}
    grads = []
    for loss_fn in (loss_sum, lambda m, b: chunked_loss_sum(m, b, chunk=7)):
        model.zero_grad()
        loss, _ = loss_fn(model, batch)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    for plain, chunked in zip(grads[0][1], grads[1][1], strict=True):
        torch.testing.assert_close(plain, chunked, rtol=1e-4, atol=1e-6)
    directory = write_model_dir(tmp_path / "llama", hf_config)
    plain_config = TrainConfig(model=str(directory), task="causal-lm", effective_batch=4, max_length=64,
                               precision="bf16")
    chunked_config = TrainConfig(**{**plain_config.to_dict(), "loss_chunk": 64})
    plain_peak, chunked = estimate(plain_config), estimate(chunked_config)
    assert chunked.peak_bytes == estimate(chunked_config, execute=True).peak_bytes
    def loss_side(result: Estimate) -> int:  # the logits, their fp32 copy and log-softmax, their gradient
        return result.breakdown["logits_and_loss"] + result.breakdown["temporaries"]

    assert loss_side(chunked) < loss_side(plain_peak) / 2
    assert chunked.peak_bytes < plain_peak.peak_bytes / 2  # the output layer runs per chunk: no whole logits


def test_the_output_layer_runs_per_chunk_only_where_the_logits_are_its_plain_product(tmp_path: Path) -> None:
    from memfit.techniques.chunked_loss import plain_head

    def built(**extra: object) -> torch.nn.Module:
        config = {**FAMILIES["llama"], **extra}
        return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**{
            key: value for key, value in config.items() if key not in ("model_type", "architectures")}))

    model = built()
    assert plain_head(model) == (model.model, model.lm_head)
    capped = built()
    capped.config.final_logit_softcapping = 30.0  # Gemma-2's soft-capped logits: the whole logits, as before
    assert plain_head(capped) is None
