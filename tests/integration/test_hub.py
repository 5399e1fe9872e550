"""Hub ids (``org/name[@revision]``) from a Hugging Face cache built by hand in a temporary ``HF_HOME``, offline:
``estimate``, ``plan``, ``train``, ``generate`` and ``models`` resolve it, and every failure is one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import transformers

from memfit import hub
from memfit.errors import ConfigError
from tests.conftest import write_pairs, write_tiny_llm
from tests.helpers import HUB_COMMIT, in_process, write_hub_cache

COMMIT = HUB_COMMIT
REPO = "tiny-org/tiny-llm"


@pytest.fixture(scope="module")
def pretrained_llm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved as a Hub repository would hold it: config, safetensors weights, tokenizer files."""
    directory = write_tiny_llm(tmp_path_factory.mktemp("source") / "tiny-llm")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(directory)))
    model.save_pretrained(str(directory))
    assert (directory / "model.safetensors").is_file()
    return directory


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


ESTIMATE = ["estimate", "--task", "causal-lm", "--batch-size", "2", "--seq-len", "16", "--device", "4090", "--json"]


def test_an_estimate_reads_the_config_from_the_cache_and_equals_the_local_directory_s(
        hf_home: Path, pretrained_llm: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_hub_cache(hf_home, REPO, pretrained_llm, files=("config.json", "tokenizer_config.json"))  # no weights
    from_hub = in_process([*ESTIMATE, "--model", REPO], capsys)
    assert from_hub.returncode == 0, from_hub.stderr
    local = in_process([*ESTIMATE, "--model", str(pretrained_llm)], capsys)
    assert json.loads(from_hub.stdout)["peak_bytes"] == json.loads(local.stdout)["peak_bytes"] > 0
    by_commit = in_process([*ESTIMATE, "--model", f"{REPO}@{COMMIT}"], capsys)  # a revision as a commit hash
    assert by_commit.returncode == 0, by_commit.stderr
    assert json.loads(by_commit.stdout)["peak_bytes"] == json.loads(local.stdout)["peak_bytes"]


def test_a_plan_resolves_a_hub_id(hf_home: Path, pretrained_llm: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_hub_cache(hf_home, REPO, pretrained_llm, files=("config.json",))
    result = in_process(["plan", "--model", REPO, "--task", "causal-lm", "--seq-len", "16", "--effective-batch", "4",
                         "--device", "4090", "--json"], capsys)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["chosen"] is not None


def test_train_and_generate_load_the_cached_snapshot(hf_home: Path, pretrained_llm: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    write_hub_cache(hf_home, REPO, pretrained_llm)
    data = write_pairs(tmp_path / "pairs.jsonl", count=16)
    out = tmp_path / "run"
    trained = in_process(["train", "--model", REPO, "--data", str(data), "--max-length", "32", "--effective-batch",
                          "4", "--max-steps", "2", "--precision", "fp32", "--output-dir", str(out), "--json"], capsys)
    assert trained.returncode == 0, trained.stderr
    summary = json.loads(trained.stdout)
    assert summary["task"] == "causal-lm" and summary["optimizer_steps"] == 2
    assert summary["config"]["model"] == REPO  # the run names the model as the user did
    generated = in_process(["generate", REPO, "--prompt", "review : great . verdict ?", "--max-new-tokens", "2"],
                           capsys)
    assert generated.returncode == 0 and generated.stdout.strip(), generated.stderr


@pytest.mark.parametrize("command", ["train", "bench"])
def test_a_run_of_a_model_whose_weights_are_not_cached_offline_says_so(
        hf_home: Path, pretrained_llm: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    snapshot = write_hub_cache(hf_home, REPO, pretrained_llm, files=("config.json", "tokenizer_config.json"))
    out = tmp_path / "run"
    result = in_process([command, "--model", REPO, "--data", str(write_pairs(tmp_path / "p.jsonl")),
                         "--output-dir", str(out)], capsys)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"memfit: error: --model {REPO}: the cached snapshot {snapshot} lacks its weights (safetensors) or tokenizer "
        "files, and HF_HUB_OFFLINE is set; unset HF_HUB_OFFLINE to download it, or pass a local model directory"]
    assert not out.exists()


def test_offline_and_not_cached_is_one_line_and_writes_nothing(hf_home: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    result = in_process([*ESTIMATE, "--model", "nobody/nothing"], capsys)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"memfit: error: --model nobody/nothing: it is not in the local cache {hf_home / 'hub'} (and no "
        "local directory has that name), and HF_HUB_OFFLINE is set; unset HF_HUB_OFFLINE to download it, or pass "
        "a local model directory"]


def test_a_revision_that_is_not_cached_names_the_cached_ones(hf_home: Path, pretrained_llm: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    write_hub_cache(hf_home, REPO, pretrained_llm, files=("config.json",))
    write_hub_cache(hf_home, REPO, pretrained_llm, files=("config.json",), ref="v1.0")
    result = in_process([*ESTIMATE, "--model", f"{REPO}@v2.0"], capsys)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"memfit: error: --model {REPO}@v2.0: revision 'v2.0' is not in the local cache (cached: main, v1.0), "
        "and HF_HUB_OFFLINE is set; unset HF_HUB_OFFLINE to download it, or pass a local model directory"]


def _hub_failure(kind: type[Exception]) -> Exception:
    return kind("from the Hub", response=mock.Mock(headers={}, status_code=404))  # type: ignore[call-arg]


@pytest.mark.parametrize(("failure", "line"), [
    ("GatedRepoError", "the repository is gated; accept its terms on huggingface.co/org/gated and log in with "
                       "`hf auth login` or set HF_TOKEN"),
    ("RepositoryNotFoundError", "no such repository on the Hub (or it is private: log in with `hf auth login` or "
                                "set HF_TOKEN); a local model directory works too"),
    ("RevisionNotFoundError", "the repository has no revision 'main'; name a branch, a tag or a commit of org/gated"),
])
def test_online_failures_name_the_fix(hf_home: Path, monkeypatch: pytest.MonkeyPatch, failure: str,
                                      line: str) -> None:
    from huggingface_hub import errors

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    raised = _hub_failure(getattr(errors, failure))
    with mock.patch("huggingface_hub.snapshot_download", side_effect=raised) as download, \
            pytest.raises(ConfigError) as caught:
        hub.resolve(hub.HubModel("org/gated", "main"), weights=False)
    assert caught.value.problems == [f"--model org/gated: {line}"]
    assert download.call_args.kwargs["allow_patterns"] == list(hub.CONFIG_FILES)  # configs only, never weights
    assert download.call_args.kwargs["cache_dir"] == hf_home / "hub"


def test_online_a_missing_file_is_downloaded_into_the_cache(hf_home: Path, pretrained_llm: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Cache first: a complete snapshot makes no request; an incomplete one asks for safetensors, never pickles."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    calls: list[dict[str, Any]] = []

    def download(repo_id: str, **kwargs: Any) -> str:
        calls.append(kwargs)
        return str(write_hub_cache(hf_home, repo_id, pretrained_llm))  # what the Hub would complete

    snapshot = write_hub_cache(hf_home, REPO, pretrained_llm, files=("config.json",))
    with mock.patch("huggingface_hub.snapshot_download", side_effect=download):
        assert hub.resolve(hub.HubModel(REPO, "main"), weights=False) == snapshot
        assert calls == []
        assert hub.resolve(hub.HubModel(REPO, "main"), weights=True) == snapshot
    assert [call["allow_patterns"] for call in calls] == [list(hub.SNAPSHOT_PATTERNS)]
    assert not any(pattern.endswith(".bin") for pattern in hub.SNAPSHOT_PATTERNS)
    assert (snapshot / "model.safetensors").is_file()


def test_models_lists_the_cached_models(hf_home: Path, pretrained_llm: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    write_hub_cache(hf_home, REPO, pretrained_llm)
    write_hub_cache(hf_home, "other/config-only", pretrained_llm, files=("config.json",))
    result = in_process(["models"], capsys)
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert "smollm2-135m" in lines and "llama-3.1-8b" in lines  # the presets first
    heading = next(index for index, line in enumerate(lines) if "local Hugging Face cache" in line)
    cached = [line.split() for line in lines[heading + 1:]]
    assert ["other/config-only", "main", "config", "only"] in [row[:4] for row in cached]
    assert [REPO, "main"] in [row[:2] for row in cached]


@pytest.mark.parametrize("name", ["./tiny-org/tiny-llm", "not a/hub id", "a/b/c"])
def test_names_that_are_not_hub_ids(name: str) -> None:
    assert hub.parse_hub_id(name) is None


def test_a_hub_id_and_revision_parse() -> None:
    assert hub.parse_hub_id("meta-llama/Llama-3.2-1B@refs/pr/3") == hub.HubModel("meta-llama/Llama-3.2-1B",
                                                                                  "refs/pr/3")
    assert hub.parse_hub_id("Qwen/Qwen2.5-0.5B") == hub.HubModel("Qwen/Qwen2.5-0.5B", "main")


def test_the_trainer_planning_helper_takes_a_hub_id(hf_home: Path, pretrained_llm: Path) -> None:
    from memfit.integrations.trainer_plan import plan_trainer_arguments

    write_hub_cache(hf_home, REPO, pretrained_llm, files=("config.json",))
    made = plan_trainer_arguments(REPO, budget="2GiB", effective_batch=4, seq_len=16, device="4090")
    assert made.plan.chosen is not None and made.plan.config["model"] == REPO
    assert made.training_arguments["per_device_train_batch_size"] * made.training_arguments[
        "gradient_accumulation_steps"] == 4
    with pytest.raises(ConfigError, match="name the card to plan for"):
        plan_trainer_arguments(REPO, budget="64MiB", effective_batch=4, seq_len=16)
