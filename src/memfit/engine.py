"""The training loop: :func:`train` reads top to bottom.

Order of a run: prepare (validate everything) -> build the model with its techniques -> per window of one
optimizer step: forward/backward over its micro-batches, unscale, check, clip, step -> evaluate each epoch ->
save the model and the summary.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import os
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import nn

from memfit import checkpoints, distributed
from memfit.build import Prepared, build_model_for, build_optimizer_for, prepare
from memfit.config import TrainConfig
from memfit.data.batches import Batch, Encoder, cut, window_order
from memfit.errors import CheckpointError, Interrupted, TrainingError
from memfit.memory.monitor import PHASES, Monitor, StepTimeline
from memfit.memory.tracker import OUT_OF_MEMORY
from memfit.models import count_parameters
from memfit.planner import Plan, plan_for_run
from memfit.report import Reporter, Summary, format_bytes, write_json
from memfit.step import IGNORE_INDEX, accumulate_window, item_count, loss_sum, to_device
from memfit.techniques.oom import OomRecovery
from memfit.techniques.optim import advance_schedule, build_scheduler
from memfit.techniques.precision import Precision
from memfit.techniques.stability import StepCheck, guarded_step


def train(config: TrainConfig, *, console: Console | None = None) -> Summary:
    """Fine-tune ``config.model`` on ``config.data``; write metrics, summary and model; return the summary."""
    started = time.perf_counter()
    config = distributed.for_launch(config)  # under torchrun: the world size it launched
    quiet = distributed.launched_rank() != 0  # rank 0 alone prints and writes
    console = Console(quiet=True) if quiet else console or Console(stderr=True)
    prepared, plan = prepare_planned(config, console)  # raises ConfigError/DataError before any work
    config = prepared.config
    strategy = distributed.resolve_strategy(config, prepared.device)
    with distributed.process_group(strategy, prepared.device.kind, cpu_offload=config.cpu_offload) as world:
        return _train(prepared, plan, world, console, started)


def _train(prepared: Prepared, plan: Plan | None, world: distributed.World, console: Console,
           started: float) -> Summary:
    config = prepared.config
    output_dir = Path(config.output_dir or f"runs/{datetime.datetime.now():%Y%m%d-%H%M%S}")
    checkpoint = checkpoints.resume_checkpoint(output_dir, resume=config.resume, overwrite=config.overwrite)
    if checkpoint is not None and checkpoint.sharded != world.distributed:
        raise CheckpointError(checkpoints.format_mismatch(checkpoint))
    distributed.barrier()  # every rank has looked at the output dir before rank 0 changes it
    device = prepared.device.torch_device
    precision = prepared.precision
    num_train = len(prepared.train_examples)
    windows_per_epoch = math.ceil(num_train / config.effective_batch)
    total_steps = min(config.max_steps or sys.maxsize, config.epochs * windows_per_epoch)

    budget = config.emulate_budget_bytes
    with Monitor.for_device(device.type, budget_bytes=budget) as monitor:
        timeline = StepTimeline(monitor, output_dir / "memory_timeline.json",
                                step=min(2, total_steps) if config.memory_timeline else None)
        model: nn.Module = build_model_for(prepared)  # freeze -> checkpointing (-> sharding, below)
        trainable, total = count_parameters(model)
        architecture = checkpoints.architecture(model)  # of the model itself, whatever wraps it later
        prepare_output_dir(output_dir, checkpoint, model, config, plan, world)
        with Reporter(console, output_dir, write=world.is_main) as reporter:
            reporter.show_config(config_rows(prepared, output_dir, trainable, total))
            if not prepared.spec.is_pretrained:
                reporter.warn(f"{config.model} has no pretrained weights here: RANDOM INIT. Memory and speed are "
                              "real; accuracy is not that of a pretrained model.")
            train_encoder = prepared.encoder(prepared.train_examples)
            val_encoder = prepared.encoder(prepared.val_examples)
            model = place_model(model, checkpoint, world, prepared, monitor, total)
            inner = distributed.unwrap(model)
            trained = [(name, p) for name, p in inner.named_parameters() if p.requires_grad]
            optimizer = build_optimizer_for(inner, config)  # last: sees only the trainable parameters
            scheduler = build_scheduler(optimizer, total_steps=total_steps, warmup_ratio=config.warmup_ratio)
            scaler = precision.make_scaler(init_scale=config.init_scale, growth_interval=config.growth_interval,
                                           sharded=world.strategy == "fsdp")
            recovery = OomRecovery(config.resolved_micro_batch_size, config.eval_batch_size,
                                   effective_batch=config.per_rank_batch, device=device,
                                   memory_now=lambda: monitor.snapshot().current_bytes,
                                   memory_needed=lambda: memory_needed_phrase(config, prepared),
                                   cannot_recover=distributed.CANNOT_RECOVER if world.distributed else None)
            run = checkpoints.Progress(micro_batch_size=recovery.micro_batch_size,
                                       eval_batch_size=recovery.eval_batch_size)
            partial: dict[str, Any] = {}  # a window resumed part-way: its gradients, loss and micro-steps done
            stop = checkpoints.StopSignals()  # SIGTERM/SIGINT: finish the micro-step, save, exit
            order = window_order(num_train, seed=config.seed, epoch=run.epoch)
            if checkpoint is not None:
                run, order, partial = resume_state(checkpoint, config, order, model, world.rank, trained, optimizer,
                                                   scheduler, scaler, recovery, reporter, device)

            def attempt_window(window: list[int], size: int) -> tuple[torch.Tensor, int, int, int]:
                """Forward + backward of each micro-batch of ``size``; gradients accumulate in .grad."""
                if world.distributed:
                    return distributed_window(model, train_encoder, window, size, world, precision=precision,
                                              scaler=scaler, device=device, phases=monitor)
                micro_batches = [train_encoder(chunk) for chunk in cut(window, size)]
                window_items = sum(item_count(batch) for batch in micro_batches)  # host-side: no sync
                start = partial.get("micro_steps_done", 0)
                loss, done = accumulate_window(model, micro_batches[start:], window_items, precision=precision,
                                               scaler=scaler, device=device, phases=monitor,
                                               loss_so_far=partial.get("loss"), should_stop=stop.requested)
                return loss, window_items, start + done, len(micro_batches)

            def reset_window() -> None:
                optimizer.zero_grad(set_to_none=True)
                partial.clear()  # a restarted window starts from its first micro-batch

            def save(*, grads: bool = False, loss: torch.Tensor | None = None,
                     rng: dict[str, Any] | None = None) -> Path:
                """A checkpoint of the run as it stands (``grads``: inside a window, after ``micro_steps_done``)."""
                run.micro_batch_size, run.eval_batch_size = recovery.micro_batch_size, recovery.eval_batch_size
                run.oom_recoveries, run.metrics_bytes = recovery.events, reporter.metrics.offset
                if world.distributed:  # every rank, together; never inside a window
                    return save_sharded_run(output_dir, model, optimizer, scheduler, scaler, order, run, config,
                                            architecture, world, device)
                state: dict[str, Any] = {
                    "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "scaler": scaler.state_dict() if scaler is not None else {},
                    "rng": rng or checkpoints.rng_state(device), "rng_window_start": recovery.window_rng,
                    "order": torch.tensor(order, dtype=torch.int64), "window_loss": loss}
                gradients = {name: p.grad.detach().cpu() for name, p in trained if p.grad is not None} if grads \
                    else None
                return checkpoints.save(output_dir, model=model, state=state, progress=run, config=config.to_dict(),
                                        keep_last=config.keep_last, grads=gradients)

            def stopped(path: Path) -> Interrupted:
                where = f", micro-step {run.micro_steps_done} of its window" if run.micro_steps_done else ""
                return Interrupted(f"{stop.name} after step {run.step}{where}: checkpoint saved to {path}; continue "
                                   "with the same command plus --resume", signal_number=stop.received or 0)

            reporter.start(total_steps, completed=run.step)
            with stop.installed():
                for epoch in range(run.epoch, config.epochs + 1):
                    if run.step >= total_steps:  # --max-steps reached at an epoch boundary
                        break
                    if epoch != run.epoch:  # a new epoch: its own seeded order
                        order = window_order(num_train, seed=config.seed, epoch=epoch)
                        run.epoch, run.offset = epoch, 0
                    model.train()
                    while run.offset < num_train and run.step < total_steps:
                        if agreed_stop(stop, world, device):  # a signal between two windows (or in an evaluation)
                            raise stopped(save())
                        window = order[run.offset:run.offset + config.effective_batch]
                        timeline.start_before(run.step + 1)
                        window_started = time.perf_counter()
                        recorded = len(recovery.events)
                        try:  # the same samples until they fit: an OOM restarts the window, smaller if needed
                            window_loss, window_items, done, count = recovery.run_window(
                                run.step + 1, functools.partial(attempt_window, window), reset=reset_window,
                                rng=partial.get("rng_window_start"))
                        except TrainingError as error:  # micro-batch 1 does not fit: keep what was learned
                            if world.distributed:  # the other ranks wait in a collective: no joint save
                                raise
                            path = save(rng=recovery.window_rng)
                            raise TrainingError(f"{error.problems[0]}; checkpoint saved to {path}, continue with "
                                                "--resume after changing the setup") from None
                        report_oom(reporter, recovery.events[recorded:])
                        if done < count:  # a signal inside the window: save its gradients so far, then stop
                            run.micro_steps_done = done
                            raise stopped(save(grads=True, loss=window_loss))
                        partial.clear()
                        with monitor.phase("optimizer"):
                            check = guarded_step(optimizer, trained, window_loss, scaler=scaler,
                                                 max_grad_norm=config.max_grad_norm)
                            loss_value, norm_value = check.loss, check.grad_norm
                            loss_finite, grads_finite = check.loss_finite, check.grads_finite
                            del window_loss  # not alive into the next window (the estimator's trace frees it too)
                            optimizer.zero_grad(set_to_none=True)
                            advance_schedule(scheduler)  # once per optimizer step, applied or skipped
                        run.step += 1
                        run.offset += len(window)

                        if loss_finite and grads_finite:
                            run.optimizer_steps += 1
                            run.consecutive_nonfinite = 0
                            run.logged_loss += loss_value * window_items
                            run.logged_items += window_items
                        else:
                            record_skip(run, check, handled_by_scaler=scaler is not None and loss_finite,
                                        reporter=reporter, max_nonfinite_steps=config.max_nonfinite_steps)
                        window_seconds = time.perf_counter() - window_started
                        run.train_seconds += window_seconds
                        timeline.save_after(run.step)
                        run.samples_seen += len(window)
                        memory = monitor.snapshot()
                        lr = float(scheduler.get_last_lr()[0])
                        # the bar shows the mean since the last log line: what metrics.jsonl and the summary report
                        reporter.step(step=run.step, loss=run.logged_loss / run.logged_items if run.logged_items
                                      else loss_value, lr=lr, samples_per_second=run.samples_seen / run.train_seconds,
                                      memory_bytes=memory.current_bytes, peak_bytes=memory.peak_bytes)
                        if run.step % config.log_every == 0 or run.step == total_steps:
                            run.last_loss = run.logged_loss / run.logged_items if run.logged_items else math.nan
                            reporter.metrics.write({
                                "type": "train", "step": run.step, "epoch": epoch, "loss": run.last_loss,
                                "lr": lr, "grad_norm": norm_value,
                                "samples_per_second": run.samples_seen / run.train_seconds,
                                "step_seconds": window_seconds, "window_samples": len(window),
                                "memory_bytes": memory.current_bytes, "peak_memory_bytes": memory.peak_bytes,
                                "rss_bytes": memory.rss_bytes})
                            run.logged_loss, run.logged_items = 0.0, 0
                        if config.save_every and run.step % config.save_every == 0 and run.step < total_steps:
                            save()
                    if run.offset >= num_train:  # the epoch ran to its end (no --max-steps break)
                        run.epochs_completed = epoch
                    if run.evaluations and run.evaluations[-1]["epoch"] == epoch:
                        continue  # evaluated before the checkpoint this run resumed from
                    recorded = len(recovery.events)
                    with monitor.phase("eval"):
                        accuracy, val_loss = recovery.run_eval(run.step, lambda size: evaluate(
                            model, val_encoder, len(prepared.val_examples), size, precision, device, world))
                    report_oom(reporter, recovery.events[recorded:])
                    record = {"type": "eval", "epoch": epoch, "step": run.step, "accuracy": accuracy,
                              "loss": val_loss}
                    run.evaluations.append(record)
                    reporter.evaluation(record)
            reporter.stop()
            if config.save_every:
                save()
            memory = monitor.snapshot()
            save_final_model(model, prepared, output_dir, world)
    mine = {"peak": memory.peak_bytes, "phases": memory.phase_peaks}
    ranks: list[dict[str, Any]] = distributed.gather(mine) if world.distributed else [mine]
    evaluations = run.evaluations
    summary = Summary(
        val_accuracy=evaluations[-1]["accuracy"], val_loss=evaluations[-1]["loss"], train_loss=run.last_loss,
        peak_memory_bytes=memory.peak_bytes,
        peak_memory_by_phase={name: memory.phase_peaks.get(name, 0) for name in (*PHASES, "eval")},
        samples_per_second=run.samples_seen / run.train_seconds if run.train_seconds else 0.0,
        optimizer_steps_per_second=run.step / run.train_seconds if run.train_seconds else 0.0,
        optimizer_steps=run.optimizer_steps, effective_batch_size=config.effective_batch,
        micro_batch_size=recovery.micro_batch_size, accumulation_steps=recovery.accumulation_steps,
        precision=precision.name, checkpointing=config.checkpointing, trainable_parameters=trainable,
        total_parameters=total, device=prepared.device.describe(), config=config.to_dict(),
        epochs_completed=run.epochs_completed, train_samples=num_train, val_samples=len(prepared.val_examples),
        train_seconds=run.train_seconds, total_seconds=time.perf_counter() - started,
        peak_rss_bytes=memory.peak_rss_bytes, peak_reserved_bytes=memory.reserved_bytes, skipped_steps=run.skipped,
        oom_recoveries=recovery.events, plan=plan.summary() if plan is not None else None,
        resumed_from=str(checkpoint.path) if checkpoint is not None else None,
        evaluations=evaluations, output_dir=str(output_dir), world_size=world.world_size,
        distributed=world.strategy, per_rank_peak_memory_bytes=[rank["peak"] for rank in ranks],
        per_rank_training_peak_bytes=[max(rank["phases"].get(name, 0) for name in PHASES) for rank in ranks],
        allreduce_seconds=world.allreduce_seconds if world.strategy == "ddp" else None)
    if world.is_main:
        write_json(output_dir / "summary.json", summary.to_dict())
        reporter.summary(summary)
    distributed.barrier()  # the run's files are complete before any rank exits
    return summary


def save_sharded_run(output_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                     scaler: torch.amp.GradScaler | None, order: list[int], run: checkpoints.Progress,
                     config: TrainConfig, architecture: dict[str, Any], world: distributed.World,
                     device: torch.device) -> Path:
    """A distributed run's checkpoint, all ranks together (:func:`memfit.checkpoints.save_sharded`)."""
    shared = {"scheduler": scheduler.state_dict(), "scaler": scaler.state_dict() if scaler is not None else {},
              "order": torch.tensor(order, dtype=torch.int64)}
    return checkpoints.save_sharded(output_dir, model=model, optimizer=optimizer, state=shared, progress=run,
                                    config=config.to_dict(), model_architecture=architecture,
                                    keep_last=config.keep_last, rank=world.rank, world_size=world.world_size,
                                    rng=checkpoints.rng_state(device))


