"""Plans off the request thread: one worker runs them in turn from a bounded queue.

A plan is minutes of fake-tensor tracing on a few cores; two at once would only share those cores. So the page's
requests put a job in a queue of at most :data:`QUEUE_LIMIT` and return at once; a full queue is refused (HTTP
503), so no one's requests pile up behind another's. A job is cancelled between two traces (the planner reports
each one), or before it starts; the page cancels its job when its inputs change. Finished jobs are kept for the
page to read, the oldest dropped past :data:`KEPT_JOBS`.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memfit.errors import MemfitError, messages

QUEUE_LIMIT = 4
"""Jobs that may wait for the worker; one more is refused."""
KEPT_JOBS = 64
FINISHED = ("done", "failed", "cancelled")
log = logging.getLogger("memfit.serve")


class Busy(Exception):
    """The queue is full."""


class Cancelled(BaseException):
    """Raised inside a running plan whose job was cancelled. A ``BaseException``, as ``KeyboardInterrupt`` is: the
    planner's handlers for a setup it cannot trace must not take it for one."""


@dataclass(kw_only=True)
class Job:
    """One plan asked for: its inputs, its progress and, when finished, its plan or its error."""

    id: str
    query: dict[str, str]
    """The inputs as given (a query string's), checked by the worker's ``run``."""
    details: bool
    """Also the chosen setup's memory and commands (the page), not only the plan (the JSON endpoint)."""
    state: str = "queued"
    """``queued``, ``running``, ``planned`` (its details follow), ``done``, ``failed`` or ``cancelled``."""
    traces: int = 0
    techniques: list[str] = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)
    started: float | None = None
    finished_at: float | None = None
    plan: dict[str, Any] | None = None
    """``memfit plan --json``'s document."""
    memory: dict[str, Any] | None = None
    """The details (:class:`memfit.planner.details.PlanDetails`), with ``details``."""
    error: str | None = None
    """The command line's message for bad inputs; for anything else, one line that the plan stopped."""
    status: int = 200
    """The HTTP status of the JSON endpoint's answer: 400 for bad inputs, 500 when the plan failed otherwise."""
    cancel: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)

    def progress(self, technique: str) -> None:
        """The planner's report after each trace; where the job is cancelled, the plan stops here."""
        self.traces += 1
        if technique not in self.techniques:
            self.techniques.append(technique)
        if self.cancel.is_set():
            raise Cancelled

    def view(self) -> dict[str, Any]:
        """What the page polls."""
        now = self.finished_at or time.monotonic()
        return {"id": self.id, "state": self.state, "traces": self.traces, "techniques": self.techniques,
                "seconds": round(now - self.started, 1) if self.started is not None else 0.0,
                "plan": self.plan, "memory": self.memory, "error": self.error}


Runner = Callable[[Job], None]
"""Runs a job: sets its ``plan`` (and ``memory``), calling ``job.progress`` after each trace."""


class Planner:
    """The queue and its worker thread; ``runner`` makes a job's plan (:func:`memfit.serve.app.run_job`)."""

    def __init__(self, runner: Runner, *, limit: int = QUEUE_LIMIT, warm: Callable[[], None] | None = None) -> None:
        self._runner, self._warm = runner, warm
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=limit)
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._work, name="memfit-planner", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, query: dict[str, str], *, details: bool) -> Job:
        """Queue a plan; :class:`Busy` when :data:`QUEUE_LIMIT` jobs already wait."""
        with self._lock:
            job = Job(id=f"{next(self._ids)}-{int(time.time() * 1000) % 100000}", query=query, details=details)
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                raise Busy(f"{self._queue.maxsize} plans are waiting already; try again when one has finished") \
                    from None
            self._jobs[job.id] = job
            self._forget_old()
        return job

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def cancel(self, job_id: str) -> Job | None:
        """Stop a job: before it starts, or at its next trace."""
        job = self.get(job_id)
        if job is not None and job.state not in FINISHED:
            job.cancel.set()
        return job

    def _forget_old(self) -> None:
        finished = [key for key, job in self._jobs.items() if job.state in FINISHED]
        for key in finished[:max(0, len(self._jobs) - KEPT_JOBS)]:
            del self._jobs[key]

    def _work(self) -> None:
        if self._warm is not None:
            self._warm()
        while True:
            job = self._queue.get()
            if job.cancel.is_set():
                self._finish(job, "cancelled")
                continue
            job.state, job.started = "running", time.monotonic()
            try:
                self._runner(job)
                self._finish(job, "done")
            except Cancelled:
                self._finish(job, "cancelled")
            except MemfitError as error:
                job.error, job.status = "\n".join(messages(error)), 400
                self._finish(job, "failed")
            except Exception as error:  # the server outlives any plan: it answers, and logs the rest
                log.exception("plan %s stopped", job.id)
                job.error, job.status = f"memfit: error: the plan stopped: {type(error).__name__}: {error}", 500
                self._finish(job, "failed")

    def _finish(self, job: Job, state: str) -> None:
        job.state, job.finished_at = state, time.monotonic()
        job.finished.set()
