"""memfit inside a real ``transformers.Trainer`` on CPU: the callback's prediction of the Trainer's own step
against what the run measures (for each kind of training data Trainer takes), the values reaching reporters,
the budget stop, a step the trace cannot run, the monitor's end, and planned arguments that Trainer runs
with."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import memfit
from memfit.devices import resolve_profile
from memfit.errors import ConfigError, OverBudget, PredictionUnavailable
from memfit.integrations.transformers import KEYS, MemfitCallback  # first: quiet imports of Trainer's libraries
from memfit.memory.tracker import StorageTracker
from memfit.planner.report import checkpointing_argument
from tests.conftest import TINY_BERT, TINY_LLAMA

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

LENGTH = 24


def _model() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "architectures"},
                                      vocab_size=512)
    return transformers.AutoModelForCausalLM.from_config(config)


def _rows(count: int = 32) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(3, 512, (LENGTH,), generator=generator).tolist()} for _ in range(count)]


def _dataset(count: int = 32) -> Any:
    return datasets.Dataset.from_list(_rows(count))


class _Examples(torch.utils.data.Dataset[dict[str, Any]]):
    """A map-style torch dataset (no columns): Trainer's collator drops what the model does not take."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.reads = [0] * len(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        self.reads[index] += 1
        return self.rows[index]


class _Stream(torch.utils.data.IterableDataset[dict[str, Any]]):
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __iter__(self) -> Any:
        return iter(self.rows)


def _collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    ids = torch.tensor([item["input_ids"] for item in items])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _trainer(tmp_path: Any, model: Any = None, callbacks: list[Any] | None = None, train_dataset: Any = None,
             data_collator: Any = _collate, **arguments: Any) -> Any:
    args = transformers.TrainingArguments(**{
        "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
        "max_steps": 3, "logging_steps": 1, "report_to": "none", "use_cpu": True, "save_strategy": "no",
        "disable_tqdm": True, **arguments})
    return transformers.Trainer(model=model or _model(), args=args,
                                train_dataset=_dataset() if train_dataset is None else train_dataset,
                                data_collator=data_collator, callbacks=callbacks)


def _peak_errors(trainer: Any) -> list[float]:
    """The measured peak's error against the prediction, of steps 2 on (the steady state)."""
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and all(set(KEYS) <= entry.keys() for entry in logged), logged
    return [entry["memfit/peak_error"] for entry in logged[1:]]


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


DATA = {"datasets": _dataset, "torch-map": lambda: _Examples(_rows()), "torch-stream": lambda: _Stream(_rows()),
        "datasets-stream": lambda: _dataset().to_iterable_dataset()}


@pytest.mark.parametrize("kind", DATA)
def test_a_callback_given_to_the_trainer_predicts_each_kind_of_training_data(
        tmp_path: Any, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    """``callbacks=[MemfitCallback()]`` as for any other callback, on a ``datasets.Dataset``, a map-style torch
    dataset and a stream (torch's and ``datasets``'); reporters added before it still receive its values."""
    reporter = _Reporter()
    callback = MemfitCallback()
    trainer = _trainer(tmp_path, callbacks=[reporter, callback], train_dataset=DATA[kind]())
    trainer.train()
    assert callback.predicted is not None and trainer.state.global_step == 3
    assert all(abs(error) <= 0.01 for error in _peak_errors(trainer)), trainer.state.log_history
    assert [set(KEYS) <= logs.keys() for logs in reporter.received if "loss" in logs] == [True] * 3
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("memfit:")]
    assert len(lines) == 1 and lines[0].startswith("memfit: this Trainer's step"), lines
    assert ("from the first 8 examples of a stream" in lines[0]) == kind.endswith("stream")


