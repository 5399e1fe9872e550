"""memfit: fine-tune transformer models on the GPU memory you actually have.

The package imports lightly: ``memfit.train``, ``memfit.estimate``, ``memfit.plan`` and the rest load torch
and transformers on first use, so the command line's help and its light commands start at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from memfit.config import TrainConfig
from memfit.dependencies import check_transformers
from memfit.errors import ConfigError, DataError, MemfitError, OverBudget, PredictionUnavailable, TrainingError

if TYPE_CHECKING:
    from memfit import memory
    from memfit.engine import train
    from memfit.memory.estimate import Estimate, estimate
    from memfit.planner import Plan, load_plan, plan
    from memfit.quantize import load_quantized
    from memfit.report import Summary
    from memfit.resolved import DryRun, dry_run

_LAZY = {"memory": ("memfit.memory", None), "train": ("memfit.engine", "train"),
         "Estimate": ("memfit.memory.estimate", "Estimate"), "estimate": ("memfit.memory.estimate", "estimate"),
         "Plan": ("memfit.planner", "Plan"), "load_plan": ("memfit.planner", "load_plan"),
         "plan": ("memfit.planner", "plan"), "load_quantized": ("memfit.quantize", "load_quantized"),
         "Summary": ("memfit.report", "Summary"), "DryRun": ("memfit.resolved", "DryRun"),
         "dry_run": ("memfit.resolved", "dry_run")}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'memfit' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    check_transformers()  # a clear error, not a failure deep in an older transformers
    module = importlib.import_module(module_name)
    return module if attribute is None else getattr(module, attribute)


__all__ = ["ConfigError", "DataError", "DryRun", "Estimate", "MemfitError", "OverBudget", "Plan",
           "PredictionUnavailable", "Summary", "TrainConfig", "TrainingError", "dry_run", "estimate", "load_plan",
           "load_quantized", "memory", "plan", "train"]
__version__ = "0.1.0"
