"""MemfitCallback on a real model in the trainers people use: predicted against measured peak per setup.

SmolLM2-135M-Instruct (the packaged weights) fine-tuned on Rotten Tomatoes reviews (the packaged corpus) as
a causal LM, by ``transformers.Trainer`` and by TRL's ``SFTTrainer``, on this machine's CPU, for a few
optimizer steps per setup (fp32/bf16, with and without gradient checkpointing, ``adamw_torch`` and
``adamw_torch_fused``; and QLoRA: the model loaded in 4 bits with ``BitsAndBytesConfig``, PEFT LoRA r=16 on
every Linear, ``adamw_torch_fused``). The callback traces each Trainer's step before it starts and logs the
measured peak of every logging interval beside it; the table shows the steady state (the last interval's, after the
optimizer's state exists). The reviews are cut to ``--length`` tokens and only those that long are kept, so
every batch is the widest one and measured equals predicted when the trace is exact.

    .venv/bin/python benchmarks/trainer_callback.py --json benchmarks/results/trainer_callback_cpu.json
    .venv/bin/python benchmarks/trainer_callback.py --techniques qlora --json ...   # replaces those rows only
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import time
from pathlib import Path
from typing import Any

import torch

from memfit.data.builtin import rotten_tomatoes
from memfit.integrations.transformers import MemfitCallback  # first: Trainer's libraries imported quietly
from memfit.packaged import smollm2_dir
from memfit.report import format_bytes

SETUPS = {"full": [(precision, checkpointing, optim) for precision in ("fp32", "bf16")
                   for checkpointing in (False, True) for optim in ("adamw_torch", "adamw_torch_fused")],
          "qlora": [(precision, checkpointing, "adamw_torch_fused") for precision in ("fp32", "bf16")
                    for checkpointing in (False, True)]}


def texts(tokenizer: Any, length: int, count: int) -> list[str]:
    """Reviews at least ``length`` tokens long, cut to exactly ``length`` tokens (decoded back to text)."""
    kept = []
    for review in rotten_tomatoes().texts:
        ids = tokenizer(review, add_special_tokens=False)["input_ids"]
        if len(ids) >= length - 1:  # the SFT trainer appends an end-of-sequence token
            kept.append(tokenizer.decode(ids[: length - 1]))
        if len(kept) == count:
            return kept
    raise SystemExit(f"only {len(kept)} reviews have {length} tokens")


def load(model_dir: Path, technique: str, precision: str) -> Any:
    """The model as a user loads it for ``technique``: fp32 weights, or 4-bit NF4 with LoRA r=16 adapters."""
    import transformers

    if technique == "full":
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    import peft

    quantization = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quantization)
    with contextlib.redirect_stderr(io.StringIO()):  # peft's own deprecation note on the model's attribute
        return peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                          task_type="CAUSAL_LM"))


def run(kind: str, technique: str, precision: str, checkpointing: bool, optim: str, *, model_dir: Path,
        rows: list[str], length: int, output: Path) -> dict[str, Any]:
    import datasets
    import transformers

    torch.manual_seed(0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = load(model_dir, technique, precision)
    common: dict[str, Any] = {"output_dir": str(output), "per_device_train_batch_size": 4,
              "gradient_accumulation_steps": 2,
              "max_steps": 3, "logging_steps": 1, "report_to": "none", "use_cpu": True, "save_strategy": "no",
              "disable_tqdm": True, "bf16": precision == "bf16", "gradient_checkpointing": checkpointing,
              "optim": optim, "learning_rate": 1e-5}
    if kind == "sft":
        from trl.trainer.sft_config import SFTConfig
        from trl.trainer.sft_trainer import SFTTrainer

        trainer: Any = SFTTrainer(model=model, args=SFTConfig(**common, max_length=length),
                                      train_dataset=datasets.Dataset.from_list([{"text": t} for t in rows]),
                                      processing_class=tokenizer)
    else:
        encoded = [[*tokenizer(t, add_special_tokens=False)["input_ids"][: length - 1], tokenizer.eos_token_id]
                   for t in rows]
        collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
        trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**common),
                                       train_dataset=datasets.Dataset.from_list([{"input_ids": e} for e in encoded]),
                                       data_collator=collator)
    callback = MemfitCallback.attach(trainer)
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    last = [entry for entry in trainer.state.log_history if "memfit/peak_bytes" in entry][-1]
    assert callback.predicted is not None
    return {"trainer": kind, "technique": technique, "precision": precision, "checkpointing": checkpointing,
            "optim": optim,
            "sequence_length": callback.predicted.sequence_length,
            "predicted_bytes": last["memfit/predicted_peak_bytes"],
            "measured_bytes": last["memfit/peak_bytes"], "error": last["memfit/peak_error"],
            "seconds": round(time.perf_counter() - started, 1)}


def key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["trainer"], row.get("technique", "full"), row["precision"], row["checkpointing"], row["optim"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="rows of the setups run replace those in it; the others stay")
    parser.add_argument("--length", type=int, default=48, help="tokens per example [48]")
    parser.add_argument("--techniques", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    args = parser.parse_args()
    import transformers

    model_dir = smollm2_dir()
    rows = texts(transformers.AutoTokenizer.from_pretrained(model_dir), args.length, 32)
    results = []
    for technique in args.techniques:
        for kind in ("trainer", "sft"):
            for precision, checkpointing, optim in SETUPS[technique]:
                row = run(kind, technique, precision, checkpointing, optim, model_dir=model_dir, rows=rows,
                          length=args.length, output=Path("/tmp/memfit-trainer-callback"))
                results.append(row)
                print(line(row), flush=True)
    if args.json:
        kept = json.loads(args.json.read_text())["rows"] if args.json.exists() else []
        ran = {key(row) for row in results}
        results = [*(row for row in kept if key(row) not in ran), *results]
        args.json.write_text(json.dumps({"model": "smollm2-135m", "device": "cpu", "rows": results}, indent=1))
    print("\n".join(["| trainer | technique | precision | checkpointing | optim | predicted | measured | error |",
                     "|---|---|---|---|---|---|---|---|", *(line(row) for row in results)]))


def line(row: dict[str, Any]) -> str:
    return (f"| {'Trainer' if row['trainer'] == 'trainer' else 'SFTTrainer'} | {row.get('technique', 'full')} | "
            f"{row['precision']} | {'on' if row['checkpointing'] else 'off'} | {row['optim']} | "
            f"{row['predicted_bytes']:,} ({format_bytes(row['predicted_bytes'])}) | {row['measured_bytes']:,} | "
            f"{100 * row['error']:+.4f} % |")


if __name__ == "__main__":
    main()
