from pathlib import Path

import pytest

from memfit.config import TrainConfig, from_mapping, load_config_file
from memfit.errors import ConfigError


def test_validate_reports_every_problem_together() -> None:
    config = TrainConfig(precision="fp8", accumulation_steps=0, checkpointing="some", lr=-1.0)
    with pytest.raises(ConfigError) as caught:
        config.validate()
    problems = caught.value.problems
    assert len(problems) == 4
    assert any("--precision 'fp8' is not one of: auto, fp32, fp16, bf16" in p for p in problems)
    assert any("--accumulation-steps must be >= 1" in p for p in problems)
    assert any("--checkpointing 'some'" in p for p in problems)
    assert any("--lr must be a positive number" in p for p in problems)


def test_micro_batch_and_accumulation_are_derived() -> None:
    assert TrainConfig(effective_batch=32).resolved_accumulation_steps == 1
    config = TrainConfig(effective_batch=32, micro_batch_size=8)
    assert (config.resolved_micro_batch_size, config.resolved_accumulation_steps) == (8, 4)
    config = TrainConfig(effective_batch=32, accumulation_steps=4)
    assert (config.resolved_micro_batch_size, config.resolved_accumulation_steps) == (8, 4)
    config = TrainConfig(effective_batch=32, micro_batch_size=10)  # 10 + 10 + 10 + 2
    assert config.resolved_accumulation_steps == 4


def test_both_micro_batch_and_accumulation_is_an_error() -> None:
    with pytest.raises(ConfigError, match="either --micro-batch-size or --accumulation-steps"):
        TrainConfig(micro_batch_size=4, accumulation_steps=8).validate()


def test_unknown_keys_are_reported() -> None:
    config = from_mapping({"max-length": 16, "learning_rat": 0.1})
    assert config.max_length == 16
    with pytest.raises(ConfigError, match="unknown option\\(s\\): learning_rat"):
        config.validate()


def test_config_files_toml_and_yaml(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('[train]\nmodel = "bert-base"\nmicro-batch-size = 4\n')
    assert load_config_file(str(toml)) == {"model": "bert-base", "micro-batch-size": 4}
    yaml = tmp_path / "run.yaml"
    yaml.write_text("precision: fp32\nepochs: 3\n")
    assert from_mapping(load_config_file(str(yaml))).epochs == 3
    with pytest.raises(ConfigError, match="no such file"):
        load_config_file(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("model = \n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config_file(str(bad))


def test_train_accepts_a_gpu_profile_file_and_reports_a_broken_one(tmp_path: Path) -> None:
    card = tmp_path / "card.toml"
    card.write_text('name = "card"\nmemory_bytes = 8589934592\ncompute_capability = [7, 5]\nfp32_flops = 1e13\n')
    config = TrainConfig(device=str(card))
    config.validate()
    assert config.plans  # trained on CUDA, planned for that card
    card.write_text("name = = 1\n")
    with pytest.raises(ConfigError, match=r"--device .*card.toml: cannot parse"):
        TrainConfig(device=str(card)).validate()
    with pytest.raises(ConfigError, match="no such file"):
        TrainConfig(device=str(tmp_path / "missing.json")).validate()
