"""Model presets: Hugging Face configs built from the published ``config.json`` values of each model.

Random init from these configs is what memfit estimates, plans and benchmarks for a preset (the sizes, heads,
vocabularies and tied embeddings that memory depends on); ``minilm`` and ``smollm2-135m`` are the two presets with
packaged weights (:mod:`memfit.models`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import transformers

from memfit import names


def _bert(**overrides: Any) -> transformers.PretrainedConfig:
    return transformers.BertConfig(**overrides)


def _vit(**overrides: Any) -> transformers.PretrainedConfig:
    return transformers.ViTConfig(**overrides)


PRESET_CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "bert-base": _bert,
    "bert-large": lambda: _bert(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                intermediate_size=4096),
    "roberta-base": lambda: transformers.RobertaConfig(vocab_size=50265, max_position_embeddings=514,
                                                       type_vocab_size=1),
    "distilbert-base": lambda: transformers.DistilBertConfig(),
    "gpt2": lambda: transformers.GPT2Config(),
    "vit-base": _vit,
    "vit-large": lambda: _vit(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                              intermediate_size=4096),
    "deit-small": lambda: _vit(hidden_size=384, num_hidden_layers=12, num_attention_heads=6,
                               intermediate_size=1536),
}


def _llama(**overrides: Any) -> transformers.PretrainedConfig:
    return transformers.LlamaConfig(hidden_act="silu", rms_norm_eps=1e-5, attention_bias=False, **overrides)


def _qwen2(**overrides: Any) -> transformers.PretrainedConfig:
    return transformers.Qwen2Config(rms_norm_eps=1e-6, rope_parameters=_rope(1_000_000.0),
                                    max_position_embeddings=32768, **overrides)


def _rope(theta: float, **scaling: Any) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta, **scaling}


def _with(config: transformers.PretrainedConfig, **attributes: Any) -> transformers.PretrainedConfig:
    """``config`` with attributes its class's signature does not name (the model reads them)."""
    for name, value in attributes.items():
        setattr(config, name, value)
    return config


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

# Decoder LLMs, random init from the published config.json values (the Hugging Face repository named beside
# each): sizes, heads, vocabularies and tied embeddings are what memory depends on. Rope scaling that does not
# change any tensor's size is left out (Phi-3.5's long-rope factor lists).
LLM_PRESET_CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    # HuggingFaceTB/SmolLM2-360M-Instruct
    "smollm2-360m": lambda: _llama(hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                                   num_attention_heads=15, num_key_value_heads=5, vocab_size=49152,
                                   max_position_embeddings=8192, rope_parameters=_rope(100000.0),
                                   tie_word_embeddings=True),
    # HuggingFaceTB/SmolLM2-1.7B-Instruct
    "smollm2-1.7b": lambda: _llama(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                                   num_attention_heads=32, num_key_value_heads=32, vocab_size=49152,
                                   max_position_embeddings=8192, rope_parameters=_rope(130000.0),
                                   tie_word_embeddings=True),
    # Qwen/Qwen2.5-0.5B-Instruct
    "qwen2.5-0.5b": lambda: _qwen2(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                   tie_word_embeddings=True),
    # Qwen/Qwen2.5-1.5B-Instruct
    "qwen2.5-1.5b": lambda: _qwen2(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                   tie_word_embeddings=True),
    # Qwen/Qwen2.5-3B-Instruct
    "qwen2.5-3b": lambda: _qwen2(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                                 num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                                 tie_word_embeddings=True),
    # Qwen/Qwen2.5-7B-Instruct
    "qwen2.5-7b": lambda: _qwen2(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 tie_word_embeddings=False),
    # Qwen/Qwen2.5-32B-Instruct
    "qwen2.5-32b": lambda: _qwen2(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                                  num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                                  tie_word_embeddings=False),
    # meta-llama/Llama-3.2-1B-Instruct
    "llama-3.2-1b": lambda: _llama(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                                   max_position_embeddings=131072,
                                   rope_parameters=_rope(500000.0, **LLAMA3_ROPE), tie_word_embeddings=True),
    # meta-llama/Llama-3.2-3B-Instruct
    "llama-3.2-3b": lambda: _llama(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                   num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                                   max_position_embeddings=131072,
                                   rope_parameters=_rope(500000.0, **LLAMA3_ROPE), tie_word_embeddings=True),
    # meta-llama/Llama-3.1-8B-Instruct
    "llama-3.1-8b": lambda: _llama(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                   max_position_embeddings=131072,
                                   rope_parameters=_rope(500000.0, **{**LLAMA3_ROPE, "factor": 8.0}),
                                   tie_word_embeddings=False),
    # meta-llama/Llama-3.1-70B-Instruct
    "llama-3.1-70b": lambda: _llama(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                    num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                    max_position_embeddings=131072,
                                    rope_parameters=_rope(500000.0, **{**LLAMA3_ROPE, "factor": 8.0}),
                                    tie_word_embeddings=False),
    # mistralai/Mistral-7B-Instruct-v0.3
    "mistral-7b": lambda: transformers.MistralConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32768, max_position_embeddings=32768, rope_parameters=_rope(1e6),
        sliding_window=None, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # microsoft/Phi-3.5-mini-instruct
    "phi-3.5-mini": lambda: transformers.Phi3Config(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32064, max_position_embeddings=131072,
        original_max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
        pad_token_id=32000, bos_token_id=1, eos_token_id=32000),
    # google/gemma-2-2b-it
    "gemma-2-2b": lambda: transformers.Gemma2Config(
        hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
        sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, tie_word_embeddings=True),
    # Mixture-of-experts decoders: every expert's weights, gradients and optimizer state sit on the card, each
    # token runs through k of them (:mod:`memfit.memory.moe`).
    # allenai/OLMoE-1B-7B-0924
    "olmoe-1b-7b": lambda: transformers.OlmoeConfig(
        hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, vocab_size=50304,
        max_position_embeddings=4096, rope_parameters=_rope(10000.0), rms_norm_eps=1e-5, pad_token_id=1,
        eos_token_id=50279, tie_word_embeddings=False),
    # deepseek-ai/DeepSeek-V2-Lite
    "deepseek-v2-lite": lambda: transformers.DeepseekV2Config(
        hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, head_dim=64, n_group=1, topk_group=1, topk_method="greedy",
        vocab_size=102400, max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # openai/gpt-oss-20b (its experts ship as MXFP4; fine-tuning runs them dequantised, in 16 bits)
    "gpt-oss-20b": lambda: transformers.GptOssConfig(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
        sliding_window=128, max_position_embeddings=131072, router_aux_loss_coef=0.9,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False},
        tie_word_embeddings=False),
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": lambda: _with(transformers.Qwen3MoeConfig(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, vocab_size=151936,
        max_position_embeddings=40960, rope_parameters=_rope(1_000_000.0), rms_norm_eps=1e-6,
        tie_word_embeddings=False), head_dim=128),  # (its class takes head_dim as an extra attribute)
    # mistralai/Mixtral-8x7B-Instruct-v0.1
    "mixtral-8x7b": lambda: transformers.MixtralConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=32768, rope_parameters=_rope(1e6), sliding_window=None, rms_norm_eps=1e-5,
        tie_word_embeddings=False),
}
PRESETS = ("minilm", *PRESET_CONFIGS, "smollm2-135m", *LLM_PRESET_CONFIGS)
assert PRESETS == names.PRESETS, "memfit.names.PRESETS lists the presets for the command line"
assert names.LLM_PRESETS == ("smollm2-135m", *LLM_PRESET_CONFIGS)
