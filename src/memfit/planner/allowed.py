"""What a plan may use beyond the accuracy-neutral setups: one typed value, read by the search, the ranking and
the verdict alike (the CLI's ``--allow-*`` flags fill it)."""

from __future__ import annotations

from dataclasses import dataclass, fields

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


NOTHING = Allowed()
"""No opt-in: only accuracy-neutral setups."""
