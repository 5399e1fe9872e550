"""Which shortened trace stands for a step: a copy of the model a few blocks deep (:mod:`memfit.memory.depth`)
and the first three micro-steps and the last of each window, replayed at full length by the estimator
(:mod:`memfit.memory.repeats`); or why the step is traced in full.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from memfit.config import TrainConfig
from memfit.memory.depth import DepthCut, depth_cut
from memfit.memory.repeats import WINDOW_STRIDE, Repeat
from memfit.memory.trace_inputs import TraceInputs
from memfit.models import with_depth


@dataclass(kw_only=True, slots=True)
class Shortened:
    """A trace of ``trace`` (a copy of ``depth.layers`` blocks, shortened windows) to replay at full length."""

    trace: TraceInputs
    config: TrainConfig
    """The run's config for the copy (its own number of trained top blocks)."""
    depth: DepthCut | None
    windows: list[Repeat]
    how: str


def shortened_trace(config: TrainConfig, trace: TraceInputs, strategy: str) -> Shortened | str:
    """The shortened trace that stands for ``trace``, or why the full one runs."""
    if strategy == "ddp":
        return "full trace: DDP's gradient buckets group parameters across blocks"
    depth = depth_cut(trace.spec, config, trace.task, tail=2 if strategy == "fsdp" else 1)
    windows = [Repeat(first=w * WINDOW_STRIDE + 2, period=1, copies=len(window) - 4,
                      limit=(w + 1) * WINDOW_STRIDE) for w, window in enumerate(trace.windows) if len(window) > 4]
    if not isinstance(depth, DepthCut) and not windows:
        return "full trace" if depth is None else f"full trace: {depth}"
    short_windows = [window[:3] + window[-1:] if len(window) > 4 else window for window in trace.windows]
    parts = []
    spec = trace.spec
    if isinstance(depth, DepthCut):
        spec = with_depth(spec, depth.layers)
        parts.append(f"{depth.layers} of {trace.spec.num_layers} blocks")
        if depth.train_top_layers is not None:
            config = dataclasses.replace(config, train_top_layers=depth.train_top_layers)
    if windows:
        parts.append(f"{sum(len(w) for w in short_windows)} of {sum(len(w) for w in trace.windows)} micro-steps")
    how = " and ".join(parts) + " traced, the rest replayed"
    if isinstance(depth, str):
        how += f" (all blocks: {depth})"
    short = dataclasses.replace(trace, spec=spec, windows=short_windows, window_items=list(trace.window_items))
    return Shortened(trace=short, config=config, depth=depth if isinstance(depth, DepthCut) else None,
                      windows=windows, how=how)
