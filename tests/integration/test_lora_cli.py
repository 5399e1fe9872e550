"""``memfit train`` with LoRA and QLoRA through the real CLI: the estimate against the run, the saved adapter
(PEFT's format) and the merged model, and nothing but memfit's own lines on stderr."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import transformers

from memfit import TrainConfig
from memfit.build import build_base
from memfit.generate import adapted_model, model_directory
from memfit.memory.estimate import estimate
from memfit.models import resolve_model
from tests.conftest import FILLER, write_pairs, write_tiny_llm
from tests.helpers import in_process, memfit

WIDE = {"hidden_size": 64, "intermediate_size": 128}


def long_pairs(path: Path) -> Path:
    """Prompts longer than --max-length (cut from the left): every text fills it, no micro-batch is padded."""
    rng = random.Random(0)
    path.write_text("".join(json.dumps({"prompt": " ".join(rng.choices(FILLER, k=30)), "completion": " yes"})
                            + "\n" for _ in range(24)))
    return path


def test_the_estimate_is_the_peak_of_a_qlora_run(tmp_path: Path) -> None:
    """QLoRA with adapter dropout and 8-bit AdamW states: every phase's peak, to the byte."""
    model = write_tiny_llm(tmp_path / "llm", chat=False, config=WIDE)
    config = TrainConfig(model=str(model), data=str(long_pairs(tmp_path / "long.jsonl")), max_length=16,
                         effective_batch=8, micro_batch_size=4, precision="bf16", max_steps=2,
                         output_dir=str(tmp_path / "run"), device="cpu", lora_rank=4, quantize_base="nf4",
                         lora_dropout=0.1, optimizer="adamw8bit")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({name: value for name, value in config.to_dict().items() if value is not None}))
    result = memfit("train", "--config", str(path), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    predicted = estimate(config, padded=False)
    assert {name: summary["peak_memory_by_phase"][name] for name in predicted.phases} == predicted.phases
    assert summary["trainable_parameters"] == predicted.trainable_parameters
    noise = [line for line in result.stderr.splitlines() if "kernel" in line.lower() or "Warning" in line]
    assert not noise, noise


def test_a_qlora_run_saves_a_peft_adapter_and_a_merged_model(tmp_path: Path) -> None:
    model_dir, data = write_tiny_llm(tmp_path / "llm", config=WIDE), write_pairs(tmp_path / "chat.jsonl", chat=True)
    out = tmp_path / "run"
    result = memfit("train", "--model", str(model_dir), "--data", str(data), "--max-length", "32",
                    "--effective-batch", "8", "--max-steps", "3", "--lr", "1e-2", "--precision", "bf16",
                    "--lora-rank", "4", "--quantize-base", "nf4", "--merge", "--output-dir", str(out))
    assert result.returncode == 0, result.stderr
    assert "LoRA r=4 alpha 8" in result.stdout and "4-bit NF4" in result.stdout
    assert result.stderr == ""  # no third-party note (bitsandbytes' kernel hub, torchao, PEFT)
    from peft import PeftModel

    # the random-init base the run started from: memfit's builder with the run's seed
    base = build_base(resolve_model(str(model_dir)), seed=0, label_names=[], pad_token_id=0, task="causal-lm")
    adapted = PeftModel.from_pretrained(base, str(out / "model"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out / "model" / "merged"))
    ids = torch.tensor([[2, 5, 7, 6, 20, 21, 22]])
    with torch.no_grad():
        expected, logits = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
    assert torch.allclose(expected, logits, atol=1e-4)
    delta = [name for name, p in adapted.named_parameters() if "lora_B" in name and p.abs().sum() > 0]
    assert delta  # the adapters learned something (B starts at zero)


def test_generate_loads_a_lora_run_through_its_merged_model_or_its_adapter(tmp_path: Path, capsys: Any) -> None:
    model_dir, data = write_tiny_llm(tmp_path / "llm"), write_pairs(tmp_path / "chat.jsonl", chat=True)
    merged_run, adapter_run = tmp_path / "merged-run", tmp_path / "adapter-run"
    trained = in_process(["train", "--model", str(model_dir), "--data", str(data), "--max-length", "32",
                          "--effective-batch", "8", "--max-steps", "3", "--lr", "1e-2", "--lora-rank", "4",
                          "--merge", "--output-dir", str(merged_run)], capsys)
    assert trained.returncode == 0, trained.stderr
    shutil.copytree(merged_run, adapter_run)
    shutil.rmtree(adapter_run / "model" / "merged")  # a run without --merge: the adapter and the run's summary
    assert model_directory(str(merged_run)) == merged_run / "model" / "merged"
    assert model_directory(str(adapter_run)) == adapter_run / "model"
    prompt = ["--prompt", "review : the film is great . verdict ?", "--max-new-tokens", "4"]
    from_merged = in_process(["generate", str(merged_run), *prompt], capsys)
    from_adapter = in_process(["generate", str(adapter_run), *prompt], capsys)
    assert from_merged.returncode == 0 and from_adapter.returncode == 0, from_merged.stderr + from_adapter.stderr
    assert from_adapter.stdout == from_merged.stdout and from_merged.stdout.strip()
    assert from_adapter.stderr == ""
    # the adapter went into the run's own random-init base (its seed): the merged model's weights exactly
    adapted = adapted_model(adapter_run / "model", pad_token_id=0).state_dict()
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(merged_run / "model" / "merged")).state_dict()
    assert adapted.keys() == merged.keys() and all(torch.equal(adapted[name], merged[name]) for name in merged)
    base = build_base(resolve_model(str(model_dir)), seed=0, label_names=[], pad_token_id=0, task="causal-lm")
    assert not torch.equal(base.state_dict()["model.layers.0.self_attn.q_proj.weight"],
                           adapted["model.layers.0.self_attn.q_proj.weight"])  # and it changed the base
