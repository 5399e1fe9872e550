"""Memory measurement: a storage-level tracker and a runtime monitor usable from any training loop."""

from memfit.memory.monitor import PHASES, MemorySnapshot, Monitor, snapshot
from memfit.memory.tracker import StorageTracker

__all__ = ["PHASES", "MemorySnapshot", "Monitor", "StorageTracker", "snapshot"]
