"""What a traced step runs on (:func:`memfit.memory.estimate.prepare_trace` makes it)."""

from __future__ import annotations

from dataclasses import dataclass

from memfit.data.batches import Batch
from memfit.devices import DeviceProfile
from memfit.models import ModelSpec


@dataclass(kw_only=True, slots=True)
class TraceInputs:
    """What a traced (or measured) step runs on, validated: the architecture without weights, the precision
    resolved for the target, and ``steps`` windows of synthetic host batches at full length."""

    profile: DeviceProfile
    spec: ModelSpec
    precision: str
    sequence_length: int | None
    image_size: int | None
    windows: list[list[Batch]]
    window_items: list[int]
    task: str = "classification"
