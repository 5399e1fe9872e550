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

The memory timeline of one step (``memfit train --memory-timeline``): :meth:`Monitor.start_timeline` before
it, :meth:`Monitor.stop_timeline` after it gives the live bytes after every allocation and free, each
labelled with its phase. CPU: from the storage tracker. CUDA: from the allocator's own history
(``torch.cuda.memory._record_memory_history``), whose alloc/free events are replayed from the allocated
bytes at the start; phase boundaries are the history's length when each phase starts and ends.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil
import torch

from memfit.errors import ConfigError
from memfit.memory.tracker import StorageTracker

PHASES = ("forward", "backward", "optimizer")
SUPPORTED = ("cpu", "cuda")
"""The device types a monitor measures (the CUDA allocator's statistics or the CPU tensor tracker)."""
TIMELINE_POINTS = 4000
"""A recorded timeline is reduced to at most this many points, each the highest of its stretch."""
_HISTORY_ENTRIES = 2_000_000
_active: list[Monitor] = []


@dataclass(frozen=True, kw_only=True, slots=True)
class MemorySnapshot:
    current_bytes: int
    """Live tensor bytes (CPU: tracked storages; CUDA: allocated)."""
    peak_bytes: int
    reserved_bytes: int | None = None
    """CUDA caching allocator's reserved bytes; ``None`` on CPU."""
    peak_reserved_bytes: int | None = None
    """Highest reserved bytes (CUDA) since the monitor started or its peaks were reset."""
    rss_bytes: int | None = None
    """Process resident set size now (CPU)."""
    peak_rss_bytes: int | None = None
    """Highest resident set size of the process so far (CPU)."""
    phase_peaks: dict[str, int] = field(default_factory=dict)


