"""Summarise a benchmarks/gpu_check.sh run: ``summary.md`` and ``summary.json`` in the output directory.

Reads the run's work directory: ``steps.tsv`` (name, exit code, seconds per step), ``results/device.txt``,
``results/validate_estimator.json``, ``results/validate_offload.json`` (activation offload rows, with
their host bytes) and ``results/bench/bench.json``. Exits 1 when a step failed.

    python benchmarks/gpu_summary.py WORK_DIR OUT_DIR [--dry-run]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from memfit.report import format_bytes

TIMED_OUT = (124, 137)
VALIDATIONS = ("validate_estimator.json", "validate_offload.json", "validate_lowmem.json")


def steps(work: Path) -> list[dict[str, Any]]:
    rows = []
    for line in (work / "steps.tsv").read_text().splitlines():
        name, code, seconds = line.split("\t")
        status = "ok" if code == "0" else "timed out" if int(code) in TIMED_OUT else f"failed (exit {code})"
        rows.append({"step": name, "exit_code": int(code), "status": status, "seconds": int(seconds)})
    return rows


def validation(work: Path) -> dict[str, Any] | None:
    paths = [work / "results" / name for name in VALIDATIONS if (work / "results" / name).is_file()]
    if not paths:
        return None
    rows = [row for path in paths for row in json.loads(path.read_text())["rows"]
            if isinstance(row["allocated_error_percent"], float)]
    if not rows:
        return {"measured_rows": 0}
    worst = max(rows, key=lambda row: abs(row["allocated_error_percent"]))
    worst_reserved = max(rows, key=lambda row: abs(row["reserved_error_percent"]))
    return {"measured_rows": len(rows), "worst_allocated_error_percent": worst["allocated_error_percent"],
            "worst_allocated_case": case_name(worst),
            "worst_reserved_error_percent": worst_reserved["reserved_error_percent"],
            "worst_reserved_case": case_name(worst_reserved),
            "rows": [{"case": case_name(row), "allocated_error_percent": row["allocated_error_percent"],
                      "reserved_error_percent": row["reserved_error_percent"],
                      **({"predicted_host_bytes": row.get("predicted_host_bytes"),
                          "measured_host_bytes": row.get("measured_host_bytes")}
                         if row.get("offload_activations") else {})} for row in rows]}


def case_name(row: dict[str, Any]) -> str:
    return (f"{row['model']} B{row['batch']} L{row['length']} {row['precision']} ckpt {row['checkpointing']}"
            + (" activations offloaded" if row.get("offload_activations") else ""))


def bench(work: Path) -> list[dict[str, Any]] | None:
    path = work / "results" / "bench" / "bench.json"
    if not path.is_file():
        return None
    keys = ("setup", "micro_batch_size", "accumulation_steps", "peak_memory_bytes", "peak_reserved_bytes",
            "predicted_peak_bytes", "samples_per_second", "val_accuracy")
    return [{key: row.get(key) for key in keys} for row in json.loads(path.read_text())["rows"]]


def markdown(summary: dict[str, Any]) -> str:
    lines = ["# memfit GPU check" + (" (dry run on CPU)" if summary["dry_run"] else ""), "", "```",
             summary["device"].strip(), "```", "", "| step | status | seconds |", "|---|---|---|"]
    lines += [f"| {row['step']} | {row['status']} | {row['seconds']} |" for row in summary["steps"]]
    valid = summary["validation"]
    if valid and valid.get("measured_rows"):
        lines += ["", f"Estimator, {valid['measured_rows']} measured setups: worst allocated error "
                      f"{valid['worst_allocated_error_percent']:+.2f} % ({valid['worst_allocated_case']}), worst "
                      f"reserved error {valid['worst_reserved_error_percent']:+.2f} % "
                      f"({valid['worst_reserved_case']}).", "", "| setup | allocated error | reserved error |",
                  "|---|---|---|"]
        lines += [f"| {row['case']} | {row['allocated_error_percent']:+.2f} % | "
                  f"{row['reserved_error_percent']:+.2f} % |" for row in valid["rows"]]
        for row in (row for row in valid["rows"] if "predicted_host_bytes" in row):  # activations offloaded
            lines += ["", f"{row['case']}: host memory {format_bytes(row['predicted_host_bytes'])} predicted, "
                          f"{format_bytes(row['measured_host_bytes'])} measured."]
    if summary["bench"]:
        lines += ["", "| bench setup | micro x acc | peak allocated | reserved | predicted | samples/s | val acc |",
                  "|---|---|---|---|---|---|---|"]
        for row in summary["bench"]:
            def size(key: str, row: dict[str, Any] = row) -> str:
                return format_bytes(row[key]) if row.get(key) else "-"

            lines.append(f"| {row['setup']} | {row['micro_batch_size']} x {row['accumulation_steps']} | "
                         f"{size('peak_memory_bytes')} | {size('peak_reserved_bytes')} | "
                         f"{size('predicted_peak_bytes')} | {row['samples_per_second'] or 0:.1f} | "
                         f"{row['val_accuracy'] if row['val_accuracy'] is not None else '-'} |")
    lines += ["", "Everything else is in results.tar.gz (logs, validate_estimator.json, bench files)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    device = work / "results" / "device.txt"
    summary: dict[str, Any] = {
        "dry_run": "--dry-run" in sys.argv, "device": device.read_text() if device.is_file() else "unknown",
        "steps": steps(work), "validation": validation(work), "bench": bench(work)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    text = markdown(summary)
    (out / "summary.md").write_text(text)
    print(text)
    return 0 if all(row["exit_code"] == 0 for row in summary["steps"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
