"""Mixture-of-experts decoders: the trace of the grouped experts equals the real CPU step to the byte, for any
routing; the load-balancing loss; LoRA on attention and on the experts; QLoRA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from memfit import TrainConfig
from memfit.memory.estimate import estimate
from memfit.memory.moe import grouped_mm_output, skewed_routing
from tests.conftest import TINY_LLAMA, TINY_MOE, write_model_dir

FAMILIES = tuple(TINY_MOE)


def write_moe(root: Path, family: str, **overrides: Any) -> Path:
    return write_model_dir(root / family, {**TINY_LLAMA, "vocab_size": 64, "tie_word_embeddings": False,
                                           **TINY_MOE[family], **overrides})


def config(model: Path, **overrides: Any) -> TrainConfig:
    values: dict[str, Any] = {"model": str(model), "task": "causal-lm", "effective_batch": 4, "micro_batch_size": 2,
                              "max_length": 16, "precision": "bf16", **overrides}
    return TrainConfig(**values)


def traced_and_measured(train_config: TrainConfig) -> tuple[int, int]:
    return estimate(train_config, seq_len=16).peak_bytes, estimate(train_config, seq_len=16, execute=True).peak_bytes


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_trace_of_a_moe_step_is_the_real_step(tmp_path: Path, family: str, precision: str) -> None:
    traced, measured = traced_and_measured(config(write_moe(tmp_path, family), precision=precision))
    assert traced == measured


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_the_grouped_experts_use_the_same_memory_for_any_routing(tmp_path: Path, family: str) -> None:
    """The grouped path's tensors are tokens x k rows whatever experts they go to: a router that sends every
    token to experts 0 and 1 measures what a balanced one measures, and what the trace predicts."""
    train_config = config(write_moe(tmp_path, family))
    traced, balanced = traced_and_measured(train_config)
    with skewed_routing([0, 1]) as calls:
        skewed = estimate(train_config, seq_len=16, execute=True).peak_bytes
    assert calls, "the routing was not replaced"
    assert traced == balanced == skewed


def test_the_load_balancing_loss_is_trained_and_traced(tmp_path: Path) -> None:
    model = write_moe(tmp_path, "mixtral", output_router_logits=True, router_aux_loss_coef=0.5)
    plain = write_moe(tmp_path / "plain", "mixtral")
    for chunk in (None, 8):
        traced, measured = traced_and_measured(config(model, loss_chunk=chunk))
        assert traced == measured
    # the router logits of every layer are kept for the loss: more than without it
    assert estimate(config(model), seq_len=16).peak_bytes > estimate(config(plain), seq_len=16).peak_bytes


def test_the_load_balancing_loss_enters_the_summed_loss_weighted_by_items() -> None:
    from memfit.techniques.router_loss import with_router_loss

    model = nn.Linear(2, 2)
    model.config = type("Config", (), {"router_aux_loss_coef": 0.5, "output_router_logits": True})()  # type: ignore[assignment]
    labels = torch.tensor([[1, 2, -100]])  # two labelled tokens
    added = with_router_loss(torch.tensor(3.0), torch.tensor(2.0), model, labels)
    assert added.item() == pytest.approx(3.0 + 0.5 * 2.0 * 2)
    assert with_router_loss(torch.tensor(3.0), None, model, labels).item() == 3.0


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_lora_on_attention_and_on_the_experts_is_exact(tmp_path: Path, family: str) -> None:
    model = write_moe(tmp_path, family)
    attention = estimate(config(model, lora_rank=4), seq_len=16)
    experts = config(model, lora_rank=4, lora_targets="q_proj,gate_up_proj,down_proj")
    traced, measured = traced_and_measured(experts)
    assert traced == measured
    assert estimate(experts, seq_len=16).trainable_parameters > attention.trainable_parameters


def test_frozen_expert_weights_are_stored_in_16_bits_beside_the_adapters() -> None:
    from memfit.techniques.lora import store_frozen

    experts = nn.Module()
    experts.gate_up_proj = nn.Parameter(torch.zeros(4, 8, 16), requires_grad=False)  # (experts, in, out)
    experts.norm = nn.LayerNorm(8).requires_grad_(False)
    experts.trained = nn.Parameter(torch.zeros(4, 8, 16))
    store_frozen(experts, torch.bfloat16)
    assert experts.gate_up_proj.dtype == torch.bfloat16
    assert experts.norm.weight.dtype == torch.float32 and experts.trained.dtype == torch.float32


def test_qlora_of_a_moe_model_is_exact(tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")
    traced, measured = traced_and_measured(config(write_moe(tmp_path, "mixtral"), lora_rank=4, quantize_base="nf4"))
    assert traced == measured


@pytest.mark.parametrize(("a", "b", "offs", "shape"), [
    ((12, 8), (4, 8, 16), (4,), (12, 16)),   # tokens x k rows through each expert's weight
    ((4, 8, 12), (12, 6), (4,), (8, 6)),     # the input's gradient pattern
    ((8, 12), (12, 6), (4,), (4, 8, 6)),     # the weights' gradient: one block per expert
    ((4, 12, 8), (4, 8, 6), None, (4, 12, 6)),  # batched
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_grouped_matmul_shapes_match_the_kernel(a: tuple[int, ...], b: tuple[int, ...],
                                                    offs: tuple[int, ...] | None, shape: tuple[int, ...],
                                                    dtype: torch.dtype) -> None:
    out = grouped_mm_output(torch.empty(a, dtype=dtype), torch.empty(b, dtype=dtype),
                            torch.empty(offs, dtype=torch.int32) if offs else None, None)
    assert tuple(out.shape) == shape and out.dtype == dtype
    if dtype == torch.float32 and len(a) == 2 and len(b) == 3:  # the CPU kernel agrees
        real = torch._grouped_mm(torch.randn(a), torch.randn(b), offs=torch.tensor([3, 6, 9, 12], dtype=torch.int32))
        assert real.shape == out.shape


def test_qlora_stores_the_experts_in_nf4_and_with_checkpointing_needs_less_than_lora(tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")
    model = write_moe(tmp_path, "qwen3_moe")
    qlora = estimate(config(model, lora_rank=4, quantize_base="nf4", checkpointing="full"), seq_len=16)
    lora = estimate(config(model, lora_rank=4, checkpointing="full"), seq_len=16)
    assert qlora.breakdown["quantized_weights"] > 0
    assert qlora.peak_bytes < lora.peak_bytes
    assert qlora.parameters == lora.parameters  # a 4-bit weight counts its weights, not its packed bytes


def test_an_nf4_expert_weight_reads_back_as_bitsandbytes_dequantises_it() -> None:
    pytest.importorskip("bitsandbytes")
    from memfit.techniques.quantized_base import NF4_BLOCKSIZE, bitsandbytes
    from memfit.techniques.quantized_experts import quantize_experts, quantized_expert_names

    torch.manual_seed(0)
    experts = nn.Module()
    weight = torch.randn(4, 16, 32)
    experts.gate_up_proj = nn.Parameter(weight.clone(), requires_grad=False)
    assert quantize_experts(experts, torch.bfloat16) == 1
    functional = bitsandbytes().functional
    packed, state = functional.quantize_4bit(weight.to(torch.bfloat16), blocksize=NF4_BLOCKSIZE,
                                             compress_statistics=True, quant_type="nf4")
    assert torch.equal(experts.gate_up_proj, functional.dequantize_4bit(packed, state))
    assert experts.gate_up_proj.shape == (4, 16, 32) and experts.gate_up_proj.dtype == torch.bfloat16
    assert quantized_expert_names(experts) == {"gate_up_proj"}
    stored = experts.parametrizations.gate_up_proj.original
    assert stored.dtype == torch.uint8 and stored.numel() == weight.numel() // 2


def test_adapters_on_nf4_experts_are_refused_in_one_line(tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")
    from memfit.errors import ConfigError

    model = write_moe(tmp_path, "qwen3_moe")
    with pytest.raises(ConfigError, match=r"^--lora-targets gate_up_proj: those expert weights are stored in NF4"):
        estimate(config(model, lora_rank=4, quantize_base="nf4", lora_targets="q_proj,gate_up_proj"), seq_len=16)


def test_a_cuda_cards_grouped_matmul_pads_its_output_rows_to_16_bytes() -> None:
    """As torch's own shape function makes it for CUDA: (rows, 6) in bf16 is stored as (rows, 8)."""
    a, b, offs = torch.empty(12, 8, dtype=torch.bfloat16), torch.empty(4, 8, 6, dtype=torch.bfloat16), torch.empty(4)
    cpu, cuda = grouped_mm_output(a, b, offs, None), grouped_mm_output(a, b, offs, None, cuda=True)
    assert cpu.shape == cuda.shape == (12, 6)
    assert cpu.untyped_storage().nbytes() == 12 * 6 * 2 and cuda.untyped_storage().nbytes() == 12 * 8 * 2 - 2 * 2


