"""The names the command line offers, known without importing torch or transformers, so ``memfit --help``
starts at once. :mod:`memfit.models`, :mod:`memfit.devices` and :mod:`memfit.data` define what each name
is and check at import that they define exactly these."""

from __future__ import annotations

LLM_PRESETS = ("smollm2-135m", "smollm2-360m", "smollm2-1.7b", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b",
               "qwen2.5-7b", "qwen2.5-32b", "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "llama-3.1-70b",
               "mistral-7b", "phi-3.5-mini", "gemma-2-2b", "olmoe-1b-7b", "deepseek-v2-lite", "gpt-oss-20b",
               "qwen3-30b-a3b", "mixtral-8x7b")
"""Decoder LLM presets: causal-LM fine-tuning by default. ``smollm2-135m`` is pretrained (packaged). The last five
are mixture-of-experts models."""
PRESETS = ("minilm", "bert-base", "bert-large", "roberta-base", "distilbert-base", "gpt2", "vit-base", "vit-large",
           "deit-small", *LLM_PRESETS)
"""Model presets: ``minilm`` and ``smollm2-135m`` (pretrained, packaged) and configs built from published HF
configs."""
PROFILES = ("1080ti", "2080ti", "t4", "v100-16", "v100-32", "3060", "3090", "4090", "a100-40", "a100-80", "l4",
            "h100", "h200", "cpu")
"""Built-in device profiles."""
BUILTIN_DATASETS = ("rotten-tomatoes", "rotten-tomatoes-sft", "fashion-mnist", "digits")
"""Datasets that ship inside packages or on the system."""
DATA_FORMATS = ("auto", "alpaca", "sharegpt", "messages", "prompt-completion", "text-label")
"""How a table's rows become examples (:mod:`memfit.data.formats`)."""
