"""memfit: fine-tune transformer models on the GPU memory you actually have."""

from memfit import memory
from memfit.config import TrainConfig
from memfit.engine import train
from memfit.errors import ConfigError, DataError, MemfitError, TrainingError
from memfit.memory.estimate import Estimate, estimate
from memfit.quantize import load_quantized
from memfit.report import Summary

__all__ = ["ConfigError", "DataError", "Estimate", "MemfitError", "Summary", "TrainConfig", "TrainingError",
           "estimate", "load_quantized", "memory", "train"]
__version__ = "0.1.0"
