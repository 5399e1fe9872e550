"""The packaged SmolLM2 conversion: processes that need it at once convert it once, and each gets it whole."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import transformers

from memfit import packaged

CONVERTED = ["config.json", "memfit-source.json", "model.safetensors", "tokenizer.json"]


class SlowModel:
    """Stands in for the dequantised model: saving it takes a while, file by file, as the real 30 s does."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(architectures=None)
        self.hf_quantizer = None

    def save_pretrained(self, directory: Path, **kwargs: Any) -> None:
        for name in ("config.json", "model.safetensors"):
            time.sleep(0.3)
            (Path(directory) / name).write_text(name)


class Tokenizer:
    def save_pretrained(self, directory: Path) -> None:
        (Path(directory) / "tokenizer.json").write_text("{}")


def test_two_conversions_at_once_convert_once_and_both_load_the_whole_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("gguf")  # the conversion's own requirement, checked before it starts
    gguf_file = tmp_path / "package" / packaged.SMOLLM2_FILE
    gguf_file.parent.mkdir()
    gguf_file.write_bytes(b"GGUF")
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(packaged, "package_file", lambda package, name: gguf_file)
    loads: list[str] = []

    def load_model(path: str, **kwargs: Any) -> SlowModel:
        loads.append(path)
        return SlowModel()

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path, **kwargs: Tokenizer())
    start = threading.Barrier(2)
    seen: list[list[str]] = []
    errors: list[BaseException] = []
    lines: list[str] = []

    def convert() -> None:
        start.wait()
        try:
            directory = packaged.smollm2_dir(log=lines.append)
            seen.append(sorted(path.name for path in directory.iterdir()))  # read as a loader would, at once
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    assert len(loads) == 1  # the second caller waited and took the first one's result
    assert sorted(line.split()[0] for line in lines) == ["converting", "waiting"]
    assert seen == [CONVERTED, CONVERTED]
    leftovers = sorted(path.name for path in (tmp_path / "cache").iterdir())
    assert leftovers == ["smollm2-135m-instruct", "smollm2-135m-instruct.lock"]  # no staging directory left
    assert packaged.smollm2_dir() == tmp_path / "cache" / "smollm2-135m-instruct" and len(loads) == 1
