"""The door to Trainer's and accelerate's internals (:mod:`memfit.integrations.trainer_compat`): one test per
access, failing loudly when an upgrade changes it; and the pieces of the Trainer trace that only a process
group or a card would show (the gather device, the autocast wrapper under DDP)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from memfit.errors import ConfigError
from memfit.integrations import trainer_compat as compat
from memfit.integrations.trainer_step import trace_autocast
from tests.conftest import TINY_LLAMA

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")


@pytest.mark.parametrize("name", compat.TRAINER_METHODS)
def test_trainer_has_each_private_method_memfit_calls(name: str) -> None:
    assert callable(getattr(transformers.Trainer, name, None)), f"transformers.Trainer.{name} is gone"


def test_the_items_count_takes_the_batches_and_a_device() -> None:
    parameters = list(inspect.signature(transformers.Trainer._get_num_items_in_batch).parameters)
    assert parameters == ["self", "batch_samples", "device"]


def test_accelerate_keeps_the_forward_under_its_autocast_wrapper() -> None:
    assert "model._original_forward = model.forward" in inspect.getsource(accelerate.Accelerator.prepare_model)


def test_transformers_layers_checkpoint_through_the_flag_and_function_memfit_sets() -> None:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**{k: v for k, v in TINY_LLAMA.items() if k != "architectures"}, "vocab_size": 64, "num_hidden_layers": 4}))
    layers = list(model.model.layers)
    with compat.checkpointing_as(model, 2):
        assert [layer.gradient_checkpointing for layer in layers] == [True, False, True, False]
        ours = {name for layer in layers for name in vars(layer) if "checkpointing" in name}
    assert [layer.gradient_checkpointing for layer in layers] == [False] * 4
    assert not any("_gradient_checkpointing_func" in vars(layer) for layer in layers)
    model.activation_checkpointing_enable()
    theirs = {name for layer in layers for name in vars(layer) if "checkpointing" in name}
    assert ours == theirs == {"gradient_checkpointing", "_gradient_checkpointing_func"}


def test_no_trainer_is_found_outside_a_trainers_call() -> None:
    assert compat.calling_trainer(object()) is None


def test_a_missing_private_method_is_one_line_naming_the_version() -> None:
    with pytest.raises(ConfigError, match=rf"transformers {transformers.__version__} has no Trainer\._clip_grad_norm"):
        compat.clip_gradients(SimpleNamespace(), nn.Linear(1, 1))


def test_the_items_of_a_window_are_counted_on_the_trainers_device() -> None:
    """With ``average_tokens_across_devices`` Trainer gathers the count over the process group: under NCCL
    only a tensor on the card can be gathered, so the count is made on the Trainer's device (here ``meta``
    stands for the card) and comes back to the CPU for the trace."""
    devices: list[torch.device] = []

    def count(batches: list[dict[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
        devices.append(device)
        return torch.tensor(sum(int(batch["labels"].numel()) for batch in batches))

    trainer = SimpleNamespace(args=SimpleNamespace(device=torch.device("meta")), _get_num_items_in_batch=count)
    items = compat.items_in_window(trainer, [{"labels": torch.ones(2, 3)}] * 2)
    assert devices == [torch.device("meta")] and items.device.type == "cpu" and int(items) == 12


class _Recorder(nn.Module):
    """Two Linear layers; the first's output dtype is what autocast made of it."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        self.dtypes.append(hidden.dtype)
        return self.second(hidden)


def test_the_trace_finds_accelerates_autocast_under_ddp() -> None:
    """accelerate wraps the module's forward in the card's autocast, then wraps the module in DDP: the trace's
    CPU autocast replaces the wrapper where it is, under the DDP object, so a bf16 run is traced in bf16 (not
    fp32, about twice the activations). One process, gloo."""
    from accelerate.utils import convert_outputs_to_fp32

    inner = _Recorder()
    inner._original_forward = inner.forward  # type: ignore[assignment]
    inner.forward = convert_outputs_to_fp32(inner._original_forward)  # type: ignore[method-assign]  # the card's
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        wrapped: Any = nn.parallel.DistributedDataParallel(inner)
        assert compat.autocast_holder(wrapped) is inner
        with trace_autocast(wrapped, "bf16"):
            wrapped(torch.ones(2, 4))
        wrapped(torch.ones(2, 4))
    finally:
        dist.destroy_process_group()
    assert inner.dtypes == [torch.bfloat16, torch.float32]
