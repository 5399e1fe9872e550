import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from memfit.errors import ConfigError
from memfit.models import PRESETS, build_model, embedding_modules, load_tokenizer, resolve_model, transformer_layers
from tests.conftest import TINY_GPT2, TINY_VIT, write_model_dir

LAYERS = {"bert-large": 24, "vit-large": 24, "distilbert-base": 6, "smollm2-360m": 32, "smollm2-1.7b": 24,
          "qwen2.5-0.5b": 24, "qwen2.5-1.5b": 28, "qwen2.5-3b": 36, "qwen2.5-7b": 28, "qwen2.5-32b": 64,
          "llama-3.2-1b": 16, "llama-3.2-3b": 28, "llama-3.1-8b": 32, "llama-3.1-70b": 80, "mistral-7b": 32,
          "phi-3.5-mini": 32, "gemma-2-2b": 26, "olmoe-1b-7b": 16, "deepseek-v2-lite": 27, "gpt-oss-20b": 24,
          "qwen3-30b-a3b": 48, "mixtral-8x7b": 32}


@pytest.mark.parametrize("name", [p for p in PRESETS if p not in ("minilm", "smollm2-135m")])
def test_presets_resolve_from_config_alone(name: str) -> None:
    spec = resolve_model(name)
    assert not spec.is_pretrained
    assert spec.modality == ("vision" if name.startswith(("vit", "deit")) else "text")
    assert spec.num_layers == LAYERS.get(name, 12)


def test_minilm_is_pretrained() -> None:
    spec = resolve_model("minilm")
    assert spec.is_pretrained and spec.num_layers == 6 and spec.head_labels is None


def test_hub_names_fail_offline_with_a_clear_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match=r"it is not in the local cache .* and HF_HUB_OFFLINE is set"):
        resolve_model("bert-base-uncased/extra")
    with pytest.raises(ConfigError, match=r"is not a preset, a local directory or a Hub id \(org/name\[@revision\]\) "
                                          r"\(presets: minilm, bert-base"):
        resolve_model("bert-huge")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no config\.json"):
        resolve_model(str(tmp_path))


def test_config_only_directory_is_random_init(tiny_bert: Path) -> None:
    spec = resolve_model(str(tiny_bert))
    assert not spec.is_pretrained and spec.tokenizer_dir is None  # no tokenizer of its own
    assert len(load_tokenizer(spec)) == 30522  # the packaged WordPiece vocabulary, loaded when text is tokenised


def test_presets_resolve_without_the_packaged_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    """Estimating and planning never tokenise: a machine without the MiniLM package can still do both."""
    import memfit.models

    def missing() -> Path:
        raise ConfigError("the packaged weights are not installed")

    monkeypatch.setattr(memfit.models, "packaged_minilm_dir", missing)
    spec = resolve_model("bert-base")
    assert spec.modality == "text" and spec.num_layers == 12
    with pytest.raises(ConfigError, match="not installed"):
        load_tokenizer(spec)


def test_saved_head_is_detected(tmp_path: Path) -> None:
    config = transformers.BertConfig(**{k: v for k, v in json.loads(json.dumps(TINY_GPT2)).items()
                                        if k == "vocab_size"}, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32, num_labels=3)
    transformers.BertForSequenceClassification(config).save_pretrained(tmp_path / "clf")
    assert resolve_model(str(tmp_path / "clf")).head_labels == 3


@pytest.mark.parametrize("task", ["causal-lm", "classification"])
def test_weights_saved_in_bf16_are_trained_in_fp32_as_the_estimate_counts_them(tmp_path: Path, task: str) -> None:
    """A Hub LLM's checkpoint is bf16 and says so in its config; transformers keeps it (``dtype="auto"``), and a
    run would then update bf16 weights the estimator and the chosen precision take for fp32. A LoRA base stored in
    16 bits anyway stays as saved (no fp32 copy at load)."""
    import torch

    from memfit.build import build_with_techniques
    from memfit.config import TrainConfig
    from memfit.memory.estimate import estimate
    from tests.conftest import write_tiny_llm

    model = write_tiny_llm(tmp_path / "llm")
    saved = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model))
    saved.to(torch.bfloat16).save_pretrained(model)
    assert json.loads((model / "config.json").read_text())["dtype"] == "bfloat16"
    spec = resolve_model(str(model))
    config = TrainConfig(model=str(model), task=task, max_length=16, effective_batch=2, precision="fp32")
    built = build_with_techniques(spec, config, label_names=["a", "b"], pad_token_id=0, task=task)
    assert {parameter.dtype for parameter in built.parameters()} == {torch.float32}
    torch.testing.assert_close(built.model.embed_tokens.weight, saved.model.embed_tokens.weight.float(), rtol=0,
                               atol=0)
    assert estimate(config, device="cpu", seq_len=16).breakdown["parameters"] == 4 * sum(
        parameter.numel() for parameter in built.parameters())

    def layout(directory: Path, saved_dtype: torch.dtype, low: torch.dtype) -> dict[str, torch.dtype]:
        saved.to(saved_dtype).save_pretrained(directory)
        lora = build_with_techniques(resolve_model(str(directory)), TrainConfig(
            model=str(directory), task=task, lora_rank=4, precision="bf16" if low == torch.bfloat16 else "fp16"),
            label_names=["a", "b"], pad_token_id=0, task=task, low_dtype=low)
        return {name: parameter.dtype for name, parameter in lora.named_parameters()}

    # a LoRA base kept in 16 bits loads as saved, laid out as an fp32 checkpoint's: frozen weights in the run's
    # 16 bits, the adapters, a trained head and the norms in fp32 (an fp16 head under fp16 fails to unscale)
    expected = layout(tmp_path / "fp32", torch.float32, torch.float16)
    assert {dtype for dtype in expected.values()} == {torch.float16, torch.float32}
    assert layout(tmp_path / "fp16", torch.float16, torch.float16) == expected
    assert layout(model, torch.bfloat16, torch.float16) == expected


