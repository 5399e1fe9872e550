"""A shortened trace replayed at full depth and window length equals the full trace, line by line; where the
step does not repeat, the full trace runs and the estimate says why."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

import memfit.memory.estimate as estimate_module
import memfit.memory.repeats as repeats_module
from memfit import TrainConfig
from memfit.memory import ddp_buckets, shortened
from memfit.memory.estimate import Estimate, estimate, prepare_trace
from memfit.memory.fake_memo import unmemoised
from memfit.memory.repeats import BLOCK, NotRepeating, Repeat, expand
from tests.conftest import TINY_BERT, TINY_LLAMA, TINY_MOE, TINY_VIT, write_model_dir

FIELDS = ("peak_bytes", "peak_reserved_bytes", "breakdown", "phases", "peak_phase", "traced_ops", "phase_ops",
          "flops", "dequantized_bytes", "trainable_parameters", "parameters", "host_bytes", "host_breakdown",
          "traced_micro_steps", "traced_samples")


def both(model: Path, device: str, **options: Any) -> tuple[Estimate, Estimate]:
    """(the full trace, every op through fake tensors; the fast one: shortened, repeated ops memoised)."""
    config = TrainConfig(model=str(model), max_length=16, **options)
    with unmemoised():
        full = estimate(config, device=device, seq_len=16, count_flops=True, exact_trace=True)
    fast = estimate(config, device=device, seq_len=16, count_flops=True)
    return full, fast


def assert_equal(full: Estimate, fast: Estimate) -> None:
    assert full.trace == "full trace"
    assert {name: getattr(fast, name) for name in FIELDS} == {name: getattr(full, name) for name in FIELDS}


@pytest.fixture(autouse=True)
def _fresh_process() -> None:
    """No run remembered as needing a spacer: each test starts as a fresh process would."""
    shortened.forget_spacers()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("repeats")
    deep = {"vocab_size": 64, "num_hidden_layers": 6}  # a copy of 4 blocks (5 with a spacer), one group copied
    return {
        "llama": write_model_dir(root / "llama", {**TINY_LLAMA, **deep}),
        "llama7": write_model_dir(root / "llama7", {**TINY_LLAMA, **deep, "num_hidden_layers": 7}),
        "llama12": write_model_dir(root / "llama12", {**TINY_LLAMA, **deep, "num_hidden_layers": 12}),
        "untied": write_model_dir(root / "untied", {**TINY_LLAMA, **deep, "tie_word_embeddings": False}),
        "bert": write_model_dir(root / "bert", {**TINY_BERT, **deep}),
        "vit": write_model_dir(root / "vit", {**TINY_VIT, "num_hidden_layers": 6}),
        "qwen3_moe": write_model_dir(root / "moe", {**TINY_LLAMA, **TINY_MOE["qwen3_moe"], **deep}),
        "deepseek_v3": write_model_dir(root / "ds", {**TINY_LLAMA, **TINY_MOE["deepseek_v3"], **deep,
                                                      "num_hidden_layers": 7}),
        "gemma2": write_model_dir(root / "gemma2", {  # sliding and full attention alternate: groups of two
            "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 32, "head_dim": 8,
            "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 8,
            **deep, "num_hidden_layers": 12, "layer_types": ["sliding_attention", "full_attention"] * 6}),
        "gpt_oss": write_model_dir(root / "gpt_oss", {**TINY_LLAMA, **TINY_MOE["gpt_oss"], **deep,
                                                      "num_hidden_layers": 12,
                                                      "layer_types": ["sliding_attention", "full_attention"] * 6}),
        "gemma2_3": write_model_dir(root / "gemma2_3", {  # two sliding blocks to one full: a period of three
            "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 32, "head_dim": 8,
            "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 8,
            **deep, "num_hidden_layers": 12,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 4}),
        "mistral": write_model_dir(root / "mistral", {  # every layer's attention slides
            **TINY_LLAMA, **deep, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
            "sliding_window": 8, "head_dim": 8}),
    }


GRID = [
    ("llama", "cpu", {"task": "causal-lm"}, "4 of 6 blocks traced"),
    ("llama", "cpu", {"task": "causal-lm", "effective_batch": 12, "micro_batch_size": 2},
     "4 of 6 blocks and 8 of 12 micro-steps traced"),
    ("llama", "1080ti", {"task": "causal-lm", "effective_batch": 12, "micro_batch_size": 2, "precision": "fp16"},
     "8 of 12 micro-steps"),
    ("llama", "4090", {"task": "causal-lm", "checkpointing": "full", "precision": "bf16"}, "4 of 6 blocks"),
    ("llama", "4090", {"task": "causal-lm", "checkpointing": "every-n", "effective_batch": 10,
                       "micro_batch_size": 2}, "8 of 10 micro-steps"),
    ("llama", "4090", {"task": "causal-lm", "lora_rank": 4, "quantize_base": "nf4", "precision": "bf16"},
     "4 of 6 blocks"),
    ("llama", "cpu", {"task": "causal-lm", "lora_rank": 4, "quantize_base": "nf4", "checkpointing": "full"},
     "4 of 6 blocks"),
    ("llama", "1080ti", {"task": "causal-lm", "optimizer": "adamw8bit", "precision": "fp16"}, "4 of 6 blocks"),
    ("llama", "cpu", {"task": "causal-lm", "fused": False, "foreach": False, "checkpointing": "full",
                      "effective_batch": 4, "micro_batch_size": 1}, "4 of 6 blocks"),  # a loop's step, per parameter
    ("llama", "4090", {"task": "causal-lm", "loss_chunk": 4, "effective_batch": 6, "micro_batch_size": 1,
                       "lora_rank": 4, "precision": "bf16"}, "8 of 12 micro-steps"),
    ("llama", "4090", {"task": "causal-lm", "optimizer_in_backward": True, "precision": "bf16",
                       "max_grad_norm": None}, "4 of 6 blocks"),
    ("llama", "4090", {"task": "causal-lm", "precision": "bf16-true"}, "4 of 6 blocks"),
    ("llama7", "4090", {"task": "causal-lm", "world_size": 2, "distributed": "fsdp", "precision": "bf16"},
     "5 of 7 blocks"),  # FSDP: two blocks above the copied one (the last two's gathers outlive the forward)
    ("llama7", "cpu", {"task": "causal-lm", "world_size": 2, "distributed": "fsdp", "effective_batch": 24,
                       "micro_batch_size": 2}, "5 of 7 blocks and 8 of 12 micro-steps"),  # a loop's step
    ("llama7", "4090", {"task": "causal-lm", "world_size": 2, "distributed": "fsdp", "effective_batch": 24,
                        "micro_batch_size": 2, "precision": "bf16", "reduce_every_micro_step": True},
     "5 of 7 blocks and 8 of 12 micro-steps"),  # each micro-step reduce-scatters into the sharded gradients
    ("llama7", "4090", {"task": "causal-lm", "world_size": 4, "distributed": "fsdp", "shard_group": 2,
                        "effective_batch": 24, "micro_batch_size": 1, "precision": "bf16",
                        "reduce_every_micro_step": True},
     "5 of 7 blocks and 8 of 12 micro-steps"),  # HSDP: each reduce-scatter's shard all-reduced in the last
    ("llama7", "4090", {"task": "causal-lm", "world_size": 2, "distributed": "fsdp", "effective_batch": 24,
                        "micro_batch_size": 2, "precision": "bf16-true"},
     "5 of 7 blocks and 8 of 12 micro-steps"),  # bf16 shards, Kahan buffers and torch-optimi's loop on DTensors
    ("llama7", "4090", {"task": "causal-lm", "world_size": 4, "distributed": "fsdp", "shard_group": 2,
                        "lora_rank": 4, "quantize_base": "nf4", "precision": "bf16", "checkpointing": "full"},
     "5 of 7 blocks"),  # QLoRA: its first block's extra casts lined up from the end (memory/repeats.py)
    ("llama7", "1080ti", {"task": "causal-lm", "world_size": 2, "distributed": "fsdp", "cpu_offload": True,
                          "precision": "fp16", "effective_batch": 24, "micro_batch_size": 2},
     "5 of 7 blocks and 8 of 12 micro-steps"),  # shards and optimizer on the host (memory/host_shards.py)
    ("llama7", "4090", {"task": "causal-lm", "world_size": 2, "distributed": "fsdp", "cpu_offload": True,
                        "precision": "bf16-true", "effective_batch": 24, "micro_batch_size": 2},
     "5 of 7 blocks and 8 of 12 micro-steps"),  # bf16 on the host: each reduced shard cast on the card first
    ("llama7", "4090", {"task": "causal-lm", "world_size": 4, "distributed": "fsdp", "shard_group": 2,
                        "cpu_offload": True, "precision": "bf16", "effective_batch": 24, "micro_batch_size": 1,
                        "reduce_every_micro_step": True},
     "5 of 7 blocks and 8 of 12 micro-steps"),  # HSDP offloaded: all-reduced shards held until the backward ends
    ("llama12", "1080ti", {"task": "causal-lm", "world_size": 2, "distributed": "fsdp", "precision": "fp16",
                           "checkpointing": "every-n"}, "8 of 12 blocks"),
    ("llama12", "4090", {"task": "causal-lm", "world_size": 2, "distributed": "fsdp", "precision": "bf16",
                         "train_top_layers": 7, "loss_chunk": 4}, "11 of 12 blocks"),
    ("llama", "4090", {"task": "causal-lm", "offload_optimizer": True, "precision": "bf16"}, "4 of 6 blocks"),
    ("llama12", "1080ti", {"task": "causal-lm", "offload_optimizer": True, "precision": "fp16", "train_top_layers": 6,
                           "effective_batch": 12, "micro_batch_size": 2}, "10 of 12 blocks and 8 of 12 micro-steps"),
    ("llama", "cpu", {"task": "causal-lm", "train_top_layers": 6}, "4 of 6 blocks"),  # every block trained
    ("llama12", "cpu", {"task": "causal-lm", "train_top_layers": 6}, "10 of 12 blocks"),  # frozen and trained
    ("llama12", "4090", {"task": "causal-lm", "train_top_layers": 3, "lora_rank": 4, "precision": "bf16",
                         "checkpointing": "full"}, "8 of 12 blocks"),  # the trained run too short to cut
    ("bert", "1080ti", {"effective_batch": 14, "micro_batch_size": 2}, "4 of 6 blocks and 8 of 14 micro-steps"),
    ("bert", "t4", {"precision": "fp16", "checkpointing": "full", "freeze_embeddings": True}, "4 of 6 blocks"),
    ("vit", "1080ti", {"effective_batch": 10, "micro_batch_size": 2, "precision": "fp16"}, "4 of 6 blocks"),
    ("qwen3_moe", "4090", {"task": "causal-lm", "precision": "bf16", "effective_batch": 10, "micro_batch_size": 2},
     "4 of 6 blocks and 8 of 10 micro-steps"),
    ("deepseek_v3", "cpu", {"task": "causal-lm"}, "5 of 7 blocks"),  # its first block is dense: one more
    ("gemma2", "4090", {"task": "causal-lm", "precision": "bf16"}, "6 of 12 blocks"),
    ("gemma2", "1080ti", {"task": "causal-lm", "precision": "fp16", "checkpointing": "full", "loss_chunk": 4},
     "8 of 12 blocks"),  # a spacer of two blocks: the first full-attention block's recompute differs
    ("gpt_oss", "4090", {"task": "causal-lm", "precision": "bf16", "effective_batch": 10, "micro_batch_size": 2},
     "6 of 12 blocks and 8 of 10 micro-steps"),
    ("gemma2_3", "4090", {"task": "causal-lm", "precision": "bf16"},
     "full trace: the model's blocks repeat only every 3 blocks"),
    ("mistral", "cpu", {"task": "causal-lm"}, "4 of 6 blocks"),  # no KV cache: no window made per layer
]


@pytest.mark.parametrize(("name", "device", "options", "how"), GRID,
                         ids=[f"{name}-{device}-{'-'.join(f'{k}={v}' for k, v in options.items())}"
                              for name, device, options, _ in GRID])
def test_the_shortened_trace_equals_the_full_trace(models: dict[str, Path], name: str, device: str,
                                                   options: dict[str, Any], how: str) -> None:
    if how.startswith("full trace"):  # refused up front: nothing shortened to compare, only the reason given
        config = TrainConfig(model=str(models[name]), max_length=16, **options)
        assert how in estimate(config, device=device, seq_len=16).trace
        return
    full, fast = both(models[name], device, **options)
    assert how in fast.trace
    assert_equal(full, fast)


DDP = {"task": "causal-lm", "world_size": 2, "distributed": "ddp"}


@pytest.mark.parametrize(("name", "device", "options", "how"), [
    ("llama", "cpu", {"effective_batch": 24, "micro_batch_size": 2},  # a loop's step, gradients under no_sync
     "4 of 6 blocks and 8 of 12 micro-steps"),
    ("llama", "4090", {"precision": "bf16", "checkpointing": "full"}, "4 of 6 blocks"),
    ("untied", "cpu", {}, "4 of 6 blocks"),  # the output layer's bucket of its own
    ("llama12", "1080ti", {"precision": "fp16", "checkpointing": "every-n", "effective_batch": 4,
                           "micro_batch_size": 1}, "6 of 12 blocks"),
])
def test_a_ddp_rank_whose_buckets_stay_within_blocks_is_shortened(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, name: str, device: str,
        options: dict[str, Any], how: str) -> None:
    """Buckets the size of the tiny blocks' parameters (an 8B model's blocks fill DDP's 25 MiB buckets block by
    block): each bucket serves one block and is copied with it; the replay equals the full trace."""
    monkeypatch.setattr(ddp_buckets, "DDP_FIRST_BUCKET_BYTES", 1024)
    monkeypatch.setattr(ddp_buckets, "DDP_BUCKET_BYTES", 4096)
    full, fast = both(models[name], device, **DDP, **options)
    assert how in fast.trace
    assert_equal(full, fast)


def test_a_ddp_rank_whose_buckets_span_blocks_is_traced_at_full_depth_says_why_and_is_remembered(
        models: dict[str, Path]) -> None:
    """DDP's 25 MiB buckets hold several of the tiny blocks: no copy repeats. The refused copy is traced again
    at full depth, its micro-steps still shortened (their buckets are the same at any depth), equal to the full
    trace; the process remembers the model (the next run goes to full depth straight away; with no micro-steps
    to shorten, to the full trace), and no spacer for it."""
    spanning = "DDP's gradient buckets group parameters of several blocks"
    full, fast = both(models["llama"], "cpu", **DDP, effective_batch=24, micro_batch_size=2)
    assert fast.trace == f"8 of 12 micro-steps traced, the rest replayed (all blocks: {spanning})"
    assert_equal(full, fast)
    config = TrainConfig(model=str(models["llama"]), max_length=16, **DDP)
    trace = prepare_trace(config, device="cpu", seq_len=16, steps=2)
    assert not shortened.spaced_first(config, trace)
    assert shortened.shortened_trace(config, trace, "ddp") == f"full trace: {spanning}"
    assert estimate(config, device="cpu", seq_len=16).trace == f"full trace: {spanning}"
    shortened.forget_spacers()
    assert isinstance(shortened.shortened_trace(config, trace, "ddp"), shortened.Shortened)


def test_a_group_that_does_not_repeat_the_one_before_is_refused() -> None:
    """Block 3 allocates 8 bytes where block 2 allocated 4: copying block 3 would be a guess."""
    events = [("a", 10 + owner, 4 * max(1, owner - 1), "activations", owner, None, 0, (True, "forward"))
              for owner in (1, 2, 3, 4)]
    with pytest.raises(NotRepeating, match="block 3 does not repeat block 2"):
        expand(events, BLOCK, Repeat(first=2, period=1, copies=2))


def block_record(blocks: int, first_extra: str) -> list[Any]:
    """A record of ``blocks`` blocks. Forward: each allocates ``h``, its output ``out`` and ``k``; the first one
    also 8-byte casts, ``first_extra``: one "before" its own work, or one before its output and one after it
    ("around"). Backward: each block from the top allocates and frees a gradient, then frees its lower
    neighbour's output."""
    forward: list[Any] = []
    for owner in range(1, blocks + 1):
        names = ["h", "out", "k"]
        if owner == 1:
            names = ["cast", *names] if first_extra == "before" else ["h", "cast", "out", "k", "cast2"]
        forward += [("a", f"{name}{owner}", 16 if name == "out" else 8, "activations", owner, None, 0,
                     (True, "forward")) for name in names]
    backward: list[Any] = []
    for owner in range(blocks, 0, -1):
        backward += [("a", f"g{owner}", 4, "temporaries", owner, None, 0, (True, "backward")),
                     ("f", f"g{owner}", 0, None, owner, None, 0, None)]
        backward += [("f", f"out{owner - 1}", 0, None, owner, None, 0, None)] if owner > 1 else []
    return forward + backward


