"""``benchmarks/gpu_check.sh --dry-run``: the GPU check's steps on this CPU at tiny sizes, and what it returns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a minute or more of CPU: outside make test-fast

ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_returns_three_files_with_every_step_in_them(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    files = sorted(path.name for path in (tmp_path / "out").iterdir())
    assert files == ["results.tar.gz", "summary.json", "summary.md"]  # a GPU run returns at most 8 files
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["dry_run"] is True
    assert [(step["step"], step["status"]) for step in summary["steps"]] == [
        ("tests_gpu", "ok"), ("validate_estimator", "ok"), ("bench_data", "ok"), ("bench", "ok")]
    assert summary["validation"]["measured_rows"] == 5
    assert summary["validation"]["worst_allocated_error_percent"] == 0.0  # on CPU the estimate is exact
    assert [row["setup"] for row in summary["bench"]] == ["FP32 baseline", "int8 inference (FP32 baseline's model)",
                                                          "memfit plan (fp32, 32 x 1)"]
    with tarfile.open(tmp_path / "out" / "results.tar.gz") as archive:
        names = set(archive.getnames())
    assert {"results/validate_estimator.json", "results/bench/bench.json", "results/bench.log",
            "results/tests_gpu.log", "steps.tsv"} <= names
    assert "memfit GPU check (dry run on CPU)" in (tmp_path / "out" / "summary.md").read_text()
