"""The page's server: a Starlette app over :class:`~memfit.serve.jobs.Planner`.

Routes:

- ``GET /``: the page (``static/``, every asset in the package; nothing is fetched from elsewhere).
- ``GET /api/options``: what the page offers (presets, cached Hub models, device profiles, tasks, opt-ins).
- ``GET /api/plan?INPUTS``: ``memfit plan --json``'s document for the same inputs (waits for the plan); bad
  inputs: HTTP 400 with the command line's message, a full queue: 503.
- ``POST /api/jobs?INPUTS``: queue a plan for the page (202 and its id); ``GET /api/jobs/ID``: its progress, its
  plan and then its details (:mod:`memfit.planner.details`); ``DELETE /api/jobs/ID``: cancel it.

INPUTS are ``memfit plan``'s options without their dashes (:mod:`memfit.planner.request`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from importlib import resources
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from memfit.errors import MemfitError, messages
from memfit.serve.jobs import Busy, Cancelled, Job, Planner

if TYPE_CHECKING:
    from memfit.planner.request import PlanRequest

SECURITY_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:",
                    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
"""The page loads nothing from elsewhere, and says so to the browser."""
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
WAIT_POLL_SECONDS = 0.2


def run_job(job: Job) -> None:
    """A job's plan, then (for the page) the shown setup's memory and commands: the command line's code path."""
    from memfit.planner.details import plan_details
    from memfit.quiet import quiet_transformers

    request = job.request if job.request is not None else checked(job.query)
    with quiet_transformers():
        made = request.run(progress=job.progress)
        job.plan = made.to_dict()
        if job.details:
            job.state = "planned"
            if job.cancel.is_set():
                raise Cancelled
            details = plan_details(made, request)
            job.memory = details.to_dict() if details is not None else None


def checked(query: dict[str, str]) -> PlanRequest:
    """The page's inputs as a plan's (:meth:`PlanRequest.from_query`), within the server's bounds."""
    from memfit.planner.request import PlanRequest

    return PlanRequest.from_query(query, served=True)


def warm() -> None:
    """Import the planner (torch, transformers) once the server listens, so the first plan does not wait for it."""
    import memfit.planner.details  # noqa: F401


def options() -> dict[str, Any]:
    """What the page's inputs offer."""
    from memfit.config import PRECISIONS, TASKS, TrainConfig
    from memfit.devices import PROFILES
    from memfit.hub import cached_models
    from memfit.names import LLM_PRESETS, PRESETS
    from memfit.options import OPT_IN_HELP

    defaults = TrainConfig()
    return {"presets": list(PRESETS), "llm_presets": list(LLM_PRESETS),
            "cached": [model["repo_id"] for model in cached_models()],
            "profiles": [{"name": p.name, "description": p.description, "memory_bytes": p.memory_bytes}
                         for p in PROFILES.values() if p.kind == "cuda"],
            "tasks": list(TASKS), "precisions": list(PRECISIONS),
            "opt_ins": [{"key": flag.removeprefix("--"), "help": text} for flag, text in OPT_IN_HELP.items()],
            "defaults": {"model": defaults.model, "seq-len": defaults.max_length,
                         "effective-batch": defaults.effective_batch, "device": "1080ti"}}


def create_app(planner: Planner, *, hosts: tuple[str, ...] | None = LOOPBACK_NAMES) -> Starlette:
    """The app; ``hosts``: the host names it answers to (``None``: any), see :class:`LocalOnly`."""

    async def index(request: Request) -> Response:
        page = resources.files("memfit.serve").joinpath("static/index.html").read_text(encoding="utf-8")
        return HTMLResponse(page, headers=SECURITY_HEADERS)

    async def api_options(request: Request) -> Response:
        return _json(await asyncio.to_thread(options))

    async def queued(request: Request, *, details: bool) -> Job | Response:
        query = dict(request.query_params)
        try:
            checked_request = await asyncio.to_thread(checked, query)
            return planner.submit(query, details=details, request=checked_request)
        except MemfitError as error:
            return _json({"error": "\n".join(messages(error))}, 400)
        except Busy as busy:
            return _json({"error": f"memfit: error: {busy}"}, 503)

    async def api_plan(request: Request) -> Response:
        job = await queued(request, details=False)
        if isinstance(job, Response):
            return job
        while not job.finished.is_set():  # no thread held while it waits; a client that leaves cancels it
            if await request.is_disconnected():
                planner.cancel(job.id)
                return _json({"error": "memfit: error: the plan was cancelled"}, 409)
            await asyncio.sleep(WAIT_POLL_SECONDS)
        if job.state != "done":
            return _json({"error": job.error}, job.status)
        return _json(job.plan)

    async def submit(request: Request) -> Response:
        job = await queued(request, details=True)
        return job if isinstance(job, Response) else _json(job.view(), 202)

    async def job_view(request: Request) -> Response:
        job = planner.get(request.path_params["job_id"])
        if job is None:
            return _json({"error": "memfit: error: no such plan (finished plans are kept a while)"}, 404)
        return _json(job.view())

    async def cancel(request: Request) -> Response:
        job = planner.cancel(request.path_params["job_id"])
        if job is None:
            return _json({"error": "memfit: error: no such plan"}, 404)
        return _json(job.view())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        planner.stop()

    routes = [Route("/", index), Route("/api/options", api_options), Route("/api/plan", api_plan),
              Route("/api/jobs", submit, methods=["POST"]),
              Route("/api/jobs/{job_id}", job_view, methods=["GET"]),
              Route("/api/jobs/{job_id}", cancel, methods=["DELETE"]),
              Mount("/static", StaticFiles(packages=[("memfit.serve", "static")]), name="static")]
    return Starlette(routes=routes, middleware=[Middleware(LocalOnly, hosts=hosts)], lifespan=lifespan)


class LocalOnly:
    """Answers only requests addressed to a name it serves (``hosts``; a page on 127.0.0.1 refuses other names, so
    another web site cannot reach it through a name that resolves here) and, on the API, only its own page's
    (a request another site's page makes, by its ``Sec-Fetch-Site`` or ``Origin``, is refused)."""

    def __init__(self, app: ASGIApp, *, hosts: tuple[str, ...] | None) -> None:
        self.app, self.hosts = app, hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope["headers"]}
            host = headers.get("host", "")
            refusal = None
            if self.hosts is not None and host_name(host) not in self.hosts:
                refusal = (400, f"memfit: error: this server answers to {', '.join(self.hosts)}, not {host!r}")
            elif scope["path"].startswith("/api/") and _cross_site(headers, host):
                refusal = (403, "memfit: error: the API answers memfit's own page, not another site's")
            if refusal is not None:
                await _json({"error": refusal[1]}, refusal[0])(scope, receive, send)
                return
        await self.app(scope, receive, send)


def host_name(host: str) -> str:
    """The name of a ``Host`` header, without its port (``[::1]:8000`` -> ``::1``)."""
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _cross_site(headers: dict[str, str], host: str) -> bool:
    if headers.get("sec-fetch-site") == "cross-site":
        return True
    origin = headers.get("origin")
    return origin is not None and urlsplit(origin).netloc != host


def _json(document: Any, status: int = 200) -> Response:
    """JSON as ``memfit plan --json`` prints it (``json.dumps``)."""
    return Response(json.dumps(document), status_code=status, media_type="application/json",
                    headers=SECURITY_HEADERS)