def replayed(events: list[Any]) -> tuple[int, list[int]]:
    """(the peak, the live bytes after each event) of ``events`` replayed through a tracker's accounting."""
    from memfit.memory.repeats import replay
    from memfit.memory.tracker import StorageTracker

    live: list[int] = []
    tracker = StorageTracker()
    for event in events:
        replay([event], tracker)
        live.append(tracker.live_bytes)
    return tracker.peak_bytes, live


def test_a_first_block_that_allocates_more_before_its_work_repeats_counted_from_the_end() -> None:
    """The first block casts first (QLoRA's input): block 2's backward frees the first block's output at another
    place (counted from the first) than block 3's frees block 2's. Counted from the last, the groups repeat, and
    the expanded 4-block record replays as the 6-block record does, event for event."""
    group = Repeat(first=2, period=1, copies=2)
    with pytest.raises(NotRepeating, match="block 3 does not repeat block 2"):
        repeats_module._Expansion(block_record(4, "before"), BLOCK, group).run()
    assert replayed(expand(block_record(4, "before"), BLOCK, group)) == replayed(block_record(6, "before"))


def test_a_first_block_that_allocates_more_around_its_output_is_refused_either_way() -> None:
    """Extra allocations before and after the first block's output: its place differs counted from either end,
    so no copy is made (the trace goes on with a spacer, or in full)."""
    with pytest.raises(NotRepeating, match="block 3 does not repeat block 2"):
        expand(block_record(4, "around"), BLOCK, Repeat(first=2, period=1, copies=2))


