"""Traces side by side: every job run once, the same plan as one process traces alone."""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import memfit.planner.search as search_module
import memfit.planner.workers as workers_module
from memfit.config import TrainConfig
from memfit.errors import ConfigError
from memfit.planner import plan
from memfit.planner.allowed import Allowed
from memfit.planner.workers import WORKERS_ENV, can_fork, side_by_side, worker_count
from tests.conftest import write_tiny_llm

forking = pytest.mark.skipif(not can_fork(), reason="needs Linux and one thread")


@pytest.fixture
def one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forks as from a process of one thread: tests run before these in the same process may leave idle
    daemon threads (a served page's), which hold no lock the jobs here take."""
    monkeypatch.setattr(workers_module.threading, "active_count", lambda: 1)


def _meet(place: Path, value: int) -> tuple[int, int]:
    """A job that waits (30 s at most) until jobs have run in two processes: proof that a worker took one."""
    (place / str(os.getpid())).touch()
    deadline = time.monotonic() + 30
    while len(list(place.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.getpid(), value * value


def _noting_the_process(place: Path, job: Any) -> Any:
    (place / str(os.getpid())).touch()
    return job()


def _fails() -> int:
    raise ValueError("a job that fails")


@forking
@pytest.mark.usefixtures("one_thread")
def test_every_job_runs_once_in_this_process_or_a_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WORKERS_ENV, "3")
    jobs = [functools.partial(_meet, tmp_path, value) for value in range(12)]
    results = dict(side_by_side(jobs))
    assert sorted(results) == list(range(12))
    assert all(results[index] == (results[index][0], index * index) for index in results)
    assert len({result[0] for result in results.values() if result is not None}) > 1  # workers took some
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("QueueFeederThread")]


@forking
@pytest.mark.usefixtures("one_thread")
def test_workers_that_cannot_run_backward_leave_the_jobs_here_and_stop_the_forking(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # as on a machine with a GPU after the first backward: autograd's device threads do not survive a fork
    def no_backward(*_: Any, **__: Any) -> None:
        raise RuntimeError("Unable to handle autograd's threading in combination with fork-based multiprocessing")

    monkeypatch.setenv(WORKERS_ENV, "2")
    monkeypatch.setattr(workers_module, "_fork_broken", False)
    monkeypatch.setattr(torch.Tensor, "backward", no_backward)
    results = dict(side_by_side([functools.partial(_noting_the_process, tmp_path, lambda: 7)] * 3))
    assert results == {0: 7, 1: 7, 2: 7}
    assert [path.name for path in tmp_path.iterdir()] == [str(os.getpid())]  # every job ran here
    assert not can_fork()  # and the next batch is traced here too


def test_a_failing_job_answers_none_for_the_caller_to_run_again(monkeypatch: pytest.MonkeyPatch) -> None:
    for workers in ("1", "2"):
        monkeypatch.setenv(WORKERS_ENV, workers)
        assert dict(side_by_side([lambda: 1, _fails, lambda: 3])) == {0: 1, 1: None, 2: 3}


def test_guesses_run_only_beside_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs from ``needed`` on are guesses: this process alone does not run them (each answers ``None``)."""
    monkeypatch.setenv(WORKERS_ENV, "1")
    ran: list[int] = []

    def job(value: int) -> int:
        ran.append(value)
        return value

    assert dict(side_by_side([functools.partial(job, value) for value in range(3)], needed=1)) == \
        {0: 0, 1: None, 2: None}
    assert ran == [0]


def test_the_worker_count_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WORKERS_ENV, "0")
    with pytest.raises(ConfigError, match="MEMFIT_TRACE_WORKERS='0': give a whole number"):
        worker_count()
    monkeypatch.delenv(WORKERS_ENV)
    assert worker_count() >= 1


@pytest.mark.slow
@forking
@pytest.mark.usefixtures("one_thread")
def test_a_plan_traced_side_by_side_equals_one_traced_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # no full fine-tuning fits: its least needs, every opt-in's need up to freezing (allowed), freezing's
    # search and its confirmations run in batches
    model = write_tiny_llm(tmp_path / "llm")
    config = TrainConfig(model=str(model), task="causal-lm", max_length=64, effective_batch=2)
    processes = tmp_path / "processes"
    processes.mkdir()
    real = search_module.side_by_side
    monkeypatch.setattr(search_module, "side_by_side", lambda jobs, needed=None: real(
        [functools.partial(_noting_the_process, processes, job) for job in jobs], needed))
    answers: list[dict[str, Any]] = []
    for workers in ("1", "2"):
        monkeypatch.setenv(WORKERS_ENV, workers)
        told: list[str] = []
        result = plan(config, device="cpu", budget="450KiB", seq_len=64, allow=Allowed(freeze=True),
                      precisions=("fp32",), progress=told.append)
        document = result.to_dict()
        document.pop("seconds")
        answers.append(document)
        assert len(told) >= result.traces  # every trace told once, the ones asked for ahead of need too
    assert len(list(processes.iterdir())) > 1  # workers traced some of the second plan
    assert json.dumps(answers[0], sort_keys=True) == json.dumps(answers[1], sort_keys=True)
    assert answers[0]["chosen"] is not None and "would not fit either" in answers[0]["verdict"]


@pytest.mark.slow
@forking
@pytest.mark.usefixtures("one_thread")
def test_where_no_full_fine_tuning_can_fit_the_adapters_least_needs_join_its_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """300,928 parameters: their fp32 weights, gradients and AdamW states alone (4.6 MiB) are over the 3.8 MiB
    usable, so LoRA's least needs are traced in full fine-tuning's first batch; the plan, LoRA's, is the one a
    single process makes."""
    model = write_tiny_llm(tmp_path / "llm", config={"hidden_size": 128, "intermediate_size": 256,
                                                     "num_attention_heads": 4, "num_key_value_heads": 2})
    config = TrainConfig(model=str(model), task="causal-lm", max_length=64, effective_batch=2)
    batches: list[list[TrainConfig]] = []
    real = search_module.side_by_side

    def recorded(jobs: list[Any], needed: int | None = None) -> Any:
        batches.append([job.args[0] for job in jobs])
        return real(jobs, needed)

    monkeypatch.setattr(search_module, "side_by_side", recorded)
    answers: list[str] = []
    for workers in ("1", "2"):
        monkeypatch.setenv(WORKERS_ENV, workers)
        result = plan(config, device="cpu", budget="4MiB", seq_len=64, allow=Allowed(lora=True),
                      precisions=("fp32",), lora_rank=4)
        document = result.to_dict()
        document.pop("seconds")
        answers.append(json.dumps(document, sort_keys=True))
    assert answers[0] == answers[1]
    assert result.chosen is not None and result.chosen.family.technique == "lora"
    assert {traced.lora_rank for traced in batches[0]} == {0, 4}  # full fine-tuning's least needs and LoRA's


def test_a_fit_that_leaves_a_trace_process_idle_traces_the_next_familys_first_point(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With two trace processes, a family whose least need is traced needs one more trace (its line's other point):
    the next family's first point is traced beside it. A family needing two traces fills both processes alone."""
    from memfit.devices import resolve_profile
    from memfit.planner.families import Family
    from memfit.planner.search import Search

    monkeypatch.setenv(WORKERS_ENV, "2")
    config = TrainConfig(model=str(write_tiny_llm(tmp_path / "llm")), max_length=16, effective_batch=8,
                         task="causal-lm")
    search = Search(config, resolve_profile("cpu"), usable_bytes=1 << 40, seq_len=16, image_size=None, num_labels=2)
    known, other = (Family(precision="fp32", checkpointing=c, kernels="fused") for c in ("full", "none"))
    assert search.fit_requests(other) == [(other, 4, True, True), (other, 2, True, True)]
    assert search._ahead([other, known]) == search.fit_requests(other)  # both processes busy already
    search.exact(known, 1)  # its least need
    assert search.fit_requests(known) == [(known, 4, True, True)]
    assert search._ahead([known, other]) == [(known, 4, True, True), (other, 4, True, True)]
    monkeypatch.setenv(WORKERS_ENV, "1")
    assert search._ahead([known, other]) == [(known, 4, True, True)]  # one process: nothing ahead


def test_a_batch_that_would_leave_a_process_idle_takes_the_likeliest_next_traces(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two trace processes: a batch of one trace takes a guess beside it, the fastest unconfirmed setup's exact
    trace (a confirmation) before what the plan names as upcoming; a batch of two takes nothing more;
    ``upcoming=True`` takes all that is upcoming. Guesses stay out of the shared cache until the search asks for
    one, which then costs no trace."""
    from memfit.devices import resolve_profile
    from memfit.planner.families import Family
    from memfit.planner.search import Search

    monkeypatch.setenv(WORKERS_ENV, "2")
    monkeypatch.setattr(search_module, "side_by_side_usable", lambda: True)
    batches: list[list[Any]] = []

    def recorded(jobs: list[Any], needed: int | None = None) -> Any:
        batches.append([job.args[0] for job in jobs])  # the configs traced
        return ((index, job()) for index, job in enumerate(jobs))

    monkeypatch.setattr(search_module, "side_by_side", recorded)
    config = TrainConfig(model=str(write_tiny_llm(tmp_path / "llm")), max_length=16, effective_batch=8,
                         task="causal-lm")
    cache: dict[Any, Any] = {}
    search = Search(config, resolve_profile("cpu"), usable_bytes=1 << 40, seq_len=16, image_size=None, num_labels=2,
                    cache=cache)
    full, none, every = (Family(precision="fp32", checkpointing=c, kernels="fused")
                         for c in ("full", "none", "every-2"))

    def traced(family: Family, micro: int) -> TrainConfig:
        return search._request(*search.exact_request(family, micro))[2]

    search.upcoming = lambda: [search.exact_request(every, 1)]
    search.prefetch([search.exact_request(full, 1)])  # nothing predicted yet: the upcoming trace beside it
    assert batches == [[traced(full, 1), traced(every, 1)]]
    assert search._request(*search.exact_request(every, 1))[1] not in cache  # a guess: not shared
    search.fit(none)  # its line's two points, traced side by side: nothing more
    assert len(batches) == 2 and len(batches[1]) == 2
    fastest = max((c for c in search.candidates.values() if not c.exact),
                  key=lambda c: c.predicted_samples_per_second)
    search.upcoming = lambda: [search.exact_request(every, 2)]
    search.prefetch([search.line_request(full, 4)])
    assert batches[2] == [search._request(*search.line_request(full, 4))[2],
                          traced(fastest.family, fastest.micro_batch_size)]
    search.upcoming = lambda: [search.exact_request(every, 2), search.exact_request(every, 4)]
    search.prefetch([search.exact_request(none, 1)], upcoming=True)
    assert batches[3] == [traced(none, 1), traced(every, 2), traced(every, 4)]
    monkeypatch.setattr(search_module, "estimate", lambda *args, **kwargs: pytest.fail("traced again"))
    guessed = search.exact(every, 1)  # asked for now: taken, and shared from then on
    assert cache[search._request(*search.exact_request(every, 1))[1]] is guessed
