"""``memfit estimate`` against real CPU steps for decoder families: predicted vs measured peak, per setup.

Small random-init configs of each family (Llama, Qwen2, Mistral, Phi-3, Gemma-2, GPT-NeoX, GPT-2) with the
shapes that matter (grouped-query attention, tied embeddings, sliding windows, parallel blocks), the
causal-LM step at micro-batch 4 (padded batches) and 1 (never padded), fp32 and bf16 with checkpointing,
plus the classification head on Llama and Qwen2 bodies. "measured" runs the very same steps on real CPU
tensors (``estimate(..., execute=True)``); tests/unit/test_causal.py and tests/integration/test_causal_cli.py
check the same against ``memfit train``.

    .venv/bin/python benchmarks/decoder_estimates.py --json benchmarks/results/decoder_estimates_cpu.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from memfit import TrainConfig
from memfit.memory.estimate import estimate

BODY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 2048, "max_position_embeddings": 256}
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_key_value_heads": 2, **BODY},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "num_key_value_heads": 2,
              "tie_word_embeddings": True, **BODY},
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "num_key_value_heads": 2, **BODY},
    "phi3": {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "num_key_value_heads": 4, "pad_token_id": 0,
             **BODY},
    "gemma2": {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "num_key_value_heads": 2,
               "head_dim": 16, "sliding_window": 32, **BODY},
    "gpt-neox": {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], **BODY},
    "gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 2, "n_head": 4,
             "vocab_size": 2048, "n_positions": 256},
}
SETUPS = [("fp32", "none", 4), ("fp32", "none", 1), ("bf16", "full", 4), ("bf16", "none", 4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as directory:
        cases: list[tuple[str, dict[str, Any], str]] = [(name, config, "causal-lm")
                                                        for name, config in FAMILIES.items()]
        for name in ("llama", "qwen2"):
            head = FAMILIES[name]["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")
            cases.append((f"{name} (classification)", {**FAMILIES[name], "architectures": [head], "pad_token_id": 0},
                          "classification"))
        for name, hf_config, task in cases:
            path = Path(directory) / name.replace(" ", "-").strip("()")
            path.mkdir()
            (path / "config.json").write_text(json.dumps(hf_config))
            for precision, checkpointing, micro in SETUPS:
                config = TrainConfig(model=str(path), task=task, effective_batch=8, micro_batch_size=micro,
                                     max_length=128, precision=precision, checkpointing=checkpointing)
                predicted, measured = estimate(config), estimate(config, execute=True)
                rows.append({"family": name, "precision": precision, "checkpointing": checkpointing,
                             "micro_batch": micro, "seq_len": 128, "predicted_bytes": predicted.peak_bytes,
                             "measured_bytes": measured.peak_bytes,
                             "error_bytes": predicted.peak_bytes - measured.peak_bytes,
                             "error_percent": round(100 * (predicted.peak_bytes - measured.peak_bytes)
                                                    / measured.peak_bytes, 4),
                             "logits_and_loss_bytes": predicted.breakdown["logits_and_loss"]})
                print(" | ".join(str(value) for value in rows[-1].values()), flush=True)
    worst = max(abs(row["error_percent"]) for row in rows)
    print(f"{len(rows)} setups: worst error {worst:.4f} %")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "worst_error_percent": worst}, indent=2))


if __name__ == "__main__":
    main()
