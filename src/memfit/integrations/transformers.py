"""memfit inside ``transformers.Trainer`` (and TRL's trainers, which are Trainers).

Three lines in an existing script::

    from memfit.integrations.transformers import MemfitCallback
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collator)
    MemfitCallback.attach(trainer, budget="11GiB")

Before the first step the callback traces the step this Trainer will run (:mod:`.trainer_step`) and logs the
predicted peak with its breakdown; when a ``budget`` is given and the prediction exceeds it, the run stops
there with one line naming the peak, the budget and a plan that fits, instead of a CUDA out-of-memory error
later. During training it measures the real peak of each logging interval (the CUDA allocator's on a card,
memfit's tensor tracker on CPU) and adds ``memfit/peak_bytes``, ``memfit/predicted_peak_bytes`` and
``memfit/peak_error`` to the Trainer's logs.

Trainer calls its callbacks in order, reporting integrations (TensorBoard, W&B, ...) first, so values a
callback added later in ``on_log`` would reach no reporter. :meth:`MemfitCallback.attach` therefore re-adds the
Trainer's other callbacks after memfit's own, through Trainer's public ``remove_callback``/``add_callback``:
then every reporter receives the memfit values of the same log, as does ``trainer.state.log_history``.

What it cannot see: memory allocated outside PyTorch's allocator (other processes, NCCL buffers, custom CUDA
extensions' own allocations); the Trainer's evaluation, whose peaks land in the interval they run in.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from typing import Any

from memfit.devices import DeviceProfile, profile_for, resolve_device, resolve_profile
from memfit.memory.monitor import Monitor
from memfit.quiet import quiet_imports, raised_loggers
from memfit.report import format_bytes
from memfit.units import parse_bytes

quiet_imports()  # transformers' model code and its quantizers (torchao) once, quietly
with raised_loggers("bitsandbytes", "kernels", level=logging.CRITICAL):
    if importlib.util.find_spec("bitsandbytes") is not None:  # Trainer imports it, and it logs a kernel note
        import bitsandbytes  # noqa: F401
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from memfit.integrations.trainer_step import TrainerStepEstimate, trace_trainer_step  # noqa: E402

WARN_ABOVE = 0.01
"""Measured above predicted by more than this share: warn (once)."""
KEYS = ("memfit/peak_bytes", "memfit/predicted_peak_bytes", "memfit/peak_error")


class MemfitCallback(TrainerCallback):
    """Estimate, budget check and measured-against-predicted peaks for ``trainer`` (see the module docstring).

    ``budget``: e.g. ``"11GiB"`` or bytes; ``None`` only predicts and measures. ``device_profile``: the card to
    predict for (a profile name such as ``"1080ti"``, or a :class:`~memfit.devices.DeviceProfile`); default:
    the device the Trainer runs on."""

    def __init__(self, trainer: Trainer, *, budget: str | int | None = None,
                 device_profile: str | DeviceProfile | None = None) -> None:
        self.trainer = trainer
        self.budget_bytes = parse_bytes(budget, option="budget") if isinstance(budget, str) else budget
        if device_profile is None:
            self.profile = profile_for(resolve_device(trainer.args.device.type))
        else:
            self.profile = device_profile if isinstance(device_profile, DeviceProfile) else \
                resolve_profile(device_profile)
        self.predicted: TrainerStepEstimate | None = None
        self.monitor: Monitor | None = None
        self.warned = False

    @classmethod
    def attach(cls, trainer: Trainer, *, budget: str | int | None = None,
               device_profile: str | DeviceProfile | None = None) -> MemfitCallback:
        """Add a callback for ``trainer`` ahead of its other callbacks, so reporters see memfit's values."""
        callback = cls(trainer, budget=budget, device_profile=device_profile)
        others = list(trainer.callback_handler.callbacks)
        for other in others:
            trainer.remove_callback(other)
        trainer.add_callback(callback)
        for other in others:
            trainer.add_callback(other)
        return callback

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self.predicted = predicted = trace_trainer_step(self.trainer, self.profile)
        parts = ", ".join(f"{name.replace('_', ' ')} {format_bytes(value)}"
                          for name, value in predicted.breakdown.items() if value)
        _say(f"memfit: this Trainer's step (micro-batch {predicted.micro_batch_size} x "
             f"{predicted.accumulation_steps}, {predicted.sequence_length} tokens, {predicted.precision}, "
             f"{predicted.optimizer}) peaks at {format_bytes(predicted.peak_bytes)} on {predicted.device} "
             f"({parts}; peak in {predicted.peak_phase})")
        if self.budget_bytes is not None and predicted.total_bytes > self.budget_bytes:
            _say(f"memfit: error: the step needs {format_bytes(predicted.total_bytes)}, over the budget of "
                 f"{format_bytes(self.budget_bytes)}; {self._advice(predicted)}")
            raise SystemExit(2)
        self.monitor = Monitor(self.trainer.args.device.type)
        self.monitor.__enter__()
        model = self.trainer.model_wrapped
        self.monitor.track_module(model)

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
        if self.monitor is not None:
            self.monitor.__exit__(None, None, None)
            self.monitor = None

    def _advice(self, predicted: TrainerStepEstimate) -> str:
        """The plan that fits, as TrainingArguments to change (or why there is none)."""
        from memfit.integrations.trainer_plan import plan_for_trainer

        return plan_for_trainer(self.trainer, budget=self.budget_bytes or 0, profile=self.profile,
                                seq_len=predicted.sequence_length)


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
