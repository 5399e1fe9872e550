"""The training loop: :func:`loop` reads top to bottom.

A run: prepare (validate everything) -> :func:`build_run` (the model with its techniques, the optimizer, the
window runner, the checkpointer's resume) -> :func:`loop`: per window of one optimizer step, forward/backward
over its micro-batches with OOM recovery, then the optimizer step (unscale, check, clip, step); log; maybe
save; evaluate after each epoch -> :func:`finish`: save the model and the summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import nn

from memfit import checkpointer, checkpoints, distributed, rank0_load, streamed_export
from memfit.build import Prepared, build_base_for, build_model_for, build_optimizer_for
from memfit.config import TrainConfig
from memfit.data.batches import window_order
from memfit.data.packing import cache_as_loaded
from memfit.errors import TrainingError
from memfit.memory.estimate import resolve_strategy
from memfit.memory.monitor import PHASES, Monitor, StepTimeline
from memfit.memory.tracker import OUT_OF_MEMORY
from memfit.models import count_parameters
from memfit.planner import Plan
from memfit.quiet import quiet_transformers
from memfit.report import Reporter, Summary, format_bytes, write_json
from memfit.resolved import config_rows, prepare_planned
from memfit.run import Run
from memfit.step import optimizer_step
from memfit.support import model_support
from memfit.techniques.lora import save_merged
from memfit.techniques.offload_activations import ActivationOffload
from memfit.techniques.oom import OomRecovery, StepWatch, oom_message
from memfit.techniques.optim import build_scheduler
from memfit.techniques.quantized_base import place_quant_states
from memfit.techniques.stability import StepCheck
from memfit.windows import PartialWindow, WindowResult, evaluate, window_runner


@quiet_transformers()
def train(config: TrainConfig, *, console: Console | None = None) -> Summary:
    """Fine-tune ``config.model`` on ``config.data``; write metrics, summary and model; return the summary."""
    started = time.perf_counter()
    config = distributed.for_launch(config)  # under torchrun: the world size it launched
    quiet = distributed.launched_rank() != 0  # rank 0 alone prints and writes
    console = Console(quiet=True) if quiet else console or Console(stderr=True)
    prepared, plan = prepare_planned(config, console)  # raises ConfigError/DataError before any work
    strategy = resolve_strategy(prepared.config, prepared.device)
    with distributed.process_group(strategy, prepared.device.kind, cpu_offload=prepared.config.cpu_offload,
                                   shard_group=prepared.config.shard_group,
                                   reduce_every_micro_step=prepared.config.reduce_every_micro_step) as world:
        output_dir = Path(prepared.config.output_dir or f"runs/{datetime.datetime.now():%Y%m%d-%H%M%S}")
        resumed = checkpointer.open_run_dir(output_dir, prepared.config, world)
        device = world.device_for(prepared.device.kind)
        with Monitor.for_device(device.type, budget_bytes=prepared.config.emulate_budget_bytes) as monitor:
            run = build_run(prepared, plan, world, output_dir, device, monitor, resumed, console)
            with run.reporter, run.stop.installed():
                loop(run)
                return finish(run, started)


def loop(run: Run) -> None:
    """For each window: run it (OOM recovery keeps its samples), step the optimizer, log, maybe save; after
    each epoch, evaluate."""
    state, config = run.state, run.config
    run.reporter.start(run.total_steps, completed=state.position.step)
    for epoch in range(state.position.epoch, config.epochs + 1):
        if state.position.step >= run.total_steps:  # --max-steps reached at an epoch boundary
            break
        if state.start_epoch(epoch):  # a new epoch: its own seeded order
            run.order = window_order(run.num_train, seed=config.seed, epoch=epoch)
        run.model.train()
        while run.running:
            if run.windows.stop_agreed(run.stop.requested()):  # a signal between windows (or in an evaluation)
                run.stop.received = run.stop.received or signal.SIGTERM  # a rank it did not reach: as SIGTERM
                raise checkpointer.stopped(run, checkpointer.save(run))
            window = run.next_window()
            run.timeline.start_before(state.position.step + 1)
            started = time.perf_counter()
            with model_support(run.prepared.spec.hf_config, active=state.position.step == 0):  # (one line)
                loss, items = run_window(run, window)  # forward + backward; gradients accumulate in .grad
                check = step_optimizer(run, loss)  # unscale, check, clip, step; an OOM here stops the run
            del loss  # not alive into the next window (the estimator's trace frees it there too)
            seconds = time.perf_counter() - started
            state.finish_window(len(window), items, check, seconds=seconds)
            if not check.applied:
                record_skip(run, check)
            run.timeline.save_after(state.position.step)
            log_step(run, epoch, check, len(window), seconds)
            if config.save_every and state.position.step % config.save_every == 0 \
                    and state.position.step < run.total_steps:
                checkpointer.save(run)
        if state.position.offset >= run.num_train:  # the epoch ran to its end (no --max-steps break)
            state.counters.epochs_completed = epoch
        if not state.evaluated(epoch):  # (a resumed run may have evaluated it before its checkpoint)
            evaluate_epoch(run, epoch)
    run.reporter.stop()
    if config.save_every:
        checkpointer.save(run)


def run_window(run: Run, window: list[int]) -> tuple[torch.Tensor, int]:
    """The window's forward and backward passes, the same samples until they fit: an OOM restarts the window
    (smaller micro-batches if needed). A stop signal inside it saves its gradients so far and stops the run."""
    recorded = len(run.recovery.events)

    def restart() -> None:  # a failed attempt's gradients go; the window starts again from its first sample
        run.optimizer.zero_grad(set_to_none=True)
        run.partial = None

    try:
        result: WindowResult = run.recovery.run_window(
            run.state.position.step + 1, lambda size: run.windows.run(window, size, run.partial), reset=restart,
            rng=run.partial.rng_window_start if run.partial is not None else None)
    except TrainingError as error:  # micro-batch 1 does not fit: keep what was learned
        if run.world.distributed or run.config.optimizer_in_backward:  # the other ranks wait in a collective,
            raise  # or the step is half applied: no save
        path = checkpointer.save(run, rng=run.recovery.window_rng)
        raise TrainingError(f"{error.problems[0]}; checkpoint saved to {path}, continue with --resume after "
                            "changing the setup") from None
    report_oom(run.reporter, run.recovery.events[recorded:])
    if result.done < result.micro_steps:  # a signal inside the window
        run.state.position.micro_steps_done = result.done
        partial = PartialWindow(micro_steps_done=result.done, loss=result.loss,
                                             rng_window_start=run.recovery.window_rng)
        raise checkpointer.stopped(run, checkpointer.save(run, partial=partial))
    run.partial = None
    return result.loss, result.items


def step_optimizer(run: Run, loss: torch.Tensor) -> StepCheck:
    """The window's optimizer step. An OOM in it stops the run (:mod:`memfit.techniques.oom`): with a checkpoint
    of the run as it was before the step if the step had changed nothing yet."""
    watch = None if run.world.distributed or run.config.optimizer_in_backward else \
        StepWatch(run.optimizer, [parameter for _, parameter in run.trained])
    try:
        with watch or contextlib.nullcontext():
            return optimizer_step(run.optimizer, run.trained, loss, scaler=run.scaler,
                                  max_grad_norm=run.config.max_grad_norm, scheduler=run.scheduler,
                                  phases=run.monitor)
    except OUT_OF_MEMORY as error:  # (the failed step's tensors go with the exception, before any saving)
        message = oom_message(error)
    raise optimizer_oom(run, watch, message)


def optimizer_oom(run: Run, watch: StepWatch | None, message: str) -> TrainingError:
    """The error that stops a run whose optimizer step ran out of memory, after saving the run as it was before
    the step when the step had not written to it yet (``watch``; ``None``: distributed, or stepped in
    backward, where no such state is left)."""
    failed = f"step {run.state.position.step + 1}: out of memory in the optimizer step ({message})"
    leaner = ("a leaner optimizer: --offload-optimizer (CUDA), --optimizer adamw8bit, LoRA (--lora-rank), "
              "--train-top-layers, or a smaller model (memfit plan)")
    if watch is None or watch.wrote:
        why = "it had updated part of the model" if watch is not None else "a distributed run, or a step in backward"
        return TrainingError(f"{failed}; no checkpoint of the run before it can be saved ({why}): resume from the "
                             f"last --save-every one, or start again, with {leaner}")
    # the window starts again on resume: its samples, its random state, the weights and state before the step
    path = checkpointer.save(run, rng=run.recovery.window_rng, optimizer_state=watch.state_before)
    return TrainingError(f"{failed}; the run before that step is saved to {path}: continue with --resume once the "
                         f"step fits (--no-foreach, or free the device's memory), or start again with {leaner}")


def log_step(run: Run, epoch: int, check: StepCheck, samples: int, seconds: float) -> None:
    """The progress bar after every step; a metrics line every ``--log-every`` steps and at the last."""
    state, step = run.state, run.state.position.step
    memory = run.monitor.snapshot()
    lr = float(run.scheduler.get_last_lr()[0])
    # the bar shows the mean since the last log line: what metrics.jsonl and the summary report
    run.reporter.step(step=step, loss=state.loss.mean(check.loss), lr=lr,
                      samples_per_second=state.samples_per_second, memory_bytes=memory.current_bytes,
                      peak_bytes=memory.peak_bytes)
    if step % run.config.log_every == 0 or step == run.total_steps:
        run.reporter.metrics.write({
            "type": "train", "step": step, "epoch": epoch, "loss": state.loss.close(), "lr": lr,
            "grad_norm": check.grad_norm, "samples_per_second": state.samples_per_second,
            "step_seconds": seconds, "window_samples": samples,
            "memory_bytes": memory.current_bytes, "peak_memory_bytes": memory.peak_bytes,
            "rss_bytes": memory.rss_bytes})


def evaluate_epoch(run: Run, epoch: int) -> None:
    """The validation metrics after ``epoch`` (epoch 0: before training); an OOM halves only the evaluation
    batch."""
    recorded = len(run.recovery.events)
    with run.monitor.phase("eval"):
        metrics = run.recovery.run_eval(run.state.position.step, lambda size: evaluate(
            run.evaluation, len(run.prepared.val_examples), size))
    report_oom(run.reporter, run.recovery.events[recorded:])
    record = {"type": "eval", "epoch": epoch, "step": run.state.position.step, **metrics}
    run.state.evaluations.append(record)
    run.reporter.evaluation(record)
    run.model.train()


def build_run(prepared: Prepared, plan: Plan | None, world: distributed.World, output_dir: Path,
              device: torch.device, monitor: Monitor, resumed: checkpoints.Checkpoint | None,
              console: Console) -> Run:
    """Everything the loop needs, in the documented order: freeze -> checkpointing -> (resumed weights) ->
    device or distributed wrap -> optimizer; then the checkpoint's state, if the run resumes."""
    config = prepared.config
    total_steps = min(config.max_steps or sys.maxsize,
                      config.epochs * math.ceil(prepared.num_train_samples / config.effective_batch))
    once = rank0_load.loads_once(config, prepared.spec, world.strategy, world.world_size)  # FSDP: rank 0 reads
    with model_support(prepared.spec.hf_config):  # an architecture memfit cannot build: one line
        model: nn.Module = rank0_load.build(lambda weights: build_model_for(prepared, weights=weights),
                                            main=world.is_main, once=once, device=device)
    built = rank0_load.materialised_bytes(model)  # freeze -> checkpointing (-> sharding, below)
    trainable, total = count_parameters(model)
    architecture = checkpoints.architecture(model)  # of the model itself, whatever wraps it later
    if resumed is not None:  # a checkpoint of another model is refused before anything changes
        checkpoints.check_architecture(resumed, model, config.model)
        checkpointer.check_optimizer_setup(resumed, config)
    checkpointer.prepare_run_dir(output_dir, resumed, plan, world)
    model = place_model(model, resumed, world, prepared, device, monitor, total, once=once)
    inner = distributed.unwrap(model)
    optimizer = build_optimizer_for(inner, config)  # last: sees only the trainable parameters
    scaler = prepared.precision.make_scaler(init_scale=config.init_scale, growth_interval=config.growth_interval,
                                            sharded=world.strategy == "fsdp")
    recovery = OomRecovery(config.resolved_micro_batch_size, config.eval_batch_size,
                           effective_batch=config.per_rank_batch, device=device,
                           memory_now=lambda: monitor.snapshot().current_bytes,
                           memory_needed=lambda: memory_needed_phrase(config, prepared),
                           cannot_recover=distributed.CANNOT_RECOVER if world.distributed
                           else CANNOT_REPLAY if config.optimizer_in_backward else None,
                           eval_splits=not world.distributed)
    stop = checkpoints.StopSignals()  # SIGTERM/SIGINT: finish the micro-step, save, exit
    runner = {"precision": prepared.precision, "scaler": scaler, "device": device, "phases": monitor,
              "stop_requested": stop.requested, "loss_chunk": config.loss_chunk,
              "offload": ActivationOffload() if config.offload_activations else None}
    run = Run(prepared=prepared, plan=plan, world=world, output_dir=output_dir, device=device, model=model,
              architecture=architecture, trained=[(n, p) for n, p in inner.named_parameters() if p.requires_grad],
              optimizer=optimizer, scheduler=build_scheduler(optimizer, total_steps=total_steps,
                                                             warmup_ratio=config.warmup_ratio),
              scaler=scaler, recovery=recovery,
              windows=window_runner(model, prepared.encoder(prepared.train_examples), world, **runner),
              evaluation=window_runner(model, prepared.encoder(prepared.val_examples), world, **runner),
              reporter=Reporter(console, output_dir, write=world.is_main), monitor=monitor,
              timeline=StepTimeline(monitor, output_dir / "memory_timeline.json",
                                    step=min(2, total_steps) if config.memory_timeline else None),
              stop=stop, total_steps=total_steps, trainable_parameters=trainable, total_parameters=total,
              checkpoint=resumed, built_bytes=built)
    start_run(run)
    return run


