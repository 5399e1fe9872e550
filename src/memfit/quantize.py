"""int8 quantization of a fine-tuned model for CPU inference, with an fp32-vs-int8 report.

Two backends (``--backend``), one report:

- ``onnxruntime`` (:mod:`memfit.onnx_int8`; the default for ``int8-dynamic`` when installed): the whole model
  in ONNX, every weight int8 per channel (the embedding tables too), run by ONNX Runtime's int8 kernels:
  close to 4x smaller and faster than fp32 PyTorch on the CPU.
- ``torchao``: int8 Linear weights inside PyTorch. ``int8-dynamic`` quantizes activations per token
  (``Int8DynamicActivationInt8WeightConfig``; fallback ``torch.ao.quantization.quantize_dynamic``);
  ``int8-weight-only`` keeps fp32 activations (``Int8WeightOnlyConfig``; no fallback). Embeddings, norms and
  the rest stay fp32, so the size ratio is below 2x for a BERT whose vocabulary table is half its weights.

Trade-off: int8 weights take a quarter of the fp32 bytes; outputs move by quantization error, which the
report measures (accuracy delta, prediction agreement, largest logit difference). This is a CPU-inference
feature: the report always runs on CPU.

A quantized model is a directory: ``config.json`` (and the tokenizer) of the source model,
``quantization.json`` (method and backend), and ``model.onnx`` (onnxruntime) or ``quantized.pt`` (torchao:
the quantized state dict; build the model from ``config.json``, apply the same torchao config, then
``load_state_dict(torch.load(...), assign=True)``). :func:`load_quantized` loads either.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from memfit import onnx_int8
from memfit.build import Prepared, prepare
from memfit.config import TrainConfig, from_mapping
from memfit.data.batches import Encoder, cut
from memfit.errors import ConfigError
from memfit.models import build_model, is_vision_config
from memfit.quiet import NOISY_LOGGERS, raised_loggers
from memfit.step import loss_sum

METHODS = ("int8-dynamic", "int8-weight-only")
BACKENDS = ("auto", "onnxruntime", "torchao")
"""``auto``: ONNX Runtime for int8-dynamic when it is installed (smaller and faster, :mod:`memfit.onnx_int8`),
else torchao (and its ``torch.ao`` fallback)."""
STATE = "quantized.pt"
INFO = "quantization.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def quantize_model(model: nn.Module, method: str) -> str:
    """Quantize ``model``'s Linear layers in place; returns the backend that did it."""
    if method not in METHODS:
        raise ConfigError(f"--method {method!r} is not one of: {', '.join(METHODS)}")
    if not any(isinstance(module, nn.Linear) for module in model.modules()):
        raise ConfigError(f"{type(model).__name__} has no Linear layers; int8 quantization here applies to "
                          "Linear layers only")
    try:
        with warnings.catch_warnings(), raised_loggers(*NOISY_LOGGERS):
            warnings.simplefilter("ignore")
            from torchao.quantization import (
                Int8DynamicActivationInt8WeightConfig,
                Int8WeightOnlyConfig,
                quantize_,
            )

            config = Int8DynamicActivationInt8WeightConfig() if method == "int8-dynamic" else Int8WeightOnlyConfig()
            quantize_(model, config)
        return "torchao"
    except ImportError:
        if method != "int8-dynamic":
            raise ConfigError(f"--method {method} needs torchao (pip install torchao); int8-dynamic works "
                              "without it") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)
    return "torch.ao"


def resolve_backend(backend: str, method: str) -> str:
    if backend not in BACKENDS:
        raise ConfigError(f"--backend {backend!r} is not one of: {', '.join(BACKENDS)}")
    if backend == "onnxruntime" and method != "int8-dynamic":
        raise ConfigError(f"--backend onnxruntime runs int8-dynamic only; use --backend torchao for {method}")
    if backend == "auto":
        return "onnxruntime" if method == "int8-dynamic" and onnx_int8.available() else "torchao"
    if backend == "onnxruntime":
        onnx_int8.require()
    return backend