def save_final_model(model: nn.Module, prepared: Prepared, output_dir: Path, world: distributed.World) -> None:
    """The fine-tuned model as a Hugging Face directory; distributed, gathered to rank 0 (a collective)."""
    weights = distributed.full_state_dict(model) if world.distributed else None
    if world.is_main:
        saved: Any = distributed.unwrap(model)
        saved.save_pretrained(output_dir / "model", safe_serialization=True, state_dict=weights)
        if prepared.tokenizer is not None:
            prepared.tokenizer.save_pretrained(output_dir / "model")


def prepare_output_dir(output_dir: Path, checkpoint: checkpoints.Checkpoint | None, model: nn.Module,
                       config: TrainConfig, plan: Plan | None, world: distributed.World) -> None:
    """Refuse a checkpoint of another model before anything changes; then (rank 0) make the run's directory."""
    if checkpoint is not None:
        checkpoints.check_architecture(checkpoint, model, config.model)
    if world.is_main:
        if checkpoint is not None:
            truncate(output_dir / "metrics.jsonl", checkpoint.progress.metrics_bytes)
        else:
            checkpoints.clear_run(output_dir)  # --overwrite, or --resume with nothing saved yet
        output_dir.mkdir(parents=True, exist_ok=True)
        if plan is not None:
            plan.save(output_dir / "plan.json")
    distributed.barrier()


