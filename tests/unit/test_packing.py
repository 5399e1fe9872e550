"""``--packing``: causal-LM examples packed into full rows. The rows hold every example once with its own labels,
an example's logits are those it has alone (transformers builds the block-diagonal mask from the positions),
and the estimate of a packed step is its measured peak."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import masking_utils

from memfit import TrainConfig
from memfit.build import prepare
from memfit.data import Columns, load_examples
from memfit.data.batches import CausalEncoder, shifted
from memfit.data.packing import PackedEncoder, disable_cache, pack
from memfit.errors import ConfigError
from memfit.memory.estimate import estimate
from memfit.step import item_count, loss_sum
from memfit.techniques.chunked_loss import chunked_loss_sum
from tests.conftest import TINY_GPT2, TINY_LLAMA, write_model_dir, write_pairs, write_tiny_llm


@pytest.fixture
def encoder(tmp_path: Path) -> CausalEncoder:
    """48 chat pairs of 20 to 30 tokens, cut to at most 24: rows of 24 tokens split some examples."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(write_tiny_llm(tmp_path / "llm")))
    examples = load_examples(str(write_pairs(tmp_path / "chat.jsonl", chat=True)), columns=Columns(),
                             task="causal-lm")
    return CausalEncoder.build(examples, tokenizer, max_length=24, choices=False)  # type: ignore[arg-type]


def segments(packed: PackedEncoder) -> list[tuple[int, int]]:
    """(start, end) of each example in the flattened rows: where the positions restart (an example that goes on in
    the next row counts on there)."""
    positions = packed.position_ids.flatten().tolist()
    starts = [i for i, p in enumerate(positions) if i == 0 or p != positions[i - 1] + 1]
    return list(zip(starts, [*starts[1:], len(positions)], strict=True))


def test_rows_are_full_and_hold_every_example_once_with_its_own_labels(encoder: CausalEncoder) -> None:
    order = list(reversed(range(len(encoder.sequences))))
    sequences = [encoder.sequences[i] for i in order]
    prompts = [encoder.prompt_lengths[i] for i in order]
    packed = pack(sequences, prompts, max_length=24, pad_token_id=encoder.pad_token_id)
    total = sum(len(sequence) for sequence in sequences)
    assert packed.input_ids.shape == packed.position_ids.shape == packed.labels.shape == (-(-total // 24), 24)
    assert total % 24, "the last row must be padded for this test to mean much"
    ids, labels = packed.input_ids.flatten(), packed.labels.flatten()
    assert len(segments(packed)) == len(sequences) + 1  # the examples, then the padding
    ends = [sum(len(sequence) for sequence in sequences[:i + 1]) for i in range(len(sequences))]
    assert any(end % 24 < len(sequence) and end % 24 for end, sequence in zip(ends, sequences, strict=True)), \
        "some example must go on in the next row for this test to mean much"
    offset = 0
    for sequence, prompt in zip(sequences, prompts, strict=True):  # each in order, whole, its labels as unpacked
        end = offset + len(sequence)
        assert ids[offset:end].tolist() == sequence
        assert packed.position_ids.flatten()[offset:end].tolist() == list(range(len(sequence)))  # also split
        assert torch.equal(labels[offset:end], shifted([sequence], [prompt], 0)["labels"][0])
        assert labels[end - 1] == -100  # an example's last token never predicts the next example's first
        offset = end
    assert (ids[offset:] == encoder.pad_token_id).all() and (labels[offset:] == -100).all()
    assert packed.position_ids.flatten()[offset:].tolist() == list(range(ids.numel() - offset))  # own segment
    assert int((labels != -100).sum()) == item_count(encoder(range(len(sequences))))  # the same loss tokens


def test_the_packing_is_seeded(encoder: CausalEncoder) -> None:
    first, again = PackedEncoder.build(encoder, 24, seed=0), PackedEncoder.build(encoder, 24, seed=0)
    other = PackedEncoder.build(encoder, 24, seed=1)
    assert torch.equal(first.input_ids, again.input_ids) and torch.equal(first.labels, again.labels)
    assert len(other) == len(first) and not torch.equal(other.input_ids, first.input_ids)
    batch = first([3, 0])
    assert set(batch) == {"input_ids", "position_ids", "labels"}  # no attention_mask: the packed path
    assert torch.equal(batch["input_ids"], first.input_ids[[3, 0]])


def tiny_causal_lm(family: str) -> transformers.PreTrainedModel:
    values = {"llama": TINY_LLAMA, "gpt2": TINY_GPT2}[family]
    config = transformers.AutoConfig.for_model(values["model_type"], **{
        key: value for key, value in values.items() if key not in ("model_type", "architectures")})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).train()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_an_example_packed_has_the_logits_it_has_alone(family: str) -> None:
    model = tiny_causal_lm(family)
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(5, 500, (length,), generator=generator).tolist() for length in (9, 14, 5, 20, 7)]
    packed = pack(sequences, [3] * len(sequences), max_length=24, pad_token_id=0)
    batch = packed(range(len(packed)))  # (3, 24): 9 + 14 + 1 of 5 | 4 of 5 + 20 | 7 + 17 padding
    inputs = {name: batch[name] for name in ("input_ids", "position_ids")}
    # transformers finds the packed sequences and builds the block-diagonal causal mask
    embeddings = torch.zeros(*batch["input_ids"].shape, 8)
    mask = masking_utils.create_causal_mask(model.config, embeddings, None, None, position_ids=batch["position_ids"])
    segment = masking_utils.find_packed_sequence_indices(batch["position_ids"])  # (B, S)
    assert mask is not None and segment is not None
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    assert torch.equal(mask[:, 0], (segment[:, :, None] == segment[:, None, :]) & causal)
    with torch.no_grad():
        with_cache = model(**inputs).logits  # a KV cache: transformers does not look for packed sequences
        disable_cache(model)
        logits = model(**inputs).logits.flatten(0, 1)  # (B * S, V)
        offset = 0
        for sequence in sequences[:2]:  # whole in the first row
            alone = model(input_ids=torch.tensor([sequence])).logits[0]
            torch.testing.assert_close(logits[offset:offset + len(sequence)], alone, rtol=1e-5, atol=1e-5)
            offset += len(sequence)
    if family == "llama":  # the cache's branch attends across examples: why the packed run disables it
        assert not torch.allclose(with_cache.flatten(0, 1)[9:23], logits[9:23], atol=1e-3)


