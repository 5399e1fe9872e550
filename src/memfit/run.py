"""The parts of a training run, built once by :func:`memfit.engine.build_run` and used by the loop, the
checkpointer and the summary: one typed object instead of many locals."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit import checkpoints, distributed
from memfit.build import Prepared
from memfit.config import TrainConfig
from memfit.memory.monitor import Monitor, StepTimeline
from memfit.planner import Plan
from memfit.report import Reporter
from memfit.run_state import RunState
from memfit.techniques.oom import OomRecovery
from memfit.windows import LocalWindows, PartialWindow


@dataclass(kw_only=True)
class Run:
    prepared: Prepared
    plan: Plan | None
    world: distributed.World
    output_dir: Path
    device: torch.device
    model: nn.Module
    """As it trains: wrapped by DDP or sharded by FSDP2 when distributed."""
    architecture: dict[str, Any]
    """Of the model itself, whatever wraps it (what a checkpoint must match)."""
    trained: list[tuple[str, nn.Parameter]]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    recovery: OomRecovery
    windows: LocalWindows
    """The training windows' runner (one rank's share when distributed)."""
    evaluation: LocalWindows
    """The validation set's runner."""
    reporter: Reporter
    monitor: Monitor
    timeline: StepTimeline
    stop: checkpoints.StopSignals
    total_steps: int
    trainable_parameters: int
    total_parameters: int
    checkpoint: checkpoints.Checkpoint | None = None
    """The checkpoint this run resumed from."""
    built_bytes: int = 0
    """Bytes of the parameters and buffers this process built before placing them (FSDP: rank 0's alone)."""
    state: RunState = field(default_factory=RunState)
    order: list[int] = field(default_factory=list)
    """The current epoch's sample order."""
    partial: PartialWindow | None = None
    """The window a resumed run continues part-way (cleared once it finishes or restarts)."""

    @property
    def config(self) -> TrainConfig:
        return self.prepared.config

    @property
    def num_train(self) -> int:
        """The samples the windows are cut from: training examples, or packed rows (``--packing``)."""
        return self.prepared.num_train_samples

    @property
    def running(self) -> bool:
        """Whether the epoch has samples left and the run steps left."""
        position = self.state.position
        return position.offset < self.num_train and position.step < self.total_steps

    def next_window(self) -> list[int]:
        offset = self.state.position.offset
        return self.order[offset:offset + self.config.effective_batch]
