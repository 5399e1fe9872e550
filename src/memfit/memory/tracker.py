"""Live tensor bytes, counted at the storage level by a dispatch mode.

:class:`StorageTracker` sees every op's outputs. Each output's ``untyped_storage()`` is counted once (views
and in-place results share their base's storage) and subtracted when that storage is freed, observed through
a weak-reference finalizer. The count is exact for tensors created while the tracker is active; tensors that
existed before (parameters, buffers) are added with :meth:`StorageTracker.track`.

``round_to`` rounds each storage up to a block size (512 emulates CUDA's caching allocator). Peaks are kept
overall and per named phase (:meth:`StorageTracker.phase`).

Overhead: one Python call per op, a few microseconds; negligible next to a transformer layer's matmuls.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class StorageTracker(TorchDispatchMode):
    def __init__(self, *, round_to: int = 1) -> None:
        super().__init__()
        self.round_to = round_to
        self.live_bytes = 0
        self.peak_bytes = 0
        self.phase_peaks: dict[str, int] = {}
        self._phase: str | None = None
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.track(leaf)
        return out

    def _rounded(self, nbytes: int) -> int:
        return -(-nbytes // self.round_to) * self.round_to

    def track(self, *tensors: torch.Tensor) -> None:
        """Count the storages of ``tensors`` (idempotent: a storage already counted is skipped)."""
        for tensor in tensors:
            if tensor.layout != torch.strided:
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in self._sizes:
                continue
            nbytes = self._rounded(storage.nbytes())
            self._sizes[key] = nbytes
            weakref.finalize(storage, self._release, key)
            self._grow(nbytes)

    def track_module(self, module: torch.nn.Module) -> None:
        self.track(*module.parameters(), *module.buffers())

    def _grow(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        if self._phase is not None and self.live_bytes > self.phase_peaks[self._phase]:
            self.phase_peaks[self._phase] = self.live_bytes

    def _release(self, key: int) -> None:
        self.live_bytes -= self._sizes.pop(key)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute the peak reached inside the block to phase ``name`` (the max over all its entries)."""
        outer = self._phase
        self._phase = name
        self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self.live_bytes)
        try:
            yield
        finally:
            self._phase = outer

    def reset_peaks(self) -> None:
        self.peak_bytes = self.live_bytes
        self.phase_peaks = {}