def tensor_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights in memory, counting the int8 data and scales of quantized tensors."""
    if isinstance(model, onnx_int8.OnnxClassifier):
        return model.weights_bytes
    def size(value: Any) -> int:
        if isinstance(value, torch.Tensor) and hasattr(value, "__tensor_flatten__"):
            names, _ = value.__tensor_flatten__()
            return sum(size(getattr(value, name)) for name in names)
        if isinstance(value, torch.Tensor):
            return value.untyped_storage().nbytes() if value.layout == torch.strided else value.element_size() * \
                value.numel()
        return 0

    total = 0
    for name, value in model.state_dict().items():
        if name.endswith("_packed_params._packed_params"):  # torch.ao: (int8 weight, fp32 bias)
            weight, bias = value
            total += weight.int_repr().numel() + (bias.numel() * 4 if bias is not None else 0) + 8
        else:
            total += size(value)
    return total


def quantize_to(fp32: nn.Module, output_dir: Path, *, method: str, backend: str, source: Path,
                prepared: Prepared, reference: Evaluation) -> tuple[nn.Module, str, int, list[str]]:
    """Quantize ``fp32`` into ``output_dir`` with ``backend`` (resolved): (int8 model, backend, file bytes,
    layer families kept in fp32). ``reference``: the fp32 model's validation logits."""
    if backend == "onnxruntime":
        encoder, count = prepared.encoder(prepared.val_examples), len(prepared.val_examples)

        def agreement(path: Path) -> float:
            logits = evaluate_logits(onnx_int8.OnnxClassifier(path), encoder, count).logits
            return float((logits.argmax(-1) == reference.logits.argmax(-1)).float().mean())

        model_file, kept = onnx_int8.export_int8(fp32, encoder(list(range(min(2, count)))), output_dir,
                                                 agreement=agreement)
        save_quantized(fp32, output_dir, method=method, backend=backend, source=source,
                       tokenizer=prepared.tokenizer, state=False)
        return onnx_int8.OnnxClassifier(model_file), backend, model_file.stat().st_size, kept
    int8 = copy.deepcopy(fp32)
    used = quantize_model(int8, method)
    save_quantized(int8, output_dir, method=method, backend=used, source=source, tokenizer=prepared.tokenizer)
    return int8, used, (output_dir / STATE).stat().st_size, []


