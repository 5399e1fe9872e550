"""int8 through ONNX Runtime: the whole model exported to ONNX, its weights quantized to int8 (every MatMul,
Gemm and the embedding tables' Gather), activations quantized per batch at run time
(``onnxruntime.quantization.quantize_dynamic``), run by ONNX Runtime's CPU kernels.

Trade-off against torchao: the embedding tables are int8 too, so the file is close to 4x smaller than fp32
(torchao keeps them fp32), and ONNX Runtime's fused int8 kernels are faster than PyTorch's fp32 at batch 1
and 8 on this CPU; the model leaves PyTorch (no autograd, no further fine-tuning of the int8 model). Needs
``onnxruntime`` and ``onnx`` (``pip install memfit[onnx]``).

A quantized directory holds ``model.onnx`` (int8), the source's ``config.json`` and tokenizer, and
``quantization.json``; :class:`OnnxClassifier` runs it with the same call as the PyTorch model
(``model(**inputs).logits``), so the report and ``memfit eval`` treat both backends alike.
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from memfit.data.batches import Batch
from memfit.errors import ConfigError
from memfit.quiet import raised_loggers

MODEL_FILE = "model.onnx"
AGREEMENT_TARGET = 0.98
"""Share of the fp32 model's validation predictions the int8 model must keep before a family stays fp32."""
OPSET = 17
QUANTIZED_OPS = ["MatMul", "Gemm", "Gather"]


def available() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("onnxruntime", "onnx"))


def require() -> None:
    if not available():
        raise ConfigError("--backend onnxruntime needs onnxruntime and onnx: pip install onnxruntime onnx "
                          "(or memfit[onnx]), or use --backend torchao")


def export_int8(model: nn.Module, sample: Batch, output_dir: Path, *, agreement: Callable[[Path], float],
                target: float = AGREEMENT_TARGET) -> tuple[Path, list[str]]:
    """Export ``model`` (fp32, eval) with ``sample``'s inputs and quantize its weights to int8, per channel.

    ``agreement(file)`` is the share of validation predictions an int8 file keeps. When quantizing everything
    keeps less than ``target``, one family of layers (the same projection in every block, e.g. each
    attention output) stays fp32: the family whose fp32 keeps ``target`` at the smallest size, else the one
    that keeps the most. Returns the int8 file and the families kept in fp32 (chosen on the validation split
    the report measures, which flatters its agreement a little).
    """
    require()
    output_dir.mkdir(parents=True, exist_ok=True)
    fp32_file, int8_file = output_dir / "model-fp32.onnx", output_dir / MODEL_FILE
    export_fp32(model, sample, fp32_file)
    quantize_file(fp32_file, int8_file, exclude=[])
    kept: list[str] = []
    if agreement(int8_file) < target:
        families = weight_families(fp32_file)
        trials = []  # (agreement, file bytes, family), one quantization and one evaluation each
        for family, nodes in families.items():
            quantize_file(fp32_file, int8_file, exclude=nodes)
            trials.append((agreement(int8_file), int8_file.stat().st_size, family))
        meets = [trial for trial in trials if trial[0] >= target]
        best = min(meets, key=lambda trial: trial[1]) if meets else max(trials, key=lambda trial: trial[0])
        kept = [best[2]]
        quantize_file(fp32_file, int8_file, exclude=families[best[2]])
    fp32_file.unlink()
    return int8_file, kept


def export_fp32(model: nn.Module, sample: Batch, path: Path) -> None:
    names = [name for name in sample if name != "labels"]
    axes = {name: {0: "batch", 1: "sequence"} if sample[name].ndim == 2 else {0: "batch"} for name in names}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the tracer's notes about Python control flow in the model's code
        torch.onnx.export(model, tuple(sample[name] for name in names), str(path), input_names=names,
                          output_names=["logits"], dynamic_axes={**axes, "logits": {0: "batch"}},
                          opset_version=OPSET, dynamo=False)


def quantize_file(fp32_file: Path, int8_file: Path, *, exclude: list[str]) -> None:
    """int8 weights per output channel, activations quantized per batch at run time; ``exclude``: nodes kept
    in fp32."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with raised_loggers(""):  # its advice to pre-process the graph is logged on the root logger
        quantize_dynamic(str(fp32_file), str(int8_file), weight_type=QuantType.QInt8, per_channel=True,
                         op_types_to_quantize=QUANTIZED_OPS, nodes_to_exclude=exclude,
                         extra_options={"MatMulConstBOnly": True})


def weight_families(fp32_file: Path) -> dict[str, list[str]]:
    """The MatMul/Gemm nodes with a weight, grouped by their name with the block index taken out: one family
    per projection of the repeated blocks (``.../layer.*/attention/output/dense/MatMul``)."""
    import onnx

    graph = onnx.load(str(fp32_file), load_external_data=False).graph
    weights = {tensor.name for tensor in graph.initializer}
    families: dict[str, list[str]] = {}
    for node in graph.node:
        if node.op_type in ("MatMul", "Gemm") and any(name in weights for name in node.input):
            families.setdefault(re.sub(r"\.\d+/", ".*/", node.name), []).append(node.name)
    return {family: nodes for family, nodes in families.items() if len(nodes) > 1}


class OnnxClassifier(nn.Module):
    """An int8 ONNX model behind the PyTorch model's call: ``model(**inputs).logits`` (a CPU tensor)."""

    def __init__(self, path: Path, *, threads: int | None = None) -> None:
        super().__init__()
        require()
        import onnx
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads or torch.get_num_threads()  # the threads the fp32 side uses
        # no busy-waiting between runs: idle threads would take the cores from PyTorch work in the same process
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.input_names = [item.name for item in self.session.get_inputs()]
        graph = onnx.load(str(path)).graph
        self.weights_bytes = sum(onnx.numpy_helper.to_array(tensor).nbytes for tensor in graph.initializer)
        """Bytes of the model's weights in memory (int8 data, scales and zero points, fp32 rest)."""

    def forward(self, **inputs: torch.Tensor) -> Any:
        if "attention_mask" not in inputs and "input_ids" in inputs:  # an unpadded batch carries no mask
            inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        feed = {name: inputs[name].numpy() for name in self.input_names}
        return SimpleNamespace(logits=torch.from_numpy(self.session.run(["logits"], feed)[0]))