def test_a_16_bit_vision_checkpoint_keeps_its_batch_norm_statistics_in_fp32(tmp_path: Path) -> None:
    import torch

    from memfit.build import build_with_techniques
    from memfit.config import TrainConfig

    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=2,
                                       image_size=32)
    transformers.ResNetForImageClassification(config).to(torch.float16).save_pretrained(tmp_path / "resnet")
    run = TrainConfig(model=str(tmp_path / "resnet"), precision="fp32")
    built = build_with_techniques(resolve_model(str(tmp_path / "resnet")), run, label_names=["a", "b"],
                                  pad_token_id=None)
    assert {tensor.dtype for tensor in [*built.parameters(), *built.buffers()] if tensor.is_floating_point()} == {
        torch.float32}
    built(pixel_values=torch.zeros(1, 3, 32, 32))  # a 16-bit running mean fails an fp32 batch norm


def test_a_pretrained_decoder_without_a_pad_id_takes_the_tokenizers_for_classification(tmp_path: Path) -> None:
    """Its head pools each row at the last token that is not padding: without a pad id, a batch of 2 fails."""
    import torch

    from tests.conftest import write_tiny_llm

    model = write_tiny_llm(tmp_path / "llm")
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model)).save_pretrained(
        model)
    assert json.loads((model / "config.json").read_text()).get("pad_token_id") is None
    classifier = build_model(resolve_model(str(model)), label_names=["a", "b"], pad_token_id=0)
    assert classifier.config.pad_token_id == 0
    classifier(input_ids=torch.tensor([[5, 6, 0], [5, 6, 7]]), attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]))


@pytest.mark.parametrize(("config", "layers", "embedding_names"), [
    (TINY_GPT2, 2, {"wte", "wpe"}),
    (TINY_VIT, 2, {"embeddings"}),
])
def test_layers_and_embeddings_are_found(tmp_path: Path, config: dict, layers: int,
                                         embedding_names: set[str]) -> None:
    spec = resolve_model(str(write_model_dir(tmp_path / "m", config)))
    model = build_model(spec, label_names=["a", "b"], pad_token_id=0)
    assert len(transformer_layers(model)) == layers
    found = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if any(module is m for m in embedding_modules(model))}
    assert found == embedding_names


def test_importing_memfit_leaves_the_process_settings_alone() -> None:
    """No HF_HUB_OFFLINE exported to child processes, transformers' verbosity and progress bars untouched: only
    memfit's own calls are quiet (importing does no network request)."""
    script = (
        "import os, transformers\n"
        "before = (transformers.logging.get_verbosity(), transformers.utils.logging.is_progress_bar_enabled())\n"
        "import memfit.models, memfit.integrations.transformers, memfit.memory.estimate\n"
        "after = (transformers.logging.get_verbosity(), transformers.utils.logging.is_progress_bar_enabled())\n"
        "assert 'HF_HUB_OFFLINE' not in os.environ and 'TRANSFORMERS_OFFLINE' not in os.environ, os.environ\n"
        "assert before == after, (before, after)\n")
    env = {name: value for name, value in os.environ.items() if name not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr


def test_memfit_calls_are_quiet_and_restore_transformers_settings(tiny_bert: Path) -> None:
    from memfit.quiet import quiet_transformers

    transformers.logging.set_verbosity_warning()
    try:
        with quiet_transformers():
            assert transformers.logging.get_verbosity() == transformers.logging.ERROR
            resolve_model(str(tiny_bert))
        assert transformers.logging.get_verbosity() == transformers.logging.WARNING
        assert transformers.utils.logging.is_progress_bar_enabled()
    finally:
        transformers.logging.set_verbosity_warning()