def test_the_widest_batch_of_a_map_style_dataset_reads_each_example_once(tmp_path: Any) -> None:
    from memfit.integrations.trainer_step import widest_batch

    rows = [{"input_ids": list(range(3, 3 + length))} for length in (5, 17, 9, 17, 30, 2, 30, 11)]
    examples = _Examples(rows)
    trainer = _trainer(tmp_path, train_dataset=examples, data_collator=transformers.DataCollatorWithPadding(
        _PadOnly(), padding="longest"), per_device_train_batch_size=3)
    widest = widest_batch(trainer)
    assert examples.reads == [1] * len(rows)
    assert widest.tensors["input_ids"].shape == (3, 30) and not widest.unpadded
    assert widest.tensors["attention_mask"].sum(dim=1).tolist() == [30, 30, 17]  # the longest, first of ties


class _PadOnly:
    """Just enough tokenizer for ``DataCollatorWithPadding``: pads ``input_ids`` with 0."""

    padding_side = "right"
    model_input_names = ("input_ids", "attention_mask")

    def pad(self, features: list[dict[str, Any]], **kwargs: Any) -> dict[str, torch.Tensor]:
        width = max(len(feature["input_ids"]) for feature in features)
        ids = torch.tensor([f["input_ids"] + [0] * (width - len(f["input_ids"])) for f in features])
        mask = torch.tensor([[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features])
        return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("remove", [True, False], ids=["remove-unused-columns", "keep-columns"])
def test_unused_columns_are_removed_as_trainer_removes_them(tmp_path: Any, remove: bool) -> None:
    """A torch dataset's examples with a column the model does not take: Trainer's collator drops it (or keeps it
    with ``remove_unused_columns=False``), and the widest batch memfit builds gets what the run's get."""
    seen: list[set[str]] = []

    def collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        seen.append(set(items[0]))
        return _collate(items)

    rows = [{**row, "source": f"row {index}"} for index, row in enumerate(_rows())]
    trainer = _trainer(tmp_path, train_dataset=_Examples(rows), data_collator=collate, remove_unused_columns=remove,
                       max_steps=1, callbacks=[MemfitCallback()])
    trainer.train()
    assert trainer.state.global_step == 1
    assert seen == [{"input_ids"} if remove else {"input_ids", "source"}] * len(seen) and len(seen) >= 3


def test_an_over_budget_step_stops_before_the_first_step(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """The callback raises memfit's exception (a RuntimeError), not SystemExit, before any optimizer step; its
    advice is checked on the Trainer's own step (memfit's plan chose a loss in chunks, which Trainer has not)."""
    trainer = _trainer(tmp_path, callbacks=[MemfitCallback(budget=1_300_000)])  # the step needs about 1.5 MiB
    with pytest.raises(memfit.OverBudget, match=r"over the budget of 1\.2 MiB; a plan that fits \(effective batch 8 "
                       r"kept, 1\.\d MiB in this Trainer's step\): per_device_train_batch_size=2, ") as stopped:
        trainer.train()
    assert isinstance(stopped.value, RuntimeError) and "\n" not in str(stopped.value)
    assert trainer.state.global_step == 0 and not trainer.optimizer.state
    assert stopped.value.budget_bytes == 1_300_000 and stopped.value.predicted.total_bytes > 1_300_000
    assert stopped.value.advice in str(stopped.value) and "chunks" not in stopped.value.advice
    assert "memfit: this Trainer's step" in capsys.readouterr().err


def test_advice_that_does_not_fit_the_trainers_own_step_is_not_given(tmp_path: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's setup is traced on the Trainer before it is advised: one the Trainer's step does not fit in
    (here the plan stands in with the Trainer's own arguments) is reported as over the budget too."""
    from memfit.integrations import trainer_plan
    from memfit.planner import Plan

    def plan_of_its_own(model: Any, **options: Any) -> trainer_plan.TrainerPlan:
        arguments = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "fp16": False,
                     "bf16": False, checkpointing_argument(): False, "optim": "adamw_torch_fused"}
        planned = Plan(chosen=None, candidates=[], budget_bytes=1, usable_bytes=1, margin=0.0, device="cpu",
                       device_description="cpu", model="llama", effective_batch=8, sequence_length=LENGTH,
                       image_size=None, verdict="", traces=0, seconds=0.0, config={})
        return trainer_plan.TrainerPlan(training_arguments=arguments, lora_config=None, quantization_config=None,
                                        plan=planned)

    monkeypatch.setattr(trainer_plan, "plan_trainer_arguments", plan_of_its_own)
    trainer = _trainer(tmp_path, callbacks=[MemfitCallback(budget=1_300_000)])
    with pytest.raises(OverBudget, match=r"memfit's plan \(per_device_train_batch_size=4, .*\) needs 1\.5 MiB in "
                       r"this Trainer's own step, over the budget too"):
        trainer.train()


def test_a_world_of_processes_gets_per_device_arguments_that_add_up_to_the_effective_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainer's batch arguments are each process's: a plan for 2 processes at effective batch 8 splits 4 per
    process, not 8 (which 2 processes would double)."""
    from memfit.integrations import trainer_plan

    planned = trainer_plan.plan_trainer_arguments(_model(), budget="2GiB", effective_batch=8, world_size=2,
                                                  seq_len=LENGTH, device="cpu", precisions=("fp32",))
    arguments = planned.training_arguments
    assert arguments["per_device_train_batch_size"] * arguments["gradient_accumulation_steps"] == 4
    with pytest.raises(ConfigError, match="effective batch 9 does not split evenly over 2 processes"):
        trainer_plan.per_device_batch(9, 2)
    asked: dict[str, Any] = {}
    monkeypatch.setattr(trainer_plan, "plan_trainer_arguments", lambda model, **options: asked.update(options) or
                        planned)
    ranks = SimpleNamespace(args=SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                                 world_size=2, fp16=False, bf16=False), model=_model())
    advice = trainer_plan.plan_for_trainer(ranks, budget=1 << 30, profile=resolve_profile("cpu"), seq_len=LENGTH,
                                           recheck=False)
    assert asked["effective_batch"] == 16 and asked["world_size"] == 2
    assert advice.startswith("a plan that fits (effective batch 16 kept over 2 processes")


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
    fake weights cannot stand for: a budget cannot be checked, said before any step, naming memfit's own
    estimate of that setup."""
    pytest.importorskip("bitsandbytes")

    directory = tmp_path / "llama"
    _model().save_pretrained(directory)
    peft = pytest.importorskip("peft")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, quantization_config=transformers.BitsAndBytesConfig(load_in_8bit=True))
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    trainer = _trainer(tmp_path, model=model)
    MemfitCallback.attach(trainer, budget="1GiB")
    with pytest.raises(PredictionUnavailable, match=r"8-bit .* --quantize-base int8\), so the budget of 1\.0 GiB "
                       "cannot be checked"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_an_fp16_trainers_scaler_is_left_to_the_run(tmp_path: Any) -> None:
    """A CPU stand-in for an fp16 Trainer on a card: accelerate's GradScaler scales the loss, and clipping
    (``max_grad_norm`` 1.0) unscales through it. The trace unscales and updates a scaler of its own each window,
    so neither its second window nor the run's first step finds the run's scaler already unscaled."""
    trainer = _trainer(tmp_path, fp16=True, max_grad_norm=1.0, callbacks=[MemfitCallback()])
    trainer.accelerator.scaler, trainer.accelerator.native_amp = torch.amp.GradScaler("cpu"), True  # as on CUDA
    trainer.train()
    assert trainer.state.global_step == 3 and trainer.accelerator.scaler.get_scale() > 0
    assert _peak_errors(trainer) == [0, 0]


def _value_reading_model() -> Any:
    """JetMoE routes each token with a loop over the experts its router picked (``.tolist()``): values fake
    tensors lack."""
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.JetMoeConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_key_value_heads=2,
        kv_channels=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128))


def test_a_step_the_trace_cannot_run_warns_and_trains_on(tmp_path: Any, capfd: pytest.CaptureFixture[str]) -> None:
    """A model whose forward reads the batch's values cannot be traced: without a budget one line says so and
    the Trainer trains on; the fake tensors' own error log does not reach the user."""
    trainer = _trainer(tmp_path, model=_value_reading_model(), callbacks=[MemfitCallback()])
    trainer.train()
    assert trainer.state.global_step == 3
    assert not any(key in entry for entry in trainer.state.log_history for key in KEYS)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "memfit" in line]
    assert len(lines) == 1 and re.fullmatch(r"memfit: warning: no prediction of this Trainer's step \(jetmoe: not "
                                            r"supported yet \(.+\)\); training goes on "
                                            r"without memfit's prediction and measurement", lines[0]), lines
    assert "fake_tensor" not in err and "Traceback" not in err


