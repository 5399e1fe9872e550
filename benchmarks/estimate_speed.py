"""How long ``memfit estimate`` takes: seconds per estimate, ops traced, and seconds per thousand ops.

Each setup is estimated ``--repeat`` times in this process after one untimed warm-up estimate (the first
call of a process also pays for lazy imports of the model's code; that cold cost is shown separately, from a
fresh process). The time of a fake-tensor trace should follow the number of ops, not the parameter bytes:
the 1.3B-parameter decoder costs no more per op than BERT-base although its parameters are 12x larger.

    .venv/bin/python benchmarks/estimate_speed.py --json benchmarks/results/estimate_speed_cpu.json
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

import torch
import transformers

from memfit import TrainConfig
from memfit.memory.estimate import estimate
from memfit.models import count_parameters, resolve_model
from memfit.report import format_bytes

# a GPT-2-style decoder of 1.3B parameters (GPT-3 XL's shape: 24 layers, 2048 wide, 16 heads)
DECODER_1_3B: dict[str, Any] = {"n_layer": 24, "n_embd": 2048, "n_head": 16, "n_positions": 2048,
                "architectures": ["GPT2ForSequenceClassification"]}


def setups(directory: Path) -> dict[str, dict[str, Any]]:
    decoder = directory / "decoder-1.3b"
    transformers.GPT2Config(**DECODER_1_3B).save_pretrained(decoder)
    common = {"micro_batch_size": 8, "effective_batch": 8, "precision": "fp16", "checkpointing": "full"}
    return {
        "bert-base S512 B8": {"model": "bert-base", "max_length": 512, **common},
        "bert-base S128 B8": {"model": "bert-base", "max_length": 128, **common},
        "bert-large S512 B8": {"model": "bert-large", "max_length": 512, **common},
        "decoder-1.3b S1024 B8": {"model": str(decoder), "max_length": 1024, **common},
    }


def parameters_of(model: str) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.build import build_with_techniques

    spec = resolve_model(model)
    with FakeTensorMode():
        built = build_with_techniques(spec, TrainConfig(model=model), label_names=["0", "1"], pad_token_id=0)
    return count_parameters(built)[1]


def cold_seconds(overrides: dict[str, Any]) -> float:
    """Wall time of ``memfit estimate`` in a fresh process: imports, trace and printing."""
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in overrides.items()]
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "memfit", "estimate", "--device", "1080ti", "--json", *flags],
                   check=True, capture_output=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return time.perf_counter() - started


IMPORT_FLOOR = "import torch, transformers; from transformers import BertForSequenceClassification"
LLM_IMPORT_FLOOR = "import torch, transformers; from transformers import LlamaForCausalLM"
START_UP = {"model": "bert-base", "seq_len": 512}
"""The start-up measured against the import floor: ``memfit estimate --model bert-base --seq-len 512``."""
LLM_START_UP = {"model": "llama-3.1-8b", "task": "causal-lm", "seq_len": 1024}
"""An 8B decoder's estimate (4 of its 32 blocks traced, the rest replayed) against its import floor, target 2x."""


def import_floor_seconds(floor: str = IMPORT_FLOOR) -> float:
    """Wall time of a fresh process that only imports what the model's estimate needs: the floor of a cold
    run."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", floor], check=True, capture_output=True)
    return time.perf_counter() - started


def start_up(repeat: int, overrides: dict[str, Any], floor: str, target: float) -> dict[str, Any]:
    """Cold ``memfit estimate`` (1080 Ti) against the import floor, alternated, medians."""
    floors, colds = [], []
    for _ in range(repeat):
        floors.append(import_floor_seconds(floor))
        colds.append(cold_seconds(overrides))
    floor_seconds, cold = statistics.median(floors), statistics.median(colds)
    flags = " ".join(f"--{key.replace('_', '-')} {value}" for key, value in overrides.items())
    return {"import_floor_seconds": round(floor_seconds, 2), "cold_estimate_seconds": round(cold, 2),
            "ratio": round(cold / floor_seconds, 2), "target_ratio": target, "command_floor": f"python -c '{floor}'",
            "command_estimate": f"memfit estimate {flags} --device 1080ti --json"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="write {rows, machine, command} here")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as directory:
        for name, overrides in setups(Path(directory)).items():
            config = TrainConfig(**overrides)
            result = estimate(config, device="1080ti", exact_trace=True)  # warm-up: lazy imports, fake-tensor caches
            times = []
            for _ in range(args.repeat):
                started = time.perf_counter()
                result = estimate(config, device="1080ti", exact_trace=True)
                times.append(time.perf_counter() - started)
            seconds = statistics.median(times)
            parameters = parameters_of(config.model)
            rows.append({"setup": name, "parameters": parameters, "traced_ops": result.traced_ops,
                         "seconds": round(seconds, 2), "ms_per_1000_ops": round(1e6 * seconds / result.traced_ops, 1),
                         "cold_cli_seconds": round(cold_seconds(overrides), 2),
                         "predicted_peak_bytes": result.peak_bytes})
    print("| setup | parameters | traced ops | seconds per estimate | ms per 1000 ops | cold CLI seconds | "
          "predicted peak (1080 Ti) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setup']} | {r['parameters'] / 1e6:,.0f}M | {r['traced_ops']:,} | {r['seconds']:.2f} | "
              f"{r['ms_per_1000_ops']:.1f} | {r['cold_cli_seconds']:.1f} | {format_bytes(r['predicted_peak_bytes'])} |")
    cold = start_up(args.repeat, START_UP, IMPORT_FLOOR, 1.3)
    llm = start_up(args.repeat, LLM_START_UP, LLM_IMPORT_FLOOR, 2.0)
    for name, measured in (("bert-base S512", cold), ("llama-3.1-8b S1024", llm)):
        print(f"\ncold start: memfit estimate {name} {measured['cold_estimate_seconds']:.2f} s, import floor "
              f"{measured['import_floor_seconds']:.2f} s: {measured['ratio']:.2f}x (target <= "
              f"{measured['target_ratio']}x)")
    print(f"\n{torch.get_num_threads()} CPU threads, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {platform.processor() or platform.machine()}")
    if args.json:
        machine = {"python": platform.python_version(), "torch": torch.__version__,
                   "transformers": transformers.__version__, "cpu_threads": torch.get_num_threads(),
                   "cpus": os.cpu_count()}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "start_up": cold, "start_up_llm": llm, "machine": machine,
                                               "command": sys.argv}, indent=2))


if __name__ == "__main__":
    main()
