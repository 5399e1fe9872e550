"""What a plan may use beyond the accuracy-neutral setups: one typed value, read by the search, the ranking and
the verdict alike (the CLI's ``--allow-*`` flags fill it)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

FLAGS = {"freeze": "--allow-freeze", "eight_bit_optimizer": "--allow-8bit-optimizer", "offload": "--allow-offload",
         "lora": "--allow-lora", "qlora": "--allow-qlora", "bf16_true": "--allow-bf16-true",
         "optimizer_in_backward": "--allow-optimizer-in-backward"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Allowed:
    """The opt-ins, in the order of fidelity the planner tries them when nothing accuracy-neutral fits."""

    optimizer_in_backward: bool = False
    """Each parameter updated in backward, its gradient freed (no clipping, one micro-batch per step)."""
    offload: bool = False
    """The optimizer's state and update on the host (one CUDA card): the same update, slower steps."""
    bf16_true: bool = False
    """The weights, gradients and optimizer state in bf16, updates Kahan-summed (a card with bf16)."""
    eight_bit_optimizer: bool = False
    """bitsandbytes' 8-bit AdamW states."""
    freeze: bool = False
    """The embeddings, or all but the top half or quarter of the layers, frozen."""
    lora: bool = False
    """LoRA adapters, the base frozen in 16 bits, when no full fine-tuning fits."""
    qlora: bool = False
    """LoRA on a 4-bit NF4 base, when LoRA does not fit."""

    def permits(self, flags: tuple[str, ...]) -> bool:
        """Whether every planner flag in ``flags`` (a family's :attr:`~memfit.planner.Family.opt_ins`) is given."""
        given = {FLAGS[item.name] for item in fields(self) if getattr(self, item.name)}
        return set(flags) <= given

    @property
    def adapters(self) -> bool:
        return self.lora or self.qlora

    @classmethod
    def of(cls, config: Any) -> Allowed:
        """The opt-ins a :class:`~memfit.config.TrainConfig` gives (its ``allow_*`` options)."""
        return cls(**{name: getattr(config, option(name)) is True for name in FLAGS})

    @property
    def flags(self) -> tuple[str, ...]:
        """The ``--allow-*`` flags given, in the order of fidelity."""
        return tuple(FLAGS[item.name] for item in fields(self) if getattr(self, item.name))

    def union(self, other: Allowed) -> Allowed:
        return Allowed(**{name: getattr(self, name) or getattr(other, name) for name in FLAGS})


def option(name: str) -> str:
    """The training option of opt-in ``name``: ``allow_8bit_optimizer`` for ``eight_bit_optimizer``."""
    return FLAGS[name].removeprefix("--").replace("-", "_")


NOTHING = Allowed()
"""No opt-in: only accuracy-neutral setups."""


@dataclass(frozen=True, slots=True)
class Advice:
    """One line of a plan's advice: what an opt-in (or a technique) would need."""

    line: str
    fits: tuple[str, ...] | None = None
    """The opt-in flags under which it would fit (``None``: it would not, or cannot be planned)."""


def over_by_weights(flag: str, what: str, weights_bytes: int, outside_bytes: int) -> Advice:
    """The advice for an opt-in whose weights alone (``what``: which, e.g. "its weights alone need"), with the
    card's memory outside PyTorch, exceed the budget: no trace can show it fitting, none is made."""
    from memfit.report import format_bytes

    outside = f" (with the {format_bytes(outside_bytes)} outside PyTorch)" if outside_bytes else ""
    return Advice(f"{flag} would not fit either: {what} {format_bytes(weights_bytes)}{outside}")