def place_model(model: nn.Module, checkpoint: checkpoints.Checkpoint | None, world: distributed.World,
                prepared: Prepared, monitor: Monitor, total: int) -> nn.Module:
    """Saved weights in, then onto the device: as it is, replicated (DDP) or sharded (FSDP2)."""
    config, device = prepared.config, prepared.device.torch_device
    try:
        if checkpoint is not None and not checkpoint.sharded:
            checkpoint.load_weights(model)
        if world.distributed:  # FSDP2 moves only the shards
            model = distributed.wrap(model, world, low_precision=prepared.precision.low_dtype, device=device)
        else:
            model.to(device)
        monitor.track_module(model)  # parameters existed before tracking started
    except OUT_OF_MEMORY:
        raise TrainingError(f"the model alone ({format_bytes(4 * total)} of fp32 parameters) does not fit the "
                            f"device memory{' budget ' + str(config.emulate_budget) if config.emulate_budget else ''}"
                            "; use a smaller model or a device with more memory") from None
    return model


def distributed_window(model: nn.Module, encoder: Encoder, window: list[int], size: int, world: distributed.World,
                       *, precision: Precision, scaler: torch.amp.GradScaler | None, device: torch.device,
                       phases: Monitor) -> tuple[torch.Tensor, int, int, int]:
    """This rank's share of a window, gradients reduced in its last backward; (the loss averaged over the
    ranks, the window's items, micro-steps done, micro-steps).

    One labelled item per sample (sequence- and image-level heads), so the window's item count over all ranks
    is its length, known to every rank without a collective.
    """
    micro_batches = rank_batches(encoder, window, size, world)
    loss, done = accumulate_window(model, micro_batches, len(window) / world.world_size, precision=precision,
                                   scaler=scaler, device=device, phases=phases,
                                   sync=functools.partial(distributed.gradient_sync, model))
    return distributed.mean_over_ranks(loss), len(window), done, len(micro_batches)


