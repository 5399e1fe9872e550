"""memfit: fine-tune transformer models on the GPU memory you actually have."""

from memfit import memory
from memfit.config import TrainConfig
from memfit.engine import train
from memfit.errors import ConfigError, DataError, MemfitError, TrainingError
from memfit.memory.estimate import Estimate, estimate
from memfit.planner import Plan, load_plan, plan
from memfit.quantize import load_quantized
from memfit.report import Summary

__all__ = ["ConfigError", "DataError", "Estimate", "MemfitError", "Plan", "Summary", "TrainConfig", "TrainingError",
           "estimate", "load_plan", "load_quantized", "memory", "plan", "train"]
__version__ = "0.1.0"
