"""Encoder-decoder models (T5, BART, mBART): ``--task seq2seq`` batches whose decoder inputs are the model's own
shift of the labels, classification heads that find one end-of-sequence token per text, and estimates equal to
real CPU steps to the byte (the trace answers the heads' end-of-sequence question as the real batch does)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode

from memfit import TrainConfig
from memfit.build import build_model_for, prepare, resolve_task
from memfit.data.batches import with_one_eos
from memfit.errors import ConfigError
from memfit.memory.estimate import encoder_decoder_batch, estimate, prepare_trace
from memfit.memory.mask_values import known_eos
from memfit.models import build_model, resolve_model
from memfit.step import item_count, loss_sum
from tests.conftest import write_model_dir, write_pairs

SIZES: dict[str, dict[str, Any]] = {
    "t5": {"d_model": 32, "d_ff": 64, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 2, "d_kv": 16},
    "bart": {"d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 2,
             "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
             "max_position_embeddings": 64},
}
SIZES["mbart"] = SIZES["bart"]
CONFIGS = {"t5": transformers.T5Config, "bart": transformers.BartConfig, "mbart": transformers.MBartConfig}
EOS = {"t5": 1, "bart": 2, "mbart": 2}


def save_model(path: Path, family: str, vocab_size: int = 512, **overrides: Any) -> Path:
    """A tiny random-init encoder-decoder's config.json, written as transformers writes it (T5's has no
    ``decoder_start_token_id``)."""
    CONFIGS[family](vocab_size=vocab_size, **SIZES[family], **overrides).save_pretrained(str(path))
    return path


GRID = [(family, task, precision) for family in CONFIGS for task in ("seq2seq", "classification")
        for precision in ("fp32", "bf16")]


@pytest.mark.parametrize(("family", "task", "precision"), GRID, ids=["-".join(case) for case in GRID])
def test_estimates_equal_real_cpu_steps(tmp_path: Path, family: str, task: str, precision: str) -> None:
    config = TrainConfig(model=str(save_model(tmp_path / family, family)), task=task, effective_batch=4,
                         max_length=16, precision=precision)
    predicted, measured = estimate(config), estimate(config, execute=True)
    assert predicted.breakdown == measured.breakdown
    assert predicted.peak_bytes == measured.peak_bytes
    assert predicted.phases == measured.phases


VARIANTS = [("t5", "seq2seq", {"checkpointing": "full", "max_target_length": 8}, False),
            ("bart", "seq2seq", {"loss_chunk": 16, "micro_batch_size": 2}, True),
            ("bart", "classification", {"checkpointing": "full", "micro_batch_size": 1}, True),
            ("mbart", "classification", {"micro_batch_size": 2}, False)]


@pytest.mark.parametrize(("family", "task", "options", "padded"), VARIANTS,
                         ids=[f"{f}-{t}-{'-'.join(o) or 'plain'}-{'padded' if p else 'full'}"
                              for f, t, o, p in VARIANTS])
def test_checkpointed_chunked_and_unpadded_steps_are_exact_too(tmp_path: Path, family: str, task: str,
                                                              options: dict[str, Any], padded: bool) -> None:
    values: dict[str, Any] = {"effective_batch": 2, "max_length": 16, "precision": "bf16", **options}
    config = TrainConfig(model=str(save_model(tmp_path / family, family)), task=task, **values)
    predicted, measured = estimate(config, padded=padded), estimate(config, execute=True, padded=padded)
    assert predicted.phases == measured.phases


def test_a_shorter_target_is_a_smaller_decoder_step(tmp_path: Path) -> None:
    model = str(save_model(tmp_path / "bart", "bart"))
    full = TrainConfig(model=model, task="seq2seq", effective_batch=4, max_length=32)
    short = TrainConfig(model=model, task="seq2seq", effective_batch=4, max_length=32, max_target_length=8)
    batch = prepare_trace(short).windows[0][0]
    assert batch["input_ids"].shape == (4, 32) and batch["labels"].shape == batch["decoder_input_ids"].shape == (4, 8)
    assert estimate(short).peak_bytes < estimate(full).peak_bytes


def test_the_heads_eos_question_is_answered_in_the_trace(tmp_path: Path) -> None:
    """Without :func:`known_eos` a fake forward stops where BART's head counts the end-of-sequence tokens; with
    it, forward and backward run and the head reads one hidden state per row."""
    spec = resolve_model(str(save_model(tmp_path / "bart", "bart")))
    batch = encoder_decoder_batch(spec, 2, 16, padded=True, task="classification", target_length=16)
    assert ((batch["input_ids"] == EOS["bart"]) & batch["attention_mask"].bool()).sum(1).tolist() == [1, 1]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = {name: mode.from_tensor(batch[name]) for name in ("input_ids", "attention_mask")}
    from transformers.initialization import no_init_weights

    with mode, no_init_weights():
        model = build_model(spec, label_names=["a", "b"], pad_token_id=0)
        with pytest.raises(DynamicOutputShapeException, match="unique_consecutive"):
            model(**inputs)
        with known_eos(EOS["bart"], [inputs["input_ids"]]):
            logits = model(**inputs).logits
            logits.sum().backward()
    assert logits.shape == (2, 2)


def test_each_text_holds_one_eos_and_the_real_classification_step_runs(tmp_path: Path, reviews_csv: Path) -> None:
    """The packaged WordPiece tokenizer of a config-only model ends texts with [SEP], not BART's or T5's
    end-of-sequence id: memfit appends it, within --max-length."""
    for family in ("bart", "t5"):
        model_dir = save_model(tmp_path / family, family, vocab_size=30522)
        prepared = prepare(TrainConfig(model=str(model_dir), data=str(reviews_csv), text_column="review",
                                       label_column="sentiment", max_length=8, device="cpu", precision="fp32"))
        assert prepared.task == "classification"
        batch = prepared.encoder(prepared.train_examples)(range(8))
        assert batch["input_ids"].shape[1] <= 8
        real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
        assert ((batch["input_ids"] == EOS[family]) & real).sum(1).tolist() == [1] * 8, family
        loss, logits = loss_sum(build_model_for(prepared), batch)
        assert logits.shape == (8, 2) and torch.isfinite(loss)


def test_one_eos_keeps_a_tokenizers_own_and_appends_a_missing_one() -> None:
    assert with_one_eos([0, 7, 2], 2, 8) == [0, 7, 2]  # BART's tokenizer: <s> ... </s>
    assert with_one_eos([250004, 7, 2, 250004], 2, 8) == [250004, 7, 2, 250004]  # mBART's: ... </s> lang
    assert with_one_eos([101, 7, 8, 102], 2, 4) == [101, 7, 8, 2]  # WordPiece cut to the limit: the eos kept
    assert with_one_eos([2, 7, 2], 2, 8) == [7, 2]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_batch_carries_the_decoder_inputs_the_model_makes_from_labels(tmp_path: Path, family: str) -> None:
    model_dir = save_model(tmp_path / family, family, vocab_size=30522)
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    prepared = prepare(TrainConfig(model=str(model_dir), data=str(pairs), max_length=16, max_target_length=4,
                                   device="cpu", precision="fp32"))
    assert prepared.task == "seq2seq"  # auto: instruction data on an encoder-decoder
    batch = prepared.encoder(prepared.train_examples)(range(4))
    labels = batch["labels"]
    assert labels.shape[1] <= 4 and "decoder_attention_mask" not in batch
    ends = [row[row != -100][-1].item() for row in labels]
    assert ends == [EOS[family]] * 4  # every target ends with the model's end-of-sequence token
    model = build_model_for(prepared).eval()
    assert torch.equal(batch["decoder_input_ids"], model.prepare_decoder_input_ids_from_labels(labels=labels))
    with torch.no_grad():
        summed, _ = loss_sum(model, batch)
        own = model(**{name: batch[name] for name in ("input_ids", "attention_mask") if name in batch},
                    labels=labels).loss
    torch.testing.assert_close(summed / item_count(batch), own)  # the loss transformers computes from labels


def test_t5_without_a_decoder_start_in_its_config_starts_with_its_pad_id(tmp_path: Path) -> None:
    spec = resolve_model(str(save_model(tmp_path / "t5", "t5")))
    assert getattr(spec.hf_config, "decoder_start_token_id", None) is None
    for task in ("seq2seq", "classification"):
        model = build_model(spec, label_names=["a", "b"], pad_token_id=0, task=task)
        assert model.config.decoder_start_token_id == 0
    assert getattr(spec.hf_config, "decoder_start_token_id", None) is None  # the spec's config untouched


def test_auto_picks_seq2seq_for_instruction_data_on_an_encoder_decoder(tmp_path: Path, reviews_csv: Path) -> None:
    t5 = str(save_model(tmp_path / "t5", "t5"))
    llm = write_model_dir(tmp_path / "llm", {"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    pairs = str(write_pairs(tmp_path / "pairs.jsonl"))
    assert resolve_task(TrainConfig(model=t5, data=pairs), resolve_model(t5)) == "seq2seq"
    assert resolve_task(TrainConfig(model=t5, data=str(reviews_csv)), resolve_model(t5)) == "classification"
    assert resolve_task(TrainConfig(model=str(llm), data=pairs), resolve_model(str(llm))) == "causal-lm"


def test_packing_a_seq2seq_run_is_refused_in_one_line(tmp_path: Path) -> None:
    config = TrainConfig(model=str(save_model(tmp_path / "t5", "t5")), task="seq2seq", packing=True)
    with pytest.raises(ConfigError, match="a seq2seq example is two sequences") as raised:
        estimate(config)
    assert len(raised.value.problems) == 1 and "\n" not in raised.value.problems[0]


@pytest.mark.parametrize(("model", "options", "message"), [
    ("gpt2", {"task": "seq2seq"}, "--task seq2seq trains an encoder-decoder model"),
    ("t5", {"task": "causal-lm"}, "encoder-decoder T5 model: use --task seq2seq"),
    ("t5", {"task": "classification", "max_target_length": 8}, "--max-target-length is the target length of"),
    ("bart", {"task": "seq2seq", "max_target_length": 100}, "--max-target-length 100 exceeds the model's 64"),
])
def test_a_task_the_model_cannot_run_is_refused(tmp_path: Path, model: str, options: dict[str, Any],
                                                message: str) -> None:
    name = model if model == "gpt2" else str(save_model(tmp_path / model, model))
    with pytest.raises(ConfigError, match=message):
        estimate(TrainConfig(model=name, **options))


def test_a_model_without_its_own_label_shift_shifts_as_its_forward_does() -> None:
    """Blenderbot has no ``prepare_decoder_input_ids_from_labels``: its forward's shift is used instead."""
    from transformers.models.blenderbot.modeling_blenderbot import shift_tokens_right

    from memfit.models import _shift_right

    labels = torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100]])
    assert torch.equal(_shift_right(labels, start=1, pad=0), shift_tokens_right(labels, 0, 1))


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_lora_adapts_the_decoder_blocks_too_and_train_top_layers_is_refused(tmp_path: Path, family: str) -> None:
    from memfit.build import build_with_techniques

    model_dir = save_model(tmp_path / family, family)
    config = TrainConfig(model=str(model_dir), task="seq2seq", lora_rank=4, max_length=16)
    model = build_with_techniques(resolve_model(str(model_dir)), config, label_names=[], pad_token_id=0,
                                  task="seq2seq")
    adapted = [name for name, parameter in model.named_parameters() if parameter.requires_grad]
    assert any("encoder" in name and "lora_A" in name for name in adapted)
    assert any("decoder" in name and "lora_A" in name for name in adapted)
    with pytest.raises(ConfigError, match="--train-top-layers counts one stack of blocks"):
        estimate(TrainConfig(model=str(model_dir), task="seq2seq", train_top_layers=1, max_length=16))


@pytest.mark.slow
def test_a_plan_that_fits_nothing_says_what_each_opt_in_would_need(tmp_path: Path) -> None:
    """Freezing the top layers does not apply to an encoder-decoder: said among the advice, the plan goes on."""
    from memfit.planner import plan
    from memfit.planner.allowed import Allowed

    model_dir = save_model(tmp_path / "t5", "t5")
    made = plan(TrainConfig(model=str(model_dir), task="seq2seq", max_length=32, effective_batch=8), device="cpu",
                budget="1MiB", seq_len=32, allow=Allowed(freeze=True, qlora=True), suggest=False)
    assert made.chosen is None
    assert "--allow-freeze (top-1) does not apply: --train-top-layers counts one stack" in made.verdict
    assert "--allow-qlora (r=16)" in made.verdict  # T5's "wo" kept in fp32, as transformers' 4-bit loading keeps it
