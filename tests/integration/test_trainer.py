"""memfit inside a real ``transformers.Trainer`` on CPU: the callback's prediction of the Trainer's own step
against what the run measures, the values reaching reporters, the budget stop, and planned arguments that
Trainer runs with."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from memfit.integrations.transformers import KEYS, MemfitCallback  # first: quiet imports of Trainer's libraries
from memfit.planner.report import checkpointing_argument
from tests.conftest import TINY_LLAMA

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

LENGTH = 24


def _model() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "architectures"},
                                      vocab_size=512)
    return transformers.AutoModelForCausalLM.from_config(config)


def _dataset(count: int = 32) -> Any:
    generator = torch.Generator().manual_seed(0)
    return datasets.Dataset.from_list([{"input_ids": torch.randint(3, 512, (LENGTH,), generator=generator).tolist()}
                                       for _ in range(count)])


def _collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    ids = torch.tensor([item["input_ids"] for item in items])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _trainer(tmp_path: Any, model: Any = None, callbacks: list[Any] | None = None, **arguments: Any) -> Any:
    args = transformers.TrainingArguments(**{
        "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
        "max_steps": 3, "logging_steps": 1, "report_to": "none", "use_cpu": True, "save_strategy": "no",
        "disable_tqdm": True, **arguments})
    return transformers.Trainer(model=model or _model(), args=args, train_dataset=_dataset(),
                                data_collator=_collate, callbacks=callbacks)


class _Reporter(transformers.TrainerCallback):
    """Stands for a reporting integration: added at construction, so it runs before callbacks added later."""

    def __init__(self) -> None:
        self.received: list[dict[str, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
               **kwargs: Any) -> None:
        self.received.append(dict(logs or {}))


SETUPS = [(False, False, "adamw_torch"), (False, True, "adamw_torch_fused"), (True, False, "adamw_torch_fused"),
          (True, True, "adamw_torch")]


@pytest.mark.parametrize(("bf16", "checkpointing", "optim"), SETUPS,
                         ids=[f"{'bf16' if b else 'fp32'}-{'ckpt' if c else 'plain'}-{o}" for b, c, o in SETUPS])
def test_the_trainers_step_peaks_where_the_callback_predicts(tmp_path: Any, capsys: pytest.CaptureFixture[str],
                                                             bf16: bool, checkpointing: bool, optim: str) -> None:
    reporter = _Reporter()
    trainer = _trainer(tmp_path, callbacks=[reporter], bf16=bf16, optim=optim,
                       **{checkpointing_argument(): checkpointing})
    callback = MemfitCallback.attach(trainer)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 3 and all(set(KEYS) <= entry.keys() for entry in logged)
    assert [set(KEYS) <= logs.keys() for logs in reporter.received if "loss" in logs] == [True] * 3
    predicted = logged[0]["memfit/predicted_peak_bytes"]
    assert callback.predicted is not None and predicted == callback.predicted.peak_bytes
    # steps 2 and 3: the steady state (step 1 makes the optimizer's state only in its optimizer step)
    assert [entry["memfit/peak_bytes"] for entry in logged[1:]] == [predicted, predicted]
    err = capsys.readouterr().err
    assert "memfit: this Trainer's step" in err and "warning" not in err
    assert "quantization-bitsandbytes" not in err and "_C_mxfp8" not in err


def test_an_over_budget_step_stops_before_the_first_step(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    trainer = _trainer(tmp_path)
    MemfitCallback.attach(trainer, budget=1_300_000)  # the step needs about 1.5 MiB; micro-batch 2 fits
    with pytest.raises(SystemExit) as stopped:
        trainer.train()
    assert stopped.value.code == 2 and trainer.state.global_step == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("memfit: error:")]
    assert len(lines) == 1 and "over the budget of 1.2 MiB" in lines[0]
    assert "a plan that fits (effective batch 8 kept" in lines[0] and "per_device_train_batch_size=" in lines[0]


def test_a_card_is_predicted_with_memfits_cuda_emulation(tmp_path: Any) -> None:
    """``device_profile``: the step as it would run on that card (allocator blocks, cuBLAS workspaces, the CUDA
    context), while this CPU run measures its own."""
    trainer = _trainer(tmp_path, max_steps=1)
    card = MemfitCallback.attach(trainer, device_profile="1080ti", budget="11GiB")
    trainer.train()
    assert card.predicted is not None and card.predicted.device == "1080ti" and trainer.state.global_step == 1
    assert card.predicted.breakdown["workspaces"] > 0 and card.predicted.non_pytorch_bytes > 0
    assert card.predicted.peak_reserved_bytes >= card.predicted.peak_bytes


class _Optimistic(MemfitCallback):
    """Predicts half the real step, so that the measurement exceeds it."""

    def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
        import dataclasses

        super().on_train_begin(*args, **kwargs)
        assert self.predicted is not None
        self.predicted = dataclasses.replace(self.predicted, peak_bytes=self.predicted.peak_bytes // 2)


def test_a_measured_peak_over_the_prediction_warns_once(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    trainer = _trainer(tmp_path)
    _Optimistic.attach(trainer)
    trainer.train()
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("memfit: warning:")]
    assert len(warnings) == 1 and "above the predicted" in warnings[0]


def test_planned_arguments_build_training_arguments_that_run(tmp_path: Any) -> None:
    from memfit.integrations.trainer_plan import plan_trainer_arguments

    model = _model()
    planned = plan_trainer_arguments(model, budget="2GiB", effective_batch=8, seq_len=LENGTH, device="cpu")
    assert planned.lora_config is None and planned.plan.chosen is not None
    assert planned.training_arguments["per_device_train_batch_size"] * \
        planned.training_arguments["gradient_accumulation_steps"] == 8
    # the same plan checkpointing every second layer: Trainer checkpoints the layers memfit's every-2 does
    chosen = planned.plan.chosen
    every_2 = dataclasses.replace(chosen, family=dataclasses.replace(chosen.family, checkpointing="every-2"))
    arguments = dataclasses.replace(planned.plan, chosen=every_2).to_training_arguments()
    trainer = _trainer(tmp_path, model=model, **{**arguments, "max_steps": 1})
    trainer.train()
    assert trainer.state.global_step == 1
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False]


def test_trls_sft_trainer_gets_the_same_callback(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """SFTTrainer's own step (its loss over a fused LM head, its token metrics) is traced as it runs; the
    metrics it computes from values during the trace are put back, so its logs are the run's own."""
    trl = pytest.importorskip("trl")
    from tests.conftest import FILLER, write_tiny_llm

    directory = write_tiny_llm(tmp_path / "llm")
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    tokenizer.eos_token, tokenizer.pad_token = "[SEP]", "[PAD]"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
    texts = datasets.Dataset.from_list([{"text": " ".join(FILLER[(i + j) % len(FILLER)] for j in range(12))}
                                        for i in range(48)])  # every text as long: every batch the widest
    args = trl.SFTConfig(output_dir=str(tmp_path / "sft"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                         max_steps=3, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                         disable_tqdm=True, bf16=True)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=texts, processing_class=tokenizer)
    MemfitCallback.attach(trainer)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 3 and all(set(KEYS) <= entry.keys() for entry in logged)
    assert [entry["memfit/peak_error"] for entry in logged[1:]] == [0, 0], logged
    tokens = [entry["num_tokens"] for entry in logged]
    assert tokens[0] > 8 and tokens == sorted(tokens)  # real token counts, not the trace's placeholders
    assert "memfit: this Trainer's step" in capsys.readouterr().err


