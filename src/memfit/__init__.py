"""memfit: fine-tune transformer models on the GPU memory you actually have."""

from memfit import memory
from memfit.config import TrainConfig
from memfit.engine import train
from memfit.errors import ConfigError, DataError, MemfitError, TrainingError
from memfit.report import Summary

__all__ = ["ConfigError", "DataError", "MemfitError", "Summary", "TrainConfig", "TrainingError", "memory",
           "train"]
__version__ = "0.1.0"
