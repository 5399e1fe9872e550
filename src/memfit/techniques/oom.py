"""Out-of-memory recovery that keeps the effective batch and never loses or repeats a sample.

When a window's forward/backward raises ``torch.OutOfMemoryError``, :class:`OomRecovery`:

1. lets the failed attempt's tensors go: the attempt runs in its own function, and the exception (whose
   traceback holds that function's frames, with their outputs, losses and saved activations) is dropped as
   soon as the ``except`` block ends; gradients accumulated so far are cleared;
2. empties the CUDA cache and restores the random state taken at the start of the window;
3. retries **the same window, the same samples**: once at the same micro-batch size (a transient OOM, e.g.
   fragmentation or another process, does not cost speed for the rest of the run), and on every further OOM
   of that window with the micro-batch split in two, which doubles the accumulation steps;
4. keeps the smaller micro-batch for the rest of the run, and records each event.

Restarting the window rather than resuming mid-window is what makes it exact: an OOM inside backward may
already have added part of the failed micro-batch's gradient to ``.grad``. The loss of every micro-batch
is divided by the window's item count (:mod:`memfit.step`), so any split gives the same gradient up to
floating-point summation order.

Trade-off: a recovered window runs again from its start (at most one window of recompute per event), and
a run that split keeps the smaller, slower micro-batch. Evaluation has its own batch size, halved on an
evaluation OOM and never the training micro-batch.

The optimizer step is not retried: its memory (the optimizer state, created at the first step, and the
update's temporaries) does not shrink with the micro-batch, so the same step would fail again, and a step
that failed part-way may already have updated some parameters, which cannot be undone. A
:class:`StepWatch` follows the step instead: until the step writes to a trained parameter or to optimizer
state that existed before it, the run is still exactly as it was before the step, and the engine saves a
checkpoint of that state (:attr:`StepWatch.state_before`, without the state the step had begun to create)
before it stops, so that ``--resume`` continues as if nothing had happened. After such a write it stops
without one. The watch is a dispatch mode around the step: one Python call per op of the step (a few per
parameter group for fused and multi-tensor kernels), and one walk over the optimizer's state per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from memfit.checkpoints import rng_state, set_rng_state
from memfit.errors import TrainingError
from memfit.memory.tracker import OUT_OF_MEMORY

T = TypeVar("T")


class OomRecovery:
    """Runs training windows and evaluations, recovering from OOM as described in the module docstring."""

    def __init__(self, micro_batch_size: int, eval_batch_size: int, *, effective_batch: int,
                 device: torch.device, memory_now: Callable[[], int],
                 memory_needed: Callable[[], str] = lambda: "", cannot_recover: str | None = None,
                 eval_splits: bool | None = None) -> None:
        self.micro_batch_size = micro_batch_size
        self.eval_batch_size = eval_batch_size
        self.effective_batch = effective_batch
        self.device = device
        self.memory_now = memory_now
        """Bytes in use right now (read while the failed attempt's tensors are still alive)."""
        self.memory_needed = memory_needed
        """A phrase naming the memory a micro-batch of 1 needs, for the final error ('' when unknown)."""
        self.cannot_recover = cannot_recover
        self.eval_splits = cannot_recover is None if eval_splits is None else eval_splits
        """Whether an evaluation OOM halves the evaluation batch (it changes nothing trained; a distributed run's
        ranks could not agree on it)."""
        """Set when every OOM must stop the run (a distributed run, whose ranks cannot agree on a smaller
        micro-batch at the failing op): what to do instead."""
        self.events: list[dict[str, Any]] = []
        self.window_rng: dict[str, Any] = {}
        """The random state at the start of the current window: what a restart of the window replays."""

    def state_dict(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch_size, "eval_batch_size": self.eval_batch_size,
                "oom_recoveries": list(self.events)}

    def load_state_dict(self, values: dict[str, Any], *, same_micro_batch: bool, same_eval_batch: bool) -> None:
        """What :meth:`state_dict` saved. A size reduced after an OOM stays reduced only when the resumed run
        asks for the size the saved one started with (else the new request stands)."""
        if same_micro_batch:
            self.micro_batch_size = values["micro_batch_size"]
        if same_eval_batch:
            self.eval_batch_size = values["eval_batch_size"]
        self.events = list(values["oom_recoveries"])

    @property
    def accumulation_steps(self) -> int:
        return math.ceil(self.effective_batch / self.micro_batch_size)

    def run_window(self, step: int, attempt: Callable[[int], T], reset: Callable[[], None],
                   rng: dict[str, Any] | None = None) -> T:
        """``attempt(micro_batch_size)`` until it succeeds; ``reset()`` clears a failed attempt's gradients.

        ``rng`` is the window's starting random state when the window was resumed part-way (default: now).
        """
        failures = 0
        self.window_rng = rng if rng is not None else rng_state(self.device)
        while True:
            done, result, memory, message = self._try(attempt, self.micro_batch_size)
            if done:
                return result  # type: ignore[return-value]
            if self.cannot_recover is not None:
                raise TrainingError(f"step {step}: out of memory at micro-batch {self.micro_batch_size} "
                                    f"({message}); {self.cannot_recover}")
            # here the exception and its traceback are gone, and with them the failed attempt's tensors
            failures += 1
            reset()
            self._release()
            old = self.micro_batch_size
            if failures > 1 and old == 1:
                needed = self.memory_needed()
                raise TrainingError(
                    f"step {step}: out of memory with a micro-batch of 1 ({message}){needed}; use "
                    "--checkpointing full, a 16-bit --precision, --train-top-layers, a shorter --max-length, "
                    "or a device with more memory")
            if failures > 1:
                self.micro_batch_size = math.ceil(old / 2)
            self.events.append({"type": "oom", "phase": "train", "step": step,
                                "action": "retry" if failures == 1 else "split", "old_micro_batch_size": old,
                                "new_micro_batch_size": self.micro_batch_size,
                                "accumulation_steps": self.accumulation_steps, "memory_bytes": memory,
                                "message": message})
            set_rng_state(self.window_rng, self.device)

    def run_eval(self, step: int, attempt: Callable[[int], T]) -> T:
        """``attempt(eval_batch_size)``, halving only the evaluation batch on OOM."""
        while True:
            done, result, memory, message = self._try(attempt, self.eval_batch_size)
            if done:
                return result  # type: ignore[return-value]
            if not self.eval_splits:
                raise TrainingError(f"step {step}: out of memory while evaluating with a batch of "
                                    f"{self.eval_batch_size} ({message}); lower --eval-batch-size")
            self._release()
            old = self.eval_batch_size
            if old == 1:
                raise TrainingError(f"step {step}: out of memory while evaluating with a batch of 1 ({message}); "
                                    "use a shorter --max-length or a device with more memory")
            self.eval_batch_size = math.ceil(old / 2)
            self.events.append({"type": "oom", "phase": "eval", "step": step, "action": "split",
                                "old_eval_batch_size": old, "new_eval_batch_size": self.eval_batch_size,
                                "memory_bytes": memory, "message": message})

    def _try(self, attempt: Callable[[int], T], size: int) -> tuple[bool, T | None, int, str]:
        """(succeeded, result, bytes in use at the failure, first line of the error)."""
        try:
            return True, attempt(size), 0, ""
        except OUT_OF_MEMORY as error:  # memory is read while the failed attempt's tensors are still alive
            return False, None, self.memory_now(), oom_message(error)

    def _release(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def oom_message(error: BaseException) -> str:
    """The first line of an out-of-memory error's message."""
    text = str(error).strip()
    return text.splitlines()[0] if text else "out of memory"


class StepWatch(TorchDispatchMode):
    """Inside, notes whether an optimizer step has written to a trained parameter or to a tensor of the optimizer
    state that existed before it (see the module docstring).

    Written is what an op's schema marks as written (in place, or ``out=``), matched by storage, so it sees the
    fused, multi-tensor and per-parameter kernels of torch, torch-optimi and bitsandbytes alike (each a
    dispatched op); a kernel launched around the dispatcher would go unseen, and memfit runs none in the step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, parameters: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.state_before: dict[str, Any] = tree_map(lambda leaf: leaf, optimizer.state_dict())
        """The optimizer's state dict before the step: its containers copied, its tensors by reference."""
        before = [leaf for leaf in tree_leaves(self.state_before) if isinstance(leaf, torch.Tensor)]
        self.storages = {tensor.untyped_storage().data_ptr() for tensor in [*parameters, *before]} - {0}
        self.wrote = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.wrote and func._schema.is_mutable:
            self.wrote = any(isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in self.storages
                             for value in written_arguments(func, args, kwargs))
        return func(*args, **kwargs)


def written_arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Any]:
    """The values an op writes to: the arguments its schema annotates as written, lists flattened."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            yield from tree_leaves(args[index] if index < len(args) else kwargs.get(argument.name))
