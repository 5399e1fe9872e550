"""What ``memfit bench`` runs: its options, validated up front. Kept apart from :mod:`memfit.bench` so the
command line can offer them without importing torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from memfit.errors import ConfigError, Problems
from memfit.units import parse_bytes

SETUPS = ("fp32", "low-accum4", "low-ckpt", "low-ckpt-top", "int8", "plan")
TOP_LAYERS = 4
HOST_RAM = "the host RAM available"
QUICK = {"samples": 256, "val_samples": 200}


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    model: str = "minilm"
    data: str = "rotten-tomatoes"
    text_column: str = "text"
    label_column: str = "label"
    device_profile: str | None = None
    """Run on this machine's device with the memory of this GPU profile (``1080ti``: 11 GiB) as the budget."""
    emulate_budget: str | None = None
    """Run with this much memory (e.g. ``400MiB``): the budget the setups are fitted and planned to."""
    effective_batch: int = 32
    samples: int | None = None
    """Training samples per setup (the first N of the shuffled training split); default: all of it."""
    val_samples: int | None = None
    max_length: int = 64
    epochs: int = 1
    lr: float = 5e-5
    seed: int = 0
    margin: float = 0.05
    """Headroom kept free when fitting the FP32 and checkpointing setups and when planning."""
    setups: tuple[str, ...] = SETUPS
    speed_rounds: int | None = None
    """Interleaved timing rounds after the runs (:func:`speed_rounds`); default 2, 0 with ``quick``."""
    speed_steps: int = 6
    """Timed steps per setup and round, after the warm-up steps."""
    output_dir: str = "runs/bench"
    quick: bool = False
    """A small matrix for a first look: 256 training and 200 validation samples unless given."""

    def validate(self) -> None:
        problems = Problems()
        if self.device_profile is not None and self.emulate_budget is not None:
            problems.add("give either --device-profile (its memory is the budget) or --emulate-budget, not both")
        if self.emulate_budget is not None:
            problems.collect(lambda: parse_bytes(str(self.emulate_budget), option="--emulate-budget"))
        if self.device_profile is not None:
            from memfit.devices import resolve_profile  # imports torch: only when a profile is given

            profile = problems.collect(lambda: resolve_profile(str(self.device_profile)))
            if profile is not None and profile.kind != "cuda":
                problems.add(f"--device-profile {self.device_profile}: not a GPU profile; give a GPU "
                             "(memfit devices) or --emulate-budget SIZE")
        unknown = [name for name in self.setups if name not in SETUPS]
        if unknown:
            problems.add(f"--setups {', '.join(unknown)}: not one of {', '.join(SETUPS)}")
        if "int8" in self.setups and "fp32" not in self.setups:
            problems.add("--setups int8 quantizes the FP32 baseline's model: add fp32")
        if self.speed_rounds is not None and self.speed_rounds < 0:
            problems.add(f"--speed-rounds must be >= 0 (got {self.speed_rounds})")
        if self.speed_steps < 1:
            problems.add(f"--speed-steps must be >= 1 (got {self.speed_steps})")
        if not 0.0 <= self.margin < 0.5:
            problems.add(f"--margin {self.margin} must be between 0 and 0.5")
        problems.raise_if_any(ConfigError)

    @property
    def resolved_speed_rounds(self) -> int:
        return self.speed_rounds if self.speed_rounds is not None else 0 if self.quick else 2

    def resolved(self) -> BenchConfig:
        """With ``quick``, the small matrix's sample counts where none were given."""
        if not self.quick:
            return self
        return dataclasses.replace(self, samples=self.samples or QUICK["samples"],
                                   val_samples=self.val_samples or QUICK["val_samples"])
