"""LoRA, quantised base weights (QLoRA) and 8-bit optimizer states: what trains, what is stored, and the
estimate against the same steps on real tensors."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from memfit.build import build_with_techniques
from memfit.config import TrainConfig
from memfit.errors import ConfigError
from memfit.memory.estimate import estimate
from memfit.models import count_parameters, resolve_model
from memfit.techniques import quantized_base
from memfit.techniques.quantized_base import _quantized, quantized_tensors
from tests.conftest import TINY_BERT, write_model_dir, write_tiny_llm

WIDE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4}


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llm(tmp_path_factory.mktemp("lora") / "llm", config=WIDE)


def causal(model: Path, **options: Any) -> TrainConfig:
    return TrainConfig(model=str(model), data="pairs.jsonl", task="causal-lm", max_length=64, effective_batch=4,
                       **options)


def build(config: TrainConfig, low_dtype: torch.dtype | None = torch.bfloat16) -> Any:
    return build_with_techniques(resolve_model(config.model), config, label_names=["0", "1"], pad_token_id=0,
                                 task="causal-lm" if config.task == "causal-lm" else "classification",
                                 low_dtype=low_dtype)


SETUPS = {  # QLoRA without checkpointing: tests/integration/test_lora_cli.py, against memfit train
    "lora-fp32-checkpointed": {"lora_rank": 8, "precision": "fp32", "checkpointing": "full"},
    "qlora-nf4-checkpointed": {"lora_rank": 8, "quantize_base": "nf4", "precision": "bf16", "checkpointing": "full"},
    "qlora-int8": {"lora_rank": 8, "quantize_base": "int8", "precision": "bf16"},
    "qlora-int8-checkpointed": {"lora_rank": 8, "quantize_base": "int8", "precision": "bf16", "checkpointing": "full"},
    "adamw8bit": {"optimizer": "adamw8bit", "precision": "bf16"},
    "lora-adamw8bit": {"lora_rank": 8, "optimizer": "adamw8bit", "precision": "bf16", "lora_dropout": 0.1},
}


@pytest.mark.parametrize("name", list(SETUPS))
def test_the_trace_peaks_where_the_same_steps_on_real_tensors_peak(llm: Path, name: str) -> None:
    """Fake tensors through PEFT's layers, bitsandbytes' kernels and its 8-bit optimizer: to the byte, by phase
    and by category (the quantised weights' packed bytes, scales and state counted storage by storage)."""
    config = causal(llm, **SETUPS[name])
    predicted, measured = estimate(config), estimate(config, execute=True)
    assert predicted.phases == measured.phases
    assert predicted.breakdown == measured.breakdown
    if "quantize_base" in SETUPS[name]:
        assert predicted.breakdown["quantized_weights"] > 0


def test_lora_trains_only_the_adapters_of_every_block_linear(llm: Path) -> None:
    model = build(causal(llm, lora_rank=4))
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in name or ".lora_B." in name for name in trained)
    hidden, inner, rank = WIDE["hidden_size"], WIDE["intermediate_size"], 4
    kv = hidden // WIDE["num_attention_heads"] * 2  # two key/value heads
    # rank x (in + out) per Linear: q and o, k and v, gate, up and down; two blocks
    per_block = rank * (2 * (hidden + hidden) + 2 * (hidden + kv) + 3 * (hidden + inner))
    assert count_parameters(model)[0] == 2 * per_block
    # the frozen base is stored in the run's 16-bit dtype, the adapters in fp32 (their master weights)
    frozen = {p.dtype for name, p in model.named_parameters() if not p.requires_grad and "proj" in name}
    assert frozen == {torch.bfloat16}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight  # still tied


def test_lora_on_the_top_layers_and_named_targets_only(llm: Path) -> None:
    model = build(causal(llm, lora_rank=4, train_top_layers=1, lora_targets="q_proj,v_proj"))
    trained = sorted(name for name, p in model.named_parameters() if p.requires_grad)
    assert all(".layers.1.self_attn." in name and ("q_proj" in name or "v_proj" in name) for name in trained)
    assert len(trained) == 4  # A and B of two layers
    with pytest.raises(ConfigError, match="names no Linear layer"):
        build(causal(llm, lora_rank=4, lora_targets="nothing_here"))