def start_run(run: Run) -> None:
    """Show the config, and put a resumed run back where its checkpoint left it."""
    run.reporter.show_config(config_rows(run.prepared, run.output_dir, run.trainable_parameters,
                                         run.total_parameters, run.plan))
    if run.config.optimizer_in_backward:
        run.reporter.warn("--optimizer-in-backward: out-of-memory recovery is off (a step updated in part cannot be "
                          "replayed); an OOM stops the run, to resume from its last checkpoint")
    if not run.prepared.spec.is_pretrained:
        run.reporter.warn(f"{run.config.model} has no pretrained weights here: RANDOM INIT. Memory and speed are "
                          "real; accuracy is not that of a pretrained model.")
    run.order = window_order(run.num_train, seed=run.config.seed, epoch=run.state.position.epoch)
    if run.checkpoint is not None:
        checkpointer.restore(run, run.checkpoint)
    elif run.config.eval_before:  # zero-shot: the model as loaded, before any step
        evaluate_epoch(run, 0)


def finish(run: Run, started: float) -> Summary:
    """Save the fine-tuned model, gather the ranks' peaks, write and show the summary."""
    memory = run.monitor.snapshot()
    from_shards = save_final_model(run)
    mine = {"peak": memory.peak_bytes, "phases": memory.phase_peaks, "built": run.built_bytes}
    ranks: list[dict[str, Any]] = distributed.gather(mine) if run.world.distributed else [mine]
    config, state, counters = run.config, run.state, run.state.counters
    summary = Summary(
        val_accuracy=state.evaluations[-1]["accuracy"], val_loss=state.evaluations[-1]["loss"],
        val_perplexity=state.evaluations[-1].get("perplexity"),
        val_accuracy_before=next((record["accuracy"] for record in state.evaluations if record["epoch"] == 0),
                                 None),
        task=run.prepared.task,
        train_loss=state.loss.last_loss, peak_memory_bytes=memory.peak_bytes,
        peak_memory_by_phase={name: memory.phase_peaks.get(name, 0) for name in (*PHASES, "eval")},
        samples_per_second=state.samples_per_second,
        optimizer_steps_per_second=state.position.step / counters.train_seconds if counters.train_seconds else 0.0,
        optimizer_steps=counters.optimizer_steps, effective_batch_size=config.effective_batch,
        micro_batch_size=run.recovery.micro_batch_size, accumulation_steps=run.recovery.accumulation_steps,
        precision=run.prepared.precision.name, checkpointing=config.checkpointing,
        trainable_parameters=run.trainable_parameters, total_parameters=run.total_parameters,
        device=run.prepared.device.describe(), config=config.to_dict(), epochs_completed=counters.epochs_completed,
        train_samples=run.num_train, val_samples=len(run.prepared.val_examples),
        train_seconds=counters.train_seconds, total_seconds=time.perf_counter() - started,
        peak_rss_bytes=memory.peak_rss_bytes, peak_reserved_bytes=memory.peak_reserved_bytes,
        offloaded_activations_peak_bytes=run.windows.offload.peak_bytes if run.windows.offload else None,
        skipped_steps=state.skipped,
        oom_recoveries=run.recovery.events, plan=run.plan.summary() if run.plan is not None else None,
        resumed_from=str(run.checkpoint.path) if run.checkpoint is not None else None,
        evaluations=state.evaluations, output_dir=str(run.output_dir), world_size=run.world.world_size,
        distributed=run.world.strategy, per_rank_peak_memory_bytes=[rank["peak"] for rank in ranks],
        per_rank_training_peak_bytes=[max(rank["phases"].get(name, 0) for name in PHASES) for rank in ranks],
        per_rank_built_bytes=[rank["built"] for rank in ranks], model_from_shards=from_shards,
        allreduce_seconds=run.world.allreduce_seconds if run.world.strategy == "ddp" else None,
        packed_rows=run.num_train if run.prepared.packed is not None else None,
        train_examples=len(run.prepared.train_examples),
        examples_per_second=state.samples_per_second * len(run.prepared.train_examples) / max(run.num_train, 1))
    if run.world.is_main:
        write_json(run.output_dir / "summary.json", summary.to_dict())
        run.reporter.summary(summary)
    distributed.barrier()  # the run's files are complete before any rank exits
    return summary