def save_quantized(model: nn.Module, output_dir: Path, *, method: str, backend: str, source: Path,
                   tokenizer: Any, state: bool = True) -> None:
    """The directory :func:`load_quantized` reads; ``state=False``: the weights are saved elsewhere (ONNX)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    if state:
        torch.save(model.state_dict(), output_dir / STATE)
    getattr(model, "config").save_pretrained(output_dir)  # noqa: B009 - a transformers model
    if tokenizer is not None:
        tokenizer.save_pretrained(output_dir)
    (output_dir / INFO).write_text(json.dumps({"method": method, "backend": backend, "source": str(source)},
                                              indent=2) + "\n")


def is_quantized_dir(path: Path) -> bool:
    return (path / INFO).is_file() and ((path / STATE).is_file() or (path / onnx_int8.MODEL_FILE).is_file())


def load_quantized(path: str | Path) -> nn.Module:
    """A model saved by ``memfit quantize``, ready for CPU inference."""
    directory = Path(path)
    if not is_quantized_dir(directory):
        raise ConfigError(f"{directory}: not a quantized model (no {INFO} and {STATE}); make one with "
                          "memfit quantize")
    info = json.loads((directory / INFO).read_text())
    if info["backend"] == "onnxruntime":
        return onnx_int8.OnnxClassifier(directory / onnx_int8.MODEL_FILE)
    config = transformers.AutoConfig.from_pretrained(str(directory), trust_remote_code=False)
    auto = (transformers.AutoModelForImageClassification if is_vision_config(config)
            else transformers.AutoModelForSequenceClassification)
    model = auto.from_config(config).eval()
    if info["backend"] == "torchao":
        quantize_model(model, info["method"])
        state = torch.load(directory / STATE, weights_only=True)
    else:  # torch.ao packed parameters are not plain tensors: a full unpickle of a file memfit wrote
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)
        with warnings.catch_warnings():  # torch's own unpickler of quantised tensors reads a TypedStorage
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
            state = torch.load(directory / STATE, weights_only=False)
    model.load_state_dict(state, assign=True)
    return model


@dataclass(kw_only=True)
class Evaluation:
    logits: torch.Tensor
    labels: torch.Tensor

    @property
    def accuracy(self) -> float:
        return float((self.logits.argmax(dim=-1) == self.labels).float().mean())


@torch.inference_mode()
def evaluate_logits(model: nn.Module, encoder: Encoder, count: int, batch_size: int = 64) -> Evaluation:
    """Logits and labels of the first ``count`` examples of ``encoder``."""
    model.eval()
    logits, labels = [], []
    for chunk in cut(range(count), batch_size):
        batch = encoder(chunk)
        logits.append(loss_sum(model, batch)[1].float())
        labels.append(batch["labels"])
    return Evaluation(logits=torch.cat(logits), labels=torch.cat(labels))


@torch.inference_mode()
def latency_ms(models: dict[str, nn.Module], encoder: Encoder, count: int, batch_size: int, *, repeats: int = 20,
               warmup: int = 3) -> dict[str, float]:
    """Median wall-clock milliseconds of one forward pass over ``batch_size`` of the ``count`` examples, per
    model, the models' passes interleaved so that the machine's drift hits them alike."""
    batch = encoder([index % count for index in range(batch_size)])
    inputs = {name: tensor for name, tensor in batch.items() if name != "labels"}
    for model in models.values():
        model.eval()
        for _ in range(warmup):
            model(**inputs)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            started = time.perf_counter()
            model(**inputs)
            times[name].append((time.perf_counter() - started) * 1000)
    return {name: statistics.median(values) for name, values in times.items()}


def source_config(source: str, *, data: str | None, columns: dict[str, str] | None = None) -> tuple[Path, TrainConfig]:
    """(model directory, the config whose validation split to use) for a run dir or a model dir."""
    path = Path(source).expanduser()
    if (path / "summary.json").is_file() and (path / "model").is_dir():  # a memfit run
        saved = json.loads((path / "summary.json").read_text())["config"]
        overrides: dict[str, Any] = {"model": str(path / "model"), "device": "cpu", "output_dir": None,
                                     "resume": None, "overwrite": False}
        if data is not None:
            overrides["data"] = data
        return path / "model", from_mapping({**saved, **overrides, **(columns or {})})
    if not path.is_dir():
        raise ConfigError(f"{source}: no such run or model directory; pass a memfit run dir (with summary.json) "
                          "or a Hugging Face model dir")
    if data is None:
        raise ConfigError(f"{source} is a model dir, not a memfit run: give --data for its validation split")
    return path, from_mapping({"model": str(path), "data": data, "device": "cpu", **(columns or {})})


def load_fp32(prepared: Prepared) -> nn.Module:
    if prepared.spec.weights_dir is None:
        raise ConfigError(f"{prepared.config.model}: no weights ({' or '.join(WEIGHT_FILES)}); quantize a "
                          "fine-tuned model")
    pad = prepared.tokenizer.pad_token_id if prepared.tokenizer is not None else None
    # a bf16-true run saves bf16 weights: the export and its comparison run in fp32
    return build_model(prepared.spec, label_names=prepared.label_names, pad_token_id=pad).float().eval()


def weights_bytes(directory: Path) -> int:
    """The bytes of a model directory's weight files (every shard of an index)."""
    from memfit.hub import safetensors_files

    files = safetensors_files(directory) or [directory / name for name in WEIGHT_FILES if (directory / name).is_file()]
    return sum(path.stat().st_size for path in files)


def classification_only(prepared: Prepared, source: str, command: str) -> Prepared:
    if prepared.task != "classification":
        kind = "a causal LM" if prepared.task == "causal-lm" else f"a {prepared.task} model"
        raise ConfigError(f"memfit {command} works on classification models, and {source} is {kind}; evaluate "
                          f"a {prepared.task} run with its own summary.json (val_accuracy, val_perplexity)")
    return prepared