def test_a_lora_plan_emits_python_that_builds_the_trainer_arguments_and_the_adapters(tmp_path: Any) -> None:
    from memfit import TrainConfig
    from memfit.integrations.trainer_plan import adapter_settings, trainer_snippet
    from memfit.planner import plan
    from tests.conftest import write_tiny_llm

    directory = write_tiny_llm(tmp_path / "llm")
    made = plan(TrainConfig(model=str(directory), task="causal-lm", lora_rank=4, max_length=16, effective_batch=4),
                device="cpu", budget="1GiB", seq_len=16, precisions=("fp32",))
    snippet = trainer_snippet(made)
    assert "peft.LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', task_type='CAUSAL_LM')" in snippet
    namespace: dict[str, Any] = {"model": transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(directory))}
    exec(compile(snippet.replace('output_dir="out"', f'output_dir="{tmp_path / "out"}"'), "<plan>", "exec"),
         namespace)
    arguments = namespace["arguments"]
    assert arguments.per_device_train_batch_size * arguments.gradient_accumulation_steps == 4
    assert type(namespace["model"]).__name__ == "PeftModelForCausalLM"
    # a QLoRA plan's 4-bit layers compute in the plan's precision, as memfit's own run of it does
    chosen = made.chosen
    assert chosen is not None
    for precision, dtype in (("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")):
        family = dataclasses.replace(chosen.family, quantize_base="nf4", precision=precision)
        qlora = dataclasses.replace(made, chosen=dataclasses.replace(chosen, family=family))
        quantization = adapter_settings(qlora, "causal-lm")[1]
        assert quantization is not None and quantization["bnb_4bit_compute_dtype"] == dtype


def test_a_qlora_trainer_is_traced_on_its_4bit_weights_and_planned_as_qlora(tmp_path: Any) -> None:
    """A model loaded in 4 bits (``BitsAndBytesConfig``) with PEFT adapters: each fake weight keeps a fake copy
    of its quantisation state, so bitsandbytes' layers dequantise in the trace as in the run."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from memfit.integrations.trainer_plan import model_technique

    directory = tmp_path / "llama"
    _model().save_pretrained(directory)
    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_use_double_quant=True,
                                                   bnb_4bit_compute_dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, quantization_config=quantization)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                       task_type="CAUSAL_LM"))
    assert model_technique(model) == {"lora_rank": 4, "lora_alpha": 8.0, "lora_dropout": 0.0,
                                      "lora_targets": "q_proj,v_proj", "quantize_base": "nf4"}
    trainer = _trainer(tmp_path, model=model)
    callback = MemfitCallback.attach(trainer)
    trainer.train()
    assert callback.predicted is not None and callback.predicted.breakdown["quantized_weights"] > 0
    measured = [entry["memfit/peak_bytes"] for entry in trainer.state.log_history if "loss" in entry][1:]
    assert measured == [callback.predicted.peak_bytes] * 2


def test_an_8bit_trainer_is_refused_before_its_first_step(tmp_path: Any) -> None:
    """bitsandbytes' 8-bit layers keep their int8 codes in a state object beside the weight, which the trace's
    fake weights cannot stand for: refused before any step, naming memfit's own estimate of that setup."""
    pytest.importorskip("bitsandbytes")
    from memfit.errors import ConfigError

    directory = tmp_path / "llama"
    _model().save_pretrained(directory)
    peft = pytest.importorskip("peft")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, quantization_config=transformers.BitsAndBytesConfig(load_in_8bit=True))
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    trainer = _trainer(tmp_path, model=model)
    MemfitCallback.attach(trainer)
    with pytest.raises(ConfigError, match=r"8-bit .* --quantize-base int8"):
        trainer.train()
    assert trainer.state.global_step == 0
