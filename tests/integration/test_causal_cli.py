"""``memfit train --task causal-lm`` end to end through the real CLI: instruction data, zero-shot and fine-tuned
accuracy, the saved causal LM, ``memfit generate``, the estimate against the run, and bad inputs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import transformers

from memfit import TrainConfig
from memfit.memory.estimate import estimate
from tests.conftest import FILLER, write_pairs, write_tiny_llm
from tests.helpers import memfit, read_metrics, run_main


def test_a_chat_run_reports_accuracy_before_and_after_and_saves_a_causal_lm(tmp_path: Path) -> None:
    model, data = write_tiny_llm(tmp_path / "llm"), write_pairs(tmp_path / "chat.jsonl", count=64, chat=True)
    out = tmp_path / "run"
    result = memfit("train", "--model", str(model), "--data", str(data), "--max-length", "32", "--effective-batch",
                    "8", "--micro-batch-size", "4", "--precision", "fp32", "--epochs", "2", "--lr", "3e-3",
                    "--eval-before", "--output-dir", str(out), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["task"] == "causal-lm"
    assert summary["val_accuracy_before"] is not None and summary["val_perplexity"] > 1.0
    evaluations = read_metrics(out, "eval")
    assert [record["epoch"] for record in evaluations] == [0, 1, 2]
    assert evaluations[-1]["loss"] < evaluations[0]["loss"]  # it learned the completions
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out / "model"))
    assert loaded.config.architectures == ["LlamaForCausalLM"]
    assert loaded.config.use_cache  # trained without a KV cache, saved for inference with one, as loaded
    assert (out / "model" / "generation_config.json").is_file()
    generated = memfit("generate", str(out), "--prompt", "review : the film is great . verdict ?",
                       "--max-new-tokens", "2")
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.strip() and not generated.stderr.strip()
    refused = memfit("quantize", str(out))  # int8 export is for classification models: said in one line
    assert refused.returncode == 2 and "is a causal LM" in refused.stderr and "Traceback" not in refused.stderr


@pytest.mark.parametrize("loss_chunk", [None, 8])
def test_the_estimate_is_the_peak_of_a_causal_run(tmp_path: Path, loss_chunk: int | None) -> None:
    """Texts that all fill --max-length (prompts cut from the left): no micro-batch is padded."""
    model = write_tiny_llm(tmp_path / "llm", chat=False)
    data = tmp_path / "long.jsonl"
    rng = random.Random(0)
    data.write_text("".join(json.dumps({"prompt": " ".join(rng.choices(FILLER, k=30)), "completion": " yes"})
                            + "\n" for _ in range(24)))
    config = TrainConfig(model=str(model), data=str(data), max_length=16, effective_batch=8, micro_batch_size=4,
                         precision="bf16", max_steps=2, output_dir=str(tmp_path / "run"), device="cpu",
                         loss_chunk=loss_chunk)
    result = memfit("train", "--config", str(_write_config(tmp_path, config)), "--json")
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout)["peak_memory_by_phase"]
    predicted = estimate(config, padded=False)
    assert {name: measured[name] for name in predicted.phases} == predicted.phases


def _write_config(tmp_path: Path, config: TrainConfig) -> Path:
    path = tmp_path / "config.json"
    values = {name: value for name, value in config.to_dict().items() if value is not None}
    path.write_text(json.dumps(values))
    return path


def test_bad_causal_inputs_are_one_line_and_write_nothing(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    plain = write_tiny_llm(tmp_path / "plain", chat=False)
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "review", "completion": " yes" * 40}) + "\n" + json.dumps(
        {"prompt": "review", "completion": " no"}) + "\n")
    cases = [(["--data", str(long), "--max-length", "16"], "completion alone is 40 tokens"),
             (["--data", str(write_pairs(tmp_path / "chat.jsonl", chat=True))], "no chat template")]
    for index, (options, message) in enumerate(cases):
        out = tmp_path / "never"
        args = ["train", "--model", str(plain), *options, "--output-dir", str(out)]
        if index == 0:  # as a user runs it: the exit code and stderr of the process
            result = memfit(*args)
            code, err = result.returncode, result.stderr
        else:  # the same main(), in this process
            code, _, err = run_main(args, capsys)
        assert code == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0] and "Traceback" not in err
        assert not out.exists()