def test_copies_are_inserted_after_the_group_and_free_their_own_storages() -> None:
    """Forward allocates one tensor per block, backward frees them all at once: two copies of block 3 allocate
    and free two more, and block 4 becomes block 6 (frees in a row are put in one order: by block)."""
    forward = [("a", owner, 8, "activations", owner, None, 0, (True, "forward")) for owner in (1, 2, 3, 4)]
    backward = [("f", owner, 0, None, owner, None, 0, None) for owner in (4, 3, 2, 1)]
    expanded = expand(forward + backward, BLOCK, Repeat(first=2, period=1, copies=2))
    assert [(event[0], event[4]) for event in expanded] == [
        *[("a", owner) for owner in range(1, 7)], *[("f", owner) for owner in range(1, 7)]]
    allocated = [event[1] for event in expanded if event[0] == "a"]
    assert sorted(allocated, key=repr) == sorted({event[1] for event in expanded if event[0] == "f"}, key=repr)


def test_qlora_needs_no_spacer_its_first_blocks_extra_casts_are_lined_up_from_the_end(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """QLoRA's first block allocates more than the rest before its ordinary work (its input's casts), which
    shifts the places the next block's backward frees by: counted back from the last, the groups repeat, and the
    copy of 4 blocks is the full trace, byte for byte; counted from the first only, it is refused."""
    full, fast = both(models["llama"], "cpu", task="causal-lm", lora_rank=4, checkpointing="full", quantize_base="nf4")
    assert "4 of 6 blocks" in fast.trace
    assert_equal(full, fast)
    monkeypatch.setattr(estimate_module, "expand", from_the_first_only)
    shortened.forget_spacers()
    assert "5 of 6 blocks" in both(models["llama"], "cpu", task="causal-lm", lora_rank=4, checkpointing="full",
                                   quantize_base="nf4")[1].trace


def from_the_first_only(events: list[Any], axis: int, repeat: Repeat) -> list[Any]:
    """:func:`memfit.memory.repeats.expand` without its second comparison (places counted back from the last)."""
    return repeats_module._Expansion(events, axis, repeat).run()


def test_a_copy_that_does_not_repeat_is_traced_again_with_a_spacer_and_remembered(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A first block that allocates more than the rest in a way the places cannot line up (QLoRA's, compared from
    the first place only): a copy without a spacer is refused, the trace runs again with one (equal to the full
    trace), and QLoRA runs of that model start with the spacer from then on (LoRA's first block is ordinary)."""
    monkeypatch.setattr(estimate_module, "expand", from_the_first_only)
    lora = TrainConfig(model=str(models["llama"]), max_length=16, task="causal-lm", lora_rank=4, checkpointing="full")
    assert "4 of 6 blocks" in estimate(lora, device="cpu", seq_len=16).trace
    full, fast = both(models["llama"], "cpu", task="causal-lm", lora_rank=4, checkpointing="full", quantize_base="nf4")
    assert "5 of 6 blocks" in fast.trace
    assert_equal(full, fast)
    qlora = dataclasses.replace(lora, quantize_base="nf4", precision="fp32")
    assert shortened.spaced_first(qlora, prepare_trace(qlora, device="cpu", seq_len=16, steps=2))
    assert not shortened.spaced_first(lora, prepare_trace(lora, device="cpu", seq_len=16, steps=2))
    assert "4 of 6 blocks" in estimate(lora, device="cpu", seq_len=16).trace