def agreed_stop(stop: checkpoints.StopSignals, world: distributed.World, device: torch.device) -> bool:
    """A stop signal on this rank or, distributed, on any rank: then every rank stops at the same window."""
    if not world.distributed:
        return stop.requested()
    if distributed.any_rank(stop.requested(), device):
        stop.received = stop.received or signal.SIGTERM  # a rank the signal did not reach stops as SIGTERM
        return True
    return False


def prepare_planned(config: TrainConfig, console: Console) -> tuple[Prepared, Plan | None]:
    """The validated run; with ``--budget``/``--plan``, of the config the planner chose."""
    prepared = prepare(config)
    if not config.plans:
        return prepared, None
    planned, plan = plan_for_run(prepared, console)
    return prepare(planned), plan


def report_oom(reporter: Reporter, events: list[dict[str, Any]]) -> None:
    """Log and show the out-of-memory events of one window or evaluation."""
    for event in events:
        reporter.metrics.write(event)
        if event["phase"] == "eval":
            reporter.warn(f"step {event['step']}: out of memory while evaluating; eval batch "
                          f"{event['old_eval_batch_size']} -> {event['new_eval_batch_size']}")
        else:
            reporter.warn(f"step {event['step']}: out of memory at micro-batch {event['old_micro_batch_size']} "
                          f"({format_bytes(event['memory_bytes'])} in use); {event['action']} -> micro-batch "
                          f"{event['new_micro_batch_size']} x {event['accumulation_steps']}")


