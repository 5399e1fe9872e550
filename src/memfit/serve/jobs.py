"""Plans off the request thread: one worker runs them in turn from a bounded queue.

A plan is minutes of fake-tensor tracing on a few cores; two at once would only share those cores. So the page's
requests put a job in a queue of at most :data:`QUEUE_LIMIT` waiting jobs and return at once; a full queue is
refused (HTTP 503), so no one's requests pile up behind another's. A waiting job that is cancelled leaves the queue
at once; a running one stops at its next trace (the planner reports each one), or before its details' trace. The
page cancels its job when its inputs change. Finished jobs are kept for the page to read, the oldest dropped past
:data:`KEPT_JOBS`.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections import OrderedDict, deque
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
    """The inputs as given (a query string's)."""
    request: Any = None
    """The inputs checked (:class:`memfit.planner.request.PlanRequest`), made when the job was asked for."""
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
        self.limit = limit
        self._runner, self._warm = runner, warm
        self._waiting: deque[Job] = deque()
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._ready = threading.Condition()
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._work, name="memfit-planner", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, query: dict[str, str], *, details: bool, request: Any = None) -> Job:
        """Queue a plan; :class:`Busy` when :attr:`limit` jobs already wait (cancelled ones do not count)."""
        with self._ready:
            if len(self._waiting) >= self.limit:
                raise Busy(f"{self.limit} plans are waiting already; try again when one has finished")
            job = Job(id=f"{next(self._ids)}-{secrets.token_hex(4)}", query=query, details=details, request=request)
            self._waiting.append(job)
            self._jobs[job.id] = job
            self._forget_old()
            self._ready.notify()
        return job

    def get(self, job_id: str) -> Job | None:
        with self._ready:
            return self._jobs.get(job_id)

    def cancel(self, job_id: str) -> Job | None:
        """Stop a job: a waiting one at once (its place in the queue freed), a running one at its next trace."""
        with self._ready:
            job = self._jobs.get(job_id)
            if job is None or job.state in FINISHED:
                return job
            job.cancel.set()
            if job in self._waiting:
                self._waiting.remove(job)
                self._finish(job, "cancelled")
        return job

    def stop(self) -> None:
        """Cancel every job (the server is stopping)."""
        with self._ready:
            for job in list(self._jobs.values()):
                if job.state not in FINISHED:
                    job.cancel.set()
            for job in self._waiting:
                self._finish(job, "cancelled")
            self._waiting.clear()

    def _forget_old(self) -> None:
        finished = [key for key, job in self._jobs.items() if job.state in FINISHED]
        for key in finished[:max(0, len(self._jobs) - KEPT_JOBS)]:
            del self._jobs[key]

    def _next(self) -> Job:
        with self._ready:
            while not self._waiting:
                self._ready.wait()
            job = self._waiting.popleft()
            job.state, job.started = "running", time.monotonic()
            return job

    def _work(self) -> None:
        if self._warm is not None:
            try:
                self._warm()
            except Exception:  # a plan will say what is missing; the worker stays
                log.exception("warming the planner failed")
        while True:
            job = self._next()
            try:
                self._runner(job)
                self._finish(job, "done")
            except Cancelled:
                self._finish(job, "cancelled")
            except MemfitError as error:
                job.error, job.status = "\n".join(messages(error)), 400
                self._finish(job, "failed")
            except BaseException as error:  # the worker outlives any plan: it answers, and logs the rest
                log.exception("plan %s stopped", job.id)
                job.error, job.status = f"memfit: error: the plan stopped: {type(error).__name__}: {error}", 500
                self._finish(job, "failed")

    @staticmethod
    def _finish(job: Job, state: str) -> None:
        job.state, job.finished_at = state, time.monotonic()
        if state == "cancelled":
            job.error, job.status = "memfit: error: the plan was cancelled", 409
        job.finished.set()
