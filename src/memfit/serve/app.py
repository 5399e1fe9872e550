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
import json
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from memfit.serve.jobs import Busy, Job, Planner

SECURITY_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:",
                    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
"""The page loads nothing from elsewhere, and says so to the browser."""
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1", "[::1]")


def run_job(job: Job) -> None:
    """A job's plan, then (for the page) the shown setup's memory and commands: the command line's code path."""
    from memfit.planner.details import plan_details
    from memfit.planner.request import PlanRequest
    from memfit.quiet import quiet_transformers

    request = PlanRequest.from_query(job.query)
    with quiet_transformers():
        made = request.run(progress=job.progress)
        job.plan = made.to_dict()
        if job.details:
            job.state = "planned"
            details = plan_details(made, request)
            job.memory = details.to_dict() if details is not None else None


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


def create_app(planner: Planner, *, hosts: tuple[str, ...] = LOOPBACK_NAMES) -> Starlette:
    """The app; ``hosts``: the host names it answers to (a page on 127.0.0.1 refuses other names, so another site
    cannot reach it through a name that resolves here)."""

    async def index(request: Request) -> Response:
        page = resources.files("memfit.serve").joinpath("static/index.html").read_text()
        return HTMLResponse(page, headers=SECURITY_HEADERS)

    async def api_options(request: Request) -> Response:
        return _json(await asyncio.to_thread(options))

    async def api_plan(request: Request) -> Response:
        try:
            job = planner.submit(dict(request.query_params), details=False)
        except Busy as busy:
            return _json({"error": f"memfit: error: {busy}"}, 503)
        await asyncio.to_thread(job.finished.wait)
        if job.state != "done":
            return _json({"error": job.error or "memfit: error: the plan was cancelled"}, job.status)
        return _json(job.plan)

    async def submit(request: Request) -> Response:
        try:
            job = planner.submit(dict(request.query_params), details=True)
        except Busy as busy:
            return _json({"error": f"memfit: error: {busy}"}, 503)
        return _json(job.view(), 202)

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

    routes = [Route("/", index), Route("/api/options", api_options), Route("/api/plan", api_plan),
              Route("/api/jobs", submit, methods=["POST"]),
              Route("/api/jobs/{job_id}", job_view, methods=["GET"]),
              Route("/api/jobs/{job_id}", cancel, methods=["DELETE"]),
              Mount("/static", StaticFiles(packages=[("memfit.serve", "static")]), name="static")]
    middleware = [] if "*" in hosts else [Middleware(TrustedHostMiddleware, allowed_hosts=list(hosts))]
    return Starlette(routes=routes, middleware=middleware)


def _json(document: Any, status: int = 200) -> Response:
    """JSON as ``memfit plan --json`` prints it (``json.dumps``)."""
    return Response(json.dumps(document), status_code=status, media_type="application/json",
                    headers=SECURITY_HEADERS)