def test_a_budget_that_cannot_be_checked_is_said_in_one_line(tmp_path: Any) -> None:
    trainer = _trainer(tmp_path, model=_value_reading_model(), callbacks=[MemfitCallback(budget="1GiB")])
    pattern = (r"^no prediction of this Trainer's step \(jetmoe: not supported yet [^\n]+\), so the budget of 1\.0 GiB "
               r"cannot be checked; [^\n]+$")
    with pytest.raises(memfit.PredictionUnavailable, match=pattern) as unavailable:
        trainer.train()
    assert isinstance(unavailable.value, RuntimeError)
    assert unavailable.value.reason.startswith("jetmoe: not supported yet (")
    assert trainer.state.global_step == 0


def test_a_mixture_of_experts_step_is_predicted_by_the_trainer_callback(tmp_path: Any) -> None:
    """The grouped experts trace like any other op (memfit.memory.moe): the callback predicts and measures."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128))
    trainer = _trainer(tmp_path, model=model, callbacks=[MemfitCallback()])
    trainer.train()
    assert all(abs(error) <= 0.005 for error in _peak_errors(trainer))


class _Failing(transformers.TrainerCallback):
    """Raises at the end of step 2, as an error (or Ctrl-C) in a training loop would: Trainer then calls no
    ``on_train_end``."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 2:
            raise RuntimeError("stopped at step 2")


