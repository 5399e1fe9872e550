"""memfit.support: which failures become "<model_type>: not supported yet (...)", and which pass as they are."""

from __future__ import annotations

import types

import pytest
import torch

from memfit.errors import ConfigError
from memfit.support import UnsupportedModel, describe, model_support

CONFIG = types.SimpleNamespace(model_type="mixtral")


def _raise_outside_memfit(error: BaseException) -> None:
    """Raises ``error`` from a frame outside memfit's package (as the model's own code would)."""
    namespace: dict[str, object] = {}
    exec(compile("def fail(error):\n    raise error\n", "/site-packages/transformers/model.py", "exec"), namespace)
    namespace["fail"](error)  # type: ignore[operator]


def test_a_failure_in_the_models_code_is_one_line() -> None:
    with pytest.raises(UnsupportedModel, match=r"^mixtral: not supported yet \(ValueError: bad shape\)$") as caught:
        with model_support(CONFIG):
            _raise_outside_memfit(ValueError("bad shape\nsecond line"))
    assert isinstance(caught.value, ConfigError) and caught.value.model_type == "mixtral"


@pytest.mark.parametrize("error", [OSError("weights file truncated"), MemoryError(),
                                   RuntimeError("DefaultCPUAllocator: can't allocate memory"),
                                   RuntimeError("CUDA error: no kernel image is available for execution"),
                                   torch.OutOfMemoryError("CUDA out of memory"), KeyboardInterrupt()])
def test_files_allocation_failures_and_interrupts_pass_as_they_are(error: BaseException) -> None:
    with pytest.raises(type(error)), model_support(CONFIG):
        _raise_outside_memfit(error)


def test_an_error_in_memfits_own_code_is_a_bug_to_see_not_a_refusal() -> None:
    from memfit.models import position_limit

    with pytest.raises(AttributeError, match="hf_config"), model_support(CONFIG):
        position_limit(None)  # type: ignore[arg-type]  (raises in memfit.models itself)


def test_a_step_that_reads_values_says_so() -> None:
    from torch._subclasses.fake_tensor import DataDependentOutputException

    error = DataDependentOutputException(torch.ops.aten._local_scalar_dense.default)
    assert describe(error).startswith("its step reads tensor values (aten._local_scalar_dense.default)")
