"""Traces side by side: the independent traces of a plan run on every core of the machine.

A plan asks for traces in batches whose members do not depend on each other: the least need at each
precision with and without a chunked loss, what each opt-in would need, a family's two line points, the
setups it confirms. Each trace is a pure function of its inputs (a config, the card, the sequence length), so
:func:`side_by_side` forks a worker process per extra core for a batch (each inherits the loaded modules and
the planner's caches: nothing is imported or sent but an index and the estimate that comes back) and this
process traces too; each takes the next trace of the batch in turn. The plan's answer is the same as one
process's, to the byte, and so is the number of traces it reports (a trace asked for ahead of need counts
only when the search uses it).

A batch that would leave a process idle (one trace, or a last round short of one) also takes *guesses*, the
traces the plan likely asks for next (:meth:`memfit.planner.search.Search.prefetch`): the fastest unconfirmed
setups, the opt-ins' least needs once the least need without them is over the budget. Where nothing but an
adapter can be chosen (no opt-in allowed, full fine-tuning's fp32 weights, gradients and AdamW states alone over
the card), the first adapter technique's least needs join full fine-tuning's first batch. A guess is kept apart
until the search asks for it (no decision, and no plan sharing the cache, sees it before), and runs only beside
a worker: a batch this process ends up running alone skips its guesses.

Trade-off: a fork per batch costs milliseconds, a trace asked for ahead of need may go unused (the second
setup of a confirmation that changes the answer), and each worker holds its own copy of what it traces (a few
hundred MB for an 8B model's shortened trace). Forking runs on Linux, from a process with one thread: a plan
run from a thread (``memfit serve``) traces one at a time. On a machine with a GPU, torch's autograd starts a
thread per device at a process's first backward, after which a forked child cannot run backward: a worker
checks that first and, where it cannot, this process stops forking and traces one at a time from then on (a
fresh ``memfit plan`` forks its first batch before any backward). ``MEMFIT_TRACE_WORKERS`` caps the
processes (``1``: this one only); by default, one per core this process may use, at most :data:`MAX_WORKERS`.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from memfit.errors import ConfigError

WORKERS_ENV = "MEMFIT_TRACE_WORKERS"
MAX_WORKERS = 8
"""Processes by default at most (each holds its own trace in memory)."""
NO_BACKWARD = 3
"""A worker's exit status when it cannot run backward (autograd's device threads, forked)."""
Result = TypeVar("Result")
_fork_broken = False
"""A forked worker could not run backward: this process traces one at a time from then on."""
_JOBS: Sequence[Callable[[], Any]] = ()
"""The batch being traced: workers forked while it is set read their jobs from it."""


def worker_count() -> int:
    """How many traces may run at once: ``MEMFIT_TRACE_WORKERS``, else the cores this process may use."""
    value = os.environ.get(WORKERS_ENV)
    if value is not None:
        if not value.strip().isdigit() or int(value) < 1:
            raise ConfigError(f"{WORKERS_ENV}={value!r}: give a whole number of processes, at least 1 (e.g. 2)")
        return int(value)
    affinity = getattr(os, "sched_getaffinity", None)
    return min(MAX_WORKERS, len(affinity(0)) if affinity is not None else os.cpu_count() or 1)


def can_fork() -> bool:
    """Whether worker processes can be forked safely here: Linux (macOS's system libraries are not safe to
    fork), this process runs one thread (a fork copies only the calling thread; a lock another thread holds
    would stay held), may have children (not a daemon) and has not seen a forked worker fail to run
    backward."""
    return sys.platform.startswith("linux") and threading.active_count() == 1 \
        and not multiprocessing.current_process().daemon and not _fork_broken


def side_by_side_usable() -> bool:
    """Whether :func:`side_by_side` runs jobs at once here (else one at a time)."""
    return worker_count() > 1 and can_fork()


def side_by_side(jobs: Sequence[Callable[[], Result]],
                 needed: int | None = None) -> Iterator[tuple[int, Result | None]]:
    """Run ``jobs`` (each returning a picklable result), yielding ``(index, result)`` as each ends, in no
    fixed order. A job that raises yields ``None``: the caller runs it again itself, where its error is
    raised as usual. ``needed``: the jobs from this index on are guesses, worth running only beside the
    others: where a worker fails and this process is left to run what is missing, each guess yields ``None``
    unrun."""
    workers = min(worker_count(), len(jobs)) - 1  # this process is one of them
    if workers < 1 or not can_fork():
        for index, job in enumerate(jobs):
            yield index, None if needed is not None and index >= needed else _quietly(job)
        return
    global _JOBS, _fork_broken
    context = multiprocessing.get_context("fork")
    taken = context.Value("i", 0)
    results: multiprocessing.Queue[tuple[int, Any]] = context.Queue()
    _JOBS = jobs
    processes = [context.Process(target=_work, args=(taken, results), daemon=True) for _ in range(workers)]
    completed = False
    try:
        for process in processes:
            try:
                process.start()
            except OSError:  # no memory or process left to fork: the workers started (if any) and this one
                break
        processes = [process for process in processes if process.pid is not None]
        done: set[int] = set()
        while (index := _next(taken)) < len(jobs):
            done.add(index)
            alone = not any(process.is_alive() for process in processes)  # none started, left, or could work
            yield index, None if alone and needed is not None and index >= needed else _quietly(jobs[index])
        while len(done) < len(jobs):
            try:
                index, result = results.get(timeout=1.0)
            except queue.Empty:
                _fork_broken = _fork_broken or any(p.exitcode == NO_BACKWARD for p in processes)
                if any(process.is_alive() for process in processes):
                    continue
                # a worker died without answering (killed): this process runs what is missing
                for index in sorted(set(range(len(jobs))) - done):
                    done.add(index)
                    yield index, None if needed is not None and index >= needed else _quietly(jobs[index])
                break
            done.add(index)
            yield index, result
        completed = True
    finally:
        _JOBS = ()
        for process in processes:
            if completed:  # no job left: each worker ends by itself (one may still be checking backward)
                process.join(timeout=10.0)
            if process.is_alive():
                process.terminate()
            process.join()
        _fork_broken = _fork_broken or any(process.exitcode == NO_BACKWARD for process in processes)
        results.close()


def _next(taken: Any) -> int:
    with taken.get_lock():
        index = int(taken.value)
        taken.value = index + 1
    return index


def _work(taken: Any, results: multiprocessing.Queue[tuple[int, Any]]) -> None:
    """A worker: the batch's next job until none is left, each result sent back. It first checks that it can
    run backward (else it exits with :data:`NO_BACKWARD`, taking no job); Ctrl-C is the parent's to handle."""
    import signal

    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)  # fake tensors compute nothing; no thread pool inherited through a fork is used
    try:
        torch.ones(1, requires_grad=True).sum().backward()
    except RuntimeError:  # "Unable to handle autograd's threading in combination with fork-based multiprocessing"
        os._exit(NO_BACKWARD)
    while (index := _next(taken)) < len(_JOBS):
        results.put((index, _quietly(_JOBS[index])))


def _quietly(job: Callable[[], Result]) -> Result | None:
    try:
        return job()
    except Exception:  # the caller runs the job again, where its error is raised
        return None
