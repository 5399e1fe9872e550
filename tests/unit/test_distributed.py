"""The distributed rules on a real (one-rank, gloo) process group: the window split, and gradients reduced only
in a window's last backward, for DDP and for FSDP2."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from memfit import distributed
from memfit.step import accumulate_window
from memfit.techniques.precision import Precision
from tests.conftest import build_tiny_bert
from tests.helpers import NoPhases


def micro_batches(count: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(5, 100, (2, 8), generator=generator),
             "attention_mask": torch.ones(2, 8, dtype=torch.long),
             "labels": torch.tensor([0, 1])} for _ in range(count)]


@pytest.mark.parametrize(("length", "size", "expected"), [
    (8, 2, ([[0, 2], [4, 6]], [[1, 3], [5, 7]], 0)),
    (5, 1, ([[0], [2], [4]], [[1], [3], [0]], 1)),  # rank 1 pads its third micro-step (label masked)
    (1, 4, ([[0]], [[0]], 1)),  # a window smaller than the ranks: rank 1 runs one padding micro-batch
])
def test_every_rank_gets_the_same_number_of_micro_batches(length: int, size: int,
                                                          expected: tuple[Any, Any, int]) -> None:
    window = list(range(length))
    first, second, padding = expected
    assert distributed.rank_chunks(window, size, distributed.World(strategy="ddp", rank=0, world_size=2)) == \
        (first, 0)
    assert distributed.rank_chunks(window, size, distributed.World(strategy="ddp", rank=1, world_size=2)) == \
        (second, padding)


def record_sync(model: torch.nn.Module, seen: list[bool], probe: Any) -> Any:
    @contextlib.contextmanager
    def sync(last: bool) -> Iterator[None]:
        with distributed.gradient_sync(model, last):
            yield
        seen.append(probe())

    return sync


def test_ddp_reduces_gradients_only_in_the_last_micro_step(monkeypatch: pytest.MonkeyPatch) -> None:
    reductions = []
    real_all_reduce = torch.distributed.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        reductions.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    with distributed.process_group("ddp", "cpu") as world:
        model = distributed.wrap(build_tiny_bert(), world, low_precision=None, device=torch.device("cpu"))
        monkeypatch.setattr(torch.distributed, "all_reduce", counting)
        seen: list[bool] = []
        accumulate_window(model, micro_batches(3), 6, precision=Precision("fp32", "cpu"), scaler=None,
                          device=torch.device("cpu"), phases=NoPhases(),
                          sync=record_sync(model, seen, lambda: sum(reductions)))
    trainable = sum(p.numel() for p in model.parameters())
    assert seen == [0, 0, trainable]  # nothing reduced until the last backward, then every gradient once
    assert world.allreduce_seconds > 0


def test_fsdp_reduces_gradients_only_in_the_last_micro_step() -> None:
    with distributed.process_group("fsdp", "cpu") as world:
        model = distributed.wrap(build_tiny_bert(), world, low_precision=None, device=torch.device("cpu"))
        sharded = [p for p in model.parameters() if p.requires_grad]
        assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in sharded)
        seen: list[bool] = []
        accumulate_window(model, micro_batches(3), 6, precision=Precision("fp32", "cpu"), scaler=None,
                          device=torch.device("cpu"), phases=NoPhases(),
                          sync=record_sync(model, seen, lambda: any(p.grad is not None for p in sharded)))
    assert seen == [False, False, True]  # unsharded gradients accumulate locally; one reduce-scatter at the end


def sharded_gradients_after_each_micro_step(model: torch.nn.Module) -> list[bool]:
    """Whether every sharded parameter of ``model`` has its gradient after each micro-step of a window of 3,
    its gradients reduced in every micro-step."""
    sharded = [p for p in model.parameters() if p.requires_grad]
    seen: list[bool] = []
    every = distributed.micro_step_sync(model, every=True)

    @contextlib.contextmanager
    def sync(last: bool) -> Iterator[None]:
        with every(last):
            yield
        seen.append(all(p.grad is not None for p in sharded))

    accumulate_window(model, micro_batches(3), 6, precision=Precision("fp32", "cpu"), scaler=None,
                      device=torch.device("cpu"), phases=NoPhases(), sync=sync)
    return seen


def test_fsdp_reduces_gradients_in_every_micro_step_when_asked() -> None:
    with distributed.process_group("fsdp", "cpu") as world:
        model = distributed.wrap(build_tiny_bert(), world, low_precision=None, device=torch.device("cpu"))
        # each backward reduce-scatters into the sharded gradients
        assert sharded_gradients_after_each_micro_step(model) == [True, True, True]


def test_ddp_puts_each_rank_on_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """DDP's device_ids name the local rank's GPU, not GPU 0, for the index-less device a rank trains on."""
    made: dict[str, Any] = {}

    class RecordingDdp(torch.nn.Module):
        def __init__(self, module: torch.nn.Module, **options: Any) -> None:
            super().__init__()
            made.update(options)

        def register_comm_hook(self, state: Any, hook: Any) -> None: ...

    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", RecordingDdp)
    world = distributed.World(strategy="ddp", rank=3, world_size=4, local_rank=3)
    distributed.wrap(torch.nn.Sequential(), world, low_precision=None, device=torch.device("cuda"))
    assert made["device_ids"] == [3]
    distributed.wrap(torch.nn.Sequential(), world, low_precision=None, device=torch.device("cpu"))
    assert made["device_ids"] is None


@pytest.fixture
def launcher_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """torchrun's agent store for a world of 2, as its workers see it (this process hosts it)."""
    import datetime

    store = torch.distributed.TCPStore("localhost", 0, is_master=True, timeout=datetime.timedelta(seconds=5))
    for name, value in {"WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "localhost",
                        "MASTER_PORT": str(store.port), "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(name, value)
    yield store


def test_rank_0_decides_once_and_the_other_ranks_read_its_answer(launcher_store: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    decisions: list[int] = []

    def decide() -> int:
        decisions.append(1)
        return 42

    monkeypatch.setenv("RANK", "0")
    assert distributed.decided_once("plan", decide, encode=str, decode=int) == 42
    monkeypatch.setenv("RANK", "1")
    assert distributed.decided_once("plan", decide, encode=str, decode=int) == 42
    assert decisions == [1]  # rank 1 read rank 0's answer


def test_a_decision_that_fails_on_rank_0_fails_on_every_rank(launcher_store: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from memfit.errors import ConfigError

    def nothing_fits() -> int:
        raise ConfigError("nothing fits 1 GiB")

    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="nothing fits 1 GiB"):
        distributed.decided_once("plan", nothing_fits, encode=str, decode=int)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ConfigError, match="nothing fits 1 GiB"):
        distributed.decided_once("plan", lambda: pytest.fail("rank 1 decided"), encode=str, decode=int)


def test_a_sharded_lora_run_gathers_its_trained_parameters_alone_for_saving() -> None:
    """What rank 0 saves of an FSDP LoRA run: its adapters and head, gathered one by one, equal to the model's
    own; the frozen base is never gathered (a 70B base would be 140 GB of host memory in 16 bits)."""
    from memfit.techniques.lora import apply_lora

    model = apply_lora(build_tiny_bert(), rank=4, alpha=8, dropout=0.0, targets=(), train_top_layers=None,
                       frozen_dtype=None)
    expected = {name: parameter.detach().clone() for name, parameter in model.named_parameters()
                if parameter.requires_grad}
    assert 0 < len(expected) < len(list(model.parameters()))
    with distributed.process_group("fsdp", "cpu") as world:
        sharded = distributed.wrap(model, world, low_precision=None, device=torch.device("cpu"))
        saved = distributed.full_state_dict(sharded, trained_only=True)
        everything = distributed.full_state_dict(sharded)
    assert saved.keys() == expected.keys() and len(everything) > len(saved)
    for name, tensor in saved.items():
        assert type(tensor) is torch.Tensor and torch.equal(tensor, expected[name]), name


def test_a_sharded_full_fine_tune_is_saved_from_its_shards_as_one_process_saves_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP full fine-tuning's model written from each rank's shards and consolidated, never gathered: files of
    at most the bytes asked for and their index, no shards left, the config one process writes, a tied weight
    once; transformers loads every weight as it was. The save's collectives wait on a group of their own, whose
    timeout outlasts a large model's consolidation on rank 0."""
    import datetime
    import json

    import transformers
    from safetensors import safe_open

    from memfit import streamed_export
    from tests.conftest import write_tiny_llm

    source = write_tiny_llm(tmp_path / "llm", config={"tie_word_embeddings": True})
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(source))
    expected = {name: value.detach().clone() for name, value in model.state_dict().items()}
    model.save_pretrained(tmp_path / "one")  # one process's save
    from safetensors.torch import save_file

    stale = tmp_path / "model" / "sharded"  # an earlier save's leftovers: its shards, files and their index
    stale.mkdir(parents=True)
    save_file({"model.norm.weight": torch.full((32,), 7.0)}, stale / "shard-00002-model-00001-of-00009.safetensors")
    for name in ("model-00009-of-00009.safetensors", "model.safetensors", "model.safetensors.index.json"):
        (tmp_path / "model" / name).write_text("stale")
    groups: list[dict[str, Any]] = []
    made = torch.distributed.new_group
    monkeypatch.setattr(torch.distributed, "new_group", lambda **options: groups.append(options) or made(**options))
    with distributed.process_group("fsdp", "cpu") as world:
        sharded = distributed.wrap(model, world, low_precision=None, device=torch.device("cpu"))
        assert streamed_export.streams(sharded, main=True)
        streamed_export.save(sharded, tmp_path / "model", main=True, file_bytes=40_000)
        streamed_export.save(sharded, tmp_path / "whole", main=True)  # under 5 GB: one file, as one process's
    assert groups == [{"backend": "gloo", "timeout": streamed_export.CONSOLIDATION_TIMEOUT}] * 2
    assert streamed_export.CONSOLIDATION_TIMEOUT >= datetime.timedelta(hours=1) > distributed.TIMEOUT
    assert sorted(path.name for path in (tmp_path / "whole").iterdir()) == sorted(
        path.name for path in (tmp_path / "one").iterdir())
    with safe_open(tmp_path / "whole" / "model.safetensors", "pt") as whole:
        assert all(torch.equal(whole.get_tensor(name), expected[name]) for name in whole.keys())
    saved = tmp_path / "model"
    files = sorted(path.name for path in saved.iterdir())
    weights = [name for name in files if name.endswith(".safetensors")]
    assert files == ["config.json", "generation_config.json", *weights, "model.safetensors.index.json"]
    assert len(weights) > 1 and all((saved / name).stat().st_size < 40_000 + 4_096 for name in weights)
    assert json.loads((saved / "config.json").read_text()) == json.loads((tmp_path / "one" / "config.json").read_text())
    with safe_open(tmp_path / "one" / "model.safetensors", "pt") as one:
        assert set(json.loads((saved / "model.safetensors.index.json").read_text())["weight_map"]) == set(one.keys())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(saved).state_dict()
    assert loaded.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), name