def record_skip(run: checkpoints.Progress, check: StepCheck, *, handled_by_scaler: bool, reporter: Reporter,
                max_nonfinite_steps: int) -> None:
    """Record a skipped (non-finite) optimizer step; stop the run after too many in a row."""
    skip: dict[str, Any] = {"step": run.step, "loss_finite": check.loss_finite, "grads_finite": check.grads_finite,
                            "handled_by": "grad_scaler" if handled_by_scaler else "memfit",
                            "parameters": check.bad_parameters}
    run.skipped.append(skip)
    reporter.metrics.write({"type": "skip", **skip})
    if handled_by_scaler:  # scaler overflows are expected and self-correcting
        return
    run.consecutive_nonfinite += 1
    reporter.warn(f"step {run.step}: non-finite {'loss' if not check.loss_finite else 'gradients'}"
                  f"{' in ' + ', '.join(skip['parameters']) if skip['parameters'] else ''}; update skipped")
    if run.consecutive_nonfinite >= max_nonfinite_steps:
        raise TrainingError(f"stopped at step {run.step}: {run.consecutive_nonfinite} consecutive optimizer steps "
                            "had a non-finite loss or gradients; lower --lr, use --precision fp32, or set "
                            "--max-grad-norm")


def resume_state(checkpoint: checkpoints.Checkpoint, config: TrainConfig, order: list[int], model: nn.Module,
                 rank: int, trained: list[tuple[str, nn.Parameter]], optimizer: torch.optim.Optimizer, scheduler: Any,
                 scaler: torch.amp.GradScaler | None, recovery: OomRecovery, reporter: Reporter,
                 device: torch.device) -> tuple[checkpoints.Progress, list[int], dict[str, Any]]:
    """Put the run back where ``checkpoint`` left it: (progress, the epoch's order, the partial window)."""
    state, run = checkpoint.state, checkpoint.progress
    changes = checkpoints.config_changes(checkpoint.config, config.to_dict())
    if changes:
        reporter.warn(f"resuming {checkpoint.path} with a changed config (saved -> now): {'; '.join(changes)}")
    saved_order = state["order"].tolist()
    if len(saved_order) != len(order):
        raise CheckpointError(f"--resume {checkpoint.path}: it was trained on {len(saved_order)} examples, this "
                              f"run has {len(order)}; resume with the same --data and split options")
    if checkpoint.sharded:  # model and optimizer state, resharded onto this run's ranks
        checkpoint.load_sharded(model, optimizer)
    else:
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state["scaler"]:
        scaler.load_state_dict(state["scaler"])
    saved_config = TrainConfig(**{k: v for k, v in checkpoint.config.items() if k in config.to_dict()})
    if saved_config.resolved_micro_batch_size == config.resolved_micro_batch_size:
        recovery.micro_batch_size = run.micro_batch_size  # an OOM-reduced micro-batch stays reduced
    if saved_config.eval_batch_size == config.eval_batch_size:
        recovery.eval_batch_size = run.eval_batch_size
    recovery.events = list(run.oom_recoveries)
    partial: dict[str, Any] = {}
    if run.micro_steps_done and recovery.micro_batch_size == run.micro_batch_size:
        for name, parameter in trained:  # continue the window after its last finished micro-step
            if name in checkpoint.grads:
                parameter.grad = checkpoint.grads[name].to(device)
        partial = {"micro_steps_done": run.micro_steps_done, "loss": state["window_loss"],
                   "rng_window_start": state["rng_window_start"]}
        checkpoints.set_rng_state(state["rng"], device)
    elif run.micro_steps_done:  # another micro-batch size: the window restarts from its first sample
        checkpoints.set_rng_state(state["rng_window_start"], device)
    elif not checkpoint.sharded:
        checkpoints.set_rng_state(state["rng"], device)
    else:  # each rank's own stream; a rank the saving run did not have keeps its fresh one
        saved_rng = checkpoint.rank_rng(rank)
        if saved_rng is not None:
            checkpoints.set_rng_state(saved_rng, device)
    run.micro_steps_done = 0
    reporter.console.print(f"resumed from {checkpoint.path} at step {run.step} (epoch {run.epoch}, "
                           f"{run.offset} samples in)")
    return run, saved_order, partial


