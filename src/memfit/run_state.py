"""The state of a training run that the loop carries from one window to the next: where it is in the data,
what it has counted, the loss since the last log line, and its history. One typed object with
``state_dict()``/``from_state_dict()``: every checkpoint saves it, a resume restores it.

Other state lives with its owner: the OOM-adjusted batch sizes with :class:`memfit.techniques.oom.OomRecovery`,
the metrics file's length with the reporter. :class:`memfit.checkpointer.Checkpointer` puts the three
together in a checkpoint's ``progress.json``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from memfit.techniques.stability import StepCheck


@dataclass(kw_only=True, slots=True)
class Position:
    """Where the run is: the epoch, the samples of its order consumed by finished optimizer steps, the
    optimizer steps taken, and (mid-window checkpoints only) the micro-steps of the current window done."""

    epoch: int = 1
    offset: int = 0
    step: int = 0
    micro_steps_done: int = 0


@dataclass(kw_only=True, slots=True)
class Counters:
    optimizer_steps: int = 0
    """Steps that updated the weights (a non-finite step is taken but skipped)."""
    consecutive_nonfinite: int = 0
    epochs_completed: int = 0
    samples_seen: int = 0
    train_seconds: float = 0.0


@dataclass(kw_only=True, slots=True)
class LossMeter:
    """The mean training loss since the last metrics line, weighted by each window's labelled items."""

    logged_loss: float = 0.0
    logged_items: int = 0
    last_loss: float = math.nan
    """The mean of the last closed interval: what the summary reports as ``train_loss``."""

    def add(self, loss: float, items: int) -> None:
        self.logged_loss += loss * items
        self.logged_items += items

    def mean(self, default: float) -> float:
        return self.logged_loss / self.logged_items if self.logged_items else default

    def close(self) -> float:
        """End the interval: its mean becomes ``last_loss`` and the next interval starts empty."""
        self.last_loss = self.mean(math.nan)
        self.logged_loss, self.logged_items = 0.0, 0
        return self.last_loss


@dataclass(kw_only=True, slots=True)
class RunState:
    position: Position = field(default_factory=Position)
    counters: Counters = field(default_factory=Counters)
    loss: LossMeter = field(default_factory=LossMeter)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    """The optimizer steps skipped for non-finite values, as logged."""
    evaluations: list[dict[str, Any]] = field(default_factory=list)

    def finish_window(self, samples: int, items: int, check: StepCheck, seconds: float) -> None:
        """Count a finished window of ``samples`` samples (``items`` labelled items) and its optimizer step."""
        self.position.step += 1
        self.position.offset += samples
        if check.applied:
            self.counters.optimizer_steps += 1
            self.counters.consecutive_nonfinite = 0
            self.loss.add(check.loss, items)
        self.counters.train_seconds += seconds
        self.counters.samples_seen += samples

    def start_epoch(self, epoch: int) -> bool:
        """Move to ``epoch``; whether it is a new one (not the epoch a resumed run is in the middle of)."""
        if epoch == self.position.epoch:
            return False
        self.position.epoch, self.position.offset = epoch, 0
        return True

    @property
    def samples_per_second(self) -> float:
        return self.counters.samples_seen / self.counters.train_seconds if self.counters.train_seconds else 0.0

    def evaluated(self, epoch: int) -> bool:
        return bool(self.evaluations) and self.evaluations[-1]["epoch"] == epoch

    def state_dict(self) -> dict[str, Any]:
        """One flat mapping of plain values (the keys of a checkpoint's ``progress.json``)."""
        return {**dataclasses.asdict(self.position), **dataclasses.asdict(self.counters),
                **dataclasses.asdict(self.loss), "skipped": list(self.skipped), "evaluations": list(self.evaluations)}

    @classmethod
    def from_state_dict(cls, values: dict[str, Any]) -> RunState:
        """The state :meth:`state_dict` saved; keys of other owners in the same mapping are ignored."""
        def part(kind: type[Any]) -> Any:
            return kind(**{f.name: values[f.name] for f in dataclasses.fields(kind) if f.name in values})

        return cls(position=part(Position), counters=part(Counters), loss=part(LossMeter),
                   skipped=list(values.get("skipped", [])), evaluations=list(values.get("evaluations", [])))
