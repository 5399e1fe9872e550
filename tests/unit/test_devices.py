"""Device profiles: the built-in table, user files, and matching the card this process sees."""

from __future__ import annotations

from pathlib import Path

import pytest

from memfit.devices import PROFILES, Device, profile_for, resolve_profile, torch_arch_problem
from memfit.errors import ConfigError

GiB = 1024**3


def test_pascal_has_no_fast_fp16_and_no_bf16() -> None:
    pascal = PROFILES["1080ti"]
    assert pascal.compute_capability == (6, 1) and pascal.memory_bytes == 11 * GiB
    assert pascal.fp16_flops == pascal.fp32_flops and not pascal.tensor_cores and not pascal.has_native_bf16
    assert PROFILES["a100-80"].has_native_bf16 and PROFILES["a100-80"].bf16_flops > 10 * PROFILES["a100-80"].fp32_flops


def test_a_user_profile_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "mycard.toml"
    path.write_text('name = "mycard"\nmemory_bytes = 8589934592\ncompute_capability = [7, 5]\n'
                    'fp32_flops = 1e13\nfp16_flops = 4e13\ntensor_cores = true\n')
    profile = resolve_profile(str(path))
    assert (profile.name, profile.memory_bytes, profile.compute_capability) == ("mycard", 8 * GiB, (7, 5))
    assert profile.kind == "cuda" and not profile.has_native_bf16
    path.write_text('name = "x"\nmemory_bytes = 1\nfp32_flops = 1\nclock = 3\n')
    with pytest.raises(ConfigError, match="unknown profile field 'clock'"):
        resolve_profile(str(path))


def test_a_profile_file_keeps_its_link_and_host_bandwidth(tmp_path: Path) -> None:
    path = tmp_path / "nvlink.toml"
    path.write_text('name = "nv"\nmemory_bytes = 1\nfp32_flops = 1\nlink_bandwidth = 3e11\nhost_bandwidth = 5e10\n')
    profile = resolve_profile(str(path))
    assert (profile.link_bandwidth, profile.host_bandwidth) == (3e11, 5e10)