def _trackers() -> list[Any]:
    return [mode for mode in _get_current_dispatch_mode_stack() if isinstance(mode, StorageTracker)]


def test_the_monitor_closes_when_training_raises(tmp_path: Any) -> None:
    """On CPU the monitor is a dispatch mode that sees every op: a train() that raises closes it, and the next
    train() measures with one monitor, as the first."""
    failing = _Failing()
    callback = MemfitCallback()
    trainer = _trainer(tmp_path, callbacks=[callback, failing])
    with pytest.raises(RuntimeError, match="stopped at step 2"):
        trainer.train()
    assert _trackers() == [] and callback.monitor is None
    trainer.remove_callback(failing)
    trainer.train()
    assert trainer.state.global_step == 3 and _trackers() == []
    assert _peak_errors(trainer) == [0, 0]


class _Uncopyable(_Examples):
    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise TypeError("this dataset is not to be copied")


def test_the_trace_copies_none_of_the_trainers_datasets(tmp_path: Any) -> None:
    """A list as the training data and a dict of evaluation datasets stay the objects they are: the trace puts
    back only what it changes (a dataset that cannot be deep-copied trains too)."""
    rows = _rows()
    held_out = _Uncopyable(_rows(8))
    trainer = _trainer(tmp_path, train_dataset=rows, callbacks=[MemfitCallback()])
    trainer.eval_dataset = {"held_out": held_out}
    trainer.train()
    assert trainer.state.global_step == 3 and trainer.train_dataset is rows
    assert trainer.eval_dataset["held_out"] is held_out


@pytest.mark.parametrize("budget", [None, "1GiB"], ids=["no-budget", "budget"])
def test_a_device_other_than_cpu_or_cuda_is_not_supported(tmp_path: Any, capsys: pytest.CaptureFixture[str],
                                                          budget: str | None) -> None:
    """On MPS or XPU the callback says "not supported" in one line (the trainer is asked as if it ran there)."""
    from memfit.memory.monitor import Monitor

    with pytest.raises(ConfigError, match="mps: not supported"):
        Monitor("mps")
    callback = MemfitCallback(budget=budget)
    trainer = _trainer(tmp_path, callbacks=[callback])
    on_mps = SimpleNamespace(device=torch.device("mps"))
    if budget is None:
        callback.on_train_begin(on_mps, trainer.state, trainer.control)  # type: ignore[arg-type]
        lines = capsys.readouterr().err.splitlines()
        assert lines == ["memfit: warning: no prediction of this Trainer's step (the Trainer runs on mps: not "
                         "supported (memfit predicts and measures Trainers on cpu and cuda)); training goes on "
                         "without memfit's prediction and measurement"]
        assert callback.monitor is None and callback.predicted is None
    else:
        with pytest.raises(PredictionUnavailable, match=r"the Trainer runs on mps: not supported"):
            callback.on_train_begin(on_mps, trainer.state, trainer.control)  # type: ignore[arg-type]


