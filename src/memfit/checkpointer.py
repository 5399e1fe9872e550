"""A run's checkpoints: where it starts (fresh or from a checkpoint), how it saves, how it resumes.

:mod:`memfit.checkpoints` is the file format (atomic writes, checksums, sharded saves); this module puts a
run's parts into it and back: the model, optimizer, scheduler and scaler states, the random states, the
epoch's order, the partial window, and ``progress.json`` made of the run's state
(:class:`memfit.run_state.RunState`), the OOM recovery's batch sizes and the metrics file's length.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from memfit import checkpoints, distributed
from memfit.config import TrainConfig
from memfit.errors import CheckpointError, Interrupted
from memfit.planner import Plan
from memfit.run import Run
from memfit.run_state import RunState
from memfit.techniques.bf16_true import uses_kahan
from memfit.windows import PartialWindow


def open_run_dir(output_dir: Path, config: TrainConfig, world: distributed.World) -> checkpoints.Checkpoint | None:
    """The checkpoint to resume (``None``: a fresh run); refuses an existing run without --resume/--overwrite."""
    checkpoint = checkpoints.resume_checkpoint(output_dir, resume=config.resume, overwrite=config.overwrite)
    if checkpoint is not None and checkpoint.sharded != world.distributed:
        raise CheckpointError(checkpoints.format_mismatch(checkpoint))
    distributed.barrier()  # every rank has looked at the output dir before rank 0 changes it
    return checkpoint


def prepare_run_dir(output_dir: Path, checkpoint: checkpoints.Checkpoint | None, plan: Plan | None,
                    world: distributed.World) -> None:
    """Rank 0 makes the run's directory: a fresh run clears what an earlier one left there, a resumed run cuts
    what it wrote after its checkpoint; the plan it trains with is saved beside it."""
    if world.is_main:
        if checkpoint is not None:  # cut what a stopped run wrote after its checkpoint
            truncate(output_dir / "metrics.jsonl", checkpoint.progress["metrics_bytes"])
        else:
            checkpoints.clear_run(output_dir)  # --overwrite, or --resume with nothing saved yet
        output_dir.mkdir(parents=True, exist_ok=True)
        if plan is not None:
            plan.save(output_dir / "plan.json")
    distributed.barrier()


def progress(run: Run) -> dict[str, Any]:
    """What ``progress.json`` holds: the run's state, the OOM recovery's, the metrics file's length."""
    return {**run.state.state_dict(), **run.recovery.state_dict(), "metrics_bytes": run.reporter.metrics.offset}


def save(run: Run, *, partial: PartialWindow | None = None, rng: dict[str, Any] | None = None,
         optimizer_state: dict[str, Any] | None = None) -> Path:
    """A checkpoint of the run as it stands; ``partial``: inside a window, with its gradients so far;
    ``optimizer_state``: the optimizer's state to save instead of its current one (a step that failed).
    Distributed, every rank saves together (a collective), never inside a window."""
    config = run.config
    if run.world.distributed:
        shared = {"scheduler": run.scheduler.state_dict(),
                  "scaler": run.scaler.state_dict() if run.scaler is not None else {},
                  "order": torch.tensor(run.order, dtype=torch.int64)}
        return checkpoints.save_sharded(
            run.output_dir, model=run.model, optimizer=run.optimizer, state=shared, progress=progress(run),
            config=config.to_dict(), model_architecture=run.architecture, keep_last=config.keep_last,
            rank=run.world.rank, world_size=run.world.world_size, rng=checkpoints.rng_state(run.device))
    state: dict[str, Any] = {
        "optimizer": run.optimizer.state_dict() if optimizer_state is None else optimizer_state,
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict() if run.scaler is not None else {},
        "rng": rng or checkpoints.rng_state(run.device), "rng_window_start": run.recovery.window_rng,
        "order": torch.tensor(run.order, dtype=torch.int64),
        "window_loss": partial.loss if partial is not None else None}
    grads = None
    if partial is not None:
        grads = {name: p.grad.detach().cpu() for name, p in run.trained if p.grad is not None}
    return checkpoints.save(run.output_dir, model=run.model, state=state, progress=progress(run),
                            config=config.to_dict(), keep_last=config.keep_last, grads=grads)


def stopped(run: Run, path: Path) -> Interrupted:
    """The error that ends a run a stop signal interrupted, after its checkpoint at ``path``."""
    done = run.state.position.micro_steps_done
    where = f", micro-step {done} of its window" if done else ""
    return Interrupted(f"{run.stop.name} after step {run.state.position.step}{where}: checkpoint saved to {path}; "
                       "continue with the same command plus --resume", signal_number=run.stop.received or 0)