def test_a_model_with_state_that_is_not_a_sharded_weight_is_gathered_to_be_saved() -> None:
    """Batch norm's counters (integer, 0-dimensional, replicated): such a model is saved by gathering, as a
    mixture of experts whose class converts its weights when it saves is; a transformers LM is written from its
    shards."""
    import transformers

    from memfit import streamed_export

    resnet = transformers.ResNetForImageClassification(transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=2))
    mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))
    answers = []
    with distributed.process_group("fsdp", "cpu") as world:
        for model in (resnet, mixtral, llama):
            sharded = distributed.wrap(model, world, low_precision=None, device=torch.device("cpu"))
            answers.append(streamed_export.streams(sharded, main=True))
    assert answers == [False, False, True]


def test_what_rank_0_cannot_check_it_gathers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A check that fails on rank 0 answers "gather" (the other ranks wait for its answer, they do not hang)."""
    from memfit import streamed_export

    def broken(model: torch.nn.Module) -> bool:
        raise RuntimeError("a model the check cannot read")

    monkeypatch.setattr(streamed_export, "_streams", broken)
    assert streamed_export.streams(torch.nn.Linear(2, 2), main=True) is False


def test_hsdp_reducing_every_micro_step_all_reduces_across_the_groups_in_the_last_only() -> None:
    """4 ranks in groups of 2 (a fake process group: collectives move no data): each micro-step reduce-scatters
    inside the group into a partial shard, and only the window's last all-reduces it across the groups and sets
    the sharded gradients."""
    with distributed.fake_world(4, 2) as mesh:
        model = distributed.shard(build_tiny_bert(), mesh, low_precision=None, cpu_offload=False, pin_memory=False)
        assert sharded_gradients_after_each_micro_step(model) == [False, False, True]


def test_the_step_in_backward_updates_fsdps_shards_and_a_sharded_checkpoint_keeps_its_states(tmp_path: Path) -> None:
    """One FSDP rank: each sharded parameter is updated by its own optimizer as FSDP hands it its reduced
    gradient, which is released; a non-finite shard is kept and makes the step's norm (summed over the ranks)
    non-finite; the per-parameter states and the learning rate the schedule reached go through a sharded
    checkpoint into a fresh run's optimizer."""
    from memfit import checkpoints
    from memfit.build import build_optimizer_for
    from memfit.config import TrainConfig
    from memfit.techniques.optimizer_in_backward import InBackwardOptimizer
    from memfit.techniques.stability import guarded_step

    config = TrainConfig(optimizer_in_backward=True, max_grad_norm=None, lr=0.1, distributed="fsdp")
    poison = {"on": False}

    def poisoned_gradient(parameter: torch.Tensor) -> None:  # runs before the optimizer's hook (registered first)
        if poison["on"]:
            assert parameter.grad is not None
            parameter.grad.fill_(float("inf"))

    with distributed.process_group("fsdp", "cpu") as world:
        def built() -> tuple[torch.nn.Module, InBackwardOptimizer]:
            torch.manual_seed(0)
            model = distributed.wrap(build_tiny_bert(), world, low_precision=None, device=torch.device("cpu"))
            dict(model.named_parameters())["classifier.weight"].register_post_accumulate_grad_hook(poisoned_gradient)
            optimizer = build_optimizer_for(model, config)
            assert isinstance(optimizer, InBackwardOptimizer) and optimizer.group is not None
            return model, optimizer

        model, optimizer = built()
        named = list(model.named_parameters())
        before = [parameter.full_tensor().clone() for _, parameter in named]
        batch = micro_batches(1)[0]
        model(**batch).loss.backward()
        assert all(parameter.grad is None for _, parameter in named)  # released as they were used
        assert not any(torch.equal(p.full_tensor(), b) for (_, p), b in zip(named, before, strict=True))
        assert guarded_step(optimizer, named, torch.ones(()), scaler=None, max_grad_norm=None).applied

        poison["on"] = True
        classifier = dict(named)["classifier.weight"]
        kept, other = classifier.full_tensor().clone(), named[0][1].full_tensor().clone()
        model(**batch).loss.backward()
        poison["on"] = False
        assert torch.equal(classifier.full_tensor(), kept)  # the non-finite shard is left alone
        assert not torch.equal(named[0][1].full_tensor(), other)  # the others are updated
        check = guarded_step(optimizer, named, torch.ones(()), scaler=None, max_grad_norm=None)
        assert not check.grads_finite and check.bad_parameters == ["classifier.weight"]

        # another rank kept one of its shards: the norm summed over the ranks says so, on every rank
        reduce = torch.distributed.all_reduce
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.distributed, "all_reduce",
                          lambda tensor, **options: (reduce(tensor, **options), tensor.add_(float("inf")))[0])
            model(**batch).loss.backward()
            check = guarded_step(optimizer, named, torch.ones(()), scaler=None, max_grad_norm=None)
        assert not check.grads_finite and check.bad_parameters == []  # none of this rank's

        for group in optimizer.param_groups:
            group["lr"] = 0.025  # where a schedule would be
        checkpoints.save_sharded(tmp_path, model=model, optimizer=optimizer, state={}, progress={"step": 2},
                                 config={}, model_architecture={}, keep_last=1, rank=0, world_size=1, rng={})
        fresh, restored = built()
        checkpoints.load(tmp_path / "checkpoints" / "step-00000002").load_sharded(fresh, restored)
        for (parameter, inner), (again, loaded) in zip(optimizer.per_parameter.items(),
                                                       restored.per_parameter.items(), strict=True):
            state, state_again = inner.state[parameter], loaded.state[again]
            assert state.keys() == state_again.keys() == {"step", "exp_avg", "exp_avg_sq"}
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[key].full_tensor(), state_again[key].full_tensor())
            assert torch.equal(state["step"], state_again["step"])
            assert restored.state[again] is state_again
        assert [group["lr"] for group in restored.param_groups] == [0.025] * len(restored.param_groups)

        # a parameter never updated yet (its only gradient was not finite) has no state: saving makes none (that
        # would change the run), and a resumed run's has none either
        model, optimizer = built()
        poison["on"] = True
        model(**batch).loss.backward()
        poison["on"] = False
        classifier = dict(model.named_parameters())["classifier.weight"]
        checkpoints.save_sharded(tmp_path / "new", model=model, optimizer=optimizer, state={}, progress={"step": 1},
                                 config={}, model_architecture={}, keep_last=1, rank=0, world_size=1, rng={})
        assert not optimizer.per_parameter[classifier].state[classifier]
        fresh, restored = built()
        checkpoints.load(tmp_path / "new" / "checkpoints" / "step-00000001").load_sharded(fresh, restored)
        for (parameter, inner), (again, loaded) in zip(optimizer.per_parameter.items(),
                                                       restored.per_parameter.items(), strict=True):
            assert inner.state[parameter].keys() == loaded.state[again].keys()