def test_a_classification_head_trains_in_full_beside_the_adapters(tmp_path: Path) -> None:
    model_dir = write_model_dir(tmp_path / "bert", TINY_BERT)
    config = TrainConfig(model=str(model_dir), lora_rank=2)
    model = build_with_techniques(resolve_model(config.model), config, label_names=["a", "b", "c"], pad_token_id=0)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    head = {name for name in trained if "classifier" in name}
    assert {name.rsplit(".", 1)[-1] for name in head} == {"weight", "bias"}
    assert all("lora_" in name for name in trained - head)


def test_nf4_storage_is_bitsandbytes_layout_to_the_byte(llm: Path) -> None:
    """Per quantised Linear of n weights: n/2 packed bytes, one 8-bit scale per block of 64, and with double
    quantisation one fp32 scale per 256 blocks, an fp32 offset, and the two code tables (16 and 256 fp32)."""
    model = build(causal(llm, lora_rank=4, quantize_base="nf4"))
    sizes = [(module.in_features * module.out_features) for module in model.modules()
             if type(module).__name__ == "Linear4bit"]
    assert len(sizes) == 2 * 7
    expected = sum(n // 2 + n // 64 + 4 * -(-(n // 64) // 256) + 4 + 16 * 4 + 256 * 4 for n in sizes)
    stored = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in quantized_tensors(model)}
    assert sum(stored.values()) == expected
    total = count_parameters(model)[1]
    assert total == count_parameters(build(causal(llm, lora_rank=4)))[1]  # weights, not packed bytes


def test_int8_storage_is_one_byte_per_weight_and_a_scale_per_row(llm: Path) -> None:
    model = build(causal(llm, lora_rank=4, quantize_base="int8"))
    rows = [(module.in_features, module.out_features) for module in model.modules()
            if type(module).__name__ == "Linear8bitLt"]
    stored = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in quantized_tensors(model)}
    assert sum(stored.values()) == sum(n_in * n_out + 4 * n_out for n_in, n_out in rows)


def test_an_int8_layer_keeps_nothing_of_its_input_for_backward() -> None:
    """bitsandbytes' own 8-bit matmul keeps its input as a ctx attribute, out of checkpointing's reach."""
    layer = _quantized(torch.nn.Linear(64, 32), "int8", torch.float32)
    leaf = torch.randn(2, 8, 64, requires_grad=True)
    inputs = leaf * 1.0
    kept = weakref.ref(inputs)
    output = layer(inputs)
    del inputs
    assert kept() is None
    output.sum().backward()
    assert leaf.grad is not None and leaf.grad.shape == leaf.shape


@pytest.mark.parametrize("device", ["cpu", "4090"])
def test_checkpointed_int8_blocks_keep_what_16bit_blocks_keep(llm: Path, device: str) -> None:
    """Was 6.9x the 16-bit base's (1,073,664 against 156,160 bytes): every block's Linear inputs."""
    precision = "bf16" if device == "cpu" else "fp16"
    activations = {kind: estimate(causal(llm, lora_rank=8, lora_targets="q_proj,v_proj", quantize_base=kind,
                                         precision=precision, checkpointing="full"), device=device)
                   .breakdown["activations"] for kind in ("int8", "none", "nf4")}
    assert activations["int8"] == activations["none"] > 0
    assert activations["int8"] <= activations["nf4"]


