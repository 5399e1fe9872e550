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
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import nn

from memfit.build import Prepared, build_model_for, build_optimizer_for, prepare
from memfit.config import TrainConfig
from memfit.data.batches import Encoder, cut, windows
from memfit.errors import TrainingError
from memfit.memory.monitor import PHASES, Monitor
from memfit.memory.tracker import OUT_OF_MEMORY
from memfit.models import count_parameters
from memfit.report import Reporter, Summary, format_bytes, write_json
from memfit.step import accumulate_window, item_count, loss_sum, to_device
from memfit.techniques.oom import OomRecovery
from memfit.techniques.optim import advance_schedule, build_scheduler
from memfit.techniques.precision import Precision
from memfit.techniques.stability import guarded_step


def train(config: TrainConfig, *, console: Console | None = None) -> Summary:
    """Fine-tune ``config.model`` on ``config.data``; write metrics, summary and model; return the summary."""
    started = time.perf_counter()
    console = console or Console(stderr=True)
    prepared = prepare(config)  # raises ConfigError/DataError before any work
    output_dir = Path(config.output_dir or f"runs/{datetime.datetime.now():%Y%m%d-%H%M%S}")
    output_dir.mkdir(parents=True, exist_ok=True)
    device = prepared.device.torch_device
    precision = prepared.precision
    micro_batch_size = config.resolved_micro_batch_size
    num_train = len(prepared.train_examples)
    windows_per_epoch = math.ceil(num_train / config.effective_batch)
    total_steps = min(config.max_steps or sys.maxsize, config.epochs * windows_per_epoch)

    budget = config.emulate_budget_bytes
    with Reporter(console, output_dir) as reporter, Monitor.for_device(device.type, budget_bytes=budget) as monitor:
        model = build_model_for(prepared)  # freeze -> checkpointing
        trainable, total = count_parameters(model)
        reporter.show_config(config_rows(prepared, output_dir, trainable, total))
        if not prepared.spec.is_pretrained:
            reporter.warn(f"{config.model} has no pretrained weights here: RANDOM INIT. Memory and speed are "
                          "real; accuracy is not that of a pretrained model.")
        train_encoder = prepared.encoder(prepared.train_examples)
        val_encoder = prepared.encoder(prepared.val_examples)
        try:
            model.to(device)  # type: ignore[arg-type]  # transformers types .to() narrowly
            monitor.track_module(model)  # parameters existed before tracking started
        except OUT_OF_MEMORY:
            raise TrainingError(f"the model alone ({format_bytes(4 * total)} of fp32 parameters) does not fit "
                                f"the device memory{' budget ' + str(config.emulate_budget) if budget else ''}; "
                                "use a smaller model or a device with more memory") from None
        trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        optimizer = build_optimizer_for(model, config)  # last: sees only the trainable parameters
        scheduler = build_scheduler(optimizer, total_steps=total_steps, warmup_ratio=config.warmup_ratio)
        scaler = precision.make_scaler(init_scale=config.init_scale, growth_interval=config.growth_interval)
        recovery = OomRecovery(micro_batch_size, config.eval_batch_size, effective_batch=config.effective_batch,
                               device=device, memory_now=lambda: monitor.snapshot().current_bytes,
                               memory_needed=lambda: memory_needed_phrase(config, prepared))

        def attempt_window(window: list[int], size: int) -> tuple[torch.Tensor, int]:
            """Forward + backward of each micro-batch of ``size``; gradients accumulate in .grad."""
            micro_batches = [train_encoder(chunk) for chunk in cut(window, size)]
            window_items = sum(item_count(batch) for batch in micro_batches)  # host-side: no sync
            return accumulate_window(model, micro_batches, window_items, precision=precision, scaler=scaler,
                                     device=device, phases=monitor), window_items

        step = optimizer_steps = consecutive_nonfinite = epochs_completed = 0
        train_seconds = 0.0
        samples_seen = 0
        logged_loss, logged_items = 0.0, 0
        last_loss = math.nan
        skipped: list[dict[str, Any]] = []
        evaluations: list[dict[str, Any]] = []
        reporter.start(total_steps)
        for epoch in range(1, config.epochs + 1):
            if step >= total_steps:  # --max-steps reached at an epoch boundary
                break
            model.train()
            for window in windows(num_train, effective_batch=config.effective_batch, seed=config.seed,
                                  epoch=epoch):
                if step >= total_steps:
                    break
                window_started = time.perf_counter()
                recorded = len(recovery.events)
                # the same samples until they fit: an OOM restarts the window, at a smaller micro-batch if needed
                window_loss, window_items = recovery.run_window(
                    step + 1, functools.partial(attempt_window, window),
                    reset=lambda: optimizer.zero_grad(set_to_none=True))
                for event in recovery.events[recorded:]:
                    reporter.metrics.write(event)
                    reporter.warn(f"step {event['step']}: out of memory at micro-batch {event['old_micro_batch_size']}"
                                  f" ({format_bytes(event['memory_bytes'])} in use); {event['action']} -> micro-batch "
                                  f"{event['new_micro_batch_size']} x {event['accumulation_steps']}")
                with monitor.phase("optimizer"):
                    check = guarded_step(optimizer, trained, window_loss, scaler=scaler,
                                         max_grad_norm=config.max_grad_norm)
                    loss_value, norm_value = check.loss, check.grad_norm
                    loss_finite, grads_finite = check.loss_finite, check.grads_finite
                    optimizer.zero_grad(set_to_none=True)
                    advance_schedule(scheduler)  # once per optimizer step, applied or skipped
                step += 1

                if loss_finite and grads_finite:
                    optimizer_steps += 1
                    consecutive_nonfinite = 0
                    logged_loss += loss_value * window_items
                    logged_items += window_items
                else:
                    skip: dict[str, Any] = {"step": step, "loss_finite": loss_finite, "grads_finite": grads_finite,
                            "handled_by": "grad_scaler" if scaler is not None and loss_finite else "memfit",
                            "parameters": check.bad_parameters}
                    skipped.append(skip)
                    reporter.metrics.write({"type": "skip", **skip})
                    if skip["handled_by"] == "memfit":  # scaler overflow skips are expected and self-correcting
                        consecutive_nonfinite += 1
                        reporter.warn(f"step {step}: non-finite {'loss' if not loss_finite else 'gradients'}"
                                      f"{' in ' + ', '.join(skip['parameters']) if skip['parameters'] else ''}"
                                      "; update skipped")
                    if consecutive_nonfinite >= config.max_nonfinite_steps:
                        raise TrainingError(
                            f"stopped at step {step}: {consecutive_nonfinite} consecutive optimizer steps had a "
                            "non-finite loss or gradients; lower --lr, use --precision fp32, or set "
                            "--max-grad-norm")
                train_seconds += time.perf_counter() - window_started
                samples_seen += len(window)
                memory = monitor.snapshot()
                lr = float(scheduler.get_last_lr()[0])
                # the bar shows the mean since the last log line: what metrics.jsonl and the summary report
                reporter.step(step=step, loss=logged_loss / logged_items if logged_items else loss_value, lr=lr,
                              samples_per_second=samples_seen / train_seconds,
                              memory_bytes=memory.current_bytes, peak_bytes=memory.peak_bytes)
                if step % config.log_every == 0 or step == total_steps:
                    last_loss = logged_loss / logged_items if logged_items else math.nan
                    reporter.metrics.write({
                        "type": "train", "step": step, "epoch": epoch, "loss": last_loss,
                        "lr": lr, "grad_norm": norm_value,
                        "samples_per_second": samples_seen / train_seconds,
                        "memory_bytes": memory.current_bytes, "peak_memory_bytes": memory.peak_bytes,
                        "rss_bytes": memory.rss_bytes})
                    logged_loss, logged_items = 0.0, 0
            else:  # the epoch ran to its end (no --max-steps break)
                epochs_completed = epoch
            recorded = len(recovery.events)
            with monitor.phase("eval"):
                accuracy, val_loss = recovery.run_eval(step, lambda size: evaluate(
                    model, val_encoder, len(prepared.val_examples), size, precision, device))
            for event in recovery.events[recorded:]:
                reporter.metrics.write(event)
                reporter.warn(f"step {step}: out of memory while evaluating; eval batch "
                              f"{event['old_eval_batch_size']} -> {event['new_eval_batch_size']}")
            record = {"type": "eval", "epoch": epoch, "step": step, "accuracy": accuracy, "loss": val_loss}
            evaluations.append(record)
            reporter.evaluation(record)
        reporter.stop()
        memory = monitor.snapshot()

    model.save_pretrained(output_dir / "model", safe_serialization=True)
    if prepared.tokenizer is not None:
        prepared.tokenizer.save_pretrained(output_dir / "model")
    summary = Summary(
        val_accuracy=evaluations[-1]["accuracy"], val_loss=evaluations[-1]["loss"], train_loss=last_loss,
        peak_memory_bytes=memory.peak_bytes,
        peak_memory_by_phase={name: memory.phase_peaks.get(name, 0) for name in (*PHASES, "eval")},
        samples_per_second=samples_seen / train_seconds if train_seconds else 0.0,
        optimizer_steps_per_second=step / train_seconds if train_seconds else 0.0,
        optimizer_steps=optimizer_steps, effective_batch_size=config.effective_batch,
        micro_batch_size=recovery.micro_batch_size, accumulation_steps=recovery.accumulation_steps,
        precision=precision.name, checkpointing=config.checkpointing, trainable_parameters=trainable,
        total_parameters=total, device=prepared.device.describe(), config=config.to_dict(),
        epochs_completed=epochs_completed, train_samples=num_train, val_samples=len(prepared.val_examples),
        train_seconds=train_seconds, total_seconds=time.perf_counter() - started,
        peak_rss_bytes=memory.peak_rss_bytes, peak_reserved_bytes=memory.reserved_bytes, skipped_steps=skipped,
        oom_recoveries=recovery.events,
        evaluations=evaluations, output_dir=str(output_dir))
    write_json(output_dir / "summary.json", summary.to_dict())
    reporter.summary(summary)
    return summary


@torch.no_grad()
def evaluate(model: nn.Module, encoder: Encoder, num_examples: int, batch_size: int, precision: Precision,
             device: torch.device) -> tuple[float, float]:
    """(accuracy, mean loss) over the validation examples; no activations are kept for backward."""
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=device)
    total_loss = torch.zeros((), device=device)
    for chunk in cut(range(num_examples), batch_size):
        batch = to_device(encoder(chunk), device)
        with precision.autocast():
            loss, logits = loss_sum(model, batch)
        correct += (logits.argmax(dim=-1) == batch["labels"]).sum()
        total_loss += loss
    return int(correct) / num_examples, float(total_loss) / num_examples


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
