"""The errors memfit raises for user mistakes.

Every user mistake surfaces as one :class:`MemfitError` that lists *all* the problems found, each as one
line naming what is wrong and how to fix it. The CLI prints those lines and exits with code 2, without a
traceback. ``assert`` is reserved for internal invariants.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class MemfitError(Exception):
    """Base class: one or more problems, each a single line."""

    exit_code = 2
    label = "error"
    """How the CLI prefixes each line: ``memfit: error: ...``."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        assert self.problems, "an error needs at least one problem"
        super().__init__("\n".join(self.problems))


def messages(error: MemfitError) -> list[str]:
    """The lines the command line prints for ``error``: ``memfit: error: ...``, one per problem."""
    return [f"memfit: {error.label}: {line}" for line in error.problems]


class ConfigError(MemfitError):
    """Options that are unknown, out of range, or incompatible with each other or with the device."""


class NothingFits(ConfigError):
    """A budgeted run that no allowed setup fits; ``fixes`` are the opt-in flag sets that would fit, in the
    planner's order of fidelity (the first changes least)."""

    def __init__(self, verdict: str, fixes: tuple[tuple[str, ...], ...] = ()) -> None:
        super().__init__(verdict)
        self.verdict, self.fixes = verdict, tuple(fixes)


class DataError(MemfitError):
    """A dataset that is missing, empty, or does not match the model's head."""


class CheckpointError(MemfitError):
    """A checkpoint that is incomplete, corrupted, or from another model; or an output dir in the way."""


class TrainingError(MemfitError):
    """A run that had to stop (for example after repeated non-finite steps); exit code 1."""

    exit_code = 1


class OverBudget(MemfitError, RuntimeError):
    """A training step predicted over its memory budget, stopped before it ran (memfit's Trainer callback):
    ``predicted`` (the traced step's :class:`~memfit.memory.estimate.StepPeak`), ``budget_bytes`` and
    ``advice`` (a setup that fits, or why there is none); the message is one line."""

    def __init__(self, line: str, *, predicted: Any, budget_bytes: int, advice: str) -> None:
        super().__init__(line)
        self.predicted, self.budget_bytes, self.advice = predicted, budget_bytes, advice


class PredictionUnavailable(MemfitError, RuntimeError):
    """A memory budget that cannot be checked, because the step could not be predicted (``reason``, one line:
    a model the trace cannot run, a device memfit does not support)."""

    def __init__(self, line: str, *, reason: str) -> None:
        super().__init__(line)
        self.reason = reason


class Interrupted(MemfitError):
    """SIGTERM/SIGINT stopped the run after saving a checkpoint; exit code 128 + the signal number."""

    label = "stopped"

    def __init__(self, problems: list[str] | str, *, signal_number: int) -> None:
        super().__init__(problems)
        self.exit_code = 128 + signal_number


class Problems:
    """Collects problems from several checks so they can be reported together."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, line: str) -> None:
        self.lines.append(line)

    def extend(self, error: MemfitError) -> None:
        self.lines.extend(error.problems)

    def collect(self, make: Callable[[], T]) -> T | None:
        """``make()``, or ``None`` with its problems recorded when it raises a :class:`MemfitError`."""
        try:
            return make()
        except MemfitError as error:
            self.extend(error)
            return None

    def __bool__(self) -> bool:
        return bool(self.lines)

    def raise_if_any(self, kind: type[MemfitError] = ConfigError) -> None:
        if self.lines:
            raise kind(self.lines)