def truncate(path: Path, size: int) -> None:
    """Cut what a stopped run wrote after its checkpoint, so resumed metrics are the uninterrupted run's."""
    if path.is_file() and path.stat().st_size > size:
        os.truncate(path, size)


@torch.no_grad()
def evaluate(model: nn.Module, encoder: Encoder, num_examples: int, batch_size: int, precision: Precision,
             device: torch.device, world: distributed.World | None = None) -> tuple[float, float]:
    """(accuracy, mean loss) over the validation examples; no activations are kept for backward.

    Distributed: each rank evaluates its share (padded so every rank runs the same forwards) and the counts
    are summed over the ranks.
    """
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=device)
    total_loss = torch.zeros((), device=device)
    batches: Iterable[Batch]
    if world is not None and world.distributed:
        batches = rank_batches(encoder, list(range(num_examples)), batch_size, world)
        model = distributed.unwrap(model)  # DDP's forward would sync buffers; FSDP2's gathers (it is its own)
    else:
        batches = (encoder(chunk) for chunk in cut(range(num_examples), batch_size))
    for host_batch in batches:
        batch = to_device(host_batch, device)
        with precision.autocast():
            loss, logits = loss_sum(model, batch)
        correct += (logits.argmax(dim=-1) == batch["labels"]).sum()  # a masked label (-100) never matches
        total_loss += loss
    if world is not None and world.distributed:
        total_correct, summed_loss = distributed.sum_over_ranks([float(correct), float(total_loss)], device)
        return total_correct / num_examples, summed_loss / num_examples
    return int(correct) / num_examples, float(total_loss) / num_examples