def _plan_with(made: Any, **family: Any) -> Any:
    chosen = made.chosen
    return dataclasses.replace(made, chosen=dataclasses.replace(chosen, family=dataclasses.replace(chosen.family,
                                                                                                     **family)))


@pytest.fixture(scope="module")
def lora_plan(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """(a plan of LoRA r=4 for a tiny LLM, its model directory)."""
    from memfit import TrainConfig
    from memfit.planner import plan
    from tests.conftest import write_tiny_llm

    directory = write_tiny_llm(tmp_path_factory.mktemp("lora") / "llm")
    made = plan(TrainConfig(model=str(directory), task="causal-lm", lora_rank=4, max_length=16, effective_batch=4),
                device="cpu", budget="1GiB", seq_len=16, precisions=("fp32",))
    return made, directory


def test_trainer_advice_refuses_a_loss_in_chunks(lora_plan: tuple[Any, Any]) -> None:
    """Trainer computes the loss over the whole sequence: a plan whose only fitting setup computes it in chunks
    is not printed as Trainer arguments (whose peak would be higher than the plan's)."""
    from memfit.integrations.trainer_plan import trainer_snippet

    with pytest.raises(ConfigError, match=r"only memfit's loss in chunks of 256 positions fits .*: Trainer computes "
                       "the loss over the whole sequence"):
        trainer_snippet(_plan_with(lora_plan[0], loss_chunk=256))


def test_a_16bit_lora_plan_stores_its_frozen_base_in_16_bits(lora_plan: tuple[Any, Any], tmp_path: Any) -> None:
    """memfit's LoRA plan under bf16 keeps the frozen base in bf16; the Trainer snippet does the same, with
    memfit's own function, so the Trainer's step is the one the plan measured."""
    from memfit.integrations.trainer_plan import trainer_snippet

    made, directory = lora_plan
    snippet = trainer_snippet(_plan_with(made, precision="bf16"))
    assert "store_frozen(model, torch.bfloat16)" in snippet
    namespace: dict[str, Any] = {"model": transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(directory))}
    exec(compile(snippet.replace('output_dir="out"', f'output_dir="{tmp_path / "out"}"'), "<plan>", "exec"),
         namespace)
    dtypes = {(parameter.requires_grad, parameter.dtype) for parameter in namespace["model"].parameters()}
    assert (True, torch.float32) in dtypes and (False, torch.bfloat16) in dtypes
    assert "store_frozen" not in trainer_snippet(made)  # fp32: nothing to store


@pytest.mark.parametrize("head", ["BertForMaskedLM", "T5ForConditionalGeneration"])
def test_heads_memfit_does_not_plan_are_refused_in_one_line(head: str) -> None:
    from memfit.integrations.trainer_plan import plan_trainer_arguments

    config = transformers.BertConfig(**{k: v for k, v in TINY_BERT.items() if k != "architectures"}) \
        if head.startswith("Bert") else transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32,
                                                              num_layers=1, num_heads=2)
    model = getattr(transformers, head)(config)
    kind = "masked-LM" if head.startswith("Bert") else "sequence-to-sequence"
    with pytest.raises(ConfigError, match=rf"^{head} is a {kind} model: memfit plans causal LMs and sequence or "
                       "image classifiers, not its head"):
        plan_trainer_arguments(model, budget="1GiB", effective_batch=4, seq_len=16, device="cpu")
