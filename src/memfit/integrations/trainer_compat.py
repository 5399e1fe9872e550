"""The one door to the internals of transformers' ``Trainer`` and accelerate that memfit's Trainer callback uses.

Checked against transformers 5.24-5.25, accelerate 1.16 and TRL 1.16. Each access below is a private name or
convention of those libraries; ``tests/unit/test_trainer_compat.py`` holds one test per access, so an upgrade
that changes one fails there, loudly, and here a missing method raises one :class:`~memfit.errors.ConfigError`
line naming the installed version.

- ``Trainer._remove_unused_columns`` and ``Trainer._get_collator_with_removed_columns``: the columns Trainer
  removes from a ``datasets.Dataset``, or from each example of any other dataset, when
  ``remove_unused_columns`` is set (:func:`training_data`);
- ``Trainer._get_num_items_in_batch``: the tokens a window's loss is normalised by (:func:`items_in_window`);
- ``Trainer._clip_grad_norm``: the run's gradient clipping (:func:`clip_gradients`);
- ``Trainer._prepare_input``: where Trainer moves each input (:func:`inputs_where_they_are`);
- accelerate's ``_original_forward``: the forward under its autocast wrapper (:func:`autocast_holder`);
- the ``gradient_checkpointing`` flag and ``_gradient_checkpointing_func`` of transformers' layers
  (:func:`checkpointing_as`);
- Trainer calls its callbacks from its own methods, with ``self`` the Trainer (:func:`calling_trainer`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfit.errors import ConfigError

CHECKED = "transformers 5.24-5.25, accelerate 1.16, TRL 1.16"
TRAINER_METHODS = ("_remove_unused_columns", "_get_collator_with_removed_columns", "_get_num_items_in_batch",
                   "_clip_grad_norm", "_prepare_input")
"""The private methods of ``transformers.Trainer`` memfit calls."""


def _method(trainer: Any, name: str) -> Callable[..., Any]:
    method = getattr(trainer, name, None)
    if not callable(method):
        import transformers

        raise ConfigError(f"transformers {transformers.__version__} has no Trainer.{name}, which memfit's Trainer "
                          f"callback uses (checked against {CHECKED}); install a transformers it was checked with")
    return method


def calling_trainer(callback: object) -> Any | None:
    """The ``transformers.Trainer`` whose callbacks include ``callback`` and that is calling it now: the nearest
    caller whose ``self`` is that Trainer (Trainer calls its callbacks' events from its own methods: ``__init__``
    for ``on_init_end``, the training loop for ``on_train_begin``); ``None`` outside such a call."""
    from transformers import Trainer

    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            handler = getattr(candidate, "callback_handler", None) if isinstance(candidate, Trainer) else None
            if handler is not None and any(item is callback for item in handler.callbacks):
                return candidate
            frame = frame.f_back
    finally:
        del frame
    return None


def training_data(trainer: Any) -> tuple[Any, Callable[[list[Any]], Any]]:
    """(``trainer.train_dataset``, its collator) as Trainer's training dataloader uses them: a
    ``datasets.Dataset`` without the columns the model's forward does not take, any other dataset's examples
    through a collator that drops them (``remove_unused_columns``; neither when it is off)."""
    dataset, collator = trainer.train_dataset, trainer.data_collator
    if _is_datasets_dataset(dataset):
        return _method(trainer, "_remove_unused_columns")(dataset, description="training"), collator
    return dataset, _method(trainer, "_get_collator_with_removed_columns")(collator, description="training")


def _is_datasets_dataset(dataset: Any) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)


def items_in_window(trainer: Any, batches: list[dict[str, torch.Tensor]]) -> Any:
    """Trainer's count of the items a window's loss is divided by, on the CPU. Counted on the Trainer's own
    device: with ``average_tokens_across_devices`` it is gathered over the process group, whose backend (NCCL)
    takes only tensors on that device."""
    count = _method(trainer, "_get_num_items_in_batch")(batches, trainer.args.device)
    return count.to("cpu") if isinstance(count, torch.Tensor) else count


def clip_gradients(trainer: Any, model: nn.Module) -> Any:
    """Trainer's gradient clipping of ``model`` (through accelerate: the GradScaler's unscale first)."""
    return _method(trainer, "_clip_grad_norm")(model)


@contextlib.contextmanager
def inputs_where_they_are(trainer: Any) -> Iterator[None]:
    """Trainer's ``_prepare_input`` (which moves each input to its device) leaves inputs where they are."""
    _method(trainer, "_prepare_input")
    trainer._prepare_input = lambda data: data
    try:
        yield
    finally:
        del trainer._prepare_input


def autocast_holder(model: nn.Module) -> nn.Module:
    """The module that carries accelerate's autocast wrapper (its ``_original_forward`` beside the wrapped
    ``forward``): ``model`` itself, or the module a ``DistributedDataParallel`` or ``DataParallel`` wrapper
    holds (accelerate wraps the forward before it wraps the model for its processes)."""
    inner = getattr(model, "module", None)
    while "_original_forward" not in vars(model) and isinstance(inner, nn.Module):
        model, inner = inner, getattr(inner, "module", None)
    return model


def original_forward(model: nn.Module) -> Callable[..., Any] | None:
    """The forward under accelerate's autocast wrapper of ``model`` (an :func:`autocast_holder`), or ``None``."""
    found = vars(model).get("_original_forward")
    return found if callable(found) else None


@contextlib.contextmanager
def checkpointing_as(model: nn.Module, every: int | None) -> Iterator[None]:
    """``model``'s transformers layers checkpointed as a plan sets it (``every``: every layer (1), one in
    ``every``, or none (``None``)) while inside, with ``use_reentrant=False`` as Trainer's default; each layer's
    own setting is put back on the way out."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    flagged = [module for module in model.modules() if hasattr(module, "gradient_checkpointing")]
    saved = [(module, module.gradient_checkpointing, vars(module).get("_gradient_checkpointing_func"))
             for module in flagged]
    function = functools.partial(checkpoint, use_reentrant=False)
    index = 0
    for module in flagged:
        vars(module)["_gradient_checkpointing_func"] = function
        if isinstance(module, GradientCheckpointingLayer):
            vars(module)["gradient_checkpointing"] = every is not None and index % every == 0
            index += 1
        else:
            vars(module)["gradient_checkpointing"] = every is not None
    try:
        yield
    finally:
        for module, enabled, previous in saved:
            vars(module)["gradient_checkpointing"] = enabled
            if previous is None:
                vars(module).pop("_gradient_checkpointing_func", None)
            else:
                vars(module)["_gradient_checkpointing_func"] = previous
