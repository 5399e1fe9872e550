"""How fast ``memfit serve`` starts, and whether it plans a preset as fast as ``memfit plan`` does.

Starts ``memfit serve --port 0`` as a user would, times until the page answers, then asks ``/api/plan`` for each
preset plan and runs ``memfit plan --json`` with the same inputs (each in a fresh process for the command, the
server kept warm as a page keeps it): wall seconds of each, and whether the two documents are equal but for their
``seconds``. Prints a table and writes JSON:

    .venv/bin/python benchmarks/serve_speed.py --json benchmarks/results/serve_cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

PLANS: dict[str, dict[str, str]] = {
    "bert-base S128 eb32 1080ti": {"model": "bert-base", "seq-len": "128", "effective-batch": "32",
                                   "device": "1080ti"},
    "smollm2-135m S512 eb16 1080ti": {"model": "smollm2-135m", "seq-len": "512", "effective-batch": "16",
                                      "device": "1080ti"},
}


def start_server() -> tuple[subprocess.Popen[str], str, float]:
    """``memfit serve --port 0``: the process, its URL and the seconds until its page answered."""
    started = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "memfit", "serve", "--port", "0"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    assert server.stdout is not None
    line = server.stdout.readline()
    url = line.split()[2]
    with urllib.request.urlopen(url, timeout=30) as answer:
        assert answer.status == 200
    return server, url, time.perf_counter() - started


def served_plan(url: str, query: dict[str, str]) -> tuple[dict[str, Any], float]:
    started = time.perf_counter()
    with urllib.request.urlopen(f"{url}api/plan?{urllib.parse.urlencode(query)}", timeout=1800) as answer:
        document: dict[str, Any] = json.loads(answer.read())
    return document, time.perf_counter() - started


def command_plan(query: dict[str, str]) -> tuple[dict[str, Any], float]:
    words = [word for key, value in query.items() for word in (f"--{key}", value)]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "memfit", "plan", *words, "--json"], capture_output=True,
                          text=True, check=False)
    seconds = time.perf_counter() - started
    return json.loads(done.stdout), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    server, url, startup = start_server()
    rows: list[dict[str, Any]] = []
    try:
        time.sleep(5)  # the worker imports the planner once the page answers; a user's first click comes later
        for name, query in PLANS.items():
            served, served_seconds = served_plan(url, query)
            printed, command_seconds = command_plan(query)
            equal = {k: v for k, v in served.items() if k != "seconds"} == {
                k: v for k, v in printed.items() if k != "seconds"}
            rows.append({"plan": name, "query": query, "served_seconds": round(served_seconds, 1),
                         "command_seconds": round(command_seconds, 1), "equal": equal, "traces": served["traces"],
                         "verdict": served["verdict"]})
    finally:
        server.terminate()
        server.wait(10)
    print(f"memfit serve: page answered {startup:.2f} s after start")
    print("| plan | /api/plan (warm server) | memfit plan --json (new process) | traces | same document |")
    print("|---|---:|---:|---:|---|")
    for row in rows:
        print(f"| {row['plan']} | {row['served_seconds']} s | {row['command_seconds']} s | {row['traces']} | "
              f"{'yes' if row['equal'] else 'NO'} |")
    if args.json:
        args.json.write_text(json.dumps({"startup_seconds": round(startup, 2), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