class Monitor:
    """Measures memory during a run; a context manager (enter before building tensors you want counted)."""

    def __init__(self, device_type: str, *, budget_bytes: int | None = None) -> None:
        if device_type not in SUPPORTED:
            raise ConfigError(f"memfit measures memory on {' and '.join(SUPPORTED)} devices; "
                              f"{device_type}: not supported")
        self.device_type = device_type
        self.budget_bytes = budget_bytes
        self.tracker = StorageTracker(budget_bytes=budget_bytes) if device_type == "cpu" else None
        self._cuda_peak = 0
        self._cuda_reserved_peak = 0
        self._cuda_phase_peaks: dict[str, int] = {}
        self._process = psutil.Process()
        self._cuda_timeline: tuple[int, list[tuple[int, str | None]]] | None = None
        """While a CUDA timeline records: (allocated bytes at its start, [(history length, phase now)])."""

    @classmethod
    def for_device(cls, device_type: str, *, budget_bytes: int | None = None) -> Monitor:
        """``budget_bytes`` emulates a smaller device: tracked on CPU, an allocator cap on CUDA."""
        return cls(device_type, budget_bytes=budget_bytes)

    def __enter__(self) -> Monitor:
        _active.append(self)
        if self.tracker is not None:
            self.tracker.__enter__()
        else:
            # cached segments of earlier work would count as this run's reserved memory, and a cap set below
            # them would never be checked (the allocator checks it only when it asks CUDA for a new segment)
            torch.cuda.empty_cache()
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
        self._mark_cuda_phase(name)
        try:
            yield
        finally:
            self._mark_cuda_phase(None)
            peak = torch.cuda.max_memory_allocated()
            self._cuda_phase_peaks[name] = max(self._cuda_phase_peaks.get(name, 0), peak)
            self._cuda_peak = max(self._cuda_peak, peak)
            self._cuda_reserved_peak = max(self._cuda_reserved_peak, torch.cuda.max_memory_reserved())

    def reset_peaks(self) -> None:
        """Forget the peaks so far (e.g. a warm-up step's): later snapshots report peaks from here on."""
        if self.tracker is not None:
            self.tracker.reset_peaks()
            return
        torch.cuda.reset_peak_memory_stats()
        self._cuda_peak = self._cuda_reserved_peak = 0
        self._cuda_phase_peaks.clear()

    def start_timeline(self) -> None:
        """Record every allocation and free from now on, until :meth:`stop_timeline`."""
        if self.tracker is not None:
            self.tracker.timeline = []
            return
        torch.cuda.memory._record_memory_history(context=None, stacks="python", max_entries=_HISTORY_ENTRIES)
        self._cuda_timeline = (torch.cuda.memory_allocated(), [(0, None)])

    @property
    def recording_timeline(self) -> bool:
        return (self.tracker.timeline is not None) if self.tracker is not None else self._cuda_timeline is not None

    def stop_timeline(self) -> dict[str, Any]:
        """The recorded timeline: ``bytes`` (live bytes after each event), ``phases`` (``name``, ``start``,
        ``end`` point indices, end exclusive), ``peak_bytes``; reduced to :data:`TIMELINE_POINTS` points."""
        if self.tracker is not None:
            events = self.tracker.timeline or []
            self.tracker.timeline = None
        else:
            assert self._cuda_timeline is not None, "start_timeline() first"
            start_bytes, marks = self._cuda_timeline
            self._cuda_timeline = None
            events = _replay_history(_cuda_history(), start_bytes, marks)
            torch.cuda.memory._record_memory_history(enabled=None)
        return timeline_record(events)

    def _mark_cuda_phase(self, name: str | None) -> None:
        if self._cuda_timeline is not None:
            self._cuda_timeline[1].append((len(_cuda_history()), name))

    def snapshot(self) -> MemorySnapshot:
        if self.tracker is not None:
            return MemorySnapshot(current_bytes=self.tracker.live_bytes, peak_bytes=self.tracker.peak_bytes,
                                  rss_bytes=self._process.memory_info().rss, peak_rss_bytes=peak_rss_bytes(),
                                  phase_peaks=dict(self.tracker.phase_peaks))
        return MemorySnapshot(current_bytes=torch.cuda.memory_allocated(),
                              peak_bytes=max(self._cuda_peak, torch.cuda.max_memory_allocated()),
                              reserved_bytes=torch.cuda.memory_reserved(),
                              peak_reserved_bytes=max(self._cuda_reserved_peak, torch.cuda.max_memory_reserved()),
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


class StepTimeline:
    """Records the memory timeline of optimizer step ``step`` (``None``: none) into ``path`` as JSON."""

    def __init__(self, monitor: Monitor, path: Path, *, step: int | None) -> None:
        self.monitor, self.path, self.step = monitor, path, step

    def start_before(self, step: int) -> None:
        if step == self.step:
            self.monitor.start_timeline()

    def save_after(self, step: int) -> None:
        if self.monitor.recording_timeline:
            record = {"step": step, "device": self.monitor.device_type, **self.monitor.stop_timeline()}
            self.path.write_text(json.dumps(record) + "\n", encoding="utf-8")


def _cuda_history() -> list[dict[str, Any]]:
    traces = torch.cuda.memory._snapshot()["device_traces"]
    return list(traces[torch.cuda.current_device()]) if traces else []


def _replay_history(history: list[dict[str, Any]], start_bytes: int,
                    marks: list[tuple[int, str | None]]) -> list[tuple[int, str | None]]:
    """Allocated bytes after each alloc/free of the CUDA allocator's history, with the phase it fell in."""
    events: list[tuple[int, str | None]] = []
    live, mark, phase = start_bytes, 0, None
    for index, entry in enumerate(history):
        while mark < len(marks) and marks[mark][0] <= index:
            phase = marks[mark][1]
            mark += 1
        if entry["action"] == "alloc":
            live += entry["size"]
        elif entry["action"] == "free_completed":
            live -= entry["size"]
        else:
            continue
        events.append((live, phase))
    return events


def timeline_record(events: list[tuple[int, str | None]], *, points: int = TIMELINE_POINTS) -> dict[str, Any]:
    """``events`` ((live bytes, phase) in order) as a JSON-ready timeline of at most ``points`` points: each
    point is the highest of its stretch of events, so the peak survives the reduction."""
    stride = max(1, -(-len(events) // points))
    reduced = [max(events[start:start + stride], key=lambda event: event[0])
               for start in range(0, len(events), stride)]
    phases: list[dict[str, Any]] = []
    for index, (_, phase) in enumerate(reduced):
        name = phase or "other"
        if phases and phases[-1]["name"] == name:
            phases[-1]["end"] = index + 1
        else:
            phases.append({"name": name, "start": index, "end": index + 1})
    return {"bytes": [value for value, _ in reduced], "phases": phases, "events": len(events),
            "peak_bytes": max((value for value, _ in events), default=0)}
