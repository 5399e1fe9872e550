"""What the device this run uses can do.

Devices are data: the rest of memfit asks a :class:`Device` (``device.has_native_bf16``) instead of branching
on a GPU's name. Native bf16 needs compute capability 8.0 (Ampere) or newer; ``torch.cuda.is_bf16_supported()``
also answers yes on older cards where bf16 is emulated and slow, so it is not trusted here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memfit.errors import ConfigError

NATIVE_BF16_CAPABILITY = (8, 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    kind: str
    """``cpu`` or ``cuda``."""
    name: str
    """Human-readable name, e.g. ``NVIDIA GeForce GTX 1080 Ti`` or ``cpu``."""
    compute_capability: tuple[int, int] | None = None
    """CUDA compute capability, ``None`` on CPU."""
    total_memory_bytes: int | None = None
    """Device memory; ``None`` on CPU, where the limit is the host's RAM."""

    @property
    def has_native_bf16(self) -> bool:
        if self.kind == "cpu":
            return True  # CPU autocast runs bf16 kernels (oneDNN); no scaler needed
        return self.compute_capability is not None and self.compute_capability >= NATIVE_BF16_CAPABILITY

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.kind)

    def describe(self) -> str:
        if self.kind == "cpu":
            return "cpu"
        major, minor = self.compute_capability or (0, 0)
        return f"{self.name} (sm_{major}{minor})"


def resolve_device(requested: str) -> Device:
    """The device ``auto | cpu | cuda`` stands for on this machine."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return Device(kind="cpu", name="cpu")
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available on this machine; use --device cpu")
    index = torch.cuda.current_device()
    properties = torch.cuda.get_device_properties(index)
    return Device(
        kind="cuda",
        name=properties.name,
        compute_capability=(properties.major, properties.minor),
        total_memory_bytes=properties.total_memory,
    )
