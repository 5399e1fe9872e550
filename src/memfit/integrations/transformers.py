"""memfit inside ``transformers.Trainer`` (and TRL's trainers, which are Trainers).

One argument in an existing script, as for any other callback::

    from memfit.integrations.transformers import MemfitCallback
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collator,
                      callbacks=[MemfitCallback(budget="11GiB")])

or, for a Trainer already built, ``MemfitCallback.attach(trainer, budget="11GiB")``.

Before the first step the callback traces the step this Trainer will run (:mod:`.trainer_step`) and logs the
predicted peak with its breakdown; when a ``budget`` is given and the prediction exceeds it,
:class:`memfit.OverBudget` is raised there, before the first optimizer step, its one line naming the peak, the
budget and a plan that fits (checked on this Trainer's own step), instead of a CUDA out-of-memory error later.
During training it measures the real peak of each logging interval (the CUDA allocator's on a card, memfit's
tensor tracker on CPU) and adds ``memfit/peak_bytes``, ``memfit/predicted_peak_bytes`` and
``memfit/peak_error`` to the Trainer's logs.

A step the trace cannot run (a mixture-of-experts router's data-dependent ops, a model spread over devices
with ``device_map="auto"``, ``nn.DataParallel``, a device other than CPU or CUDA) does not end the training:
without a budget one warning line says why and the run trains on without memfit; with a budget, which then
cannot be checked, :class:`memfit.PredictionUnavailable` says why in one line.

Trainer passes its callbacks the model, optimizer and dataloader, not itself, and the trace runs the Trainer's
own ``training_step``: the callback takes the Trainer that calls it (:func:`.trainer_compat.calling_trainer`)
when it is built (``on_init_end``) or trains (``on_train_begin``). Trainer calls its callbacks in order,
reporting integrations (TensorBoard, W&B, ...) first, so values a callback added later in ``on_log`` would
reach no reporter: the callback moves itself to the front of the Trainer's callbacks, and every reporter
receives the memfit values of the same log, as does ``trainer.state.log_history``.

The measurement's monitor (on CPU a dispatch mode that sees every op) is closed in ``on_train_end``, and also
when ``train()`` raises or is interrupted, which Trainer ends without calling its callbacks: the callback wraps
the Trainer's ``train`` once, when it first finds the Trainer, and closes a monitor still open before it
opens another.

What it cannot see: memory allocated outside PyTorch's allocator (other processes, NCCL buffers, custom CUDA
extensions' own allocations); the Trainer's evaluation, whose peaks land in the interval they run in.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import sys
from typing import Any

import torch

from memfit.devices import DeviceProfile, profile_for, resolve_device, resolve_profile
from memfit.errors import ConfigError, MemfitError, OverBudget, PredictionUnavailable
from memfit.memory.monitor import SUPPORTED, Monitor
from memfit.quiet import quiet_imports, raised_loggers
from memfit.report import format_bytes
from memfit.support import describe, model_support
from memfit.units import parse_bytes

quiet_imports()  # transformers' model code and its quantizers (torchao) once, quietly
with raised_loggers("bitsandbytes", "kernels", level=logging.CRITICAL):
    if importlib.util.find_spec("bitsandbytes") is not None:  # Trainer imports it, and it logs a kernel note
        import bitsandbytes  # noqa: F401
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from memfit.integrations import trainer_compat as compat  # noqa: E402
from memfit.integrations.trainer_step import TrainerStepEstimate, trace_trainer_step  # noqa: E402

WARN_ABOVE = 0.01
"""Measured above predicted by more than this share: warn (once)."""
KEYS = ("memfit/peak_bytes", "memfit/predicted_peak_bytes", "memfit/peak_error")


class MemfitCallback(TrainerCallback):
    """Estimate, budget check and measured-against-predicted peaks for the Trainer it is given to (see the
    module docstring).

    ``budget``: e.g. ``"11GiB"`` or bytes; ``None`` only predicts and measures. ``device_profile``: the card to
    predict for (a profile name such as ``"1080ti"``, or a :class:`~memfit.devices.DeviceProfile`); default:
    the device the Trainer runs on. ``trainer``: not needed (the callback finds the Trainer it is given to)."""

    def __init__(self, trainer: Trainer | None = None, *, budget: str | int | None = None,
                 device_profile: str | DeviceProfile | None = None) -> None:
        self.budget_bytes = parse_bytes(budget, option="budget") if isinstance(budget, str) else budget
        self.device_profile = resolve_profile(device_profile) if isinstance(device_profile, str) else device_profile
        self.trainer: Any = None
        self.profile: DeviceProfile | None = None
        self.predicted: TrainerStepEstimate | None = None
        self.monitor: Monitor | None = None
        self.warned = False
        self._closes_after: Any = None
        """The Trainer whose ``train`` this callback wraps to close its monitor."""
        if trainer is not None:
            self._bind(trainer)

    @classmethod
    def attach(cls, trainer: Trainer, *, budget: str | int | None = None,
               device_profile: str | DeviceProfile | None = None) -> MemfitCallback:
        """Add a callback to ``trainer``, ahead of its other callbacks, so reporters see memfit's values."""
        callback = cls(budget=budget, device_profile=device_profile)
        trainer.add_callback(callback)
        callback._bind(trainer)
        return callback

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        trainer = compat.calling_trainer(self)  # Trainer(..., callbacks=[MemfitCallback()]) is being built
        if trainer is not None:
            self._bind(trainer)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self.close()  # a monitor an earlier train() left open
        trainer = compat.calling_trainer(self) or self.trainer
        if trainer is None:
            raise ConfigError("MemfitCallback found no Trainer calling it: give it to one with Trainer(..., "
                              "callbacks=[MemfitCallback(...)]) or MemfitCallback.attach(trainer)")
        self._bind(trainer)
        self.predicted = predicted = self._predict(trainer, args.device.type)
        if predicted is None:
            return
        _say(_prediction_line(predicted))
        if self.budget_bytes is not None and predicted.total_bytes > self.budget_bytes:
            advice = self._advice(trainer, predicted)
            raise OverBudget(f"the step needs {format_bytes(predicted.total_bytes)}, over the budget of "
                             f"{format_bytes(self.budget_bytes)}; {advice}", predicted=predicted,
                             budget_bytes=self.budget_bytes, advice=advice)
        self.monitor = Monitor(args.device.type).__enter__()
        self.monitor.track_module(trainer.model_wrapped)
        self.monitor.track(*_state_tensors(trainer.optimizer), category="optimizer_state")

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if self.monitor is None or self.predicted is None or logs is None or "loss" not in logs:
            return  # evaluation logs and the run's summary carry no training peak
        measured = self.monitor.snapshot().peak_bytes
        predicted = self.predicted.peak_bytes
        error = (measured - predicted) / predicted
        values = dict(zip(KEYS, (measured, predicted, round(error, 6)), strict=True))
        logs.update(values)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)
        if error > WARN_ABOVE and not self.warned:
            self.warned = True
            _say(f"memfit: warning: measured peak {format_bytes(measured)} is {100 * error:.1f} % above the "
                 f"predicted {format_bytes(predicted)} (step {state.global_step})")
        self.monitor.reset_peaks()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop measuring (on CPU: the tracker's dispatch mode ends); nothing when not measuring."""
        if self.monitor is not None:
            monitor, self.monitor = self.monitor, None
            monitor.__exit__(None, None, None)

    def _bind(self, trainer: Any) -> None:
        """Take ``trainer`` as this callback's: first among its callbacks, its monitor closed after ``train``."""
        self.trainer = trainer
        callbacks = trainer.callback_handler.callbacks
        if any(item is self for item in callbacks) and callbacks[0] is not self:
            # in place: Trainer may be calling its callbacks in order now, and those after this one keep their places
            callbacks[:] = [self, *(item for item in callbacks if item is not self)]
        if self._closes_after is not trainer:
            self._closes_after = trainer
            trainer.train = _closing_after(trainer.train, self)

    def _predict(self, trainer: Any, device_type: str) -> TrainerStepEstimate | None:
        """The traced step, or, where it cannot be traced, ``None`` after a warning (no budget) or
        :class:`~memfit.errors.PredictionUnavailable` (a budget, which cannot be checked then)."""
        try:
            self.profile = self._profile(device_type)
            with model_support(getattr(trainer.model, "config", None)):
                return trace_trainer_step(trainer, self.profile)
        except Exception as error:  # any failure of the trace: the run goes on, or the budget says why
            reason = _reason(error)
            if self.budget_bytes is not None:
                raise PredictionUnavailable(
                    f"no prediction of this Trainer's step ({reason}), so the budget of "
                    f"{format_bytes(self.budget_bytes)} cannot be checked; train without a budget, or plan the "
                    "model with memfit plan", reason=reason) from error
            _say(f"memfit: warning: no prediction of this Trainer's step ({reason}); training goes on without "
                 "memfit's prediction and measurement")
            return None

    def _profile(self, device_type: str) -> DeviceProfile:
        if device_type not in SUPPORTED:
            raise ConfigError(f"the Trainer runs on {device_type}: not supported (memfit predicts and measures "
                              f"Trainers on {' and '.join(SUPPORTED)})")
        return self.device_profile or profile_for(resolve_device(device_type))

    def _advice(self, trainer: Any, predicted: TrainerStepEstimate) -> str:
        """The plan that fits, as TrainingArguments to change (or why there is none)."""
        from memfit.integrations.trainer_plan import plan_for_trainer

        assert self.profile is not None and self.budget_bytes is not None, "advice follows a budgeted prediction"
        return plan_for_trainer(trainer, budget=self.budget_bytes, profile=self.profile,
                                seq_len=predicted.sequence_length)


def _closing_after(train: Any, callback: MemfitCallback) -> Any:
    """``train`` that closes ``callback``'s monitor however it ends (Trainer calls no callback on an
    exception or an interrupt)."""
    @functools.wraps(train)
    def train_then_close(*args: Any, **kwargs: Any) -> Any:
        try:
            return train(*args, **kwargs)
        finally:
            callback.close()

    return train_then_close


def _state_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The tensors of ``optimizer``'s state that exist before the first step (a second ``train()``, a run
    resumed from a checkpoint): made before the monitor opened, they are counted as it opens."""
    state = getattr(optimizer, "state", None) or {}
    return [value for per_parameter in state.values() for value in per_parameter.values()
            if isinstance(value, torch.Tensor)]


def _prediction_line(predicted: TrainerStepEstimate) -> str:
    parts = ", ".join(f"{name.replace('_', ' ')} {format_bytes(value)}"
                      for name, value in predicted.breakdown.items() if value)
    streamed = (f"; from the first {predicted.streamed_examples} examples of a stream: a wider batch later "
                "needs more") if predicted.streamed_examples else ""
    return (f"memfit: this Trainer's step (micro-batch {predicted.micro_batch_size} x "
            f"{predicted.accumulation_steps}, {predicted.sequence_length} tokens, {predicted.precision}, "
            f"{predicted.optimizer}) peaks at {format_bytes(predicted.peak_bytes)} on {predicted.device} "
            f"({parts}; peak in {predicted.peak_phase}{streamed})")


def _reason(error: Exception) -> str:
    """``error`` as one clause: its first line (a memfit error's own words; else with its type's name)."""
    if isinstance(error, MemfitError):
        return "; ".join(error.problems)
    return describe(error)


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
