"""What the device this run uses can do.

Devices are data: the rest of memfit asks a :class:`Device` (``device.has_native_bf16``) instead of branching
on a GPU's name. Native bf16 needs compute capability 8.0 (Ampere) or newer; ``torch.cuda.is_bf16_supported()``
also answers yes on older cards where bf16 is emulated and slow, so it is not trusted here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from memfit import names
from memfit.errors import ConfigError
from memfit.files import load_option_file

if TYPE_CHECKING:
    import torch

NATIVE_BF16_CAPABILITY = (8, 0)
PCIE3_BANDWIDTH = 12e9
"""Achievable bytes per second of PCIe 3.0 x16: the default link and host bandwidth of a profile."""
NODE_BANDWIDTH = 10e9
"""Bytes per second between machines by default: 80 % of one 100 Gb/s Ethernet or InfiniBand EDR link (an
assumption, not a measurement: a profile file sets ``node_bandwidth`` to the cluster's own)."""
DATACENTER_NODE_GBS = {"A100": 160.0, "H100": 320.0}
"""GB/s between machines of data-center cards: 80 % of eight 200 Gb/s (HDR, A100 systems) or 400 Gb/s (NDR,
H100 systems) InfiniBand links per machine, one per GPU (an assumption, as :data:`NODE_BANDWIDTH`)."""
GPU_OP_OVERHEAD_S = 15e-6
"""Host time per op of an eager CUDA step, from ``memfit bench`` of BERT-base at 128 tokens on an H200
(benchmarks/results/gpu_h200): step time less the FLOP model's compute, over the traced ops, is 13.9 us
(bf16, micro-batch 8 x 4) and 17.0 us (bf16, full checkpointing, 32 x 1)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    kind: str
    """``cpu`` or ``cuda``."""
    name: str
    """Human-readable name, e.g. ``NVIDIA GeForce GTX 1080 Ti`` or ``cpu``."""
    compute_capability: tuple[int, int] | None = None
    """CUDA compute capability, ``None`` on CPU."""
    total_memory_bytes: int | None = None
    """Device memory; ``None`` on CPU, where the limit is the host's RAM."""

    @property
    def has_native_bf16(self) -> bool:
        if self.kind == "cpu":
            return True  # CPU autocast runs bf16 (no scaler needed); fast only where auto_precision says so
        return self.compute_capability is not None and self.compute_capability >= NATIVE_BF16_CAPABILITY

    @property
    def auto_precision(self) -> str:
        """What ``--precision auto`` means here: bf16 where it is native (CUDA >= 8.0; a CPU with AVX512-BF16 or
        AMX), else fp16 on a CUDA card and fp32 on a CPU (which emulates bf16 matmuls, 20x slower or more)."""
        if self.kind == "cpu":
            return "bf16" if cpu_has_native_bf16() else "fp32"
        return "bf16" if self.has_native_bf16 else "fp16"

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.kind)

    def describe(self) -> str:
        if self.kind == "cpu":
            return "cpu"
        major, minor = self.compute_capability or (0, 0)
        return f"{self.name} (sm_{major}{minor})"


def cpu_has_native_bf16() -> bool:
    """Whether this machine's CPU computes bf16 matmuls natively (AVX512-BF16 or AMX tiles), from torch's own
    checks of the CPU (``torch.cpu._is_avx512_bf16_supported``, ``_is_amx_tile_supported``: private, checked on
    torch 2.4-2.13; where a torch lacks them, bf16 is taken as native, as memfit did before)."""
    import torch

    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(check is None for check in checks):
        return True
    return any(check() for check in checks if check is not None)


def resolve_device(requested: str) -> Device:
    """The device ``auto | cpu | cuda`` stands for on this machine (a GPU profile name means ``cuda``)."""
    import torch

    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return Device(kind="cpu", name="cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {requested}: no CUDA device is available on this machine; use --device cpu "
                          "(or plan for a card without one: memfit plan --device NAME)")
    index = torch.cuda.current_device()
    properties = torch.cuda.get_device_properties(index)
    capability = (properties.major, properties.minor)
    problem = torch_arch_problem(capability, properties.name)
    if problem is not None:
        raise ConfigError(problem)
    return Device(kind="cuda", name=properties.name, compute_capability=capability,
                  total_memory_bytes=properties.total_memory)


LEGACY_TORCH = "pip install 'torch==2.14.*' --index-url https://download.pytorch.org/whl/cu126"
"""The last torch builds with kernels for cards before Turing (Maxwell, Pascal, Volta): CUDA 12.6 wheels, which
end with torch 2.14; CUDA 12.8+ and 13.x builds start at sm_75."""