def save_final_model(run: Run) -> bool:
    """The fine-tuned model as a Hugging Face directory (distributed, a collective): FSDP's full fine-tuning
    written from the shards (:mod:`memfit.streamed_export`; returns ``True``), else gathered to rank 0 (an
    adapter alone, its base not gathered). Its config has the KV-cache setting it was loaded with."""
    with cache_as_loaded(distributed.unwrap(run.model), run.prepared.spec.hf_config):
        return _save_final_model(run)


def _save_final_model(run: Run) -> bool:
    adapters = bool(run.config.lora_rank) and run.world.strategy == "fsdp"  # saved alone: the base not gathered
    from_shards = run.world.strategy == "fsdp" and not adapters and streamed_export.streams(
        run.model, main=run.world.is_main)
    if from_shards:
        streamed_export.save(run.model, run.output_dir / "model", main=run.world.is_main)
    else:
        if run.world.is_main:  # an earlier save's weight files (a resumed run saves again, perhaps otherwise)
            streamed_export.remove_weights(run.output_dir / "model")
        weights = distributed.full_state_dict(run.model, trained_only=adapters) if run.world.distributed else None
        if run.world.is_main:
            saved: Any = distributed.unwrap(run.model)
            saved.save_pretrained(run.output_dir / "model", safe_serialization=True, state_dict=weights)
    if run.world.is_main:
        if run.prepared.tokenizer is not None:
            run.prepared.tokenizer.save_pretrained(run.output_dir / "model")
        if run.config.merge:  # the adapter merged into the base as loaded (its saved dtype, not quantised)
            save_merged(run.output_dir / "model", build_base_for(run.prepared), run.output_dir / "model" / "merged")
            if run.prepared.tokenizer is not None:
                run.prepared.tokenizer.save_pretrained(run.output_dir / "model" / "merged")
    return from_shards


