"""Precision: mixed (autocast over fp32 weights) or "true" 16-bit weights.

Trade-off: activations saved for backward are roughly halved and tensor-core GPUs run 2-8x faster; the fp32
weights (and their gradients and optimizer state) stay, so model-state memory does not shrink.

- ``fp16``: autocast + :class:`torch.amp.GradScaler`. The loss is scaled so small gradients survive fp16's
  range; steps whose gradients overflow are skipped by the scaler and the scale is lowered. On Pascal cards
  (GTX 10xx) fp16 arithmetic is not faster than fp32: it buys memory, not speed. On CPU fp16 kernels are
  ~20x slower than fp32, so it is refused unless forced.
- ``bf16``: autocast, no scaler (bf16 has fp32's range). Needs native support: CUDA compute capability
  >= 8.0 or a CPU. Older cards emulate it slowly, so it is refused there.
- ``bf16-true`` (Lightning's name): the weights themselves, their gradients and the optimizer state in bf16,
  no autocast and no fp32 master copy: 2 + 2 + 4 bytes per trained parameter with AdamW instead of 4 + 4 + 8,
  and no 16-bit weight copies. bf16 keeps 8 bits of mantissa, so an update smaller than about 1/256 of a
  weight is rounded away; Kahan summation (:mod:`memfit.techniques.bf16_true`, on by default) keeps it.
  What is learned changes a little: the forward and backward run in bf16 throughout.
- ``fp32``: no autocast; the reference for accuracy.
- ``auto``: :attr:`memfit.devices.Device.auto_precision`: bf16 on CUDA >= 8.0, fp16 on older CUDA cards; on
  CPU bf16 where the processor computes it natively (AVX512-BF16 or AMX), else fp32: without them a bf16 matmul
  is emulated, 20x slower or more (forward and backward of a 768x384x1536 matmul on a 2-core AMD EPYC with AVX2
  only: 34 ms in fp32, 820 ms in bf16).

Incompatible: ``fp16`` on CPU without ``force_cpu_fp16``; ``bf16`` and ``bf16-true`` on CUDA below compute
capability 8.0 without ``force_bf16`` (emulated there, slowly). fp16-true is not offered: fp16 weights without
an fp32 master copy and without loss scaling diverge.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from memfit.devices import Device

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "bf16-true": torch.bfloat16}


def resolve_precision(requested: str, device: Device, *, force_cpu_fp16: bool,
                      force_bf16: bool = False) -> tuple[str, list[str]]:
    """The concrete precision ``requested`` means on ``device``, and the problems it has there."""
    if requested == "auto":
        return device.auto_precision, []
    problems = []
    if requested == "fp16" and device.kind == "cpu" and not force_cpu_fp16:
        problems.append("--precision fp16 on CPU runs about 20x slower than fp32; use --precision bf16 "
                        "(or add --force-cpu-fp16 to run it anyway)")
    if requested in ("bf16", "bf16-true") and not device.has_native_bf16 and not force_bf16:
        instead = "--precision fp16" if requested == "bf16" else \
            "--precision fp32 with --optimizer adamw8bit and --optimizer-in-backward"
        problems.append(f"--precision {requested}: {device.describe()} has no native bf16 (needs compute capability "
                        f">= 8.0); use {instead} (or add --force-bf16 to run it emulated, slowly)")
    return requested, problems


@dataclass(frozen=True, slots=True)
class Precision:
    name: str
    """``fp32``, ``fp16``, ``bf16`` (mixed) or ``bf16-true``."""
    device_type: str

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    @property
    def uses_autocast(self) -> bool:
        return self.name in ("fp16", "bf16")

    @property
    def weights_dtype(self) -> torch.dtype | None:
        """The dtype the weights themselves are stored and trained in, when not fp32 (``bf16-true``)."""
        return torch.bfloat16 if self.name == "bf16-true" else None

    @property
    def uses_scaler(self) -> bool:
        return self.name == "fp16"

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        if not self.uses_autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    @property
    def low_dtype(self) -> torch.dtype | None:
        """The 16-bit compute dtype, ``None`` under fp32."""
        return None if self.name == "fp32" else self.dtype

    def make_scaler(self, *, init_scale: float, growth_interval: int,
                    sharded: bool = False) -> torch.amp.GradScaler | None:
        """fp16's GradScaler; ``sharded`` (FSDP): the one that agrees on overflow across the ranks' shards."""
        if not self.uses_scaler:
            return None
        if sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(self.device_type, init_scale=init_scale, growth_interval=growth_interval)
        return torch.amp.GradScaler(self.device_type, init_scale=init_scale, growth_interval=growth_interval)