def test_a_broken_profile_file_is_reported_against_device(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("name = = 3\n")
    with pytest.raises(ConfigError, match=r"^--device .*broken.toml: cannot parse"):
        resolve_profile(str(path))


@pytest.mark.parametrize(("name", "capability", "memory_gib", "expected"), [
    ("NVIDIA GeForce GTX 1080 Ti", (6, 1), 11, "1080ti"),
    ("NVIDIA A100-SXM4-80GB", (8, 0), 80, "a100-80"),
    ("NVIDIA A100-PCIE-40GB", (8, 0), 40, "a100-40"),
    ("Tesla T4", (7, 5), 15, "t4"),
    ("NVIDIA H200", (9, 0), 140, "h200"),
])
def test_the_card_in_this_process_maps_to_its_profile(name: str, capability: tuple[int, int], memory_gib: int,
                                                      expected: str) -> None:
    device = Device(kind="cuda", name=name, compute_capability=capability, total_memory_bytes=memory_gib * GiB)
    assert profile_for(device).name == expected
    assert profile_for(device, memory_bytes=11 * GiB).memory_bytes == 11 * GiB  # a per-process cap


def test_an_unknown_card_gets_a_profile_from_its_properties() -> None:
    device = Device(kind="cuda", name="NVIDIA L40S", compute_capability=(8, 9), total_memory_bytes=45 * GiB)
    profile = profile_for(device)
    assert (profile.name, profile.compute_capability, profile.memory_bytes) == ("NVIDIA L40S", (8, 9), 45 * GiB)
    assert profile.non_pytorch_bytes > 0


@pytest.mark.parametrize(("arches", "capability", "runs"), [
    (["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"], (6, 1), True),  # cu126: sm_60 runs on 6.1
    (["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"], (6, 1), False),  # cu128: no Pascal
    (["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"], (8, 9), True),  # 8.6 code on 8.9
    (["sm_75", "sm_80", "sm_90a"], (9, 0), True),
    (["sm_80", "compute_80"], (7, 5), False),  # PTX runs only on newer cards
    (["sm_75", "compute_75"], (8, 0), True),  # PTX of an older version: compiled by the driver
])
def test_the_installed_torch_is_checked_against_the_card(arches: list[str], capability: tuple[int, int],
                                                          runs: bool) -> None:
    problem = torch_arch_problem(capability, "the card", arches)
    assert (problem is None) == runs, problem
    if capability == (6, 1) and not runs:
        assert problem is not None and "sm_61" in problem and "torch==2.14.*" in problem and "cu126" in problem
    assert torch_arch_problem(capability, "the card", []) is None  # a CPU build: nothing to say


@pytest.mark.parametrize(("avx512_bf16", "amx", "expected"),
                         [(False, False, "fp32"), (True, False, "bf16"), (False, True, "bf16")])
def test_auto_precision_on_cpu_is_bf16_only_where_the_processor_computes_it(
        monkeypatch: pytest.MonkeyPatch, avx512_bf16: bool, amx: bool, expected: str) -> None:
    import torch

    from memfit.techniques.precision import resolve_precision

    # torch's own CPU checks are private; this fails loudly if a torch release renames them
    assert callable(torch.cpu._is_avx512_bf16_supported) and callable(torch.cpu._is_amx_tile_supported)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    cpu = Device(kind="cpu", name="cpu")
    assert resolve_precision("auto", cpu, force_cpu_fp16=False) == (expected, [])
    assert resolve_precision("bf16", cpu, force_cpu_fp16=False) == ("bf16", [])  # asked for, always given


def test_auto_precision_on_cuda_follows_the_compute_capability() -> None:
    from memfit.techniques.precision import resolve_precision

    ampere = Device(kind="cuda", name="A100", compute_capability=(8, 0), total_memory_bytes=80 * GiB)
    pascal = Device(kind="cuda", name="GTX 1080 Ti", compute_capability=(6, 1), total_memory_bytes=11 * GiB)
    assert resolve_precision("auto", ampere, force_cpu_fp16=False) == ("bf16", [])
    assert resolve_precision("auto", pascal, force_cpu_fp16=False) == ("fp16", [])


def test_each_nccl_communicator_of_a_rank_is_a_stated_unmeasured_constant_outside_pytorch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rank of a distributed run on a card holds NCCL's buffers outside PyTorch's allocator, per communicator:
    the default group's (DDP, FSDP), and HSDP's mesh groups too; none in one process or on a CPU. The figure is
    the profiles' stated constant, said unmeasured, until a profile file gives its own."""
    from memfit import TrainConfig
    from memfit.cli import main
    from memfit.devices import CUDA_CONTEXT_BYTES, NCCL_COMMUNICATOR_BYTES
    from memfit.memory.estimate import estimate
    from tests.conftest import TINY_LLAMA, write_model_dir

    model = str(write_model_dir(tmp_path / "llama", {**TINY_LLAMA, "vocab_size": 64}))

    def outside(device: str, **options: object) -> tuple[int, int, bool]:
        config = TrainConfig(model=model, task="causal-lm", max_length=8, effective_batch=4, **options)  # type: ignore[arg-type]
        result = estimate(config, device=device, seq_len=8)
        assert result.total_bytes == result.peak_reserved_bytes + result.non_pytorch_bytes
        assert result.non_pytorch_bytes - result.communicator_bytes == resolve_profile(device).non_pytorch_bytes
        return result.communicators, result.communicator_bytes, result.communicator_measured

    assert PROFILES["4090"].communicator_bytes == NCCL_COMMUNICATOR_BYTES and not PROFILES["4090"].communicator_measured
    assert outside("4090") == (0, 0, False)
    assert outside("4090", distributed="ddp", world_size=2) == (1, NCCL_COMMUNICATOR_BYTES, False)
    assert outside("4090", distributed="fsdp", world_size=2) == (1, NCCL_COMMUNICATOR_BYTES, False)
    assert outside("4090", distributed="fsdp", world_size=4, shard_group=2) == (3, 3 * NCCL_COMMUNICATOR_BYTES, False)
    assert outside("cpu", distributed="fsdp", world_size=2) == (0, 0, False)
    card = tmp_path / "measured.toml"
    card.write_text('name = "measured"\nmemory_bytes = 25769803776\ncompute_capability = [8, 9]\n'
                    'fp32_flops = 8e13\nbf16_flops = 1.6e14\ncommunicator_bytes = 314572800\n')
    assert outside(str(card), distributed="fsdp", world_size=2) == (1, 314572800, True)
    assert resolve_profile(str(card)).non_pytorch_bytes == CUDA_CONTEXT_BYTES
    assert main(["estimate", "--model", model, "--task", "causal-lm", "--max-length", "8", "--device", "4090",
                 "--distributed", "fsdp", "--world-size", "4", "--shard-group", "2", "--effective-batch", "4"]) == 0
    assert "outside PyTorch (NCCL, 3 communicators, unmeasured)" in capsys.readouterr().out
