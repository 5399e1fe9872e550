"""Repeated ops answered from their first answer: the same outputs (shapes, strides, dtypes, devices, which
storages are fresh and which are shared), so a trace counts the same bytes with and without the memo."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from memfit import TrainConfig
from memfit.memory import fake_memo
from memfit.memory.estimate import estimate
from memfit.memory.fake_answers import FakeAnswers
from memfit.memory.fake_memo import FakeMemo, unmemoised
from tests.conftest import TINY_BERT, TINY_LLAMA, write_model_dir

aten = torch.ops.aten


def metadata(tensor: torch.Tensor) -> tuple[Any, ...]:
    return (type(tensor), tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.storage_offset(),
            tensor.device, tensor.untyped_storage().nbytes(), tensor.requires_grad)


@pytest.fixture
def memo() -> FakeMemo:
    fake_memo._MEMO.clear()
    return FakeMemo()


def test_a_repeated_op_gets_fresh_outputs_views_of_its_input_and_in_place_results_as_fake_tensors_do(
        memo: FakeMemo) -> None:
    with FakeTensorMode() as mode:
        a, b = torch.empty(4, 6), torch.empty(6, 3, dtype=torch.float32)
        cases: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = [
            (aten.mm.default, (a, b), {}),  # a fresh output
            (aten.t.default, (a,), {}),  # a view of the input's storage
            (aten.slice.Tensor, (a, 1, 2, 5), {}),  # a view at an offset
            (aten.split.Tensor, (a, 2, 1), {}),  # several views, a list
            (aten.native_layer_norm.default, (a, [6], None, None, 1e-5), {}),  # several fresh outputs, a tuple
            (aten._to_copy.default, (a,), {"dtype": torch.bfloat16}),
            (aten.add_.Tensor, (torch.empty(4, 6), a), {}),  # in place: the input itself
        ]
        for func, args, kwargs in cases:
            plain = func(*args, **kwargs)
            first, again = memo(func, args, kwargs), memo(func, args, kwargs)
            for out in (first, again):
                assert type(out) is type(plain)
                outs, plains = (out, plain) if isinstance(out, (list, tuple)) else ([out], [plain])
                for made, expected in zip(outs, plains, strict=True):
                    assert isinstance(made, FakeTensor) and made.fake_mode is mode
                    assert metadata(made) == metadata(expected)
                    aliased = [arg for arg in args if isinstance(arg, torch.Tensor) and
                               arg.untyped_storage()._cdata == expected.untyped_storage()._cdata]
                    if aliased:  # a view or the input: the same storage as the plain answer's
                        assert made.untyped_storage()._cdata == aliased[0].untyped_storage()._cdata
                    else:  # a fresh storage, its own
                        assert made.untyped_storage()._cdata != expected.untyped_storage()._cdata
            if func is aten.add_.Tensor:
                assert again is args[0]
    assert memo.hits == len(cases)


def test_a_key_is_what_the_outputs_follow_from(memo: FakeMemo) -> None:
    with FakeTensorMode():
        a, b = torch.empty(4, 6), torch.empty(6, 4)
        memo(aten.mm.default, (a, b), {})
        wider = memo(aten.mm.default, (a, torch.empty(6, 5)), {})  # another shape: answered afresh
        assert tuple(wider.shape) == (4, 5)
        halves = memo(aten.mm.default, (a.half(), b.half()), {})  # another dtype
        assert halves.dtype == torch.float16
        strided = memo(aten.clone.default, (b.t(),), {"memory_format": torch.preserve_format})
        assert strided.stride() == b.t().stride()  # clone keeps the input's strides
        contiguous = memo(aten.clone.default, (b,), {"memory_format": torch.preserve_format})
        assert contiguous.stride() == b.stride()
        whole = a.to(torch.int64)
        as_int = memo(aten.add.Tensor, (whole, 1), {})
        as_float = memo(aten.add.Tensor, (whole, 1.0), {})  # 1 is not 1.0: an int64 sum, then a float one
        assert (as_int.dtype, as_float.dtype) == (torch.int64, torch.float32)
        out = torch.empty(0)
        for _ in range(2):  # an out= variant resizes its output: run every time
            memo(aten.mm.out, (a, b), {"out": out})
            assert tuple(out.shape) == (4, 4)
            out.resize_(0)
    assert memo.hits == 0


def test_what_cannot_be_repeated_passes_through(memo: FakeMemo) -> None:
    real = torch.ones(4, 6)
    with FakeTensorMode(allow_non_fake_inputs=True):
        a = torch.empty(4, 6)
        shared = a.view(4, 6)
        for _ in range(2):
            memo(aten.add.Tensor, (a, real), {})  # not a fake tensor
            memo(aten.resize_.default, (torch.empty(2), [3]), {})  # changes an input's storage in place
            memo(aten.t_.default, (torch.empty(2, 3),), {})  # changes an input's metadata in place
            memo(aten.add_.Tensor, (a, shared), {})  # its inputs share a storage: which one it returns is unknown
        constant = torch.tensor(2.0)  # made from a value inside the mode: fake mode keeps it
        assert constant.constant is not None
        memo(aten.mul.Tensor, (constant, constant), {})
        memo(aten.mul.Tensor, (constant, constant), {})
    assert memo.hits == 0


@pytest.mark.parametrize(("name", "device"), [("llama", "1080ti"), ("bert", "cpu")])
def test_a_trace_with_the_memo_equals_the_trace_without_it_and_the_memo_answers_most_ops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, device: str) -> None:
    config = {**TINY_LLAMA, "vocab_size": 64, "num_hidden_layers": 3} if name == "llama" else \
        {**TINY_BERT, "vocab_size": 64}
    run = TrainConfig(model=str(write_model_dir(tmp_path / name, config)),
                      task="causal-lm" if name == "llama" else "classification", max_length=16, effective_batch=4,
                      micro_batch_size=2, precision="fp16" if device == "1080ti" else "fp32", checkpointing="full")
    with unmemoised():
        plain = estimate(run, device=device, seq_len=16, count_flops=True, exact_trace=True)
    answered: list[FakeAnswers] = []
    original = FakeAnswers.__init__

    def kept(self: FakeAnswers, *, cuda: bool = False, memo: bool = False) -> None:
        original(self, cuda=cuda, memo=memo)
        answered.append(self)

    monkeypatch.setattr(FakeAnswers, "__init__", kept)
    memoised = estimate(run, device=device, seq_len=16, count_flops=True, exact_trace=True)
    fields = [field.name for field in dataclasses.fields(plain) if field.name != "seconds"]
    assert {f: getattr(memoised, f) for f in fields} == {f: getattr(plain, f) for f in fields}
    hits = sum(answers.memo.hits for answers in answered if answers.memo is not None)
    assert hits > plain.traced_ops / 2


def test_this_torch_makes_fake_tensors_as_the_memo_does() -> None:
    assert fake_memo._usable()  # else every trace runs unmemoised: correct, and about twice as slow


def test_only_the_training_step_is_memoised_not_the_models_build() -> None:
    answers = FakeAnswers(memo=True)
    with FakeTensorMode(), answers:
        a = torch.empty(2, 3)
        for _ in range(2):
            torch.mm(a, a.t())  # as a build runs it: through fake tensors
        assert answers.memo is not None and answers.memo.hits == 0  # not asked, outside memoising()
        with answers.memoising():
            for _ in range(2):
                torch.mm(a, a.t())
    assert answers.memo.hits >= 2  # the transpose and the product, once each