def torch_arch_problem(capability: tuple[int, int], name: str, arch_list: list[str] | None = None) -> str | None:
    """Why the installed torch cannot run on a card of ``capability`` (one line naming the fix), or ``None``.

    A build runs on a card when it carries machine code of the same major version and an equal or lower minor
    (``sm_60`` runs on a 6.1 card) or PTX of an equal or lower version, which the driver compiles on load.
    ``arch_list`` defaults to ``torch.cuda.get_arch_list()``; an empty one (a CPU build) says nothing.
    """
    import torch

    arches = torch.cuda.get_arch_list() if arch_list is None else arch_list
    if not arches:
        return None
    for arch in arches:
        kind, _, digits = arch.partition("_")
        digits = digits.rstrip("abf")  # sm_90a, sm_100f: feature-specific variants of the same version
        if not digits.isdigit():
            continue
        version = (int(digits[:-1]), int(digits[-1]))
        if (kind == "sm" and version[0] == capability[0] and version[1] <= capability[1]) or (
                kind == "compute" and version <= capability):
            return None
    major, minor = capability
    fix = (f"install a CUDA 12.6 build of torch 2.14, the last with kernels for it: {LEGACY_TORCH}"
           if capability < (7, 5) else "install a torch build for CUDA 12.8 or newer")
    return (f"the installed torch {torch.__version__} has no CUDA kernels for {name} (sm_{major}{minor}; it "
            f"carries {', '.join(arches)}); {fix}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceProfile:
    """A target device for estimates and plans: what it holds and how fast it computes, as data.

    FLOP/s are dense peak figures from the vendors' datasheets (no sparsity). ``fp16_flops`` and
    ``bf16_flops`` are what autocast's matmuls get: tensor-core rates with fp32 accumulation where the card
    has tensor cores, otherwise the rate cuBLAS reaches with fp16 storage (on Pascal, fp32's: fp16 there buys
    memory, not speed). ``bf16_flops`` is 0 where bf16 is not native.
    """

    name: str
    description: str
    memory_bytes: int
    compute_capability: tuple[int, int] | None
    fp32_flops: float
    fp16_flops: float
    bf16_flops: float
    memory_bandwidth: float
    """Bytes per second."""
    tensor_cores: bool
    non_pytorch_bytes: int = 0
    """Memory the process uses outside PyTorch's allocator (CUDA context, cuBLAS/cuDNN workspaces)."""
    communicator_bytes: int = 0
    """Device memory NCCL takes outside PyTorch's allocator for each communicator a rank of a distributed run
    holds (its buffers per channel and peer): :data:`NCCL_COMMUNICATOR_BYTES` on a card unless its profile
    gives its own figure; none on a CPU (gloo keeps no device buffers)."""
    communicator_measured: bool = False
    """Whether :attr:`communicator_bytes` was measured on such a card (a profile file's own figure), or is
    the stated, unmeasured constant."""
    op_overhead_s: float = GPU_OP_OVERHEAD_S
    """Host time per ATen op of an eager step (Python, dispatcher, kernel launch): what makes small
    micro-batches slow. The planner's cost model charges it for every op a step dispatches."""
    link_bandwidth: float = PCIE3_BANDWIDTH
    """Bytes per second one rank's collectives move between cards of this kind in one machine (bus bandwidth:
    NVLink where such cards have it, else PCIe): what DDP's all-reduce and FSDP's gathers cost."""
    host_bandwidth: float = PCIE3_BANDWIDTH
    """Bytes per second between the card and host memory (PCIe): what FSDP's CPU offload pays."""
    node_bandwidth: float = NODE_BANDWIDTH
    """Bytes per second a collective moves between machines (the bus bandwidth of all one machine's network
    links): what crosses nodes costs when a plan's GPUs fill several machines (``--gpus-per-node``); a
    collective that spans nodes runs at the lower of this and :attr:`link_bandwidth`."""

    def flops_for(self, precision: str) -> float:
        """Dense matmul throughput under ``precision`` (fp32, fp16 or bf16 autocast)."""
        return {"fp32": self.fp32_flops, "fp16": self.fp16_flops, "bf16": self.bf16_flops,
                "bf16-true": self.bf16_flops}[precision]

    def precisions(self) -> tuple[str, ...]:
        """The precisions worth planning with: fp32 and the device's low precision (bf16 where native; else
        fp16 on CUDA; on CPU fp16 is ~20x slower and not offered)."""
        return ("fp32", "bf16") if self.has_native_bf16 else ("fp32", "fp16")

    @property
    def kind(self) -> str:
        return "cpu" if self.compute_capability is None else "cuda"

    @property
    def has_native_bf16(self) -> bool:
        return self.kind == "cpu" or (self.compute_capability or (0, 0)) >= NATIVE_BF16_CAPABILITY

    def as_device(self) -> Device:
        return Device(kind=self.kind, name=self.description, compute_capability=self.compute_capability,
                      total_memory_bytes=self.memory_bytes if self.kind == "cuda" else None)


GiB = 1024**3
TERA = 1e12
CUDA_CONTEXT_BYTES = 400 * 1024**2  # typical CUDA context + cuBLAS workspace of a training process
NCCL_COMMUNICATOR_BYTES = 688 * 1024**2
"""NCCL's own device buffers for one communicator, outside PyTorch's allocator: a stated constant, unmeasured by
memfit. The figure is the one reported in NVIDIA/nccl issue 964 (four A100s with NVLink: 688 MB for a group of
more than two ranks after its first all-reduce, 544 MB for two). It varies with the NCCL version, the channels
and peers NCCL sets up, the link and NCCL's environment (``NCCL_BUFFSIZE``, NVLink SHARP); a profile file's
``communicator_bytes`` replaces it, and ``benchmarks/nccl_probe.py`` measures one card's one-rank communicator."""


def _gpu(name: str, description: str, memory_gib: float, capability: tuple[int, int], fp32: float, fp16: float,
         bf16: float, bandwidth_gbs: float, tensor_cores: bool, *, link_gbs: float = 12,
         host_gbs: float = 12, node_gbs: float = NODE_BANDWIDTH / 1e9) -> DeviceProfile:
    """``link_gbs``/``host_gbs``/``node_gbs``: achievable (not nominal) GB/s: PCIe 3.0 x16 ~12, 4.0 ~24, 5.0
    ~48; NVLink bus bandwidth from the datasheets' per-GPU figure, halved for what all-reduce reaches; between
    machines 80 % of the network's line rate (:data:`NODE_BANDWIDTH`, :data:`DATACENTER_NODE_GBS`)."""
    return DeviceProfile(name=name, description=description, memory_bytes=int(memory_gib * GiB),
                         compute_capability=capability, fp32_flops=fp32 * TERA, fp16_flops=fp16 * TERA,
                         bf16_flops=bf16 * TERA, memory_bandwidth=bandwidth_gbs * 1e9, tensor_cores=tensor_cores,
                         non_pytorch_bytes=CUDA_CONTEXT_BYTES, communicator_bytes=NCCL_COMMUNICATOR_BYTES,
                         link_bandwidth=link_gbs * 1e9, host_bandwidth=host_gbs * 1e9, node_bandwidth=node_gbs * 1e9)


CPU_FP32 = 0.3 * TERA
"""With the planner's 50 % efficiency, ~150 GFLOP/s: fitted, with :data:`CPU_OP_OVERHEAD_S` and the bf16
factor, to the step times of ``memfit bench`` on 2 AVX512-BF16 cores (MiniLM on Rotten Tomatoes and a small
ViT on Fashion-MNIST, benchmarks/results/bench_*_cpu). Other CPUs differ; only the ratios matter to a plan."""
CPU_OP_OVERHEAD_S = 40e-6
"""Fitted with :data:`CPU_FP32` (the op counts exclude ``tensor.device`` queries, which only a traced step
dispatches: 3.2-3.5x fewer ops than when the fit counted them, at 12 us each). On a CPU it also stands for
the time of the small ops the FLOP count leaves out (layer norms, softmax, element-wise)."""
CPU_GLOO_BANDWIDTH = 1.86e9
"""gloo's all-reduce bus bandwidth between two processes on this 2-core host (64 MiB, median of 5), measured
by ``benchmarks/distributed_overhead.py`` (benchmarks/results/distributed_overhead_cpu.json)."""


def _cpu_bf16_flops() -> float:
    """bf16 matmul rate of this CPU: 1.3x fp32 where oneDNN has native bf16 dot products (AVX512-BF16, AMX;
    the fit above), else half (bf16 through conversions). Read from the CPU's flags where Linux lists them
    (importing torch to ask oneDNN takes seconds), else from oneDNN."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        flags = set(cpuinfo.read_text(errors="replace").split())
        native = bool(flags & {"avx512_bf16", "amx_bf16"})
    else:
        import torch

        try:
            native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            native = False
    return CPU_FP32 * (1.3 if native else 0.5)


PROFILES: dict[str, DeviceProfile] = {profile.name: profile for profile in (
    _gpu("1080ti", "NVIDIA GeForce GTX 1080 Ti", 11, (6, 1), 11.3, 11.3, 0, 484, False),
    _gpu("2080ti", "NVIDIA GeForce RTX 2080 Ti", 11, (7, 5), 13.4, 53.8, 0, 616, True),
    _gpu("t4", "NVIDIA T4", 15, (7, 5), 8.1, 65, 0, 320, True),
    _gpu("v100-16", "NVIDIA V100 16GB", 16, (7, 0), 15.7, 125, 0, 900, True, link_gbs=75),
    _gpu("v100-32", "NVIDIA V100 32GB", 32, (7, 0), 15.7, 125, 0, 900, True, link_gbs=75),
    _gpu("3060", "NVIDIA GeForce RTX 3060 12GB", 12, (8, 6), 12.7, 25.5, 25.5, 360, True, link_gbs=24,
         host_gbs=24),
    _gpu("3090", "NVIDIA GeForce RTX 3090", 24, (8, 6), 35.6, 71, 71, 936, True, link_gbs=24, host_gbs=24),
    _gpu("4090", "NVIDIA GeForce RTX 4090", 24, (8, 9), 82.6, 165, 165, 1008, True, link_gbs=24, host_gbs=24),
    _gpu("a100-40", "NVIDIA A100 40GB", 40, (8, 0), 19.5, 312, 312, 1555, True, link_gbs=150, host_gbs=24,
         node_gbs=DATACENTER_NODE_GBS["A100"]),
    _gpu("a100-80", "NVIDIA A100 80GB", 80, (8, 0), 19.5, 312, 312, 2039, True, link_gbs=150, host_gbs=24,
         node_gbs=DATACENTER_NODE_GBS["A100"]),
    _gpu("l4", "NVIDIA L4", 22, (8, 9), 30.3, 121, 121, 300, True, link_gbs=24, host_gbs=24),
    _gpu("h100", "NVIDIA H100 80GB (SXM)", 80, (9, 0), 67, 989, 989, 3350, True, link_gbs=225, host_gbs=48,
         node_gbs=DATACENTER_NODE_GBS["H100"]),
    _gpu("h200", "NVIDIA H200", 139, (9, 0), 67, 989, 989, 4800, True, link_gbs=225, host_gbs=48,
         node_gbs=DATACENTER_NODE_GBS["H100"]),
    DeviceProfile(name="cpu", description="host CPU", memory_bytes=0, compute_capability=None, fp32_flops=CPU_FP32,
                  fp16_flops=0.005 * TERA, bf16_flops=_cpu_bf16_flops(), memory_bandwidth=20e9, tensor_cores=False,
                  op_overhead_s=CPU_OP_OVERHEAD_S, link_bandwidth=CPU_GLOO_BANDWIDTH, host_bandwidth=20e9),
)}
assert tuple(PROFILES) == names.PROFILES, "memfit.names.PROFILES lists the profiles for the command line"


ALIASES = {"a100-40gb": "a100-40", "a100-80gb": "a100-80", "v100-16gb": "v100-16", "v100-32gb": "v100-32",
           "gtx1080ti": "1080ti", "rtx2080ti": "2080ti", "rtx3090": "3090", "rtx4090": "4090"}
"""Other spellings of the built-in names (``memfit devices`` lists the canonical ones)."""


def resolve_profile(name: str) -> DeviceProfile:
    """A built-in profile by name (or alias), or one read from a TOML/JSON file with the same field names."""
    name = ALIASES.get(name.lower(), name)
    if name in PROFILES:
        return PROFILES[name]
    path = Path(name)
    if path.suffix in (".toml", ".json"):
        return _profile_from_file(path)
    raise ConfigError(f"--device {name!r} is not a known device (known: {', '.join(PROFILES)}) "
                      "nor a .toml/.json profile file")


def profile_for(device: Device, *, memory_bytes: int | None = None) -> DeviceProfile:
    """The profile of a device this process sees: the built-in one whose name and capability match, with
    the memory it really has (or ``memory_bytes``, e.g. a per-process cap); else a profile built from its
    properties, with fp32 throughput unknown (0)."""
    if device.kind == "cpu":
        return PROFILES["cpu"]
    memory = memory_bytes if memory_bytes is not None else device.total_memory_bytes or 0
    tokens = set(re.split(r"[^a-z0-9]+", device.name.lower()))
    candidates = [profile for profile in PROFILES.values()
                  if profile.compute_capability == device.compute_capability and _model_token(profile) in tokens]
    if candidates:  # e.g. A100 40GB vs 80GB: the one closest in memory
        best = min(candidates, key=lambda p: abs(p.memory_bytes - (device.total_memory_bytes or 0)))
        return replace(best, memory_bytes=memory)
    return DeviceProfile(name=device.name, description=device.name, memory_bytes=memory,
                         compute_capability=device.compute_capability, fp32_flops=0.0, fp16_flops=0.0,
                         bf16_flops=0.0, memory_bandwidth=0.0, tensor_cores=(device.compute_capability or (0, 0))
                         >= (7, 0), non_pytorch_bytes=CUDA_CONTEXT_BYTES, communicator_bytes=NCCL_COMMUNICATOR_BYTES)


CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
"""Where Linux states a container's memory limit (cgroup v2, v1)."""


def host_memory_bytes() -> int | None:
    """This machine's memory, or its container's limit where lower (``None`` where the system says neither):
    what a run's offloaded bytes, over the ranks it launches here, must fit."""
    try:
        known = [os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")]
    except (AttributeError, ValueError, OSError):
        known = []
    for limit in CGROUP_LIMITS:
        try:
            text = limit.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max": no limit
            known.append(int(text))
    return min(known, default=None)


def _model_token(profile: DeviceProfile) -> str:
    """The model number in a profile's description: ``1080`` for "NVIDIA GeForce GTX 1080 Ti"."""
    words = re.split(r"[^a-z0-9]+", profile.description.lower())
    return next((word for word in words if any(char.isdigit() for char in word)), profile.name)


def _profile_from_file(path: Path) -> DeviceProfile:
    raw = load_option_file(str(path), flag="--device", section=None)
    fields = {"name", "description", "memory_bytes", "compute_capability", "fp32_flops", "fp16_flops",
              "bf16_flops", "memory_bandwidth", "tensor_cores", "non_pytorch_bytes", "communicator_bytes",
              "op_overhead_s", "link_bandwidth", "host_bandwidth", "node_bandwidth"}
    unknown = sorted(set(raw) - fields)
    missing = sorted({"name", "memory_bytes", "fp32_flops"} - set(raw))
    if unknown or missing:
        raise ConfigError([f"{path}: unknown profile field {key!r}" for key in unknown]
                          + [f"{path}: missing profile field {key!r}" for key in missing])
    capability = raw.get("compute_capability")
    return DeviceProfile(
        name=str(raw["name"]), description=str(raw.get("description", raw["name"])),
        memory_bytes=int(raw["memory_bytes"]), compute_capability=tuple(capability) if capability else None,
        fp32_flops=float(raw["fp32_flops"]), fp16_flops=float(raw.get("fp16_flops", raw["fp32_flops"])),
        bf16_flops=float(raw.get("bf16_flops", 0.0)), memory_bandwidth=float(raw.get("memory_bandwidth", 0.0)),
        tensor_cores=bool(raw.get("tensor_cores", False)),
        non_pytorch_bytes=int(raw.get("non_pytorch_bytes", CUDA_CONTEXT_BYTES if capability else 0)),
        communicator_bytes=int(raw.get("communicator_bytes", NCCL_COMMUNICATOR_BYTES if capability else 0)),
        communicator_measured="communicator_bytes" in raw,
        op_overhead_s=float(raw.get("op_overhead_s", GPU_OP_OVERHEAD_S)),
        link_bandwidth=float(raw.get("link_bandwidth", PCIE3_BANDWIDTH)),
        host_bandwidth=float(raw.get("host_bandwidth", PCIE3_BANDWIDTH)),
        node_bandwidth=float(raw.get("node_bandwidth", NODE_BANDWIDTH)))


def gpu_profile_problems(name: str, flag: str, devices: tuple[str, ...] = ()) -> list[str]:
    """What is wrong with ``name`` as a GPU to plan for (a built-in profile or a profile file), given to ``flag``
    (``devices``: the other values it takes)."""
    try:
        profile = resolve_profile(name)
    except ConfigError as error:
        if Path(name).suffix in (".toml", ".json"):
            return error.problems
        choices = f"one of: {', '.join(devices)}, or " if devices else ""
        return [f"{flag} {name!r} is not {choices}a GPU profile to plan for (memfit devices) or a .toml/.json "
                "profile file"]
    if profile.kind == "cuda":
        return []
    return [f"{flag} {name!r} is not a GPU profile; " + ("use --device cpu" if devices else
                                                        "give one of memfit devices' GPUs")]