def test_a_trainer_qlora_plan_of_a_moe_model_is_refused_in_one_line() -> None:
    """Trainer's 4-bit loading leaves the experts in 16 bits, which memfit's QLoRA stores in NF4: no such plan."""
    import transformers

    from memfit.errors import ConfigError
    from memfit.integrations.trainer_plan import plan_trainer_arguments

    model = transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2))
    with pytest.raises(ConfigError, match="experts stay in 16 bits under Trainer's 4-bit loading"):
        plan_trainer_arguments(model, budget="1GiB", effective_batch=4, seq_len=16, allow_qlora=True, device="4090")


def test_only_expert_projections_count_as_expert_weights() -> None:
    """A 3-D class token or RWKV's mixing vectors stay as they are; an experts module's projections are experts."""
    from memfit.techniques.quantized_experts import is_expert_weight

    embeddings, experts = nn.Module(), type("MixtralExperts", (nn.Module,), {})()
    token, stack = torch.zeros(1, 1, 8), torch.zeros(4, 8, 16)
    assert not is_expert_weight(embeddings, "cls_token", token)
    assert is_expert_weight(experts, "gate_up_proj", stack) and is_expert_weight(experts, "w1", stack)
    assert not is_expert_weight(nn.Conv1d(4, 4, 3), "weight", torch.zeros(4, 4, 3))


