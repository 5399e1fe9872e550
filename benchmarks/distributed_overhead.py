"""What a second process costs and buys: step time of 1 vs 2 processes at the same global batch.

Runs ``memfit train`` three times on the same windows (MiniLM on Rotten Tomatoes by default): one process
without a distributed strategy, then ``torchrun --nproc-per-node 2`` with DDP and with FSDP2. Each run's step
time is the median ``step_seconds`` of its ``metrics.jsonl`` after the warm-up steps. It also measures the
all-reduce bandwidth of the backend (the planner's ``link_bandwidth``) with a 2-process probe.

    speedup     = t(1 process) / t(2 processes)
    efficiency  = speedup / 2        (1.0: perfect scaling)

On CPU (gloo) both processes share the same cores: the one-process run uses every core for its threads,
each rank of the 2-process runs gets half (torchrun sets OMP_NUM_THREADS=1 per rank unless told otherwise;
``--threads-per-rank`` overrides it). The efficiency there measures what DDP/FSDP's communication and the
split cost, not a gain from more hardware. On a machine with N GPUs pass ``--device cuda`` (NCCL).

    python benchmarks/distributed_overhead.py --json benchmarks/results/distributed_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def probe_bandwidth(megabytes: int, repeats: int) -> None:
    """Under torchrun: time an all-reduce of ``megabytes`` of fp32 and print the bus bandwidth (rank 0)."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() and os.environ.get("PROBE_DEVICE") == "cuda" else "gloo"
    dist.init_process_group(backend)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")
    tensor = torch.ones(megabytes * 1024 * 1024 // 4, device=device)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    world = dist.get_world_size()
    seconds = statistics.median(times[1:])
    bus = 2 * (world - 1) / world * tensor.numel() * 4 / seconds  # what each rank moves, per second
    if dist.get_rank() == 0:
        print(json.dumps({"backend": backend, "bytes": tensor.numel() * 4, "seconds": seconds,
                          "bus_bandwidth_bytes_per_s": bus}))
    dist.destroy_process_group()


def train(args: argparse.Namespace, out: Path, strategy: str) -> dict[str, Any]:
    command = ["train", "--model", args.model, "--data", args.data, "--max-length", str(args.max_length),
               "--effective-batch", str(args.effective_batch), "--micro-batch-size", str(args.micro_batch_size),
               "--max-steps", str(args.steps), "--precision", "fp32", "--log-every", "1", "--device", args.device,
               "--train-samples", str(args.effective_batch * args.steps), "--val-samples", "32",
               "--output-dir", str(out), "--overwrite", "--json"]
    env = dict(os.environ)
    if strategy == "none":
        launch = [sys.executable, "-m", "memfit"]
    else:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                  "memfit"]
        command += ["--distributed", strategy]
        if args.threads_per_rank:
            env["OMP_NUM_THREADS"] = str(args.threads_per_rank)
    started = time.perf_counter()
    result = subprocess.run([*launch, *command], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{strategy}: memfit train failed:\n{result.stderr[-3000:]}")
    wall = time.perf_counter() - started
    summary = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [line["step_seconds"] for line in lines if line["type"] == "train"][args.warmup:]
    weights = out / "model"
    return {"strategy": strategy, "processes": 1 if strategy == "none" else 2, "steps_timed": len(steps),
            "median_step_seconds": statistics.median(steps), "min_step_seconds": min(steps),
            "max_step_seconds": max(steps), "per_rank_peak_bytes": summary["per_rank_training_peak_bytes"],
            "allreduce_seconds": summary["allreduce_seconds"], "val_accuracy": summary["val_accuracy"],
            "wall_seconds": wall, "weights": str(weights)}


def max_weight_difference(first: str, second: str) -> float:
    from memfit.hub import read_weights

    a, b = read_weights(Path(first)), read_weights(Path(second))
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--data", default="rotten-tomatoes")
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--effective-batch", type=int, default=16, help="global batch [16]")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="per process [8]")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median [2]")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--threads-per-rank", type=int, help="OMP_NUM_THREADS of each rank [torchrun's: 1]")
    parser.add_argument("--probe-megabytes", type=int, default=64)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # the torchrun child
    args = parser.parse_args()
    if args.probe:
        probe_bandwidth(args.probe_megabytes, repeats=5)
        return 0

    env = {**os.environ, "PROBE_DEVICE": args.device}
    probe = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            __file__, "--probe", "--probe-megabytes", str(args.probe_megabytes)],
                           capture_output=True, text=True, env=env)
    if probe.returncode != 0:
        raise SystemExit(f"bandwidth probe failed:\n{probe.stderr[-3000:]}")
    bandwidth = json.loads([line for line in probe.stdout.splitlines() if line.startswith("{")][-1])
    with tempfile.TemporaryDirectory() as work:
        rows = [train(args, Path(work) / name, name) for name in ("none", "ddp", "fsdp")]
        single = rows[0]
        for row in rows:
            row["speedup"] = single["median_step_seconds"] / row["median_step_seconds"]
            row["efficiency"] = row["speedup"] / row["processes"]
            row["max_abs_weight_difference_vs_one_process"] = max_weight_difference(single["weights"],
                                                                                     row["weights"])
        for row in rows:
            del row["weights"]
    print(f"| setup ({args.model}, global batch {args.effective_batch}, {args.device}) | processes | median step "
          "| speedup | efficiency | peak per rank | max weight diff vs 1 process |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        peaks = ", ".join(f"{peak / 2**20:.1f} MiB" for peak in row["per_rank_peak_bytes"])
        print(f"| {row['strategy']} | {row['processes']} | {row['median_step_seconds']:.3f} s | "
              f"{row['speedup']:.2f}x | {row['efficiency']:.2f} | {peaks} | "
              f"{row['max_abs_weight_difference_vs_one_process']:.1e} |")
    print(f"all-reduce bus bandwidth ({bandwidth['backend']}, {bandwidth['bytes'] / 2**20:.0f} MiB): "
          f"{bandwidth['bus_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s")
    if args.json:
        payload = {"rows": rows, "bandwidth": bandwidth, "args": vars(args),
                   "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                               "python": platform.python_version()},
                   "command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d")}
        Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
