"""The planner: the fastest setup that fits a memory budget, at the effective batch the user chose.

The effective batch is never changed: the planner only chooses how to compute it. What it varies:

- accuracy-neutral, always allowed: the micro-batch / accumulation split, the precision (fp32 and the
  device's low precision: bf16 where native, else fp16 on CUDA), checkpointing (none, every 2nd layer, every
  layer), and the optimizer's implementation (foreach kernels or a per-parameter loop);
- opt-in, because they change what is learned: freezing (``allow_freeze``: the embeddings, or all but the top
  half or quarter of the layers) and 8-bit optimizer states (``allow_8bit_optimizer``, needs bitsandbytes).
  They are a last resort: used only when no accuracy-neutral setup fits, least freezing first.

Cost model (all of it):

    memory   peak(m) = the estimator's exact trace of the setup (memory.estimate), or a line through two
             traces of the same family at micro-batches m1, m2: per phase (forward, backward, optimizer,
             zero_grad) allocated(m) = a + b·m, the peak is the largest phase, plus the allocator's reserve
             (also a line) and the non-PyTorch bytes of the device. A trace of two micro-steps stands for
             any accumulation >= 2: every micro-step after the first sees the same live set, except the
             window's input batches, which all live until the window ends (added per sample).
    time     t(step) = E·F / (R_dtype·EFFICIENCY)            compute: F = traced FLOPs per sample (forward,
                                                               backward, checkpointing's recompute), R_dtype
                                                               = the profile's dense FLOP/s for the dtype
             + (k·ops_micro + ops_optimizer)·τ                per-op host overhead: k micro-steps of a window
             + trainable·BYTES_PER_TRAINED_PARAMETER / BW     the optimizer's memory traffic
             + communication (``--gpus N``, per optimizer step, W = N ranks, r = (W-1)/W, link = the
               profile's rank-to-rank bandwidth; taken as not hidden behind compute, an upper bound):
               ddp   2r·trainable·4 / link                   the gradient all-reduce
               fsdp  k·2r·params·b / link + r·trainable·4 / link   all-gathers in forward and backward of
                                                               each micro-step (b: bytes of the compute
                                                               dtype), one reduce-scatter of fp32 gradients
               offload: fsdp's, plus k·2·params·b/W + trainable·4/W over the host link, and the optimizer
               step on the host (its traffic at host memory speed)
    speed    E / t(step) samples/s (E the global batch; with N ranks each computes E/N); fits = peak <=
             budget·(1 - margin), the peak being one rank's.

On a card whose fp16 rate equals its fp32 rate (Pascal), fp16 only adds cast ops: it is chosen for memory,
never for speed. Search: families (precision x checkpointing x optimizer implementation) are traced in the
order of their best possible speed (a bound from what was traced so far); a family that cannot beat the
best fitting setup at any micro-batch is not traced. The chosen setup and the runner-up are confirmed with
exact traces, as is any faster setup whose line comes within ``BAND`` of the budget.

What only a GPU can confirm: EFFICIENCY and τ are typical eager-mode figures, not measured per card; the
ranking depends on their ratio, the memory side does not.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from memfit.build import Prepared
from memfit.config import DEVICES, TrainConfig, from_mapping
from memfit.devices import DeviceProfile, profile_for, resolve_profile
from memfit.errors import ConfigError, Problems
from memfit.memory.estimate import Estimate, estimate, prepare_trace
from memfit.report import format_bytes
from memfit.techniques.optim import optimizer_problems

EFFICIENCY = 0.5
"""Share of the dense peak FLOP/s an eager transformer step reaches."""
BYTES_PER_TRAINED_PARAMETER = 32
"""AdamW step traffic: read weight, gradient and two states, write weight and two states (fp32), plus the
norm's read of the gradient."""
HOST_MEMORY_BANDWIDTH = 20e9
"""Bytes per second of the host's memory: where an offloaded optimizer step runs."""
BAND = 0.10
"""A fitted setup this close above the usable budget is traced exactly before it is rejected."""
CHECKPOINTING = ("none", "every-2", "full")
STEPS = 2
"""Optimizer steps per trace: the steady state (Adam's states live) starts in step 2."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Family:
    """Everything of a setup except the micro-batch split."""

    precision: str
    checkpointing: str
    """``none | every-2 | full``."""
    foreach: bool
    freeze: str = "none"
    """``none | embeddings | top-K`` (train only the top K layers)."""
    optimizer: str = "adamw"
    strategy: str = "none"
    """More than one GPU: ``ddp``, ``fsdp`` or ``fsdp-offload``; ``none`` for one."""

    @property
    def ranks(self) -> bool:
        return self.strategy != "none"

    @property
    def accuracy_neutral(self) -> bool:
        return self.freeze == "none" and self.optimizer != "adamw8bit"

    @property
    def optimizer_label(self) -> str:
        if self.optimizer == "adamw8bit":
            return "adamw8bit"
        return f"{self.optimizer}-{'foreach' if self.foreach else 'loop'}"

    def configure(self, base: TrainConfig, *, micro_batch_size: int, effective_batch: int) -> TrainConfig:
        """``base`` with this family's techniques and the given split (``effective_batch``: the global one,
        over ``base.world_size`` ranks when the family is distributed)."""
        top = int(self.freeze.removeprefix("top-")) if self.freeze.startswith("top-") else None
        return dataclasses.replace(
            base, micro_batch_size=micro_batch_size, accumulation_steps=None, effective_batch=effective_batch,
            distributed=self.strategy.removesuffix("-offload"), cpu_offload=self.strategy == "fsdp-offload",
            world_size=base.world_size if self.ranks else 1,
            precision=self.precision, checkpointing="every-n" if self.checkpointing == "every-2" else
            self.checkpointing, checkpoint_every=2, foreach=self.foreach, optimizer=self.optimizer,
            freeze_embeddings=self.freeze == "embeddings" or base.freeze_embeddings,
            train_top_layers=top if top is not None else base.train_top_layers)


@dataclass(kw_only=True, slots=True)
class Candidate:
    family: Family
    micro_batch_size: int
    accumulation_steps: int
    predicted_peak_bytes: int | None
    """What is compared with the budget: peak reserved by the allocator plus the non-PyTorch bytes."""
    predicted_allocated_bytes: int | None
    peak_phase: str | None
    predicted_samples_per_second: float
    exact: bool
    """From an exact trace of this setup (else from the family's line)."""
    fits: bool | None
    """``None``: not traced, because it cannot beat the chosen setup."""
    reason: str = ""
    relative_speed: float | None = None
    """Predicted samples/s relative to the chosen setup."""
    world_size: int = 1
    """Ranks whose windows make one optimizer step (1 unless the family is distributed)."""

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks: ``predicted_samples_per_second`` counts them all."""
        return self.micro_batch_size * self.accumulation_steps * self.world_size

    def to_dict(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch_size, "accumulation_steps": self.accumulation_steps,
                "precision": self.family.precision, "checkpointing": self.family.checkpointing,
                "optimizer": self.family.optimizer_label, "foreach": self.family.foreach,
                "freeze": self.family.freeze, "accuracy_neutral": self.family.accuracy_neutral,
                "distributed": self.family.strategy, "world_size": self.world_size,
                "predicted_peak_bytes": self.predicted_peak_bytes,
                "predicted_allocated_bytes": self.predicted_allocated_bytes, "peak_phase": self.peak_phase,
                "predicted_samples_per_second": self.predicted_samples_per_second,
                "predicted_optimizer_steps_per_second": self.predicted_samples_per_second / self.global_batch,
                "relative_speed": self.relative_speed, "exact": self.exact, "fits": self.fits,
                "reason": self.reason}

    def describe(self) -> str:
        freeze = "" if self.family.freeze == "none" else f", freeze {self.family.freeze}"
        ranks = f"{self.family.strategy}, " if self.family.ranks else ""
        per_rank = " per rank" if self.family.ranks else ""
        return (f"{ranks}micro-batch {self.micro_batch_size} x {self.accumulation_steps}{per_rank}, "
                f"{self.family.precision}, checkpointing {self.family.checkpointing}, "
                f"{self.family.optimizer_label}{freeze}")


@dataclass(kw_only=True, slots=True)
class Plan:
    chosen: Candidate | None
    candidates: list[Candidate]
    """Ranked: fitting setups by predicted speed, then the rest by predicted peak."""
    budget_bytes: int
    usable_bytes: int
    """The budget less the margin: what a setup's predicted peak must stay under."""
    margin: float
    device: str
    device_description: str
    model: str
    effective_batch: int
    sequence_length: int | None
    image_size: int | None
    verdict: str
    """One line: what was chosen and why, or why nothing fits and what would."""
    traces: int
    seconds: float
    config: dict[str, Any] = field(default_factory=dict)
    """The base training options the plan was made for (its own choices applied by :meth:`to_config`)."""

    def to_dict(self) -> dict[str, Any]:
        return {"chosen": self.chosen.to_dict() if self.chosen else None,
                "candidates": [candidate.to_dict() for candidate in self.candidates],
                "budget_bytes": self.budget_bytes, "usable_bytes": self.usable_bytes, "margin": self.margin,
                "device": self.device, "device_description": self.device_description, "model": self.model,
                "effective_batch": self.effective_batch, "sequence_length": self.sequence_length,
                "image_size": self.image_size, "verdict": self.verdict, "traces": self.traces,
                "seconds": self.seconds, "config": self.config}

    def summary(self) -> dict[str, Any]:
        """The chosen setup as planned, the budget and the verdict (what a run's summary keeps)."""
        return {"chosen": self.chosen.to_dict() if self.chosen else None, "budget_bytes": self.budget_bytes,
                "usable_bytes": self.usable_bytes, "device": self.device, "verdict": self.verdict}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    def to_config(self, base: TrainConfig | None = None) -> TrainConfig:
        """The training config that runs the chosen setup (``base``: the plan's own options)."""
        if self.chosen is None:
            raise ConfigError(self.verdict)
        base = dataclasses.replace(base or from_mapping(self.config), budget=None, plan=None)
        return self.chosen.family.configure(base, micro_batch_size=self.chosen.micro_batch_size,
                                            effective_batch=self.effective_batch)

    def to_training_arguments(self) -> dict[str, Any]:
        """Keyword arguments for ``transformers.TrainingArguments`` that run the chosen setup in HF Trainer.

        Trainer checkpoints every layer, so an every-2 plan becomes full checkpointing there (less memory,
        slower). A for-loop AdamW plan maps to fused AdamW, which keeps no gradient-sized temporaries either.
        Freezing is not a training argument: a plan that freezes warns, and the caller freezes the model.
        """
        if self.chosen is None:
            raise ConfigError(self.verdict)
        family = self.chosen.family
        if family.freeze != "none":
            warnings.warn(f"the plan freezes {family.freeze}: freeze those parameters (requires_grad=False) "
                          "before building the Trainer", stacklevel=2)
        optim = {"adamw8bit": "adamw_bnb_8bit", "sgd": "sgd"}.get(family.optimizer) or (
            "adamw_torch" if family.foreach else "adamw_torch_fused")
        config = from_mapping(self.config)
        arguments: dict[str, Any] = {
            "per_device_train_batch_size": self.chosen.micro_batch_size,
            "gradient_accumulation_steps": self.chosen.accumulation_steps,
            "fp16": family.precision == "fp16", "bf16": family.precision == "bf16",
            "gradient_checkpointing": family.checkpointing != "none", "optim": optim,
            "learning_rate": config.lr, "weight_decay": config.weight_decay,
            "max_grad_norm": config.max_grad_norm if config.max_grad_norm is not None else 0.0,
        }
        if family.checkpointing != "none":
            arguments["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
        if self.device == "cpu":
            arguments["use_cpu"] = True
        return arguments


def plan_for_run(prepared: Prepared, console: Console) -> tuple[TrainConfig, Plan]:
    """The config a run with ``--budget`` (plan now, for the device this run uses) or ``--plan`` (a saved
    plan) trains with; the options the plan does not choose stay the run's."""
    config = prepared.config
    if config.plan is not None:
        made = load_plan(config.plan)
        if made.model != config.model:
            raise ConfigError(f"--plan {config.plan} was made for --model {made.model}, not {config.model}; "
                              "plan again for this model")
        if made.device != profile_for(prepared.device).name:
            console.print(f"[yellow]note:[/] {config.plan} was planned for {made.device_description}; this run "
                          f"is on {prepared.device.describe()}")
    else:
        named = config.device not in DEVICES  # --device 1080ti: plan for that card
        target = resolve_profile(config.device) if named else profile_for(prepared.device)
        made = plan(config, device=target, budget=config.budget, seq_len=config.max_length,
                    num_labels=len(prepared.label_names), gpus=config.world_size,
                    precisions=None if config.precision == "auto" else (config.precision,))
    if made.chosen is None:
        raise ConfigError(made.verdict)
    if made.effective_batch != config.effective_batch and config.plan is not None:
        console.print(f"[yellow]note:[/] the plan's effective batch {made.effective_batch} replaces "
                      f"{config.effective_batch}")
    console.print(f"plan: {made.verdict} (planned in {made.seconds:.1f} s from {made.traces} traces)")
    return made.to_config(base=config), made


def load_plan(path: str | Path) -> Plan:
    """A plan saved by ``memfit plan --save`` (or :meth:`Plan.save`)."""
    file = Path(path)
    try:
        raw = json.loads(file.read_text())
        chosen = raw["chosen"]
        return Plan(chosen=_candidate(chosen) if chosen else None, candidates=[],
                    **{name: raw[name] for name in ("budget_bytes", "usable_bytes", "margin", "device",
                                                     "device_description", "model", "effective_batch",
                                                     "sequence_length", "image_size", "verdict", "traces",
                                                     "seconds", "config")})
    except FileNotFoundError:
        raise ConfigError(f"--plan {path}: no such file; make one with memfit plan ... --save {path}") from None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"--plan {path}: not a plan saved by memfit plan --save ({error!r}); "
                          "make it again") from None


def _candidate(raw: dict[str, Any]) -> Candidate:
    family = Family(precision=raw["precision"], checkpointing=raw["checkpointing"], foreach=raw["foreach"],
                    freeze=raw["freeze"], optimizer=raw["optimizer"].split("-")[0],
                    strategy=raw.get("distributed", "none"))
    return Candidate(family=family, micro_batch_size=raw["micro_batch_size"],
                     accumulation_steps=raw["accumulation_steps"], predicted_peak_bytes=raw["predicted_peak_bytes"],
                     predicted_allocated_bytes=raw["predicted_allocated_bytes"], peak_phase=raw["peak_phase"],
                     predicted_samples_per_second=raw["predicted_samples_per_second"], exact=raw["exact"],
                     fits=raw["fits"], reason=raw["reason"], relative_speed=raw["relative_speed"],
                     world_size=raw.get("world_size", 1))


@dataclass(frozen=True, kw_only=True, slots=True)
class StepCost:
    """What a family's step costs besides its FLOP rate, from one of its traces."""

    flops_per_sample: float
    ops_per_micro_step: float
    ops_per_optimizer_step: float
    trainable_parameters: int
    parameters: int = 0

    @classmethod
    def of(cls, trace: Estimate) -> StepCost:
        assert trace.flops is not None, "planner traces count FLOPs"
        micro_steps = trace.traced_micro_steps
        ops = trace.phase_ops
        return cls(flops_per_sample=trace.flops / trace.traced_samples,
                   ops_per_micro_step=(ops.get("forward", 0) + ops.get("backward", 0)) / micro_steps,
                   ops_per_optimizer_step=(ops.get("optimizer", 0) + ops.get("zero_grad", 0)) / STEPS,
                   trainable_parameters=trace.trainable_parameters, parameters=trace.parameters)


def step_seconds(cost: StepCost, profile: DeviceProfile, precision: str, *, effective_batch: int,
                 accumulation_steps: int, strategy: str = "none", world_size: int = 1) -> float:
    """The cost model's time of one optimizer step of one rank (see the module docstring);
    ``effective_batch`` is the samples this rank computes."""
    compute = effective_batch * cost.flops_per_sample / (profile.flops_for(precision) * EFFICIENCY)
    overhead = (accumulation_steps * cost.ops_per_micro_step + cost.ops_per_optimizer_step) * profile.op_overhead_s
    traffic = cost.trainable_parameters * BYTES_PER_TRAINED_PARAMETER / profile.memory_bandwidth
    if strategy == "none" or world_size == 1:
        return compute + overhead + traffic
    share = (world_size - 1) / world_size
    gradients = 4 * cost.trainable_parameters
    if strategy == "ddp":
        return compute + overhead + traffic + 2 * share * gradients / profile.link_bandwidth
    gathered = 2 * accumulation_steps * cost.parameters * (4 if precision == "fp32" else 2)
    communication = share * (gathered + gradients) / profile.link_bandwidth
    traffic /= world_size  # each rank steps its shard
    if strategy == "fsdp-offload":
        host = (gathered + gradients) / world_size / profile.host_bandwidth
        traffic = traffic * profile.memory_bandwidth / HOST_MEMORY_BANDWIDTH
        communication += host
    return compute + overhead + traffic + communication


def micro_batch_sizes(effective_batch: int) -> list[int]:
    """Micro-batch sizes worth trying, largest first: E/k rounded up for k a divisor of E or a power of two
    (a remainder goes to a smaller last micro-step), one per distinct size."""
    splits = {k for k in range(1, effective_batch + 1) if effective_batch % k == 0}
    splits |= {2**i for i in range(effective_batch.bit_length()) if 2**i <= effective_batch}
    return sorted({math.ceil(effective_batch / k) for k in splits}, reverse=True)


@dataclass(frozen=True, slots=True)
class _Line:
    """A family's peak as a function of the micro-batch, through its two traces with accumulation."""

    low: Estimate
    high: Estimate | None

    def at(self, micro: int) -> tuple[int, int, str]:
        """(compared bytes, allocated bytes, peak phase) at ``micro``."""
        def line(low: float, high: float) -> float:
            if self.high is None:
                return low
            slope = (high - low) / (self.high.micro_batch_size - self.low.micro_batch_size)
            return low + slope * (micro - self.low.micro_batch_size)

        other = self.high or self.low
        phases = {name: line(value, other.phases.get(name, value)) for name, value in self.low.phases.items()}
        phase = max(phases, key=lambda name: phases[name])
        reserve = max(0.0, line(self.low.peak_reserved_bytes - self.low.peak_bytes,
                                other.peak_reserved_bytes - other.peak_bytes))
        allocated = int(phases[phase])
        return int(allocated + reserve) + self.low.non_pytorch_bytes, allocated, phase


class _Search:
    def __init__(self, base: TrainConfig, profile: DeviceProfile, *, usable_bytes: int, seq_len: int | None,
                 image_size: int | None, num_labels: int, cache: dict[Any, Estimate] | None = None) -> None:
        self.base, self.profile, self.usable = base, profile, usable_bytes
        self.seq_len, self.image_size, self.num_labels = seq_len, image_size, num_labels
        self.global_batch = base.effective_batch
        self.world_size = base.world_size
        self.effective = base.per_rank_batch
        """Samples of a window one rank computes (the global batch with one GPU)."""
        self.micros = micro_batch_sizes(self.effective)
        self.traces: dict[tuple[Family, int, bool, bool], Estimate] = {}
        self.cache = {} if cache is None else cache
        self.lines: dict[Family, _Line] = {}
        self.costs: dict[Family, StepCost] = {}
        self.candidates: dict[tuple[Family, int], Candidate] = {}
        self.considered: list[Family] = []
        """Every family searched, traced or not."""

    def ranks(self, family: Family) -> int:
        return self.world_size if family.ranks else 1

    # --- tracing ---
    def trace(self, family: Family, micro: int, *, accumulate: bool, lean: bool = False) -> Estimate:
        """A trace; ``accumulate``: windows of two micro-steps (exact for any accumulation >= 2, with the
        window's other inputs added); ``lean``: a one-micro-batch first step (the fit's points: the same
        allocated peak for a quarter fewer ops; the allocator's reserve can differ, so confirmations are not
        lean and equal ``memfit estimate``)."""
        lean = lean and accumulate  # a window of one micro-batch is lean already
        key = (family, micro, accumulate, lean)
        if key not in self.traces:
            ranks = self.ranks(family)
            config = family.configure(self.base, micro_batch_size=micro,
                                      effective_batch=(2 * micro if accumulate else micro) * ranks)
            shared = (json.dumps(config.to_dict(), sort_keys=True), self.profile, self.seq_len, self.image_size,
                      self.num_labels)
            if shared not in self.cache:
                self.cache[shared] = estimate(config, device=self.profile, seq_len=self.seq_len,
                                              image_size=self.image_size, num_labels=self.num_labels, steps=STEPS,
                                              count_flops=True, lean_warmup=lean)
            self.traces[key] = self.cache[shared]
        return self.traces[key]

    def exact(self, family: Family, micro: int) -> Estimate:
        return self.trace(family, micro, accumulate=math.ceil(self.effective / micro) > 1)

    def fit(self, family: Family) -> None:
        """Trace ``family`` at its two largest micro-batches with accumulation and predict every split."""
        accumulated = [micro for micro in self.micros if math.ceil(self.effective / micro) > 1]
        if accumulated:
            traces = [self.trace(family, micro, accumulate=True, lean=True) for micro in accumulated[:2]]
            self.lines[family] = _Line(traces[-1], traces[0] if len(traces) > 1 else None)
        else:  # an effective batch of 1: one setup, traced exactly
            self.lines[family] = _Line(self.exact(family, 1), None)
        self.costs[family] = self.step_cost(family, self.lines[family].low)
        for micro in self.micros:
            self.predict(family, micro)

    def predict(self, family: Family, micro: int) -> Candidate:
        steps = math.ceil(self.effective / micro)
        full, lean = (family, micro, steps > 1, False), (family, micro, steps > 1, steps > 1)
        if full in self.traces or lean in self.traces:
            trace = self.traces.get(full) or self.traces[lean]
            peak, allocated, phase = trace.total_bytes, trace.peak_bytes, trace.peak_phase
            exact = full in self.traces
        else:
            trace = self.lines[family].low
            (peak, allocated, phase), exact = self.lines[family].at(micro), False
        if steps > 1:  # traced with a window of 2 micro-batches: the rest of the window's inputs
            extra = int(trace.breakdown["inputs"] / (2 * trace.micro_batch_size) * (self.effective - 2 * micro))
            peak, allocated = peak + extra, allocated + extra
        seconds = step_seconds(self.costs[family], self.profile, family.precision,
                               effective_batch=self.effective, accumulation_steps=steps, strategy=family.strategy,
                               world_size=self.world_size)
        candidate = Candidate(family=family, micro_batch_size=micro, accumulation_steps=steps,
                              predicted_peak_bytes=peak, predicted_allocated_bytes=allocated, peak_phase=phase,
                              predicted_samples_per_second=self.global_batch / seconds, exact=exact,
                              fits=peak <= self.usable, world_size=self.ranks(family))
        self.candidates[(family, micro)] = candidate
        return candidate

    def step_cost(self, family: Family, trace: Estimate) -> StepCost:
        """The family's step cost from its trace. FSDP's optimizer step runs on DTensors, whose inner ops a
        trace does not see: it costs at least the ops of a replica's step with the same optimizer."""
        cost = StepCost.of(trace)
        if not family.strategy.startswith("fsdp"):
            return cost
        replicas = [known.ops_per_optimizer_step for other, known in self.costs.items()
                    if other.strategy in ("none", "ddp") and (other.foreach, other.optimizer, other.freeze)
                    == (family.foreach, family.optimizer, family.freeze)]
        return dataclasses.replace(cost, ops_per_optimizer_step=max([cost.ops_per_optimizer_step, *replicas]))

    # --- search ---
    def lower_bound_seconds(self, family: Family) -> float:
        """No setup of ``family`` is faster than this, by what is known from the traced families: FLOPs grow
        with checkpointing, ops with checkpointing and with autocast's casts."""
        rank = CHECKPOINTING.index(family.checkpointing)
        known = [(other, cost) for other, cost in self.costs.items()
                 if other.freeze == family.freeze and other.optimizer == family.optimizer
                 and CHECKPOINTING.index(other.checkpointing) <= rank
                 and other.strategy in (family.strategy, "none", "ddp")]  # a replica's step: the least ops
        flops = max((cost.flops_per_sample for _, cost in known), default=0.0)
        ops = max((cost.ops_per_micro_step for other, cost in known
                   if other.precision in (family.precision, "fp32")), default=0.0)
        step_ops = min((cost.ops_per_optimizer_step for other, cost in known if other.foreach == family.foreach),
                       default=0.0)
        trainable = min((cost.trainable_parameters for _, cost in known), default=0)
        parameters = min((cost.parameters for _, cost in known), default=0)
        bound = StepCost(flops_per_sample=flops, ops_per_micro_step=ops, ops_per_optimizer_step=step_ops,
                         trainable_parameters=trainable, parameters=parameters)
        return step_seconds(bound, self.profile, family.precision, effective_batch=self.effective,
                            accumulation_steps=1, strategy=family.strategy, world_size=self.world_size)

    def best(self, *, confirmed: bool) -> Candidate | None:
        fitting = [c for c in self.candidates.values() if c.fits and (c.exact or not confirmed)]
        return max(fitting, key=lambda c: c.predicted_samples_per_second, default=None)

    def search(self, families: list[Family]) -> None:
        """Fit families in the order of their best possible speed until none can beat the best fitting setup,
        then confirm the top setups exactly; repeat while a confirmation changes the answer."""
        order = {family: index for index, family in enumerate(families)}
        self.considered.extend(family for family in families if family not in self.considered)
        while True:
            best = self.best(confirmed=False)
            best_seconds = self.global_batch / best.predicted_samples_per_second if best else math.inf
            open_families = [family for family in families if family not in self.lines
                             and self.lower_bound_seconds(family) < best_seconds * (1 - 1e-9)]
            if open_families:
                self.fit(min(open_families, key=lambda f: (self.lower_bound_seconds(f), order[f])))
                continue
            if not self.confirm():
                return

    def confirm(self) -> bool:
        """Trace exactly the two fastest fitting setups, and any faster one within ``BAND`` above the budget.
        Returns whether any prediction changed."""
        changed = False
        confirmed = 0
        for candidate in sorted(self.candidates.values(), key=lambda c: -c.predicted_samples_per_second):
            if confirmed == 2:
                break
            near = candidate.predicted_peak_bytes is not None and \
                candidate.predicted_peak_bytes <= self.usable * (1 + BAND)
            if not candidate.exact and (candidate.fits or near):
                self.exact(candidate.family, candidate.micro_batch_size)
                updated = self.predict(candidate.family, candidate.micro_batch_size)
                changed = changed or updated.fits != candidate.fits
                candidate = updated
            if candidate.fits:
                confirmed += 1
        return changed

    def exact_candidate(self, family: Family, micro: int) -> Candidate:
        """``family`` at ``micro`` from an exact trace (without fitting the family's line)."""
        trace = self.exact(family, micro)
        self.costs.setdefault(family, self.step_cost(family, trace))
        return self.predict(family, micro)

    def smallest(self, families: list[Family]) -> Candidate:
        """The least memory any of ``families`` needs, traced exactly: micro-batch 1 of the family whose line
        is lowest there."""
        fitted = [family for family in families if family in self.lines]
        least = min((self.predict(family, 1) for family in fitted), key=lambda c: c.predicted_peak_bytes or 0)
        return self.exact_candidate(least.family, 1)


def plan(config: TrainConfig | None = None, *, model: str | None = None, device: str | DeviceProfile = "1080ti",
         budget: str | int | None = None, effective_batch: int | None = None, seq_len: int | None = None,
         image_size: int | None = None, margin: float = 0.05, allow_freeze: bool = False,
         allow_8bit_optimizer: bool = False, precisions: tuple[str, ...] | None = None,
         num_labels: int = 2, cache: dict[Any, Estimate] | None = None, gpus: int | None = None) -> Plan:
    """The fastest setup of ``config`` (or of ``model``) that fits ``budget`` (default: the device's memory)
    at ``effective_batch``; see the module docstring for the search and its cost model.

    ``cache``: a dict shared between calls keeps their traces (plans of one model for several budgets).
    ``gpus`` (default ``config.world_size``): plan one rank of that many, choosing DDP or FSDP (and CPU offload
    on CUDA) too, unless ``config.distributed`` names one; the budget is each GPU's."""
    started = time.perf_counter()
    base = config or TrainConfig()
    base = dataclasses.replace(base, model=model or base.model, effective_batch=effective_batch or base.effective_batch,
                               micro_batch_size=None, accumulation_steps=None, budget=None, plan=None,
                               world_size=gpus or base.world_size)
    if base.world_size > 1 and base.distributed == "none":
        base = dataclasses.replace(base, distributed="auto")
    problems = Problems()
    if base.world_size < 1:
        problems.add(f"--gpus must be >= 1 (got {base.world_size})")
    elif base.world_size > base.effective_batch:
        problems.add(f"--gpus {base.world_size} is more than --effective-batch {base.effective_batch}: every GPU "
                     "needs at least one sample of each step")
    profile = problems.collect(lambda: device if isinstance(device, DeviceProfile) else resolve_profile(device))
    budget_bytes = problems.collect(lambda: _budget_bytes(budget, profile))
    if not 0.0 <= margin < 0.5:
        problems.add(f"--margin {margin} must be between 0 and 0.5 (e.g. 0.05 for 5 %)")
    if allow_8bit_optimizer:
        problems.lines.extend(optimizer_problems("adamw8bit"))
    if profile is not None:
        allowed = profile.precisions()
        for precision in precisions or ():
            if precision not in allowed:
                problems.add(f"--precision {precision}: not planned on {profile.description}; use one of "
                             f"{', '.join(allowed)} (or auto)")
        if min(profile.flops_for(p) for p in allowed) <= 0:
            problems.add(f"device {profile.description} has no throughput figures to plan with; pass a profile "
                         "file with fp32_flops (and fp16_flops/bf16_flops) as --device")
    problems.raise_if_any(ConfigError)
    assert profile is not None and budget_bytes is not None
    spec = prepare_trace(base, device=profile, seq_len=seq_len, image_size=image_size, steps=1).spec  # errors now
    usable = int(budget_bytes * (1 - margin))
    search = _Search(base, profile, usable_bytes=usable, seq_len=seq_len, image_size=image_size,
                     num_labels=num_labels, cache=cache)
    foreach_default = profile.kind == "cuda"  # torch's default: foreach kernels on CUDA, a loop on CPU
    chosen_precisions = tuple(p for p in profile.precisions() if not precisions or p in precisions)
    neutral = [Family(precision=p, checkpointing=c, foreach=foreach_default, optimizer=base.optimizer, strategy=s)
               for s in strategies(base, profile)
               for p in sorted(chosen_precisions, key=lambda p: -profile.flops_for(p)) for c in CHECKPOINTING]
    search.search(neutral)
    advice: list[str] = []
    chosen = search.best(confirmed=True)
    smallest = None
    if chosen is None:  # nothing accuracy-neutral fits: a leaner optimizer step, then the opt-ins
        smallest = search.smallest(neutral)
        leaner = search.exact_candidate(dataclasses.replace(smallest.family, foreach=not smallest.family.foreach), 1)
        if (leaner.predicted_peak_bytes or 0) < (smallest.predicted_peak_bytes or 0):
            smallest = leaner
        chosen = search.best(confirmed=True)
    if chosen is None:
        chosen, advice = _opt_ins(search, smallest, spec.num_layers, allow_freeze=allow_freeze,
                                  allow_8bit=allow_8bit_optimizer)
    ranked = _rank(search, chosen, allowed=lambda f: (f.freeze == "none" or allow_freeze)
                   and (f.optimizer != "adamw8bit" or allow_8bit_optimizer))
    verdict = _verdict(chosen, smallest, advice, usable, budget_bytes, margin)
    length = seq_len or base.max_length
    return Plan(chosen=chosen, candidates=ranked, budget_bytes=budget_bytes, usable_bytes=usable, margin=margin,
                device=profile.name, device_description=profile.description, model=base.model,
                effective_batch=base.effective_batch, sequence_length=None if spec.modality == "vision" else length,
                image_size=(image_size or int(spec.hf_config.image_size)) if spec.modality == "vision" else None,
                verdict=verdict, traces=len(search.traces), seconds=time.perf_counter() - started,
                config=base.to_dict())


def strategies(base: TrainConfig, profile: DeviceProfile) -> tuple[str, ...]:
    """What a plan for ``base.world_size`` ranks may choose from: replicate first, then shard, then offload
    (CUDA only; on CPU the shards already live in host memory)."""
    if base.world_size == 1:
        return ("none",)
    offload = ("fsdp-offload",) if profile.kind == "cuda" else ()
    if base.distributed == "ddp":
        return ("ddp",)
    if base.distributed == "fsdp":
        return ("fsdp-offload",) if base.cpu_offload and offload else ("fsdp", *offload)
    return ("ddp", "fsdp", *offload)


def _budget_bytes(budget: str | int | None, profile: DeviceProfile | None) -> int | None:
    from memfit.units import parse_bytes

    if isinstance(budget, int):
        return budget
    if budget is not None:
        return parse_bytes(budget, option="--budget")
    if profile is None:
        return None
    if profile.kind == "cpu":
        raise ConfigError("--device cpu has no fixed memory: give --budget, e.g. --budget 2GiB")
    return profile.memory_bytes


def _opt_ins(search: _Search, smallest: Candidate | None, num_layers: int, *, allow_freeze: bool,
             allow_8bit: bool) -> tuple[Candidate | None, list[str]]:
    """When nothing accuracy-neutral fits: what each opt-in needs at least; the least change that fits wins
    if it is allowed, searched like the neutral families."""
    assert smallest is not None
    lean = smallest.family
    freezes = list(dict.fromkeys(["embeddings", f"top-{max(1, num_layers // 2)}", f"top-{max(1, num_layers // 4)}"]))
    options: list[tuple[str, bool, list[Family]]] = [
        (f"--allow-freeze ({freeze})", allow_freeze,
         [dataclasses.replace(lean, freeze=freeze, checkpointing=c) for c in CHECKPOINTING]) for freeze in freezes]
    if not optimizer_problems("adamw8bit"):
        options.insert(0, ("--allow-8bit-optimizer", allow_8bit,
                           [dataclasses.replace(lean, optimizer="adamw8bit", checkpointing=c) for c in CHECKPOINTING]))
    advice = []
    for label, allowed, families in options:
        try:
            need = search.exact_candidate(families[-1], 1)  # full checkpointing, micro-batch 1: its least
        except Exception as error:  # bitsandbytes' kernels may not run on fake tensors; say so, plan the rest
            if families[0].optimizer != "adamw8bit":
                raise
            advice.append(f"{label} could not be traced ({type(error).__name__}); it is not planned")
            continue
        fits = bool(need.fits)
        advice.append(f"{label} {'would fit' if fits else 'would not fit either'}: it needs at least "
                      f"{format_bytes(need.predicted_peak_bytes or 0)}")
        if fits and allowed:
            search.search(families)
            chosen = search.best(confirmed=True)
            if chosen is not None:
                return chosen, advice
    if optimizer_problems("adamw8bit"):
        advice.append("--allow-8bit-optimizer needs bitsandbytes (pip install bitsandbytes) to be planned")
    return None, advice


def _rank(search: _Search, chosen: Candidate | None, *, allowed: Callable[[Family], bool]) -> list[Candidate]:
    traced = list(search.candidates.values())
    fitting = sorted((c for c in traced if c.fits and allowed(c.family)), key=lambda c: -c.predicted_samples_per_second)
    rest = sorted((c for c in traced if c not in fitting), key=lambda c: c.predicted_peak_bytes or 0)
    runner_up = next((c for c in fitting if c is not chosen), None) if chosen is not None else None
    reference = chosen.predicted_samples_per_second if chosen else None
    for candidate in fitting + rest:
        if not allowed(candidate.family):
            flag = "--allow-freeze" if candidate.family.freeze != "none" else "--allow-8bit-optimizer"
            candidate.reason = f"{'fits' if candidate.fits else 'does not fit'}; opt-in, needs {flag}"
        elif candidate is chosen:
            candidate.reason = "chosen: fastest that fits" + (
                "" if candidate.family.accuracy_neutral else " (an opt-in: changes what is learned)")
        elif candidate is runner_up:
            candidate.reason = "runner-up"
        elif candidate.fits:
            candidate.reason = "fits, slower"
        else:
            candidate.reason = f"over {format_bytes(search.usable)} usable"
    pruned = []
    for family in search.considered:
        if family in search.lines:
            continue
        best_case = search.global_batch / search.lower_bound_seconds(family)  # samples of all ranks, as above
        pruned.append(Candidate(family=family, micro_batch_size=search.effective, accumulation_steps=1,
                                predicted_peak_bytes=None, predicted_allocated_bytes=None, peak_phase=None,
                                predicted_samples_per_second=best_case, exact=False, fits=None,
                                reason="not traced: cannot beat the chosen", world_size=search.ranks(family)))
    ranked = fitting + rest + pruned
    for candidate in ranked:
        if reference:
            candidate.relative_speed = candidate.predicted_samples_per_second / reference
    return ranked


def _verdict(chosen: Candidate | None, smallest: Candidate | None, advice: list[str], usable: int,
             budget: int, margin: float) -> str:
    where = f"{format_bytes(budget)} ({format_bytes(usable)} usable with the {margin:.0%} margin)"
    if chosen is not None:
        return (f"{chosen.describe()} fits {where}: needs {format_bytes(chosen.predicted_peak_bytes or 0)}, "
                f"predicted {chosen.predicted_samples_per_second:.1f} samples/s")
    assert smallest is not None
    return (f"nothing fits {where}: the smallest any allowed setup needs is "
            f"{format_bytes(smallest.predicted_peak_bytes or 0)} ({smallest.describe()}); " + "; ".join(advice))