def place_model(model: nn.Module, checkpoint: checkpoints.Checkpoint | None, world: distributed.World,
                prepared: Prepared, device: torch.device, monitor: Monitor, total: int, *,
                once: bool = False) -> nn.Module:
    """Saved weights in, then onto the device: as it is, replicated (DDP) or sharded (FSDP2); ``once``: rank 0
    alone holds the weights, the other ranks receive their shards (:mod:`memfit.rank0_load`)."""
    config = prepared.config

    def wrap(built: nn.Module) -> nn.Module:
        return distributed.wrap(built, world, low_precision=prepared.precision.low_dtype, device=device)

    try:
        if checkpoint is not None and not checkpoint.sharded:  # one process only (checkpointer.open_run_dir)
            checkpoint.load_weights(model)
        if once:
            model = rank0_load.shard_from_rank_0(model, wrap, main=world.is_main, device=device,
                                                 offload=world.cpu_offload)
        elif world.distributed:  # FSDP2 moves only the shards
            model = wrap(model)
            place_quant_states(model, device)  # (4-bit states are neither parameters nor buffers)
        else:
            model.to(device)
        monitor.track_module(model)  # parameters existed before tracking started
    except OUT_OF_MEMORY:
        raise TrainingError(f"the model alone ({format_bytes(4 * total)} of fp32 parameters) does not fit the "
                            f"device memory{' budget ' + str(config.emulate_budget) if config.emulate_budget else ''}"
                            "; use a smaller model or a device with more memory") from None
    return model


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


