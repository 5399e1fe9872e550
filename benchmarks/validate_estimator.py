"""Check ``memfit estimate`` against real training steps: predicted vs measured peak memory, per setup.

On a CUDA machine each row builds the model with memfit's builder and techniques, runs the engine's window
and optimizer step on the card (random init; values do not change memory), one warm-up step, then resets the
peak statistics and runs a second step. ``torch.cuda.max_memory_allocated()`` and ``max_memory_reserved()``
of that step are compared with the estimate for this card's profile (the same code path as
``memfit estimate --device <card>``). Target: allocated within 1 %, reserved within 5 %.

``--dry-run`` (any machine, no GPU needed) runs everything except the CUDA measurement: the same
measurement routine on CPU tensors, checked against ``estimate(device="cpu")`` (must be 0 % off), plus the
predictions of the CUDA grid for ``--device`` with the measured columns left empty. ``--measured FILE``
(any machine) sets today's predictions beside the measured columns of an earlier GPU run's ``--json``.

    .venv/bin/python benchmarks/validate_estimator.py --dry-run --json benchmarks/results/validate_estimator_dry.json
    python benchmarks/validate_estimator.py --grid full --json results/validate_estimator_h200.json  # on a GPU
    python benchmarks/validate_estimator.py --grid lora --json results/validate_lora_h200.json   # LoRA, offload rows
    python benchmarks/validate_estimator.py --grid activations --json results/validate_offload_h200.json
    .venv/bin/python benchmarks/validate_estimator.py --measured results/validate_estimator_h200.json --device h200
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from memfit import TrainConfig
from memfit.build import build_with_techniques
from memfit.devices import DeviceProfile, profile_for, resolve_device, resolve_profile
from memfit.memory.estimate import estimate, prepare_trace, run_steps
from memfit.memory.monitor import Monitor
from memfit.memory.tracker import StorageTracker
from memfit.report import format_bytes
from memfit.techniques.offload_activations import ActivationOffload
from memfit.techniques.precision import Precision

GiB = 1024**3


@dataclass(frozen=True)
class Case:
    model: str
    batch: int
    length: int
    """Sequence length (text) or image size (vision)."""
    precision: str
    checkpointing: str
    train_top_layers: int | None = None
    lora_rank: int = 0
    offload_optimizer: bool = False
    offload_activations: bool = False
    optimizer_in_backward: bool = False
    kahan: bool | None = None

    @property
    def vision(self) -> bool:
        return self.model.startswith("vit") or Path(self.model).name.startswith("vit")

    def config(self) -> TrainConfig:
        return TrainConfig(model=self.model, micro_batch_size=self.batch, effective_batch=self.batch,
                           max_length=self.length if not self.vision else 128, precision=self.precision,
                           checkpointing=self.checkpointing, train_top_layers=self.train_top_layers,
                           lora_rank=self.lora_rank, offload_optimizer=self.offload_optimizer,
                           offload_activations=self.offload_activations, kahan=self.kahan,
                           optimizer_in_backward=self.optimizer_in_backward,
                           max_grad_norm=None if self.optimizer_in_backward else 1.0)

    def shape(self) -> dict[str, Any]:
        return {"seq_len": None if self.vision else self.length, "image_size": self.length if self.vision else None}


def cuda_grid(name: str) -> list[Case]:
    """BERT-base/large and ViT-base/large at several shapes, fp32/fp16/bf16, with and without checkpointing, and
    two causal LMs."""
    text = [("bert-base", 8, 128), ("bert-base", 32, 128), ("bert-base", 8, 512), ("bert-large", 8, 512)]
    vision = [("vit-base", 8, 224), ("vit-base", 32, 224), ("vit-large", 8, 224)]
    shapes = text + vision
    precisions = ("fp32", "fp16", "bf16")
    checkpointing = ("none", "full")
    if name == "tiny":
        return []
    if name == "activations":  # saved activations offloaded to the host, each beside a setup without it
        return [Case("bert-base", 8, 512, "fp16", "none"), Case("bert-base", 8, 512, "fp16", "none",
                                                                 offload_activations=True),
                Case("bert-base", 8, 512, "fp16", "full", offload_activations=True),
                Case("smollm2-360m", 4, 512, "bf16", "full", offload_activations=True)]
    if name == "lowmem":  # 16-bit weights (torch's AdamW in bf16; Kahan needs torch-optimi), the step in backward
        return [Case("smollm2-360m", 4, 512, "bf16-true", "full", kahan=False),
                Case("smollm2-360m", 4, 512, "bf16-true", "full", kahan=False, optimizer_in_backward=True),
                Case("qwen2.5-0.5b", 4, 512, "bf16-true", "full", kahan=False, optimizer_in_backward=True),
                Case("smollm2-360m", 4, 512, "fp32", "full", optimizer_in_backward=True),
                Case("smollm2-360m", 4, 512, "bf16-true", "full", kahan=True, optimizer_in_backward=True)]
    if name == "lora":  # LoRA r=16 on a 16-bit base (PEFT; QLoRA needs bitsandbytes on the card), and full
        # fine-tuning with the optimizer offloaded to the host
        return [Case("smollm2-360m", 4, 512, "bf16", "none", lora_rank=16),
                Case("smollm2-360m", 4, 512, "bf16", "full", lora_rank=16),
                Case("qwen2.5-0.5b", 4, 512, "bf16", "full", lora_rank=16),
                Case("llama-3.2-1b", 2, 1024, "bf16", "full", lora_rank=16),
                Case("smollm2-360m", 4, 512, "fp32", "full", offload_optimizer=True),
                Case("qwen2.5-0.5b", 4, 512, "bf16", "full", offload_optimizer=True)]
    # causal LMs (the LLM presets train as causal LMs): SmolLM2-360M, and Llama-3.2-1B with its top 4 layers
    # trained (the plan for 11 GiB at 1024 tokens), bf16 with checkpointing
    llms = [Case("smollm2-360m", 4, 512, "bf16", "full"), Case("llama-3.2-1b", 1, 1024, "bf16", "full", 4)]
    if name == "small":
        shapes = [("bert-base", 8, 128), ("bert-large", 8, 512), ("vit-base", 8, 224)]
    return [Case(model, batch, length, precision, ckpt) for model, batch, length in shapes
            for precision in precisions for ckpt in checkpointing] + llms


def tiny_grid(directory: Path) -> list[Case]:
    """Tiny random-init configs, so a CPU dry run measures real steps in seconds."""
    import transformers

    configs = {
        "bert-tiny": transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=128, vocab_size=1000, max_position_embeddings=128,
                                             architectures=["BertForSequenceClassification"]),
        "vit-tiny": transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=128, image_size=32, patch_size=8,
                                           architectures=["ViTForImageClassification"]),
    }
    paths = {}
    for name, hf_config in configs.items():
        hf_config.save_pretrained(directory / name)
        paths[name] = str(directory / name)
    return [Case(paths["bert-tiny"], 8, 64, precision, ckpt) for precision in ("fp32", "bf16")
            for ckpt in ("none", "full")] + [Case(paths["vit-tiny"], 8, 32, "bf16", "full")]


def measure(case: Case, profile: DeviceProfile, device: torch.device) -> dict[str, int]:
    """Peak bytes of step 2 (after a warm-up step) on ``device``: the CUDA allocator's, or tracked on CPU; and
    the most host memory the offloaded activations held (``host``; 0 without offloading)."""
    config = case.config()
    offload = ActivationOffload() if config.offload_activations else None
    trace = prepare_trace(config, device=profile, **case.shape())
    precision = Precision(trace.precision, device.type)
    model = build_with_techniques(trace.spec, config, label_names=["0", "1"], pad_token_id=0, task=trace.task,
                                  low_dtype=precision.low_dtype, weights_dtype=precision.weights_dtype)
    model.train()
    if device.type == "cuda":
        model.to(device)
        monitor = Monitor("cuda")

        def reset_after_warm_up(step: int) -> None:
            if step == 1:
                torch.cuda.synchronize()
                monitor.reset_peaks()

        with monitor:
            run_steps(model, config, precision, trace.windows, trace.window_items, device=device, phases=monitor,
                      scaler=precision.make_scaler(init_scale=config.init_scale,
                                                   growth_interval=config.growth_interval),
                      cuda=True, after_step=reset_after_warm_up, offload=offload)
            torch.cuda.synchronize()
        # the monitor resets the allocator's peak statistics at each phase: its snapshot holds the step's peak
        peaks = monitor.snapshot()
        result = {"allocated": peaks.peak_bytes, "reserved": peaks.peak_reserved_bytes or 0,
                  "host": offload.peak_bytes if offload is not None else 0}
        del model
        gc.collect()
        torch.cuda.empty_cache()
        return result
    with StorageTracker() as tracker:
        run_steps(model, config, precision, trace.windows, trace.window_items, device=device, phases=tracker)
    return {"allocated": tracker.peak_bytes, "reserved": tracker.peak_bytes, "host": 0}


def error_percent(predicted: int, measured: int | None) -> float | None:
    return None if measured is None else round(100.0 * (predicted - measured) / measured, 3)


def row(case: Case, profile: DeviceProfile, measured: dict[str, int] | None) -> dict[str, Any]:
    started = time.perf_counter()
    predicted = estimate(case.config(), device=profile, **case.shape())
    seconds = time.perf_counter() - started
    allocated = measured["allocated"] if measured else None
    reserved = measured["reserved"] if measured else None
    return {**asdict(case), "model": Path(case.model).name, "device": profile.name,
            "predicted_allocated_bytes": predicted.peak_bytes, "measured_allocated_bytes": allocated,
            "allocated_error_percent": error_percent(predicted.peak_bytes, allocated),
            "predicted_reserved_bytes": predicted.peak_reserved_bytes, "measured_reserved_bytes": reserved,
            "reserved_error_percent": error_percent(predicted.peak_reserved_bytes, reserved),
            "predicted_host_bytes": predicted.host_bytes,
            "measured_host_bytes": measured.get("host") if measured else None,
            "peak_phase": predicted.peak_phase, "estimate_seconds": round(seconds, 2)}


def markdown(rows: list[dict[str, Any]]) -> str:
    def cell(value: Any, as_bytes: bool = False) -> str:
        if value is None:
            return "unmeasured"
        if isinstance(value, str):
            return value
        return format_bytes(value) if as_bytes else f"{value:+.2f} %" if isinstance(value, float) else str(value)

    lines = ["| model | batch | len | precision | ckpt | device | predicted alloc | measured alloc | error | "
             "predicted reserved | measured reserved | error |", "|" + "---|" * 12]
    for r in rows:
        model = f"{r['model']} LoRA r={r['lora_rank']}" if r.get("lora_rank") else r["model"]
        model += " (optimizer offloaded)" if r.get("offload_optimizer") else ""
        model += " (step in backward)" if r.get("optimizer_in_backward") else ""
        model += " (Kahan)" if r.get("kahan") else ""
        model += (f" (activations offloaded: host {cell(r.get('predicted_host_bytes'), True)} predicted, "
                  f"{cell(r.get('measured_host_bytes'), True)} measured)" if r.get("offload_activations") else "")
        lines.append(f"| {model} | {r['batch']} | {r['length']} | {r['precision']} | {r['checkpointing']} | "
                     f"{r['device']} | {cell(r['predicted_allocated_bytes'], True)} | "
                     f"{cell(r['measured_allocated_bytes'], True)} | {cell(r['allocated_error_percent'])} | "
                     f"{cell(r['predicted_reserved_bytes'], True)} | {cell(r['measured_reserved_bytes'], True)} | "
                     f"{cell(r['reserved_error_percent'])} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=("tiny", "small", "full", "lora", "activations", "lowmem"),
                        default="small",
                        help="the CUDA setups; tiny: none (a dry run measures only its CPU grid); lora: LoRA r=16 "
                             "on four LLMs, and two with the optimizer offloaded; activations: saved "
                             "activations offloaded to the host; lowmem: bf16-true weights and the optimizer "
                             "step in backward [small]")
    parser.add_argument("--dry-run", action="store_true", help="no CUDA: measure on CPU, predict the CUDA grid")
    parser.add_argument("--device", default="1080ti", help="profile predicted in a dry run [1080ti]")
    parser.add_argument("--memory-gib", type=float, help="cap this process's CUDA memory (e.g. 11 for a 1080 Ti)")
    parser.add_argument("--json", help="write {rows, machine, command} here")
    parser.add_argument("--measured", help="no CUDA: today's predictions against the measured columns of an "
                                           "earlier GPU run's --json (profile from --device)")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    if args.measured:
        target = resolve_profile(args.device)
        for earlier in json.loads(Path(args.measured).read_text())["rows"]:
            case = Case(earlier["model"], earlier["batch"], earlier["length"], earlier["precision"],
                        earlier["checkpointing"], earlier.get("train_top_layers"), earlier.get("lora_rank", 0),
                        earlier.get("offload_optimizer", False), earlier.get("offload_activations", False),
                        earlier.get("optimizer_in_backward", False), earlier.get("kahan"))
            measured = {"allocated": earlier["measured_allocated_bytes"],
                        "reserved": earlier["measured_reserved_bytes"], "host": earlier.get("measured_host_bytes")}
            rows.append(row(case, target, measured if isinstance(measured["allocated"], int) else None))
    elif args.dry_run:
        with tempfile.TemporaryDirectory() as directory:
            cpu = resolve_profile("cpu")
            for case in tiny_grid(Path(directory)):
                rows.append(row(case, cpu, measure(case, cpu, torch.device("cpu"))))
        target = resolve_profile(args.device)
        rows.extend(row(case, target, None) for case in cuda_grid(args.grid)
                    if target.has_native_bf16 or not case.precision.startswith("bf16"))
    else:
        if not torch.cuda.is_available():
            sys.stderr.write("validate_estimator: no CUDA device; use --dry-run on this machine\n")
            return 2
        device = resolve_device("cuda")
        memory = None
        if args.memory_gib:
            memory = int(args.memory_gib * GiB)
            torch.cuda.set_per_process_memory_fraction(min(1.0, memory / (device.total_memory_bytes or memory)))
        profile = profile_for(device, memory_bytes=memory)
        for case in cuda_grid(args.grid):
            if case.precision.startswith("bf16") and not profile.has_native_bf16:
                continue
            if case.kahan and importlib.util.find_spec("optimi") is None:
                print(f"skipped {case}: torch-optimi is not installed", flush=True)
                continue
            try:
                rows.append(row(case, profile, measure(case, profile, torch.device("cuda"))))
            except torch.OutOfMemoryError:
                gc.collect()
                torch.cuda.empty_cache()
                rows.append({**row(case, profile, None), "measured_allocated_bytes": "OOM"})
            print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    table = markdown(rows)
    print(table)
    measured_rows = [r for r in rows if isinstance(r["allocated_error_percent"], float)]
    if measured_rows:
        worst = max(abs(float(r["allocated_error_percent"])) for r in measured_rows)
        worst_reserved = max(abs(float(r["reserved_error_percent"])) for r in measured_rows)
        print(f"\n{len(measured_rows)} measured rows: worst allocated error {worst:.2f} %, "
              f"worst reserved error {worst_reserved:.2f} %")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        machine = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
                   "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
        Path(args.json).write_text(json.dumps({"rows": rows, "machine": machine, "command": sys.argv}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