def test_a_hybrid_of_several_block_classes_takes_lora(tmp_path: Path) -> None:
    """Jamba's layers are attention and Mamba blocks: the stack is the list of num_hidden_layers blocks. Its
    Mamba layers read a Linear's weight directly, which a 4-bit Linear has not: QLoRA is one line."""
    pytest.importorskip("bitsandbytes")
    from memfit.support import UnsupportedModel
    from memfit.sweep import tiny_config

    tiny_config("jamba").save_pretrained(tmp_path / "jamba")
    traced, measured = traced_and_measured(config(tmp_path / "jamba", lora_rank=4, checkpointing="full"))
    assert traced == measured
    with pytest.raises(UnsupportedModel, match=r"^jamba: not supported yet \("):
        estimate(config(tmp_path / "jamba", lora_rank=4, quantize_base="nf4"), seq_len=16)


def test_every_4_bit_state_of_a_moe_qlora_model_is_found_after_fsdp_shards_it(tmp_path: Path) -> None:
    """The states a rank-0 load broadcasts and a sharded run puts on the card: the Linear layers' and the expert
    stacks', before and after FSDP2 replaces the parameters (dropping what the packed weights carried)."""
    pytest.importorskip("bitsandbytes")
    from memfit import distributed
    from memfit.build import build_with_techniques
    from memfit.models import resolve_model
    from memfit.techniques.quantized_base import place_quant_states, quant_states

    run = config(write_moe(tmp_path, "mixtral"), lora_rank=4, quantize_base="nf4", precision="fp32")
    model = build_with_techniques(resolve_model(run.model), run, label_names=[], pad_token_id=0, task="causal-lm",
                                  low_dtype=None)
    before = quant_states(model)
    experts = [state for module in model.modules() if (state := getattr(module, "nf4_state", None)) is not None]
    assert experts and all(any(state is found for found in before) for state in experts)
    with distributed.process_group("fsdp", "cpu") as world:
        sharded = distributed.wrap(model, world, low_precision=None, device=torch.device("cpu"))
        after = quant_states(sharded)
        assert len(after) == len(before) and all(a is b for a, b in zip(after, before, strict=True))
        slots = place_quant_states(sharded, torch.device("cpu"))
    assert len(slots) == sum(3 if state.state2 is not None else 2 for state in before) + \
        sum(2 for state in before if state.state2 is not None)  # codes, scales (an offset), the nested two