def record_skip(run: Run, check: StepCheck) -> None:
    """Record a skipped (non-finite) optimizer step; stop the run after too many in a row."""
    state, step = run.state, run.state.position.step
    handled_by_scaler = run.scaler is not None and check.loss_finite
    skip: dict[str, Any] = {"step": step, "loss_finite": check.loss_finite, "grads_finite": check.grads_finite,
                            "handled_by": "grad_scaler" if handled_by_scaler else "memfit",
                            "parameters": check.bad_parameters}
    state.skipped.append(skip)
    run.reporter.metrics.write({"type": "skip", **skip})
    if handled_by_scaler:  # scaler overflows are expected and self-correcting
        return
    state.counters.consecutive_nonfinite += 1
    skipped = "those parameters not updated, the others were (optimizer in backward)" \
        if run.config.optimizer_in_backward else "update skipped"
    run.reporter.warn(f"step {step}: non-finite {'loss' if not check.loss_finite else 'gradients'}"
                      f"{' in ' + ', '.join(skip['parameters']) if skip['parameters'] else ''}; {skipped}")
    if state.counters.consecutive_nonfinite >= run.config.max_nonfinite_steps:
        advice = "lower --lr or use --precision fp32" if run.config.optimizer_in_backward else \
            "lower --lr, use --precision fp32, or set --max-grad-norm"
        raise TrainingError(f"stopped at step {step}: {state.counters.consecutive_nonfinite} consecutive optimizer "
                            f"steps had a non-finite loss or gradients; {advice}")


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


CANNOT_REPLAY = ("--optimizer-in-backward may have updated part of the model in this step, which cannot be "
                 "replayed; start again, or resume from a checkpoint if --save-every wrote one, with a setup that "
                 "fits (memfit plan)")
