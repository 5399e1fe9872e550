"""The planner's cost model of a step's time: compute, per-op host overhead, optimizer traffic and (with
several GPUs) communication; see :mod:`memfit.planner` for the formulas."""

from __future__ import annotations

from dataclasses import dataclass

from memfit.devices import DeviceProfile
from memfit.memory.estimate import Estimate

EFFICIENCY = 0.5
"""Share of the dense peak FLOP/s an eager transformer step reaches."""
BYTES_PER_TRAINED_PARAMETER = 32
"""AdamW step traffic: read weight, gradient and two states, write weight and two states (fp32), plus the
norm's read of the gradient."""
KAHAN_BYTES_PER_TRAINED_PARAMETER = 10
"""Kahan summation's extra traffic per bf16 parameter: its compensation buffer read and written in the update,
read again when added to the weight, and the rounding error written back through a temporary (5 x 2 bytes)."""
HOST_MEMORY_BANDWIDTH = 20e9
"""Bytes per second of the host's memory: where an offloaded optimizer step runs."""
STEPS = 2
"""Optimizer steps per trace: the steady state (Adam's states live) starts in step 2."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepCost:
    """What a family's step costs besides its FLOP rate, from one of its traces."""

    flops_per_sample: float
    ops_per_micro_step: float
    ops_per_optimizer_step: float
    trainable_parameters: int
    parameters: int = 0
    dequantized_bytes_per_micro_step: float = 0.0
    """QLoRA: bytes read and written to dequantise the 4-bit weights in one forward and backward."""
    offloaded_bytes_per_sample: float = 0.0
    """``--offload-activations``: the saved activations one sample moves to the host (and back); a micro-step's
    grow with its micro-batch, whichever micro-batch the cost was traced at."""

    @classmethod
    def of(cls, trace: Estimate) -> StepCost:
        assert trace.flops is not None, "planner traces count FLOPs"
        micro_steps = trace.traced_micro_steps
        ops = trace.phase_ops
        return cls(flops_per_sample=trace.flops / trace.traced_samples,
                   ops_per_micro_step=(ops.get("forward", 0) + ops.get("backward", 0)) / micro_steps,
                   ops_per_optimizer_step=ops.get("optimizer", 0) / STEPS,
                   trainable_parameters=trace.trainable_parameters, parameters=trace.parameters,
                   dequantized_bytes_per_micro_step=(trace.dequantized_bytes or 0) / micro_steps,
                   offloaded_bytes_per_sample=trace.host_breakdown.get("offloaded_activations", 0)
                   / trace.micro_batch_size)


def step_seconds(cost: StepCost, profile: DeviceProfile, precision: str, *, effective_batch: int,
                 accumulation_steps: int, strategy: str = "none", world_size: int = 1,
                 offload: bool = False, kahan: bool = False, paged: bool = False, shard_group: int | None = None,
                 per_node: int | None = None, reduce_every: bool = False) -> float:
    """The cost model's time of one optimizer step of one rank (see the module docstring);
    ``effective_batch`` is the samples this rank computes; ``offload``: the optimizer's step on the host;
    ``kahan``: bf16 weights' compensated update; ``paged``: 8-bit states paged through the host (taken as
    paged in and out once per step: the card is short, or the plan would not need them paged);
    ``shard_group``: FSDP shards within groups of this many ranks (HSDP); ``per_node``: ranks per machine
    (``None``: all on one); ``reduce_every``: FSDP reduces the gradients in each of the window's micro-steps."""
    compute = effective_batch * cost.flops_per_sample / (profile.flops_for(precision) * EFFICIENCY)
    overhead = (accumulation_steps * cost.ops_per_micro_step + cost.ops_per_optimizer_step) * profile.op_overhead_s
    step_bytes = BYTES_PER_TRAINED_PARAMETER // 2 if precision == "bf16-true" else BYTES_PER_TRAINED_PARAMETER
    step_bytes += KAHAN_BYTES_PER_TRAINED_PARAMETER if kahan else 0
    optimizer = cost.trainable_parameters * step_bytes / profile.memory_bandwidth
    if paged:  # two 1-byte states per parameter, in and out over the host link
        optimizer += cost.trainable_parameters * 4 / profile.host_bandwidth
    if offload:  # fp32 gradients to the host and weights back over PCIe, the update at host memory speed
        optimizer = cost.trainable_parameters * (2 * 4 / profile.host_bandwidth
                                                 + BYTES_PER_TRAINED_PARAMETER / HOST_MEMORY_BANDWIDTH)
    traffic = optimizer + accumulation_steps * cost.dequantized_bytes_per_micro_step / profile.memory_bandwidth
    # offloaded activations cross the host link twice (out in forward, back in backward), not overlapped
    traffic += effective_batch * 2 * cost.offloaded_bytes_per_sample / profile.host_bandwidth
    if strategy == "none" or world_size == 1:
        return compute + overhead + traffic
    gradients = 4 * cost.trainable_parameters  # reduced in fp32 (bf16-true's too: FSDP's reduce dtype)
    if strategy == "ddp":
        return compute + overhead + traffic + 2 * _share(world_size) * gradients / _bus(profile, world_size, per_node)
    gathered = 2 * accumulation_steps * cost.parameters * (4 if precision == "fp32" else 2)
    group = shard_group if shard_group is not None and shard_group < world_size else world_size
    scattered = gradients * (accumulation_steps if reduce_every else 1)  # a reduce-scatter per micro-step
    communication = _share(group) * (gathered + scattered) / _bus(profile, group, per_node)
    if group < world_size:  # HSDP: each rank's gradient shard all-reduced across the groups too
        replicas = world_size // group
        across = profile.link_bandwidth if per_node is None or per_node >= world_size else \
            min(profile.link_bandwidth, profile.node_bandwidth / per_node)  # every rank of a machine sends its shard
        communication += 2 * _share(replicas) * gradients / group / across
    traffic /= group  # each rank steps its shard
    if strategy == "fsdp-offload":  # each rank's shards to the card for every gather, as the host keeps them
        stored = 2 if precision == "bf16-true" else 4  # (fp32 under mixed precision, cast on the card); each
        to_card = 2 * accumulation_steps * cost.parameters * stored  # reduced shard back, bf16-true's cast first
        to_host = scattered // 2 if precision == "bf16-true" else scattered
        host = (to_card + to_host) / group / profile.host_bandwidth
        traffic = traffic * profile.memory_bandwidth / HOST_MEMORY_BANDWIDTH
        communication += host
    return compute + overhead + traffic + communication


def _share(ranks: int) -> float:
    """What a ring collective over ``ranks`` moves per byte of its input: (n - 1) / n."""
    return (ranks - 1) / ranks


def _bus(profile: DeviceProfile, ranks: int, per_node: int | None) -> float:
    """The bus bandwidth of a collective over ``ranks`` consecutive ranks, ``per_node`` to a machine: the cards'
    link inside one machine, the lower of it and the network's across machines."""
    if per_node is None or ranks <= per_node:
        return profile.link_bandwidth
    return min(profile.link_bandwidth, profile.node_bandwidth)
