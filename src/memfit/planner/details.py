"""What a plan shows beside its table: the memory of one setup (the chosen one, or when nothing fits the one that
needs least) as a breakdown against the budget and as a timeline over the traced steps, from one more trace of
that setup (``memfit estimate``'s), and what to run: the ``memfit train`` command and, where Trainer can run the
setup, its ``TrainingArguments``.

The trace is of the whole window. Its allocated bytes are the plan's figure; so is its peak, except where the
window is longer than two micro-steps: the plan traces two and adds the other micro-batches' inputs to the
allocator's reserve as well, which the reserve may absorb (then this peak is a little lower).
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Any

from memfit.commands import train_command
from memfit.errors import ConfigError
from memfit.memory.estimate import CATEGORIES, estimate
from memfit.planner.families import Candidate
from memfit.planner.report import Plan
from memfit.planner.request import PlanRequest
from memfit.planner.speed import STEPS

RESERVE, NON_PYTORCH = "allocator_reserve", "non_pytorch"
"""The breakdown's last two parts: what the caching allocator keeps beyond the live tensors, and the memory
PyTorch does not see (the CUDA context, the libraries' kernels)."""


@dataclass(kw_only=True, slots=True)
class PlanDetails:
    which: str
    """``chosen``, or ``least need`` when nothing fits."""
    setup: str
    """The setup, as the plan describes it."""
    predicted_peak_bytes: int
    """The breakdown's sum: the setup's peak as ``memfit estimate`` traces it."""
    budget_bytes: int
    usable_bytes: int
    breakdown: dict[str, int]
    """Bytes at the peak by what holds them (:data:`memfit.memory.estimate.CATEGORIES`), then the allocator's
    reserve and the non-PyTorch memory."""
    peak_phase: str
    timeline: dict[str, Any]
    """Allocated bytes over the traced steps (:attr:`memfit.memory.estimate.Estimate.timeline`)."""
    train_command: str | None
    """``memfit train`` with the chosen setup (``torchrun`` for several GPUs); ``None`` when nothing fits."""
    trainer: str | None
    """Python that sets up Trainer for the setup (``memfit plan --emit trainer``), or ``None``."""
    trainer_notes: list[str]
    """What the Trainer code leaves to the caller (adapters, freezing), or why there is none (a setup Trainer has
    no setting for)."""
    trace: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def shown(made: Plan) -> Candidate | None:
    """The setup whose memory a plan shows: the chosen one, else the exactly traced one that needs least among
    those the plan's opt-ins allow (a plan that says what the others would need traces them too)."""
    if made.chosen is not None:
        return made.chosen
    traced = [c for c in made.candidates if c.exact and c.predicted_peak_bytes is not None]
    allowed = [c for c in traced if set(c.family.opt_ins) <= set(made.opt_ins)] or traced
    return min(allowed, key=lambda c: c.predicted_peak_bytes or 0, default=None)


def plan_details(made: Plan, request: PlanRequest) -> PlanDetails | None:
    """The memory and the commands of :func:`shown`'s setup; ``None`` when no setup was traced."""
    candidate = shown(made)
    if candidate is None:
        return None
    config = made.config_of(candidate)
    traced = estimate(config, device=request.device, seq_len=made.sequence_length, image_size=made.image_size,
                      num_labels=request.num_labels, steps=STEPS, timeline=True, exact_trace=request.exact_trace)
    breakdown = {name: traced.breakdown.get(name, 0) for name in CATEGORIES}
    breakdown[RESERVE] = traced.peak_reserved_bytes - traced.peak_bytes
    breakdown[NON_PYTORCH] = traced.non_pytorch_bytes
    trainer, notes = _trainer(made) if candidate is made.chosen else (None, [])
    assert traced.timeline is not None, "traced with its timeline"
    return PlanDetails(which="chosen" if candidate is made.chosen else "least need", setup=candidate.describe(),
                       predicted_peak_bytes=sum(breakdown.values()), budget_bytes=made.budget_bytes,
                       usable_bytes=made.usable_bytes, breakdown=breakdown, peak_phase=traced.peak_phase,
                       timeline=traced.timeline, trainer=trainer, trainer_notes=notes, trace=traced.trace,
                       train_command=train_command(config, made.gpus_per_node) if candidate is made.chosen else None)


def _trainer(made: Plan) -> tuple[str | None, list[str]]:
    """The chosen setup as Trainer code, with the warnings it gives as notes."""
    from memfit.integrations.trainer_plan import trainer_snippet

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            snippet: str | None = trainer_snippet(made)
        except ConfigError as error:
            snippet = None
            caught.append(warnings.WarningMessage(error.problems[0], UserWarning, __file__, 0))
    return snippet, list(dict.fromkeys(str(warning.message) for warning in caught))