OPTIMIZER_SETUP = ("optimizer", "optimizer_in_backward", "offload_optimizer", "kahan", "precision")
"""Options that decide the layout of the optimizer's saved state."""


def check_optimizer_setup(checkpoint: checkpoints.Checkpoint, config: TrainConfig) -> None:
    """A checkpoint's optimizer state loads only into the optimizer setup that saved it: refuse another one
    before anything is written (``auto`` precision and an unset ``kahan`` compare as resolved)."""
    def setup(values: dict[str, Any]) -> dict[str, Any]:
        chosen = {name: values.get(name) for name in OPTIMIZER_SETUP}
        chosen["kahan"] = uses_kahan(chosen["kahan"], precision=str(chosen["precision"]),
                                     optimizer=str(chosen["optimizer"]))
        chosen["precision"] = "bf16-true" if chosen["precision"] == "bf16-true" else "mixed or fp32"
        return chosen

    saved, now = setup(checkpoint.config), setup(config.to_dict())
    changed = [name for name in OPTIMIZER_SETUP if saved[name] != now[name]]
    if changed:
        was = ", ".join(f"--{name.replace('_', '-')} {checkpoint.config.get(name)}" for name in changed)
        raise CheckpointError(f"--resume {checkpoint.path}: its optimizer state was saved with {was}; resume with "
                          "those options (or start a fresh run in a new --output-dir)")


def restore(run: Run, checkpoint: checkpoints.Checkpoint) -> None:
    """Put the run back where ``checkpoint`` left it: states, order, position, and a window saved part-way."""
    config, saved = run.config, checkpoint.state
    changes = checkpoints.config_changes(checkpoint.config, config.to_dict())
    if changes:
        run.reporter.warn(f"resuming {checkpoint.path} with a changed config (saved -> now): {'; '.join(changes)}")
    order = saved["order"].tolist()
    if len(order) != run.num_train:
        raise CheckpointError(f"--resume {checkpoint.path}: it was trained on {len(order)} samples (examples, or "
                              f"packed rows), this run has {run.num_train}; resume with the same --data, split "
                              "and --packing options")
    if checkpoint.sharded:  # model and optimizer state, resharded onto this run's ranks
        checkpoint.load_sharded(run.model, run.optimizer)
    else:
        run.optimizer.load_state_dict(saved["optimizer"])
    run.scheduler.load_state_dict(saved["scheduler"])
    if run.scaler is not None and saved["scaler"]:
        run.scaler.load_state_dict(saved["scaler"])
    values = checkpoint.progress
    started_as = TrainConfig(**{k: v for k, v in checkpoint.config.items() if k in config.to_dict()})
    run.recovery.load_state_dict(
        values, same_micro_batch=started_as.resolved_micro_batch_size == config.resolved_micro_batch_size,
        same_eval_batch=started_as.eval_batch_size == config.eval_batch_size)
    run.state, run.order = RunState.from_state_dict(values), order
    restore_window(run, checkpoint)
    position = run.state.position
    run.reporter.console.print(f"resumed from {checkpoint.path} at step {position.step} (epoch {position.epoch}, "
                               f"{position.offset} samples in)")


def restore_window(run: Run, checkpoint: checkpoints.Checkpoint) -> None:
    """The random state, and the gradients and loss of a window the checkpoint saved part-way."""
    saved, done = checkpoint.state, run.state.position.micro_steps_done
    if done and run.recovery.micro_batch_size == checkpoint.progress["micro_batch_size"]:
        for name, parameter in run.trained:  # continue the window after its last finished micro-step
            if name in checkpoint.grads:
                parameter.grad = checkpoint.grads[name].to(run.device)
        run.partial = PartialWindow(micro_steps_done=done, loss=saved["window_loss"],
                                    rng_window_start=saved["rng_window_start"])
        checkpoints.set_rng_state(saved["rng"], run.device)
    elif done:  # another micro-batch size: the window restarts from its first sample
        checkpoints.set_rng_state(saved["rng_window_start"], run.device)
    elif not checkpoint.sharded:
        checkpoints.set_rng_state(saved["rng"], run.device)
    else:  # each rank's own stream; a rank the saving run did not have keeps its fresh one
        rank_rng = checkpoint.rank_rng(run.world.rank)
        if rank_rng is not None:
            checkpoints.set_rng_state(rank_rng, run.device)
    run.state.position.micro_steps_done = 0


def truncate(path: Path, size: int) -> None:
    """Cut ``path`` to ``size`` bytes, so resumed metrics are the uninterrupted run's."""
    if path.is_file() and path.stat().st_size > size:
        os.truncate(path, size)