def _lora_grads(model: Any, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B starts at zero, which would leave every A without a gradient
        for name, parameter in model.named_parameters():
            if ".lora_B." in name:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
    model.train()
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def test_int8_lora_gradients_are_bitsandbytes_own_with_and_without_checkpointing(
        llm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    options = {"lora_rank": 4, "quantize_base": "int8", "lora_dropout": 0.1}
    input_ids = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(0))
    fixed = _lora_grads(build(causal(llm, **options)), input_ids)
    checkpointed = _lora_grads(build(causal(llm, checkpointing="full", **options)), input_ids)
    monkeypatch.setattr(quantized_base, "frozen_int8_forward", lambda layer, x: type(layer).forward(layer, x))
    bitsandbytes_own = _lora_grads(build(causal(llm, **options)), input_ids)
    assert fixed.keys() == checkpointed.keys() == bitsandbytes_own.keys() and len(fixed) == 2 * 7 * 2
    for name, grad in fixed.items():
        assert grad.abs().sum() > 0, name
        assert torch.equal(grad, bitsandbytes_own[name]) and torch.equal(grad, checkpointed[name]), name


@pytest.mark.parametrize(("options", "message"), [
    ({"quantize_base": "nf4"}, "nothing would train; add --lora-rank"),
    ({"lora_rank": -1}, "--lora-rank must be >= 0"),
    ({"lora_rank": 4, "lora_dropout": 1.0}, "--lora-dropout must be in [0, 1)"),
    ({"merge": True}, "--merge merges LoRA adapters"),
    ({"quantize_base": "nf2", "lora_rank": 4}, "quantize"),
])
def test_bad_adapter_options_are_one_line_each(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        TrainConfig(**options).validate()
    assert len(error.value.problems) == 1 and message in error.value.problems[0]


def test_the_paged_optimizer_is_refused_off_cuda(llm: Path) -> None:
    from memfit.techniques.optim import optimizer_problems

    assert optimizer_problems("paged-adamw8bit", "cuda") == []
    [problem] = optimizer_problems("paged-adamw8bit", "cpu")
    assert "CUDA unified memory" in problem and "--optimizer adamw8bit" in problem


@pytest.mark.parametrize("rows", [8, 7])
def test_a_cuda_target_holds_the_dequantised_weight_while_a_4bit_matmul_runs(rows: int) -> None:
    """bitsandbytes' CUDA fallback (on Pascal from 8 rows): fp32 block scales twice and the whole weight in
    the compute dtype live beside the output; below 8 rows its fused kernel needs none."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.memory.emulation import _dequantising
    from memfit.memory.tracker import StorageTracker
    from memfit.techniques.quantized_base import _quantized, bitsandbytes

    with FakeTensorMode(allow_non_fake_inputs=True):
        layer = _quantized(torch.nn.Linear(256, 512, bias=False), "nf4", torch.float16)
        inputs = torch.empty(rows, 256, dtype=torch.float16)
        with StorageTracker() as tracker:
            tracker.track(inputs, *quantized_tensors(layer))
            before = tracker.live_bytes
            _dequantising(bitsandbytes().matmul_4bit, (6, 1))(inputs, layer.weight, quant_state=layer.quant_state)
    output, weights = rows * 512 * 2, 256 * 512
    transients = 2 * (weights // 64) * 4 + weights * 2 if rows >= 8 else 0
    assert tracker.peak_bytes - before == output + transients


def test_a_paged_optimizer_keeps_its_big_states_out_of_the_cards_allocator(tmp_path: Path) -> None:
    """On a CUDA target, paged AdamW8bit's two 8-bit states of every tensor of 100,000 elements or more live in
    unified memory, which the driver pages to the host: the allocator's peak is that much lower."""
    model = write_tiny_llm(tmp_path / "llm", config={"hidden_size": 256, "intermediate_size": 512})
    config = causal(model, optimizer="adamw8bit", precision="fp16")
    plain = estimate(config, device="1080ti")
    paged = estimate(causal(model, optimizer="paged-adamw8bit", precision="fp16"), device="1080ti")
    big = [p.numel() for p in build(config, low_dtype=None).parameters() if p.numel() >= 100_000]
    assert big and plain.peak_bytes - paged.peak_bytes == 2 * sum(big)
    assert paged.host_breakdown["paged_optimizer"] == 2 * sum(big)  # unified memory, backed by the host
    released = estimate(causal(model, optimizer="paged-adamw8bit", precision="fp32", optimizer_in_backward=True,
                               max_grad_norm=None, micro_batch_size=None), device="1080ti")
    assert released.host_breakdown["paged_optimizer"] == 2 * sum(big)  # the same with a step per parameter
