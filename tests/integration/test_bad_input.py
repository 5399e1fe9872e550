"""Every bad input of the table in docs/bad-inputs.md: one clear line, exit code 2, no traceback, no file touched.

The cases run the real CLI entry point in-process (``memfit.cli.main``), which is what the ``memfit`` script
calls; a few subprocess runs in test_cli.py cover the script itself.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.console import Console

from memfit.cli import main
from memfit.engine import train
from tests.conftest import TINY_BERT, tiny_config, write_model_dir, write_reviews

DOC = Path(__file__).parents[2] / "docs" / "bad-inputs.md"
Setup = Callable[[Path], list[str]]


def base(work: Path, *extra: str, data: Path | None = None, model: Path | None = None) -> list[str]:
    return ["train", "--model", str(model or work / "bert"), "--data", str(data or work / "reviews.csv"),
            "--text-column", "review", "--label-column", "sentiment", "--max-length", "32",
            "--output-dir", str(work / "out"), "--max-steps", "2", *extra]


def file(work: Path, name: str, content: bytes | str) -> Path:
    path = work / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def images(work: Path, broken: bool) -> Path:
    from PIL import Image

    for label in ("cat", "dog"):
        for index in range(2):
            Image.new("L", (8, 8), color=index * 80).save(file(work, f"pics/{label}/{index}.png", b""))
    if broken:
        file(work, "pics/dog/broken.png", b"\x89PNG\r\n\x1a\n not really an image")
    return work / "pics"


def two_gpu_plan(work: Path) -> Path:
    """A plan saved for 2 GPUs (DDP) of the tiny BERT."""
    from memfit.planner.families import Candidate, Family
    from memfit.planner.report import Plan

    chosen = Candidate(family=Family(precision="fp32", checkpointing="none", kernels="loop", strategy="ddp"),
                       micro_batch_size=2, accumulation_steps=2, predicted_peak_bytes=1 << 20,
                       predicted_allocated_bytes=1 << 20, peak_phase="backward", predicted_samples_per_second=1.0,
                       exact=True, fits=True, world_size=2)
    path = work / "plan-2-gpus.json"
    Plan(chosen=chosen, candidates=[chosen], budget_bytes=1 << 30, usable_bytes=1 << 29, margin=0.05, device="cpu",
         device_description="host CPU", model=str(work / "bert"), effective_batch=8, sequence_length=32,
         image_size=None, verdict="fits", traces=1, seconds=0.0).save(path)
    return path


def finished_run(work: Path, **overrides: object) -> Path:
    """A real short run with a checkpoint in ``work/out``."""
    config = tiny_config(work / "bert", work / "reviews.csv", work / "out", max_steps=2, save_every=2, **overrides)
    train(config, console=Console(file=io.StringIO()))
    return work / "out"


def corrupt_checkpoint(work: Path) -> list[str]:
    out = finished_run(work)
    state = out / "checkpoints" / "step-00000002" / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    return base(work, "--resume", str(out / "checkpoints" / "step-00000002"))


def other_model(work: Path) -> list[str]:
    finished_run(work)
    wide = write_model_dir(work / "wide", {**TINY_BERT, "hidden_size": 64})
    return base(work, "--resume", model=wide)


CASES: dict[str, tuple[Setup, str]] = {
    # --- CLI values and units ---
    "unknown-flag": (lambda w: base(w, "--bogus"), "unrecognized arguments: --bogus"),
    "not-an-integer": (lambda w: base(w, "--effective-batch", "lots"), "invalid int value: 'lots'"),
    "unknown-choice": (lambda w: base(w, "--precision", "fp8"), "invalid choice: 'fp8'"),
    "zero-batch": (lambda w: base(w, "--effective-batch", "0"), "--effective-batch must be >= 1 (got 0)"),
    "micro-above-effective": (lambda w: base(w, "--micro-batch-size", "64"),
                              "--micro-batch-size 64 is larger than --effective-batch 32"),
    "micro-and-accumulation": (lambda w: base(w, "--micro-batch-size", "4", "--accumulation-steps", "2"),
                               "give either --micro-batch-size or --accumulation-steps"),
    "negative-lr": (lambda w: base(w, "--lr", "-1"), "--lr must be a positive number (got -1.0)"),
    "val-fraction-range": (lambda w: base(w, "--val-fraction", "1.5"), "--val-fraction must be between 0 and 1"),
    "budget-without-unit": (lambda w: base(w, "--emulate-budget", "300"), "'300' is not a memory size"),
    "budget-unknown-unit": (lambda w: base(w, "--emulate-budget", "11G"), "'11G' is not a memory size"),
    "save-every-zero": (lambda w: base(w, "--save-every", "0"), "--save-every must be >= 1 (got 0)"),
    "resume-and-overwrite": (lambda w: base(w, "--resume", "--overwrite"), "give either --resume or --overwrite"),
    "fp16-on-cpu": (lambda w: base(w, "--precision", "fp16", "--device", "cpu"), "--force-cpu-fp16"),
    "too-many-top-layers": (lambda w: base(w, "--train-top-layers", "9"), "larger than"),
    "sequence-too-long": (lambda w: base(w, "--max-length", "600"), "exceeds the model's 128 positions"),
    # --- config files ---
    "config-missing": (lambda w: base(w, "--config", str(w / "nope.toml")), "nope.toml: no such file"),
    "config-invalid-toml": (lambda w: base(w, "--config", str(file(w, "bad.toml", "lr = = 3"))), "cannot parse"),
    "config-unknown-key": (lambda w: base(w, "--config", str(file(w, "typo.toml", "learning_rate = 0.1"))),
                           "unknown option(s): learning_rate"),
    "config-wrong-type": (lambda w: base(w, "--config", str(file(w, "type.json", '{"epochs": "three"}'))),
                          "--epochs must be an integer (got 'three')"),
    "config-not-utf8": (lambda w: base(w, "--config", str(file(w, "latin.toml", b"seed = 1 # \xe9t\xe9"))),
                        "cannot read it"),
    "config-unknown-format": (lambda w: base(w, "--config", str(file(w, "run.ini", "[train]"))),
                              "use a .toml, .yaml/.yml or .json file"),
    # --- data ---
    "data-missing": (lambda w: base(w, data=w / "missing.csv"), "no such file or directory"),
    "csv-empty": (lambda w: base(w, data=file(w, "empty.csv", "review,sentiment\n")), "the table holds no rows"),
    "csv-wrong-column": (lambda w: base(w, "--label-column", "stars"), "no column 'stars' (--label-column)"),
    "csv-bad-row": (lambda w: base(w, data=file(w, "ragged.csv", "review,sentiment\ngood film,pos\na,b,c,neg\n")),
                    "line 3 has more fields than the header's 2"),
    "csv-not-utf8": (lambda w: base(w, data=file(w, "latin.csv", b"review,sentiment\nd\xe9j\xe0 vu,pos\n")),
                     "not UTF-8 text (byte 0xe9"),
    "jsonl-malformed": (lambda w: base(w, data=file(w, "bad.jsonl", '{"review": "ok", "sentiment": "pos"}\n{oops\n')),
                        "line 2 is not JSON"),
    "jsonl-not-objects": (lambda w: base(w, data=file(w, "lists.jsonl", '["ok", "pos"]\n')),
                          "line 1 is a JSON list, not an object"),
    "data-wrong-type": (lambda w: base(w, data=file(w, "data.xlsx", "x")), "unsupported file type"),
    "one-label-only": (lambda w: base(w, data=file(w, "same.csv", "review,sentiment\na,pos\nb,pos\nc,pos\n")),
                       "every example has the same label"),
    "labels-out-of-head-range": (lambda w: base(w, model=head_model(w), data=file(
        w, "three.csv", "review,sentiment\na,0\nb,1\nc,2\nd,0\n")), "has 3 labels (0, 1, 2) but"),
    "image-unreadable": (lambda w: base(w, model=write_model_dir(w / "vit", {
        "architectures": ["ViTModel"], "model_type": "vit", "image_size": 8, "patch_size": 4, "num_channels": 1,
        "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}),
        data=images(w, broken=True)), "cannot read image"),
    "text-data-vision-model": (lambda w: base(w, model=write_model_dir(w / "vit2", {
        "architectures": ["ViTModel"], "model_type": "vit", "image_size": 8, "patch_size": 4, "num_channels": 1,
        "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64})),
        "pair text data with a text model"),
    "packing-classification": (lambda w: base(w, "--packing"), "--packing packs causal-LM examples"),
    # --- models ---
    "model-unknown": (lambda w: base(w, model=w / "no-such-model"), "is not a preset, a local directory or a Hub id"),
    "model-hub-id-offline": (lambda w: ["train", "--model", "google/bert_uncased_L-2_H-128_A-2", "--output-dir",
                                        str(w / "out")], "and HF_HUB_OFFLINE is set; unset HF_HUB_OFFLINE to download"),
    "model-dir-without-config": (lambda w: base(w, model=file(w, "empty-model/README", "x").parent),
                                 "no config.json in"),
    "model-config-broken": (lambda w: base(w, model=file(w, "broken-model/config.json", "{").parent),
                            "cannot read config.json"),
    # --- output dir and checkpoints ---
    "output-dir-exists": (lambda w: [*base(w)] if file(w, "out/metrics.jsonl", "{}\n") else [],
                          "already holds files; choose a new --output-dir"),
    "resume-missing-path": (lambda w: base(w, "--resume", str(w / "out" / "checkpoints" / "step-9")),
                            "no such checkpoint directory"),
    "resume-without-output-dir": (lambda w: ["train", "--resume"], "--resume needs --output-dir"),
    "checkpoint-corrupted": (corrupt_checkpoint, "state.pt: corrupted (checksum mismatch)"),
    "checkpoint-other-model": (other_model, "the checkpoint is of another model"),
    # --- quantize and eval ---
    "quantize-no-such-dir": (lambda w: ["quantize", str(w / "nowhere")], "no such run or model directory"),
    "quantize-not-a-model": (lambda w: ["quantize", str(file(w, "notes/a.txt", "x").parent), "--data",
                                        str(w / "reviews.csv"), "--text-column", "review", "--label-column",
                                        "sentiment"], "no config.json in"),
    "quantize-model-dir-without-data": (lambda w: ["quantize", str(w / "bert")], "give --data for its validation"),
    "quantize-unknown-method": (lambda w: ["quantize", str(w / "bert"), "--method", "int4"],
                                "invalid choice: 'int4'"),
    "quantize-untrained-model": (lambda w: ["quantize", str(w / "bert"), "--data", str(w / "reviews.csv"),
                                            "--text-column", "review", "--label-column", "sentiment",
                                            "--output-dir", str(w / "q")], "no weights"),
    "eval-not-a-model": (lambda w: ["eval", "--model", str(w / "nowhere")], "no such run or model directory"),
    # --- planning ---
    "plan-budget-without-unit": (lambda w: base(w, "--budget", "11"), "--budget '11' is not a memory size"),
    "budget-and-micro-batch": (lambda w: base(w, "--budget", "1GiB", "--micro-batch-size", "4"),
                               "--budget/--plan choose the micro-batch"),
    "plan-file-missing": (lambda w: base(w, "--plan", str(w / "plan.json")), "no such file; make one with"),
    "plan-cpu-without-budget": (lambda w: ["plan", "--model", str(w / "bert"), "--device", "cpu"],
                                "--device cpu has no fixed memory"),
    "plan-unknown-device": (lambda w: ["plan", "--model", str(w / "bert"), "--device", "gtx970"],
                            "is not a known device"),
    "plan-bad-margin": (lambda w: ["plan", "--model", str(w / "bert"), "--margin", "80%"],
                        "must be between 0 and 50%"),
    "opt-in-without-budget": (lambda w: base(w, "--allow-lora"),
                              "opt-ins are for the planner, and this run does not plan"),
    "opt-in-with-saved-plan": (lambda w: base(w, "--plan", str(w / "plan.json"), "--allow-qlora"),
                               "a saved --plan has chosen its setup already"),
    "dry-run-without-plan": (lambda w: base(w, "--dry-run"), "--dry-run stops after the plan"),
    "device-profile-cpu": (lambda w: base(w, "--device-profile", "cpu"),
                           "--device-profile 'cpu' is not a GPU profile"),
    "device-profile-and-emulated-budget": (lambda w: base(w, "--device-profile", "1080ti", "--emulate-budget",
                                                          "1GiB"), "runs with the card's memory (or --budget)"),
    "bench-profile-and-budget": (lambda w: ["bench", "--model", str(w / "bert"), "--device-profile", "1080ti",
                                            "--emulate-budget", "1GiB"], "give either --device-profile"),
    "bench-cpu-profile": (lambda w: ["bench", "--model", str(w / "bert"), "--device-profile", "cpu"],
                          "not a GPU profile"),
    "bench-unknown-setup": (lambda w: ["bench", "--model", str(w / "bert"), "--setups", "fp8"],
                            "invalid choice: 'fp8'"),
    # --- low-memory full fine-tuning ---
    "bf16-true-without-bf16": (lambda w: ["estimate", "--model", str(w / "bert"), "--device", "1080ti",
                                          "--precision", "bf16-true"], "has no native bf16"),
    "kahan-without-bf16-true": (lambda w: base(w, "--kahan"), "--kahan compensates the rounding of bf16 weights"),
    "in-backward-with-clipping": (lambda w: base(w, "--optimizer-in-backward"), "add --max-grad-norm none"),
    "in-backward-with-accumulation": (lambda w: base(w, "--optimizer-in-backward", "--max-grad-norm", "none",
                                                     "--micro-batch-size", "8"),
                                      "gradients cannot accumulate over 4 micro-batches"),
    "packing-without-position-ids": (lambda w: ["estimate", "--model", str(write_model_dir(w / "bloom", {
        "architectures": ["BloomForCausalLM"], "model_type": "bloom", "hidden_size": 32, "n_layer": 1, "n_head": 2,
        "vocab_size": 128})), "--task", "causal-lm", "--packing"], "which a Bloom model does not take"),
    "resume-another-optimizer-setup": (lambda w: (finished_run(w), base(w, "--resume", "--optimizer-in-backward",
                                                                       "--max-grad-norm", "none"))[1],
                                       "its optimizer state was saved with --optimizer-in-backward False"),
    "offload-activations-on-cpu": (lambda w: base(w, "--offload-activations", "--device", "cpu"),
                                   "--offload-activations moves saved activations from a CUDA card"),
    # --- more than one GPU ---
    "cpu-offload-without-fsdp": (lambda w: base(w, "--cpu-offload"), "--cpu-offload offloads FSDP shards"),
    "cpu-offload-on-cpu": (lambda w: base(w, "--distributed", "fsdp", "--cpu-offload", "--device", "cpu"),
                           "on a cpu device they are in host memory already"),
    "cpu-offload-with-shard-group-1": (lambda w: ["estimate", "--model", str(w / "bert"), "--distributed", "fsdp",
                                                  "--world-size", "2", "--shard-group", "1", "--cpu-offload",
                                                  "--device", "4090"],
                                       "--cpu-offload with --shard-group 1 is not estimated"),
    "8bit-optimizer-sharded": (lambda w: base(w, "--distributed", "fsdp", "--optimizer", "adamw8bit"),
                               "not on FSDP's sharded parameters; use --distributed ddp"),
    "int8-base-distributed": (lambda w: base(w, "--distributed", "ddp", "--lora-rank", "4", "--quantize-base",
                                             "int8"), "use --quantize-base nf4 with --distributed"),
    "estimate-ranks-without-strategy": (lambda w: ["estimate", "--model", str(w / "bert"), "--world-size", "2"],
                                        "--world-size 2 needs --distributed ddp, fsdp or auto"),
    "plan-more-gpus-than-samples": (lambda w: ["plan", "--model", str(w / "bert"), "--gpus", "64"],
                                    "--gpus 64 is more than --effective-batch 32"),
    "shard-group-without-fsdp": (lambda w: base(w, "--distributed", "ddp", "--shard-group", "2"),
                                 "--shard-group shards FSDP's parameters within groups of ranks"),
    "shard-group-not-dividing": (lambda w: ["estimate", "--model", str(w / "bert"), "--distributed", "fsdp",
                                            "--world-size", "4", "--shard-group", "3"],
                                 "--shard-group 3 must divide the 4 ranks into equal groups"),
    "plan-for-another-world-size": (lambda w: base(w, "--plan", str(two_gpu_plan(w))),
                                    "was planned for 2 GPU(s) and this run has 1 process(es)"),
    "plan-gpus-and-max-gpus": (lambda w: ["plan", "--model", str(w / "bert"), "--gpus", "2", "--max-gpus", "4"],
                               "--gpus plans one number of GPUs and --max-gpus every number up to it"),
    "plan-max-gpus-zero": (lambda w: ["plan", "--model", str(w / "bert"), "--max-gpus", "0"],
                           "--max-gpus must be >= 1 (got 0)"),
    "resume-single-process-run-distributed": (lambda w: (finished_run(w), base(w, "--resume", "--distributed",
                                                                              "ddp"))[1],
                                              "written by a single-process run; resume it without --distributed"),
}


def head_model(work: Path) -> Path:
    """A saved classifier with a 2-label head."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**TINY_BERT, num_labels=2))
    model.save_pretrained(work / "two-labels")
    return work / "two-labels"


def snapshot(work: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(work)): (p.stat().st_size, p.stat().st_mtime_ns) for p in work.rglob("*")}


def test_the_table_has_at_least_25_cases_and_the_doc_lists_each() -> None:
    assert len(CASES) >= 25
    doc = DOC.read_text()
    rows = dict(re.findall(r"^\| `([a-z0-9-]+)` \|.*\| `(.+)` \|$", doc, flags=re.MULTILINE))
    assert rows.keys() == CASES.keys()
    for name, (_, fragment) in CASES.items():
        assert rows[name] == fragment.replace("|", "\\|"), name


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                   monkeypatch: pytest.MonkeyPatch) -> None:
    setup, fragment = CASES[name]
    work = tmp_path / "work"
    write_model_dir(work / "bert", TINY_BERT)
    write_reviews(work / "reviews.csv")
    monkeypatch.chdir(work)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # an empty Hugging Face cache (and offline)
    args = setup(work)
    capsys.readouterr()
    before = snapshot(work)
    try:
        code = main(args)
    except SystemExit as exit_:  # argparse's own errors
        code = int(exit_.code or 0)
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memfit: error: "), stderr
    assert fragment in lines[0], lines[0]
    assert snapshot(work) == before  # nothing written, nothing changed
