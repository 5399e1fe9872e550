"""``memfit serve``: the planner as a local web page (the ``serve`` extra: Starlette and uvicorn).

Pick a model, a card and what the plan may change; the page shows each setup the plan weighed (fits or not, its
peak, its speed, why), the chosen setup's memory as a stacked bar against the card and over the traced steps, and
what to run. Its inputs live in the URL, so a link reproduces the page. The page calls the same code as ``memfit
plan`` (:class:`memfit.planner.request.PlanRequest`): ``/api/plan`` answers ``memfit plan --json``'s document.

Why this stack: Starlette (routing, static files, a test client) and uvicorn (the server) are small, maintained
and start in a fraction of a second; the planner's own checks validate the inputs, so no validation framework is
needed. The page is one HTML file, a style sheet and a script that draws its two charts as SVG (a stacked bar and a
line): a charting library would outweigh the page, and every asset ships in the package, so nothing is fetched at
run time.

Safety: it listens on 127.0.0.1 unless ``--host`` says otherwise (then it warns); it answers only to the host
names it listens on, and its API only to its own page (:class:`memfit.serve.app.LocalOnly`); a model directory
given on the page is read (its config and tokenizer files), never run; each input is checked when it arrives and
bad input answered with the command line's one-line message (HTTP 400); plans run one at a time off the request
thread, from a bounded queue (:mod:`memfit.serve.jobs`).
"""

from __future__ import annotations

import importlib.util
import ipaddress
import socket
import sys
import warnings

from memfit.errors import ConfigError

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def serve(*, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, queue_limit: int | None = None) -> int:
    """Serve the page until interrupted (Ctrl-C)."""
    missing = [name for name in ("starlette", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"memfit serve needs {' and '.join(missing)}: pip install 'memfit[serve]'")
    if queue_limit is not None and queue_limit < 1:
        raise ConfigError(f"--queue {queue_limit}: at least 1 plan must be able to wait")
    listener = _listen(host, port)
    import uvicorn

    from memfit.serve.app import LOOPBACK_NAMES, create_app, run_job, warm
    from memfit.serve.jobs import QUEUE_LIMIT, Planner

    warnings.simplefilter("ignore")  # the libraries' warnings are not the page's: memfit reports in its words
    if not is_loopback(host):
        sys.stderr.write(f"memfit: warning: serving on {host}: anyone who can reach this machine can run plans "
                         "here and name model directories on it; the default 127.0.0.1 keeps it to this machine\n")
    planner = Planner(run_job, limit=queue_limit or QUEUE_LIMIT, warm=warm)
    hosts = tuple(dict.fromkeys((*LOOPBACK_NAMES, host.strip("[]")))) if is_loopback(host) else None
    app = create_app(planner, hosts=hosts)
    bound = listener.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    print(f"memfit serve: http://{shown}:{bound}/ (Ctrl-C stops it)", flush=True)
    planner.start()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2))
    server.run(sockets=[listener])
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound now, so a port in use is one clear line before anything starts."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port}: choose a port between 1 and 65535 (0: any free one)")
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host.strip("[]"), port))
    except OSError as error:
        listener.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({error.strerror}); choose another --port or --host") \
            from None
    listener.listen(64)
    return listener
