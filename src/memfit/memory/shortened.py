"""Which shortened trace stands for a step: a copy of the model a few blocks deep (:mod:`memfit.memory.depth`)
and the first three micro-steps and the last of each window, replayed at full length by the estimator
(:mod:`memfit.memory.repeats`); or why the step is traced in full.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from memfit.config import TrainConfig
from memfit.memory.depth import DepthCut, depth_cut
from memfit.memory.repeats import SPANNING_BUCKETS, WINDOW_STRIDE, NotRepeating, Repeat
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
    spacer: bool = False
    """The copy keeps a spacer below its groups (:mod:`memfit.memory.depth`)."""


def shortened_trace(config: TrainConfig, trace: TraceInputs, strategy: str, *,
                    spacer: bool | None = None) -> Shortened | str:
    """The shortened trace that stands for ``trace``, or why the full one runs. ``spacer``
    (:func:`memfit.memory.depth.depth_cut`): by default, where a run like this one needed it before."""
    if spacer is None:
        spacer = spaced_first(config, trace)
    depth: DepthCut | str | None = SPANNING_BUCKETS  # the micro-steps still repeat
    if strategy != "ddp" or _buckets_key(config, trace) not in _SPANNING:
        depth = depth_cut(trace.spec, config, trace.task, tail=2 if strategy == "fsdp" else 1, spacer=spacer)
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
                      windows=windows, how=how, spacer=spacer)


def after_refusal(config: TrainConfig, trace: TraceInputs, strategy: str, refused: Shortened,
                  reason: NotRepeating) -> Shortened | str:
    """What runs after ``refused`` did not repeat: a deeper copy, with a spacer, once (where its groups of blocks
    did not repeat and a spacer makes the copy deeper); the micro-steps alone, at full depth, where DDP's buckets
    span blocks (remembered: a plan traces the same model again); else the full trace, saying why."""
    if reason.buckets:
        _remember(_SPANNING, _buckets_key(config, trace))
        return shortened_trace(config, trace, strategy)
    spaced = shortened_trace(config, trace, strategy, spacer=True) if reason.blocks and not refused.spacer else None
    if isinstance(spaced, Shortened) and spaced.depth not in (None, refused.depth):
        return spaced
    return f"full trace: {reason}"


_SPACED: set[tuple[str, ...]] = set()
"""The runs whose copy without a spacer did not repeat: a plan traces the same model and technique many times."""
_SPANNING: set[tuple[str, ...]] = set()
"""The DDP runs whose gradient buckets group parameters of several blocks: traced in full from then on."""


def spaced_first(config: TrainConfig, trace: TraceInputs) -> bool:
    """Whether a copy for this run starts with a spacer: where a run like this one needed it before (QLoRA's
    first block, which allocates more than the rest for its input's casts, does not need one: the places of its
    storages are compared counted back from its last, :func:`memfit.memory.repeats.expand`)."""
    return _spacer_key(config, trace) in _SPACED


def needs_spacer(config: TrainConfig, trace: TraceInputs) -> None:
    """Remember that a run like this one (the model, task and technique) needs a spacer in its copy."""
    _remember(_SPACED, _spacer_key(config, trace))


def _remember(runs: set[tuple[str, ...]], key: tuple[str, ...]) -> None:
    if len(runs) > 64:
        runs.clear()
    runs.add(key)


def forget_spacers() -> None:
    """Forget which runs needed a spacer or had DDP buckets across blocks, as a fresh process starts."""
    _SPACED.clear()
    _SPANNING.clear()


def _spacer_key(config: TrainConfig, trace: TraceInputs) -> tuple[str, ...]:
    """What decides how a copy's first block allocates and frees: the model, the task, adapters, the optimizer
    step's kernels (a wrong guess costs time, never bytes: a copy that does not repeat is refused and traced
    otherwise)."""
    return (json.dumps(trace.spec.hf_config.to_dict(), sort_keys=True, default=str), trace.task,
            str(config.lora_rank > 0), config.quantize_base, config.optimizer, str(config.fused), str(config.foreach))


def _buckets_key(config: TrainConfig, trace: TraceInputs) -> tuple[str, ...]:
    """What decides how DDP's buckets group a run's trained parameters: the model, the task, which parameters
    are trained (a wrong guess costs time, never bytes: the record is checked)."""
    return (json.dumps(trace.spec.hf_config.to_dict(), sort_keys=True, default=str), trace.task,
            str(config.lora_rank), str(config.lora_targets), config.quantize_base, str(config.freeze_embeddings),
            str(config.train_top_layers))
