"""The runtime memory monitor: current and peak bytes, overall and per phase, on CUDA or CPU.

- CUDA: ``torch.cuda.memory_allocated`` / ``memory_reserved`` / ``max_memory_allocated``. Phase peaks reset
  the allocator's peak counter at each phase start; the overall peak is the max over phases.
- CPU: live tensor bytes from a :class:`~memfit.memory.tracker.StorageTracker` (the same accounting the
  estimator uses), plus the process RSS from psutil, which also counts the Python heap and libraries.

Use it from your own loop::

    monitor = memfit.memory.Monitor.for_device("cpu")
    with monitor:                      # starts tracking on CPU
        monitor.track_module(model)
        with monitor.phase("forward"):
            loss = model(batch).loss
    monitor.snapshot().peak_bytes
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import TracebackType

import psutil
import torch

from memfit.memory.tracker import StorageTracker

PHASES = ("forward", "backward", "optimizer")
_active: list[Monitor] = []


@dataclass(frozen=True, kw_only=True, slots=True)
class MemorySnapshot:
    current_bytes: int
    """Live tensor bytes (CPU: tracked storages; CUDA: allocated)."""
    peak_bytes: int
    reserved_bytes: int | None = None
    """CUDA caching allocator's reserved bytes; ``None`` on CPU."""
    rss_bytes: int | None = None
    """Process resident set size now (CPU)."""
    peak_rss_bytes: int | None = None
    """Highest resident set size of the process so far (CPU)."""
    phase_peaks: dict[str, int] = field(default_factory=dict)


class Monitor:
    """Measures memory during a run; a context manager (enter before building tensors you want counted)."""

    def __init__(self, device_type: str, *, budget_bytes: int | None = None) -> None:
        self.device_type = device_type
        self.budget_bytes = budget_bytes
        self.tracker = StorageTracker(budget_bytes=budget_bytes) if device_type == "cpu" else None
        self._cuda_peak = 0
        self._cuda_phase_peaks: dict[str, int] = {}
        self._process = psutil.Process()

    @classmethod
    def for_device(cls, device_type: str, *, budget_bytes: int | None = None) -> Monitor:
        """``budget_bytes`` emulates a smaller device: tracked on CPU, an allocator cap on CUDA."""
        return cls(device_type, budget_bytes=budget_bytes)

    def __enter__(self) -> Monitor:
        _active.append(self)
        if self.tracker is not None:
            self.tracker.__enter__()
        else:
            torch.cuda.reset_peak_memory_stats()
            if self.budget_bytes is not None:
                total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, self.budget_bytes / total))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        _active.remove(self)
        if self.tracker is not None:
            self.tracker.__exit__(kind, error, traceback)
        elif self.budget_bytes is not None:
            torch.cuda.set_per_process_memory_fraction(1.0)  # the cap was this run's, not the process's

    def track_module(self, module: torch.nn.Module) -> None:
        if self.tracker is not None:
            self.tracker.track_module(module)

    def track(self, *tensors: torch.Tensor, category: str | None = None) -> None:
        if self.tracker is not None:
            self.tracker.track(*tensors, category=category)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.tracker is not None:
            with self.tracker.phase(name):
                yield
            return
        torch.cuda.reset_peak_memory_stats()
        try:
            yield
        finally:
            peak = torch.cuda.max_memory_allocated()
            self._cuda_phase_peaks[name] = max(self._cuda_phase_peaks.get(name, 0), peak)
            self._cuda_peak = max(self._cuda_peak, peak)

    def snapshot(self) -> MemorySnapshot:
        if self.tracker is not None:
            return MemorySnapshot(current_bytes=self.tracker.live_bytes, peak_bytes=self.tracker.peak_bytes,
                                  rss_bytes=self._process.memory_info().rss, peak_rss_bytes=peak_rss_bytes(),
                                  phase_peaks=dict(self.tracker.phase_peaks))
        return MemorySnapshot(current_bytes=torch.cuda.memory_allocated(),
                              peak_bytes=max(self._cuda_peak, torch.cuda.max_memory_allocated()),
                              reserved_bytes=torch.cuda.memory_reserved(),
                              phase_peaks=dict(self._cuda_phase_peaks))


def peak_rss_bytes() -> int | None:
    """The process's peak RSS (``getrusage``; kibibytes on Linux, bytes on macOS), ``None`` where unknown."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def snapshot(device_type: str | None = None) -> MemorySnapshot:
    """Memory right now: the innermost active monitor's view, else the CUDA allocator's, else the RSS."""
    if _active:
        return _active[-1].snapshot()
    kind = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        return MemorySnapshot(current_bytes=torch.cuda.memory_allocated(),
                              peak_bytes=torch.cuda.max_memory_allocated(),
                              reserved_bytes=torch.cuda.memory_reserved())
    rss = psutil.Process().memory_info().rss
    return MemorySnapshot(current_bytes=rss, peak_bytes=rss, rss_bytes=rss)