def run_quantize(source: str, *, method: str = "int8-dynamic", backend: str = "auto", data: str | None = None,
                 output_dir: str | None = None, columns: dict[str, str] | None = None) -> dict[str, Any]:
    """Quantize, save, and compare with fp32 on the validation split; returns (and writes) the report.

    ``columns``: ``text_column``/``label_column`` of a CSV/JSONL ``data``.
    """
    if method not in METHODS:
        raise ConfigError(f"--method {method!r} is not one of: {', '.join(METHODS)}")
    chosen = resolve_backend(backend, method)
    model_dir, config = source_config(source, data=data, columns=columns)
    prepared = classification_only(prepare(config), source, "quantize")
    fp32 = load_fp32(prepared)
    out = Path(output_dir) if output_dir else model_dir.parent / f"{model_dir.name}-{method}"
    encoder, count = prepared.encoder(prepared.val_examples), len(prepared.val_examples)  # tokenised once
    reference = evaluate_logits(fp32, encoder, count)
    int8, backend, int8_bytes, kept_fp32 = quantize_to(fp32, out, method=method, backend=chosen, source=model_dir,
                                                       prepared=prepared, reference=reference)
    quantized = evaluate_logits(int8, encoder, count)
    models = {"fp32": fp32, "int8": int8}
    latency = {size: latency_ms(models, encoder, count, size) for size in (1, 8)}
    sides = {}
    for name, evaluation, disk in (("fp32", reference, weights_bytes(model_dir)), ("int8", quantized, int8_bytes)):
        sides[name] = {"size_bytes": disk, "memory_bytes": tensor_bytes(models[name]),
                       "val_accuracy": evaluation.accuracy, "latency_ms_batch1": latency[1][name],
                       "latency_ms_batch8": latency[8][name]}
    report = {
        "backend": backend, "method": method, "source": str(model_dir), "output_dir": str(out),
        "kept_fp32": kept_fp32,
        "val_samples": len(prepared.val_examples), "threads": torch.get_num_threads(), **sides,
        "size_ratio": sides["fp32"]["size_bytes"] / sides["int8"]["size_bytes"],
        "memory_ratio": sides["fp32"]["memory_bytes"] / sides["int8"]["memory_bytes"],
        "latency_ratio_batch1": sides["fp32"]["latency_ms_batch1"] / sides["int8"]["latency_ms_batch1"],
        "latency_ratio_batch8": sides["fp32"]["latency_ms_batch8"] / sides["int8"]["latency_ms_batch8"],
        "accuracy_delta_points": 100 * (sides["int8"]["val_accuracy"] - sides["fp32"]["val_accuracy"]),
        "prediction_agreement": float((reference.logits.argmax(-1) == quantized.logits.argmax(-1)).float().mean()),
        "max_abs_logit_diff": float((reference.logits - quantized.logits).abs().max()),
    }
    (out / "quantize.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def run_eval(source: str, *, data: str | None = None, columns: dict[str, str] | None = None) -> dict[str, Any]:
    """Validation accuracy of any saved model: a run dir, a model dir, or a quantized dir."""
    path = Path(source).expanduser()
    if is_quantized_dir(path):
        info = json.loads((path / INFO).read_text())
        source_dir = Path(info["source"])
        run_dir = source_dir.parent if (source_dir.parent / "summary.json").is_file() else None
        _, config = source_config(str(run_dir or path), data=data, columns=columns)
        prepared = prepare(config)
        model = load_quantized(path)
    else:
        _, config = source_config(source, data=data, columns=columns)
        prepared = classification_only(prepare(config), source, "eval")
        model = load_fp32(prepared)
    evaluation = evaluate_logits(model, prepared.encoder(prepared.val_examples), len(prepared.val_examples))
    return {"model": str(path), "val_accuracy": evaluation.accuracy, "val_samples": len(prepared.val_examples)}
