"""How many GPUs, and how: ``memfit plan --max-gpus N``.

For full fine-tuning and each adapter the user allows (LoRA, then QLoRA), and for each GPU count from 1 to N,
the planner's own plan of one rank of that many (:func:`memfit.planner.plan` with ``gpus``): the memory
techniques searched with DDP, FSDP and, on a card, FSDP with CPU offload, at the user's effective batch over
all the GPUs (micro-batch x accumulation x GPUs), each setup's step time including its communication. Every
plan traces the real step of one rank (a fake process group of that many ranks); the plans share their traces.

The answer is the fewest GPUs each technique needs, and a chosen setup: the most faithful technique that fits
(full fine-tuning, then LoRA, then QLoRA) on the fewest GPUs it needs, with the ``torchrun`` command that
trains it. A count above the effective batch is not planned (every GPU needs a sample of each step). With
``--gpus-per-node G``, counts above G are whole machines (2G, 3G, ...), planned with HSDP too and their
traffic across machines priced at the profile's ``node_bandwidth``; with ``--host-memory``, a setup whose
machine would hold more offloaded bytes than that does not fit.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memfit.commands import train_command
from memfit.config import PLANNED_LORA_RANK
from memfit.errors import ConfigError
from memfit.planner.details import shown
from memfit.planner.report import Plan
from memfit.report import format_bytes

if TYPE_CHECKING:
    from memfit.memory.estimate import Estimate
    from memfit.planner.request import PlanRequest

TECHNIQUES = {"full": "full fine-tuning", "lora": "LoRA", "qlora": "QLoRA"}
"""In order of fidelity: the chosen setup is the first that fits."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Cell:
    """One technique on one number of GPUs: its plan."""

    technique: str
    gpus: int
    plan: Plan

    @property
    def fits(self) -> bool:
        return self.plan.chosen is not None

    @property
    def least_bytes(self) -> int | None:
        """When nothing fits: the least any setup of the technique needs per GPU (traced)."""
        least = shown(self.plan) if self.plan.chosen is None else None
        return least.predicted_peak_bytes if least is not None else None

    def to_dict(self) -> dict[str, Any]:
        chosen = self.plan.chosen
        command = train_command(self.plan.to_config(), self.plan.gpus_per_node) if chosen is not None else None
        return {"technique": self.technique, "gpus": self.gpus, "fits": self.fits,
                "chosen": chosen.to_dict() if chosen is not None else None,
                "setup": chosen.describe() if chosen is not None else None, "least_bytes": self.least_bytes,
                "command": command,
                "verdict": self.plan.verdict}


@dataclass(kw_only=True, slots=True)
class GpuCount:
    """Every technique's plan at every count (:attr:`cells`, by technique then count)."""

    cells: list[Cell]
    max_gpus: int
    lora_rank: int
    skipped: dict[str, str]
    """Techniques not planned, and why (bitsandbytes missing, a card its kernels do not run on)."""
    seconds: float

    def fewest(self, technique: str) -> Cell | None:
        """The fewest GPUs on which ``technique`` fits (``None``: not within :attr:`max_gpus`)."""
        return next((cell for cell in self.cells if cell.technique == technique and cell.fits), None)

    @property
    def chosen(self) -> Cell | None:
        """The most faithful technique that fits, on the fewest GPUs it needs."""
        return next((cell for technique in TECHNIQUES if (cell := self.fewest(technique)) is not None), None)

    @property
    def techniques(self) -> list[str]:
        return list(dict.fromkeys(cell.technique for cell in self.cells))

    def label(self, technique: str) -> str:
        return TECHNIQUES[technique] + (f" r={self.lora_rank}" if technique != "full" else "")

    def verdict(self) -> str:
        """One line: the fewest GPUs each technique needs, and the chosen setup; when nothing fits, what each
        technique needs at least on the most GPUs planned."""
        parts = []
        for technique in self.techniques:
            cell = self.fewest(technique)
            parts.append(f"{self.label(technique)}: {cell.gpus if cell is not None else f'more than {self.max_gpus}'}")
        chosen = self.chosen
        line = "fewest GPUs: " + ", ".join(parts)
        if chosen is None:
            needs = [f"{self.label(cell.technique)} needs at least {format_bytes(cell.least_bytes)} per GPU"
                     for cell in self.cells if cell.gpus == self.max_gpus and cell.least_bytes is not None]
            return f"nothing fits on up to {self.max_gpus} GPU(s)" + (f" ({', '.join(needs)} on "
                                                                       f"{self.max_gpus})" if needs else "")
        assert chosen.plan.chosen is not None
        return (line + f"; chosen: {self.label(chosen.technique)} on {chosen.gpus} GPU(s), "
                f"{chosen.plan.chosen.describe()}")

    def to_dict(self) -> dict[str, Any]:
        chosen = self.chosen
        return {"max_gpus": self.max_gpus, "verdict": self.verdict(), "seconds": self.seconds,
                "fewest_gpus": {technique: cell.gpus if (cell := self.fewest(technique)) else None
                                for technique in self.techniques},
                "chosen": chosen.to_dict() if chosen is not None else None, "skipped": self.skipped,
                "cells": [cell.to_dict() for cell in self.cells]}


def plan_gpu_count(request: PlanRequest, max_gpus: int, *, progress: Callable[[str], None] | None = None,
                   cache: dict[Any, Estimate] | None = None, fewest_only: bool = False) -> GpuCount:
    """Each technique's plan on 1..``max_gpus`` GPUs (see the module docstring); ``fewest_only``: each technique
    up to the first count it fits on (the fewest GPUs and their setup, not the setups on more)."""
    from memfit.devices import resolve_profile
    from memfit.planner.choose import adapter_problem

    started = time.perf_counter()
    if max_gpus < 1:
        raise ConfigError(f"--max-gpus must be >= 1 (got {max_gpus})")
    if request.gpus is not None:
        raise ConfigError("--gpus plans one number of GPUs and --max-gpus every number up to it; give one of them")
    effective = request.config().effective_batch
    per_node = request.gpus_per_node
    if per_node is not None and per_node < 1:
        raise ConfigError(f"--gpus-per-node must be >= 1 (got {per_node})")
    counts = [gpus for gpus in range(1, min(max_gpus, effective) + 1)  # whole machines beyond one
              if per_node is None or gpus <= per_node or gpus % per_node == 0]
    shared: dict[Any, Estimate] = {} if cache is None else cache
    profile = resolve_profile(request.device)
    rank = request.lora_rank or PLANNED_LORA_RANK
    techniques = ["full", *(t for t in ("lora", "qlora") if getattr(request.allow, t))]
    skipped = {t: problem for t in techniques if t != "full" and (problem := adapter_problem(t, profile))}
    cells = []
    for technique in (t for t in techniques if t not in skipped):
        options = {**request.options, "lora_rank": 0 if technique == "full" else rank,
                   "quantize_base": "nf4" if technique == "qlora" else "none"}
        asked = dataclasses.replace(request, options=options, lora_rank=rank,
                                    allow=dataclasses.replace(request.allow, lora=False, qlora=False))
        for gpus in counts:
            made = dataclasses.replace(asked, gpus=gpus).run(progress=progress, cache=shared, suggest=False)
            cells.append(Cell(technique=technique, gpus=gpus, plan=made))
            if fewest_only and made.chosen is not None:
                break
    return GpuCount(cells=cells, max_gpus=max(counts), lora_rank=rank, skipped=skipped,
                    seconds=time.perf_counter() - started)