def rank_batches(encoder: Encoder, indices: list[int], size: int, world: distributed.World) -> list[Batch]:
    """This rank's micro-batches of ``indices`` (:func:`memfit.distributed.rank_chunks`), padding masked out."""
    chunks, padding = distributed.rank_chunks(indices, size, world)
    batches = [encoder(chunk) for chunk in chunks]
    for batch in batches[len(batches) - padding:]:
        batch["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)
    return batches


def memory_needed_phrase(config: TrainConfig, prepared: Prepared) -> str:
    """``"; a micro-batch of 1 needs 1.2 GiB (memfit estimate)"``, or ``""`` when it cannot be estimated."""
    from torch.utils._python_dispatch import _disable_current_modes

    from memfit.devices import profile_for
    from memfit.memory.estimate import estimate

    try:
        one = dataclasses.replace(config, micro_batch_size=1, accumulation_steps=None)
        with _disable_current_modes():  # the run's own tracker (and its budget) must not see the trace
            needed = estimate(one, device=profile_for(prepared.device)).peak_bytes
    except Exception:  # the estimate is a courtesy in an error message; its own failure must not mask it
        return ""
    return f"; a micro-batch of 1 needs {format_bytes(needed)} (memfit estimate)"


def config_rows(prepared: Prepared, output_dir: Path, trainable: int, total: int) -> list[tuple[str, str]]:
    """The resolved config, as (name, value) rows for the console."""
    config = prepared.config
    checkpointing = config.checkpointing + (f" (N={config.checkpoint_every})"
                                            if config.checkpointing == "every-n" else "")
    freezing = ", ".join(filter(None, ["embeddings" if config.freeze_embeddings else "",
                                       f"all but top {config.train_top_layers} layers"
                                       if config.train_top_layers else ""])) or "none"
    return [
        ("model", f"{config.model} ({type(prepared.spec.hf_config).__name__}, {prepared.spec.num_layers} layers, "
                  f"{'pretrained' if prepared.spec.is_pretrained else 'random init'})"),
        ("data", f"{config.data}: {len(prepared.train_examples)} train / {len(prepared.val_examples)} val, "
                 f"{len(prepared.label_names)} labels ({', '.join(prepared.label_names[:4])}"
                 f"{', ...' if len(prepared.label_names) > 4 else ''})"),
        ("device", prepared.device.describe()),
        ("batch", f"effective {config.effective_batch} = micro {config.resolved_micro_batch_size} x "
                  f"{config.resolved_accumulation_steps} accumulation steps"),
        ("precision", f"{prepared.precision.name}"
                      f"{' (auto)' if config.precision == 'auto' else ''}"
                      f"{' + GradScaler' if prepared.precision.uses_scaler else ''}"),
        ("checkpointing", checkpointing),
        ("freezing", freezing),
        ("parameters", f"{trainable:,} trainable of {total:,} "
                       f"({format_bytes(4 * total)} in fp32)"),
        ("optimizer", f"{config.optimizer} lr {config.lr:g}, weight decay {config.weight_decay:g}, "
                      f"foreach {config.foreach if config.foreach is not None else 'default'}, "
                      f"clip {config.max_grad_norm if config.max_grad_norm is not None else 'off'}"),
        ("schedule", f"{config.epochs} epoch(s), max steps {config.max_steps or '-'}, seed {config.seed}, "
                     f"max length {config.max_length}"),
        ("output", str(output_dir)),
    ]
