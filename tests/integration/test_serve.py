"""``memfit serve``: the inputs, the JSON endpoint against ``memfit plan --json``, bad input, the queue, the
details the page shows, the command it prints, and the page itself in Chromium (skipped where none is installed)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from memfit.errors import ConfigError
from memfit.planner.allowed import Allowed
from memfit.planner.request import QUERY_KEYS, PlanRequest
from tests.conftest import write_tiny_llm
from tests.helpers import run_main, write_hub_cache

starlette = pytest.importorskip("starlette", reason="memfit serve needs the serve extra")
from starlette.testclient import TestClient  # noqa: E402

from memfit.serve.app import create_app, host_name, run_job  # noqa: E402
from memfit.serve.jobs import Busy, Job, Planner  # noqa: E402

pytestmark = pytest.mark.xdist_group("serve")  # one tiny model and one server for the module
SMALL = {"seq-len": "32", "effective-batch": "4", "device": "4090"}


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llm(tmp_path_factory.mktemp("serve") / "tiny-llm")


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    planner = Planner(run_job)
    planner.start()
    with TestClient(create_app(planner), base_url="http://127.0.0.1") as test_client:
        yield test_client


def test_the_query_string_takes_the_plan_commands_options() -> None:
    request = PlanRequest.from_query({"model": "llama-3.2-1b", "seq-len": "1024", "effective-batch": "16",
                                      "device": "t4", "budget": "8GiB", "margin": "10%", "allow-lora": "1",
                                      "allow-qlora": "", "allow-freeze": "0", "gpus": "", "precision": "fp16"})
    assert request == PlanRequest(model="llama-3.2-1b", seq_len=1024, effective_batch=16, device="t4",
                                  budget="8GiB", margin=0.1, precision="fp16", allow=Allowed(lora=True, qlora=True))
    assert PlanRequest.from_query(request.to_query()) == request


def test_each_bad_query_input_is_one_line() -> None:
    with pytest.raises(ConfigError) as raised:
        PlanRequest.from_query({"seq-len": "long", "task": "poetry", "allow-qlora": "maybe", "colour": "blue",
                                "margin": "70%"})
    assert raised.value.problems == [
        "seq-len='long' is not a whole number",
        "task='poetry': choose one of auto, classification, causal-lm, seq2seq",
        "allow-qlora='maybe': give 1 or 0",
        f"unknown input 'colour'; the inputs are {', '.join(QUERY_KEYS)}",
        "margin='70%' must be between 0 and 50%"]


def test_the_json_endpoint_answers_the_plan_commands_document(client: TestClient, tiny_llm: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    query = {"model": str(tiny_llm), **SMALL, "allow-lora": "1"}
    answer = client.get("/api/plan", params=query)
    assert answer.status_code == 200, answer.text
    words = [word for key, value in query.items() for word in (f"--{key}", value) if key != "allow-lora"]
    code, out, _ = run_main(["plan", *words, "--allow-lora", "--json"], capsys)
    assert code == 0
    served, printed = answer.json(), json.loads(out)
    assert served.pop("seconds") > 0 and printed.pop("seconds") > 0  # the time it took: the only difference
    assert served == printed
    assert served["chosen"] is not None and served["opt_ins"] == ["--allow-lora"]


@pytest.mark.parametrize("query", [
    {"seq-len": "abc"},
    {"model": "no-such-preset"},
    {"device": "gtx-9090"},
    {"budget": "lots"},
    {"effective-batch": "0"},
], ids=["not-a-number", "unknown-model", "unknown-device", "bad-budget", "zero-batch"])
def test_bad_input_is_http_400_with_the_commands_message(client: TestClient, tiny_llm: Path, query: dict[str, str],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    query = {"model": str(tiny_llm), **SMALL, **query}
    answer = client.get("/api/plan", params=query)
    assert answer.status_code == 400
    message = answer.json()["error"]
    assert message.startswith("memfit: error: ") and "Traceback" not in message
    if query["seq-len"] == "abc":
        assert message == "memfit: error: seq-len='abc' is not a whole number"
    elif query["device"] == "gtx-9090":  # the page takes a built-in profile only, never a file
        assert message.startswith("memfit: error: device='gtx-9090': choose one of 1080ti, 2080ti, ")
    else:  # these reach the planner: the same lines as the command's
        code, _, err = run_main(["plan", *(w for k, v in query.items() for w in (f"--{k}", v)), "--json"], capsys)
        assert code == 2 and err.strip() == message
    assert client.get("/api/options").status_code == 200  # the server goes on


def test_a_model_directory_is_read_never_run(client: TestClient, tmp_path: Path) -> None:
    own_code = tmp_path / "own-code"
    own_code.mkdir()
    marker = tmp_path / "ran"
    (own_code / "config.json").write_text(json.dumps({
        "model_type": "own-model", "auto_map": {"AutoConfig": "configuration_own.OwnConfig"}}))
    (own_code / "configuration_own.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    answer = client.get("/api/plan", params={"model": str(own_code), **SMALL})
    assert answer.status_code == 400 and not marker.exists()
    assert answer.json()["error"] == (
        f"memfit: error: --model {own_code}: its architecture is the repository's own code (auto_map in "
        "config.json), which memfit does not run; use a model whose architecture transformers ships")


def test_other_host_names_and_other_sites_are_refused(client: TestClient) -> None:
    with TestClient(create_app(Planner(run_job)), base_url="http://rebound.example") as other:
        assert other.get("/api/options").status_code == 400
    assert [host_name(h) for h in ("127.0.0.1:8000", "[::1]:8000", "localhost", "[::1]")] == [
        "127.0.0.1", "::1", "localhost", "::1"]
    for headers in ({"Origin": "http://elsewhere.example"}, {"Sec-Fetch-Site": "cross-site"}, {"Origin": "null"}):
        refused = client.post("/api/jobs", params={"model": "bert-base"}, headers=headers)
        assert refused.status_code == 403, headers
    same_page = {"Origin": "http://127.0.0.1", "Sec-Fetch-Site": "same-origin"}
    assert client.get("/api/options", headers=same_page).status_code == 200


def test_a_server_plans_only_built_in_cards_and_bounded_steps(tmp_path: Path) -> None:
    profile = tmp_path / "card.toml"
    profile.write_text("memory = '8GiB'\n")
    with pytest.raises(ConfigError) as raised:
        PlanRequest.from_query({"device": str(profile), "effective-batch": "100000", "seq-len": "1000"}, served=True)
    assert raised.value.problems[0].startswith(f"device={str(profile)!r}: choose one of 1080ti, ")
    assert raised.value.problems[1] == ("effective-batch x seq-len = 100,000,000 tokens per step; the page plans at "
                                        "most 16,777,216 (memfit plan has no such bound)")
    assert PlanRequest.from_query({"device": str(profile)}).device == str(profile)  # the command line reads files


def _waiting_runner(release: threading.Event) -> Any:
    def run(job: Job) -> None:
        while not release.wait(0.01):
            job.progress("full fine-tuning")  # cancelled here
        job.plan = {"verdict": "done"}
    return run


def test_a_full_queue_is_refused_and_a_cancelled_plan_stops() -> None:
    release = threading.Event()
    planner = Planner(_waiting_runner(release), limit=1)
    planner.start()
    running = planner.submit({}, details=False)
    _wait_for(lambda: running.state == "running")
    queued = planner.submit({}, details=False)
    with pytest.raises(Busy, match="1 plans are waiting already"):
        planner.submit({}, details=False)
    with TestClient(create_app(planner), base_url="http://127.0.0.1") as test_client:
        refused = test_client.post("/api/jobs", params={"model": "bert-base"})
        assert refused.status_code == 503 and refused.json()["error"].startswith("memfit: error: ")
        bad = test_client.get("/api/plan", params={"seq-len": "abc"})  # checked on arrival, not behind the queue
        assert bad.status_code == 400 and bad.json()["error"] == "memfit: error: seq-len='abc' is not a whole number"
        planner.cancel(queued.id)  # a waiting job leaves the queue at once, its place freed
        assert queued.state == "cancelled" and queued.traces == 0
        later = planner.submit({}, details=False)
        assert test_client.delete(f"/api/jobs/{running.id}").status_code == 200
        assert running.finished.wait(5) and running.state == "cancelled" and running.traces >= 1
        release.set()
        assert later.finished.wait(5) and later.state == "done" and later.plan == {"verdict": "done"}
        release.clear()
        last = planner.submit({}, details=False)
    assert last.finished.wait(5) and last.state == "cancelled"  # a stopping server cancels what it has


def test_a_failing_plan_is_one_line_and_the_next_one_runs() -> None:
    def run(job: Job) -> None:
        if job.query.get("fail"):
            raise RuntimeError("a kernel the trace does not know")
        job.plan = {"verdict": "fine"}

    planner = Planner(run)
    planner.start()
    failed = planner.submit({"fail": "1"}, details=False)
    assert failed.finished.wait(5) and failed.state == "failed" and failed.status == 500
    assert failed.error == "memfit: error: the plan stopped: RuntimeError: a kernel the trace does not know"
    fine = planner.submit({}, details=False)
    assert fine.finished.wait(5) and fine.plan == {"verdict": "fine"}


def test_the_page_job_shows_the_chosen_setups_own_peak_and_the_command_that_runs_it(client: TestClient,
                                                                                    tiny_llm: Path) -> None:
    submitted = client.post("/api/jobs", params={"model": str(tiny_llm), **SMALL, "budget": "2GiB"})
    assert submitted.status_code == 202
    job = _finished(client, submitted.json()["id"])
    assert job["state"] == "done", job["error"]
    chosen, memory = job["plan"]["chosen"], job["memory"]
    assert memory["which"] == "chosen" and memory["budget_bytes"] == 2 * 2**30
    assert memory["predicted_peak_bytes"] == chosen["predicted_peak_bytes"]  # one more trace, the same figure
    allocated = sum(value for key, value in memory["breakdown"].items()
                    if key not in ("allocator_reserve", "non_pytorch"))
    assert memory["timeline"]["peak_bytes"] == allocated
    assert {phase["name"] for phase in memory["timeline"]["phases"]} >= {"forward", "backward", "optimizer"}
    words = shlex.split(memory["train_command"])
    assert words[:2] == ["memfit", "train"]
    assert words[words.index("--micro-batch-size") + 1] == str(chosen["micro_batch_size"])
    assert "TrainingArguments(" in memory["trainer"]


def test_where_nothing_fits_the_page_shows_the_least_need_and_no_command(tiny_llm: Path) -> None:
    from memfit.planner.details import plan_details
    from memfit.planner.request import PlanRequest

    request = PlanRequest.from_query({"model": str(tiny_llm), **SMALL, "budget": "300MiB"})
    from memfit.planner import plan

    made = plan(request.config(), device=request.device, budget=request.budget, seq_len=request.seq_len,
                suggest=False)
    assert made.chosen is None
    details = plan_details(made, request)
    assert details is not None and details.which == "least need" and details.train_command is None
    least = min((c for c in made.candidates if c.exact), key=lambda c: c.predicted_peak_bytes or 0)
    assert least.accumulation_steps > 2
    # the plan traces a window of two micro-steps and adds the other inputs; the details trace the whole window:
    # the same allocated bytes, and an allocator reserve that may absorb those inputs
    allocated = sum(value for key, value in details.breakdown.items() if key not in ("allocator_reserve",
                                                                                       "non_pytorch"))
    assert allocated == least.predicted_allocated_bytes
    assert details.usable_bytes < details.predicted_peak_bytes <= (least.predicted_peak_bytes or 0)


def test_serve_refuses_a_port_in_use_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        code, out, err = run_main(["serve", "--port", str(taken.getsockname()[1])], capsys)
    assert code == 2 and out == ""
    assert err.startswith("memfit: error: cannot listen on 127.0.0.1:") and err.count("\n") == 1


def test_serving_beyond_this_machine_warns(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    import uvicorn

    import memfit.serve

    def loopback(host: str, port: int) -> socket.socket:  # no socket on another interface in a test
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        return listener

    monkeypatch.setattr(memfit.serve, "_listen", loopback)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)
    code, out, err = run_main(["serve", "--host", "0.0.0.0", "--port", "0"], capsys)
    assert code == 0 and out.startswith("memfit serve: http://0.0.0.0:")
    assert err.startswith("memfit: warning: serving on 0.0.0.0: anyone who can reach this machine")


# --- the page in a browser -------------------------------------------------------------------------------------
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HUB_MODEL = "tiny-org/tiny-llama"


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    import uvicorn

    planner = Planner(run_job)
    planner.start()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    server = uvicorn.Server(uvicorn.Config(create_app(planner), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    _wait_for(lambda: server.started)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here (make install gets Debian's chromium with apt)")
def test_the_page_plans_in_a_browser(server_url: str, tiny_llm: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # the model by its Hub id, from the cache, offline
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_hub_cache(tmp_path / "hf-home", HUB_MODEL, tiny_llm)
    errors: list[str] = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(server_url)
        # offered, it is cached: the page fills its list from /api/options after loading, so wait for it
        page.wait_for_selector(f"#models option[value='{HUB_MODEL}']", state="attached", timeout=30_000)
        assert page.locator(f"#models option[value='{HUB_MODEL}']").count() == 1
        page.fill("input[name=model]", HUB_MODEL)
        page.fill("input[name=seq-len]", SMALL["seq-len"])
        page.fill("input[name=effective-batch]", SMALL["effective-batch"])
        page.select_option("select[name=device]", "1080ti")
        page.fill("input[name=budget]", "460MiB")  # a budget the tiny model nearly fills: a readable bar
        page.click("#plan-button")
        page.wait_for_selector("body[data-state=done]", timeout=120_000)
        verdict = page.inner_text("#verdict")
        assert "fits" in verdict and page.locator("#candidates tbody tr").count() >= 2
        assert page.locator("#candidates tr.chosen").count() == 1
        assert page.locator("#breakdown rect[data-part=parameters]").count() == 1
        assert page.locator("#timeline polyline").count() == 1
        assert page.locator("#timeline rect[data-phase=backward]").count() >= 1
        assert page.inner_text("#train-command").startswith(f"memfit train --model {HUB_MODEL}")
        page.screenshot(path=tmp_path / "serve.png", full_page=True)
        if os.environ.get("MEMFIT_SCREENSHOT"):  # the README's picture: MEMFIT_SCREENSHOT=docs/images/serve.png
            shutil.copy(tmp_path / "serve.png", os.environ["MEMFIT_SCREENSHOT"])
        shared = page.url  # the inputs are in the URL: opening it plans the same again
        assert "seq-len=32" in shared and "device=1080ti" in shared and "budget=460MiB" in shared
        again = browser.new_page()
        again.goto(shared)
        again.wait_for_selector("body[data-state=done]", timeout=120_000)
        assert again.inner_text("#verdict") == verdict
        assert again.input_value("input[name=model]") == HUB_MODEL
        browser.close()
    assert errors == []


def _finished(test_client: TestClient, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job: dict[str, Any] = test_client.get(f"/api/jobs/{job_id}").json()
        if job["state"] in ("done", "failed", "cancelled"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"plan {job_id} did not finish")


def _wait_for(condition: Any, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
