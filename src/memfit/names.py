"""The names the command line offers, known without importing torch or transformers, so ``memfit --help``
starts at once. :mod:`memfit.models`, :mod:`memfit.devices` and :mod:`memfit.data` define what each name
is and check at import that they define exactly these."""

from __future__ import annotations

PRESETS = ("minilm", "bert-base", "bert-large", "roberta-base", "distilbert-base", "gpt2", "vit-base", "vit-large",
           "deit-small")
"""Model presets: ``minilm`` (pretrained, packaged) and configs built from published HF configs."""
PROFILES = ("1080ti", "2080ti", "t4", "v100-16", "v100-32", "3060", "3090", "4090", "a100-40", "a100-80", "l4",
            "h100", "h200", "cpu")
"""Built-in device profiles."""
BUILTIN_DATASETS = ("rotten-tomatoes", "fashion-mnist", "digits")
"""Datasets that ship inside packages or on the system."""