def test_a_chunked_loss_reads_the_packed_positions_too() -> None:
    model = tiny_causal_lm("llama")
    disable_cache(model)
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(5, 500, (length,), generator=generator).tolist() for length in (9, 14, 5, 20, 7)]
    batch = pack(sequences, [3] * len(sequences), max_length=24, pad_token_id=0)(range(3))
    plain, _ = loss_sum(model, batch)
    chunked, _ = chunked_loss_sum(model, batch, chunk=7)
    torch.testing.assert_close(chunked, plain)
    without_positions, _ = loss_sum(model, {k: v for k, v in batch.items() if k != "position_ids"})
    assert not torch.allclose(without_positions, plain)  # the positions reach the model


DECODER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 128,
           "model_type": "llama", "architectures": ["LlamaForCausalLM"]}


@pytest.mark.parametrize(("precision", "checkpointing", "micro", "loss_chunk"),
                         [("fp32", "none", 4, None), ("bf16", "full", 4, None), ("bf16", "none", 8, 16)])
def test_the_estimate_of_a_packed_step_equals_the_real_cpu_step(tmp_path: Path, precision: str,
                                                               checkpointing: str, micro: int,
                                                               loss_chunk: int | None) -> None:
    model = write_model_dir(tmp_path / "llama", DECODER)
    common: dict[str, Any] = {"model": str(model), "task": "causal-lm", "effective_batch": 8,
                              "micro_batch_size": micro, "max_length": 32, "precision": precision,
                              "checkpointing": checkpointing, "loss_chunk": loss_chunk}
    packed = TrainConfig(**common, packing=True)
    predicted, measured = estimate(packed), estimate(packed, execute=True)  # real rows of two examples each
    assert predicted.breakdown == measured.breakdown
    assert predicted.phases == measured.phases
    unpacked = estimate(TrainConfig(**common), padded=False)
    assert predicted.peak_bytes > unpacked.peak_bytes  # the (B, 1, S, S) mask and the repeated K/V


def test_packing_a_classification_run_is_refused(tmp_path: Path, reviews_csv: Path) -> None:
    bert = write_model_dir(tmp_path / "bert", {"model_type": "bert", "architectures": ["BertModel"],
                                               "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                               "intermediate_size": 64})
    with pytest.raises(ConfigError, match="--packing packs causal-LM examples"):
        estimate(TrainConfig(model=str(bert), packing=True))
    llm, pairs = write_tiny_llm(tmp_path / "llm"), write_pairs(tmp_path / "chat.jsonl", chat=True)
    with pytest.raises(ConfigError, match="this run is classification"):
        prepare(TrainConfig(model=str(llm), data=str(reviews_csv), text_column="review", label_column="sentiment",
                            task="classification", packing=True, device="cpu"))
    prepared = prepare(TrainConfig(model=str(llm), data=str(pairs), max_length=32, packing=True, device="cpu"))
    assert prepared.packed is not None and prepared.num_train_samples == len(prepared.packed)
    assert prepared.encoder(prepared.train_examples) is prepared.packed
    assert prepared.encoder(prepared.val_examples) is not prepared.packed  # validation: per example
