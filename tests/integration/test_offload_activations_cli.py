"""``--offload-activations`` through the CLI: refused on a CPU device in one line, estimated for a CUDA card."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import write_tiny_llm
from tests.helpers import in_process, run_main

REFUSAL = ("--offload-activations moves saved activations from a CUDA card to host memory; on a cpu device they "
           "are in host memory already: drop --offload-activations")


@pytest.mark.parametrize("command", [["train", "--device", "cpu"], ["estimate"]])
def test_a_cpu_device_is_refused_in_one_line_and_nothing_is_written(command: list[str], tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    model = write_tiny_llm(tmp_path / "llm")
    result = in_process([*command, "--model", str(model), "--offload-activations"], capsys, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"memfit: error: {REFUSAL}"]
    assert not (tmp_path / "runs").exists()


def test_a_cuda_card_keeps_fewer_activations_and_the_host_holds_them(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # the table's lines unwrapped, whatever the terminal the tests run in
    model = write_tiny_llm(tmp_path / "llm")
    common = ["estimate", "--model", str(model), "--device", "4090", "--batch-size", "2", "--seq-len", "64",
              "--precision", "bf16", "--json"]
    results = {}
    for flag in ("--no-offload-activations", "--offload-activations"):
        code, out, err = run_main([*common, flag], capsys)
        assert code == 0, err
        results[flag] = json.loads(out)
    kept, offloaded = results["--no-offload-activations"], results["--offload-activations"]
    assert offloaded["config"]["offload_activations"] is True
    assert offloaded["breakdown"]["activations"] < kept["breakdown"]["activations"] / 10
    assert offloaded["peak_bytes"] <= kept["peak_bytes"] and kept["host_bytes"] == 0
    assert offloaded["host_bytes"] == offloaded["host_breakdown"]["offloaded_activations"] > 0
    code, out, _ = run_main([*common[:-1], "--offload-activations"], capsys)  # the table names the host line
    assert code == 0 and "host memory (offloaded activations)" in out and "activations offloaded" in out
