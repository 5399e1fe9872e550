"""``plan()``: the fastest setup of a run that fits a memory budget at its effective batch, and the plan a
``memfit train --budget/--plan`` run trains with."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console

from memfit import distributed
from memfit.build import Prepared
from memfit.commands import launch_line
from memfit.config import DEVICES, PLANNED_LORA_RANK, TrainConfig, runs_sharded
from memfit.devices import Device, DeviceProfile, host_memory_bytes, profile_for, resolve_profile
from memfit.errors import ConfigError, NothingFits, Problems
from memfit.memory.depth import parameter_count
from memfit.memory.estimate import Estimate, prepare_trace
from memfit.models import ModelSpec
from memfit.planner.allowed import NOTHING, Advice, Allowed, over_by_weights
from memfit.planner.families import (
    CHECKPOINTING,
    Candidate,
    Family,
    default_kernels,
    leaner_kernels,
    least_first,
    runs_on,
    strategies,
    with_chunked_loss,
    with_sharded_gradients,
)
from memfit.planner.opt_ins import bitsandbytes_problem, need_requests, opt_ins
from memfit.planner.report import Plan, load_plan, plan_from_dict, rank_candidates, verdict_line
from memfit.planner.search import Request, Search
from memfit.quiet import quiet_transformers
from memfit.report import format_bytes
from memfit.techniques.bf16_true import uses_kahan
from memfit.techniques.optim import optimizer_problems


@quiet_transformers()
def plan(config: TrainConfig | None = None, *, model: str | None = None, device: str | DeviceProfile = "1080ti",
         budget: str | int | None = None, effective_batch: int | None = None, seq_len: int | None = None,
         image_size: int | None = None, margin: float = 0.05, allow: Allowed = NOTHING,
         lora_rank: int = 16, precisions: tuple[str, ...] | None = None, num_labels: int = 2,
         cache: dict[Any, Estimate] | None = None, gpus: int | None = None, suggest: bool = True,
         exact_trace: bool = False, progress: Callable[[str], None] | None = None,
         gpus_per_node: int | None = None, host_memory: str | int | None = None) -> Plan:
    """The fastest setup of ``config`` (or of ``model``) that fits ``budget`` (default: the device's memory)
    at ``effective_batch``; see the module docstring for the search and its cost model. ``allow``: the opt-ins
    (:class:`~memfit.planner.allowed.Allowed`) tried in their order of fidelity when nothing accuracy-neutral
    fits; LoRA and QLoRA of ``lora_rank`` last.

    ``cache``: a dict shared between calls keeps their traces (plans of one model for several budgets).
    ``gpus`` (default ``config.world_size``): plan one rank of that many, choosing DDP or FSDP (and CPU offload
    on CUDA) too, unless ``config.distributed`` names one; the budget is each GPU's. ``suggest=False``: when
    nothing fits, trace only the opt-ins allowed, not what the others would need (a training run, which cannot
    opt in to them; a table of one technique per cell). ``exact_trace``: every setup traced in full rather than
    shortened and replayed (the same numbers, slower); ``progress(technique)``: told after each trace.
    ``gpus_per_node``: the GPUs of one machine, where ``gpus`` fill several (communication across machines at
    the profile's ``node_bandwidth``; FSDP within each machine and replicated across them, HSDP, planned too);
    ``host_memory`` (e.g. ``"256GiB"``): one machine's host memory, which what its ranks offload must fit."""
    started = time.perf_counter()
    allow = allow.union(Allowed.of(config or TrainConfig()))  # a run's own --allow-* options
    base = _planned_base(config or TrainConfig(), model=model, effective_batch=effective_batch, gpus=gpus)
    profile, budget_bytes, host_bytes = _checked_inputs(base, device, budget, margin, precisions=precisions,
                                                        allow_8bit=allow.eight_bit_optimizer,
                                                        lora_rank=lora_rank if allow.adapters else None,
                                                        gpus_per_node=gpus_per_node, host_memory=host_memory)
    inputs = prepare_trace(base, device=profile, seq_len=seq_len, image_size=image_size, steps=1)  # errors now
    given, allow = allow.flags, asked_for(allow, base, precisions)
    spec = inputs.spec
    usable = int(budget_bytes * (1 - margin))
    search = Search(base, profile, usable_bytes=usable, seq_len=seq_len, image_size=image_size,
                     num_labels=num_labels, cache=cache, exact_trace=exact_trace, progress=progress,
                     per_node=gpus_per_node, host_memory=host_bytes, spec=inputs.spec, task=inputs.task)
    chosen_precisions = _fastest_first(profile, precisions)
    stages = {name: allowed for name, allowed in (("lora", allow.lora), ("qlora", allow.qlora))
              if (allowed or suggest) and not base.lora_rank}
    optimizers = ("adamw", "adamw8bit") if allow.eight_bit_optimizer else ("adamw",)
    _speculate(search, allow, chosen_precisions, stages, suggest=suggest, rank=lora_rank, optimizers=optimizers,
               spec=spec, task=inputs.task)
    chosen, smallest = _neutral(search, base, profile, chosen_precisions, spec, inputs.task)
    advice: list[Advice] = []
    if chosen is None:
        chosen, advice = opt_ins(search, smallest, spec.num_layers, allow, suggest=suggest, task=inputs.task)
    if chosen is None and stages:
        chosen = _adapters(search, profile, chosen_precisions, stages, rank=lora_rank, advice=advice,
                           optimizers=optimizers, task=inputs.task, spec=spec)
    ranked = rank_candidates(search, chosen, allowed=lambda f: allow.permits(f.opt_ins))
    verdict = verdict_line(chosen, smallest, [item.line for item in advice], usable, budget_bytes, margin,
                           host=search.host_per_node(shown.family, shown.predicted_host_bytes)
                           if (shown := chosen or smallest) else 0, host_memory=host_bytes)
    length = seq_len or base.max_length
    return Plan(chosen=chosen, candidates=ranked, budget_bytes=budget_bytes, usable_bytes=usable, margin=margin,
                device=profile.name, device_description=profile.description, model=base.model,
                effective_batch=base.effective_batch, sequence_length=None if spec.modality == "vision" else length,
                image_size=(image_size or spec.image_size) if spec.modality == "vision" else None,
                verdict=verdict, traces=len(search.traces), seconds=time.perf_counter() - started,
                config=base.to_dict(), fixes=[item.fits for item in advice if item.fits is not None], opt_ins=given,
                gpus_per_node=search.per_node, host_memory_bytes=host_bytes)


def _planned_base(config: TrainConfig, *, model: str | None, effective_batch: int | None,
                  gpus: int | None) -> TrainConfig:
    """The run's options the plan starts from: its split, budget and opt-ins are the plan's to choose."""
    base = dataclasses.replace(config, model=model or config.model,
                               effective_batch=effective_batch or config.effective_batch, micro_batch_size=None,
                               accumulation_steps=None, budget=None, plan=None, world_size=gpus or config.world_size,
                               device_profile=None).without_opt_ins()
    if base.world_size > 1 and base.distributed == "none":
        base = dataclasses.replace(base, distributed="auto")
    return base


def _fastest_first(profile: DeviceProfile, precisions: tuple[str, ...] | None) -> tuple[str, ...]:
    """The precisions planned (``precisions``, else the device's), the fastest first; bf16-true where named (or
    opted in)."""
    named = planned_precisions(profile) if precisions else profile.precisions()
    return tuple(sorted((p for p in named if not precisions or p in precisions), key=lambda p: -profile.flops_for(p)))


def _neutral(search: Search, base: TrainConfig, profile: DeviceProfile, precisions: tuple[str, ...],
             spec: ModelSpec, task: str) -> tuple[Candidate | None, Candidate | None]:
    """(the fastest accuracy-neutral setup that fits, or ``None``; when none does, the least any needs, with
    the leanest optimizer step). Where the model's weights, gradients and optimizer state alone exceed the
    budget, the least need (every precision, full checkpointing, with and without a chunked loss, micro-batch
    1) is traced first: when it does not fit, no other setup does (each keeps at least as much), and the
    families are not searched."""
    def kahan(precision: str) -> bool:
        return uses_kahan(base.kahan, precision=precision, optimizer=base.optimizer)

    neutral = with_chunked_loss([
        Family(precision=p, checkpointing=c, kernels=default_kernels(base.optimizer, s, profile, kahan=kahan(p)),
               optimizer=base.optimizer, strategy=s, shard_group=group, lora_rank=base.lora_rank,
               quantize_base=base.quantize_base, kahan=kahan(p), optimizer_in_backward=base.optimizer_in_backward,
               offload_optimizer=base.offload_optimizer, offload_activations=base.offload_activations,
               packing=base.packing)
        for s, group in strategies(base, profile, search.per_node) for p in precisions if runs_on(p, s)
        for c in CHECKPOINTING], base, task)
    neutral = with_sharded_gradients(neutral, base)
    smallest = None
    if _states_exceed(search, base, spec, task):  # the least first: when even it does not fit, nothing does
        smallest = _least_need(search, neutral, upcoming=True)
    if smallest is None or smallest.fits:
        search.search(neutral)
        chosen = search.best(confirmed=True)
        if chosen is not None:
            return chosen, None
        smallest = search.smallest(neutral)
    if smallest.fits:
        # micro-batch 1 fits where the family's line said none would (a line through larger micro-batches
        # misjudges the small ones; most with a chunked loss): its larger micro-batches, traced while they fit
        for micro in sorted(m for m in search.micros if m > 1):
            if not search.exact_candidate(smallest.family, micro).fits:
                break
        return search.best(confirmed=True), None
    search.least = smallest  # the opt-ins' least needs are traced beside the leaner steps'
    leaner = [dataclasses.replace(smallest.family, kernels=kernels) for kernels in leaner_kernels(smallest.family)]
    search.prefetch(search.exact_request(family, search.least_micro(family)) for family in leaner)
    for family in leaner:
        candidate = search.exact_candidate(family, search.least_micro(family))
        if (candidate.predicted_peak_bytes or 0) < (smallest.predicted_peak_bytes or 0):
            smallest = candidate
    chosen = search.best(confirmed=True)  # a leaner step's micro-batch 1 may fit
    search.least = None if chosen is not None else smallest
    return chosen, search.least


def plan_for_run(prepared: Prepared, console: Console) -> tuple[TrainConfig, Plan]:
    """The config a run with ``--budget`` (plan now, for the device this run uses, or the card of
    ``--device-profile``) or ``--plan`` (a saved plan) trains with; the options the plan does not choose stay the
    run's. Nothing allowed fits: :class:`~memfit.errors.NothingFits`, with what each opt-in would need."""
    config = prepared.config
    if config.plan is not None:
        made = load_plan(config.plan)
        if made.model != config.model:
            raise ConfigError(f"--plan {config.plan} was made for --model {made.model}, not {config.model}; "
                              "plan again for this model")
        if made.device != profile_for(prepared.device).name:
            console.print(f"[yellow]note:[/] {config.plan} was planned for {made.device_description}; this run "
                          f"is on {prepared.device.describe()}")
        launched, planned_ranks = distributed.launched_world_size(), made.chosen.world_size if made.chosen else 1
        if planned_ranks != launched:
            launch = launch_line(planned_ranks, made.gpus_per_node)
            raise ConfigError(f"--plan {config.plan} was planned for {planned_ranks} GPU(s) and this run has "
                              f"{launched} process(es); launch it with {launch} train "
                              f"--plan {config.plan}, or plan again with --gpus {launched}")
    else:  # under torchrun rank 0 plans and every rank trains its plan
        made = distributed.decided_once("plan", lambda: _planned_here(prepared, console),
                                        encode=lambda done: json.dumps(done.to_dict()),
                                        decode=lambda text: plan_from_dict(json.loads(text)))
    if made.chosen is None:
        raise ConfigError(made.verdict)
    if made.effective_batch != config.effective_batch and config.plan is not None:
        console.print(f"[yellow]note:[/] the plan's effective batch {made.effective_batch} replaces "
                      f"{config.effective_batch}")
    console.print(f"plan: {made.verdict} (planned in {made.seconds:.1f} s from {made.traces} traces)")
    planned = made.to_config(base=config)
    if config.device_profile is not None:  # the card's plan, run here within the card's memory
        planned = rehearsal(planned, made, device=prepared.device, console=console)
    return planned, made


def _planned_here(prepared: Prepared, console: Console) -> Plan:
    """The run's plan, made in this process; when nothing allowed fits, :class:`NothingFits` with what the
    opt-ins not given would need (the advice of memfit plan)."""
    traces: dict[Any, Estimate] = {}  # shared by the two plans
    made = _plan_now(prepared, console, suggest=False, cache=traces)
    if made.chosen is None:
        made = _plan_now(prepared, console, suggest=True, cache=traces)
        raise NothingFits(made.verdict, tuple(made.fixes))
    return made


def _plan_now(prepared: Prepared, console: Console, *, suggest: bool, cache: dict[Any, Estimate]) -> Plan:
    config = prepared.config
    here = config.device_profile is None and config.device in DEVICES  # the card this run trains on
    if config.device_profile is not None:
        target = resolve_profile(config.device_profile)
    else:  # --device 1080ti: plan for that card
        target = profile_for(prepared.device) if here else resolve_profile(config.device)
    if suggest:
        console.print("nothing the run allows fits; tracing what the other opt-ins would need ...")
    return plan(config, device=target, budget=config.budget, seq_len=config.max_length,
                num_labels=len(prepared.label_names), gpus=config.world_size, suggest=suggest, cache=cache,
                lora_rank=PLANNED_LORA_RANK, precisions=None if config.precision == "auto" else (config.precision,),
                gpus_per_node=distributed.launched_per_node(),
                host_memory=host_memory_bytes() if here else None)  # what its ranks here offload must fit


def rehearsal(planned: TrainConfig, made: Plan, *, device: Device, console: Console) -> TrainConfig:
    """A card's plan run on this machine (``--device-profile``): the card's memory (or the budget) emulated as
    the limit. Without CUDA, what the plan moves to the host stays there already (the optimizer, the saved
    activations, paged 8-bit states run unpaged), and fp16 planned for a card without bf16 runs, slowly."""
    assert made.chosen is not None
    console.print(f"[yellow]note:[/] rehearsing the plan for {made.device_description} on {device.describe()}, "
                  f"{format_bytes(made.budget_bytes)} emulated; the peak measured here is this machine's (the "
                  f"card's is predicted at {format_bytes(made.chosen.predicted_peak_bytes or 0)})")
    emulated = dataclasses.replace(planned, emulate_budget=f"{made.budget_bytes}B")
    if device.kind == "cuda":
        return emulated
    host = [name for name, moved in (("the optimizer", planned.offload_optimizer),
                                     ("the saved activations", planned.offload_activations),
                                     ("paged 8-bit states", planned.optimizer == "paged-adamw8bit")) if moved]
    if host:
        console.print(f"[yellow]note:[/] {' and '.join(host)} on the host as planned for the card: without CUDA "
                      "everything is in host memory already")
        emulated = dataclasses.replace(emulated, offload_optimizer=False, offload_activations=False,
                                       optimizer="adamw8bit" if planned.optimizer == "paged-adamw8bit"
                                       else planned.optimizer)
    if planned.precision == "fp16":
        console.print("[yellow]note:[/] fp16 as planned for the card; on this CPU it runs, about 20x slower than "
                      "fp32")
        emulated = dataclasses.replace(emulated, force_cpu_fp16=True)
    return emulated


def _checked_inputs(base: TrainConfig, device: str | DeviceProfile, budget: str | int | None, margin: float, *,
                    precisions: tuple[str, ...] | None, allow_8bit: bool, lora_rank: int | None,
                    gpus_per_node: int | None = None,
                    host_memory: str | int | None = None) -> tuple[DeviceProfile, int, int | None]:
    """The device profile, the budget and one machine's host memory in bytes; every problem of the planning
    inputs raised at once."""
    problems = Problems()
    host_bytes = None if host_memory is None else problems.collect(
        lambda: _size(host_memory, option="--host-memory"))
    if gpus_per_node is not None and gpus_per_node < 1:
        problems.add(f"--gpus-per-node must be >= 1 (got {gpus_per_node})")
    elif gpus_per_node is not None and base.world_size > gpus_per_node and base.world_size % gpus_per_node:
        filled = (base.world_size // gpus_per_node + 1) * gpus_per_node
        problems.add(f"--gpus {base.world_size} does not fill machines of --gpus-per-node {gpus_per_node}: give a "
                     f"multiple of {gpus_per_node} (e.g. --gpus {filled})")
    if base.world_size < 1:
        problems.add(f"--gpus must be >= 1 (got {base.world_size})")
    elif base.world_size > base.effective_batch:
        problems.add(f"--gpus {base.world_size} is more than --effective-batch {base.effective_batch}: every GPU "
                     "needs at least one sample of each step")
    profile = problems.collect(lambda: device if isinstance(device, DeviceProfile) else resolve_profile(device))
    budget_bytes = problems.collect(lambda: _budget_bytes(budget, profile))
    if not 0.0 <= margin < 0.5:
        problems.add(f"--margin {margin} must be between 0 and 0.5 (e.g. 0.05 for 5 %)")
    if allow_8bit:
        problems.lines.extend(optimizer_problems("adamw8bit"))
    if lora_rank is not None and lora_rank < 1:
        problems.add(f"--lora-rank {lora_rank}: a planned adapter needs a rank of at least 1 (e.g. 16)")
    if profile is not None:
        allowed = planned_precisions(profile)
        for precision in precisions or ():
            if precision not in allowed:
                problems.add(f"--precision {precision}: not planned on {profile.description}; use one of "
                             f"{', '.join(allowed)} (or auto)")
        if min(profile.flops_for(p) for p in allowed) <= 0:
            problems.add(f"device {profile.description} has no throughput figures to plan with; pass a profile "
                         "file with fp32_flops (and fp16_flops/bf16_flops) as --device")
        elif min(profile.memory_bandwidth, profile.link_bandwidth, profile.host_bandwidth,
                 profile.node_bandwidth) <= 0:
            problems.add(f"device {profile.description} has no memory_bandwidth (or a link, host or node bandwidth "
                         "of 0) to plan with; give it in bytes per second in the profile file, e.g. "
                         "memory_bandwidth = 4.8e11")
    problems.raise_if_any(ConfigError)
    assert profile is not None and budget_bytes is not None
    return profile, budget_bytes, host_bytes


def _size(size: str | int, *, option: str) -> int:
    from memfit.units import parse_bytes

    return size if isinstance(size, int) else parse_bytes(size, option=option)


def _budget_bytes(budget: str | int | None, profile: DeviceProfile | None) -> int | None:
    if budget is not None:
        return _size(budget, option="--budget")
    if profile is None:
        return None
    if profile.kind == "cpu":
        raise ConfigError("--device cpu has no fixed memory: give --budget, e.g. --budget 2GiB")
    return profile.memory_bytes


def _adapters(search: Search, profile: DeviceProfile, precisions: tuple[str, ...], stages: dict[str, bool], *,
              rank: int, advice: list[Advice], optimizers: tuple[str, ...], task: str,
              spec: ModelSpec) -> Candidate | None:
    """When no full fine-tuning fits: LoRA, then QLoRA (``stages``: which the user allows). Each says what it
    needs at least (micro-batch 1, full checkpointing, the leanest precision); the first allowed one that fits
    is searched like the neutral families and its fastest setup chosen."""
    for technique, allowed in stages.items():
        flag = f"--allow-{technique}"
        problem = adapter_problem(technique, profile)
        if problem:
            advice.append(Advice(f"{flag}: {problem}"))
            continue
        families = _adapter_families(search, profile, precisions, technique, rank=rank, optimizers=optimizers,
                                     task=task)
        base_bytes = _base_floor(search, spec, technique, task)
        if base_bytes is not None:
            advice.append(over_by_weights(f"{flag} (r={rank})", "its base weights alone need at least", base_bytes,
                                          profile.non_pytorch_bytes))
            continue
        try:
            need = _least_need(search, [_leanest_step(family, optimizers, profile) for family in families])
        except ConfigError as error:  # an architecture the technique does not reach: advice, not the plan's end
            advice.append(Advice(f"{flag} does not apply: {error.problems[0]}"))
            continue
        advice.append(Advice(f"{flag} (r={rank}) {'would fit' if need.fits else 'would not fit either'}: it needs "
                             f"at least {format_bytes(need.predicted_peak_bytes or 0)}{search.over_host(need)}",
                             fits=need.family.opt_ins if need.fits else None))
        if need.fits and allowed:
            search.search(families)
            chosen = search.best(confirmed=True, where=lambda f, t=technique: f.technique == t)  # type: ignore[misc]
            if chosen is not None:
                return chosen
    return None


def _adapter_families(search: Search, profile: DeviceProfile, precisions: tuple[str, ...], technique: str, *,
                      rank: int, optimizers: tuple[str, ...], task: str) -> list[Family]:
    """The families of ``technique`` (``lora``/``qlora``) a plan searches."""
    quantized = "nf4" if technique == "qlora" else "none"
    families = with_chunked_loss([
        Family(precision=p, checkpointing=c, kernels=default_kernels(o, s, profile), optimizer=o, strategy=s,
               shard_group=group, lora_rank=rank, quantize_base=quantized, packing=search.base.packing)
        for s, group in strategies(search.base, profile, search.per_node) for o in optimizers
        if runs_sharded(o) or not s.startswith("fsdp") for p in precisions if runs_on(p, s)
        for c in CHECKPOINTING],
        search.base, task)
    return with_sharded_gradients(families, search.base)


def _adapters_least(search: Search, profile: DeviceProfile, precisions: tuple[str, ...], stages: dict[str, bool], *,
                    rank: int, optimizers: tuple[str, ...], task: str, spec: ModelSpec) -> list[Request]:
    """The least-need traces :func:`_adapters` asks for first: those of the first technique it traces."""
    for technique in stages:
        if adapter_problem(technique, profile) or _base_floor(search, spec, technique, task) is not None:
            continue
        families = _adapter_families(search, profile, precisions, technique, rank=rank, optimizers=optimizers,
                                     task=task)
        leanest = dict.fromkeys(_leanest_step(family, optimizers, profile) for family in families
                                if family.checkpointing == "full")
        return [search.exact_request(family, search.least_micro(family)) for family in leanest]
    return []


def _leanest_step(family: Family, optimizers: tuple[str, ...], profile: DeviceProfile) -> Family:
    """``family`` with the leanest of ``optimizers`` its strategy runs (the last one, 8-bit when allowed)."""
    optimizer = next(o for o in reversed(optimizers) if runs_sharded(o) or not family.strategy.startswith("fsdp"))
    return dataclasses.replace(family, optimizer=optimizer,
                               kernels=default_kernels(optimizer, family.strategy, profile))


def _speculate(search: Search, allow: Allowed, precisions: tuple[str, ...], stages: dict[str, bool], *,
               suggest: bool, rank: int, optimizers: tuple[str, ...], spec: ModelSpec, task: str) -> None:
    """Tell ``search`` what the plan likely traces later (:attr:`Search.upcoming`): the opt-ins' least needs,
    and the adapters' where nothing else can be chosen (their first technique's, beside full fine-tuning's least
    needs): full fine-tuning's fp32 weights, gradients and AdamW states alone exceed the card, no opt-in is
    allowed and no precision the user names stores weights in 16 bits."""
    opt_ins_allowed = dataclasses.replace(allow, lora=False, qlora=False) != NOTHING
    adapters = _adapters_least(search, search.profile, precisions, stages, rank=rank, optimizers=optimizers,
                               task=task, spec=spec) \
        if stages and not opt_ins_allowed and "bf16-true" not in precisions \
        and _states_exceed(search, search.base, spec, task) else []
    search.upcoming = functools.partial(_upcoming, search, allow, suggest=suggest, num_layers=spec.num_layers,
                                        task=task, adapters=adapters)


def _upcoming(search: Search, allow: Allowed, *, suggest: bool, num_layers: int, task: str,
              adapters: list[Request]) -> list[Request]:
    """The traces the plan likely asks for next (:attr:`Search.upcoming`): once the least need without opt-ins
    is known and over the budget, the opt-ins' least needs; then ``adapters``' least needs."""
    needs = [] if search.least is None else need_requests(search, search.least, num_layers, allow,
                                                           suggest=suggest, task=task)
    return [*needs, *adapters]


def _least_need(search: Search, families: list[Family], *, upcoming: bool = False) -> Candidate:
    """The least ``families`` need: their fully checkpointed setups at the least micro-batch, with and without
    the loss in chunks (the chunks need more where one sample's logits are small beside the output layer's
    gradient), traced at every precision and the smallest taken. The slowest precision is not the leanest: a
    LoRA base stored in 16 bits needs less than in fp32, so a LoRA that fits only in 16 bits is searched, not
    reported as not fitting; fp32 keeps no 16-bit copies of the weights, which autocast does."""
    leanest = dict.fromkeys(family for family in families if family.checkpointing == "full")
    return min(search.exact_candidates(leanest, upcoming=upcoming), key=least_first)


LORA_BASE_BYTES = 2
"""The least a LoRA base keeps per parameter: 16-bit Linear and embedding weights under mixed precision (fp32
keeps them in fp32, norms stay fp32 in either)."""


def _base_floor(search: Search, spec: ModelSpec, technique: str, task: str) -> int | None:
    """The bytes a LoRA base's weights need at least, when they and the card's memory outside PyTorch alone
    exceed the usable budget on one GPU (no trace can show such a setup fitting); else ``None``, and the least
    need is traced. QLoRA's 4-bit base has no floor worth checking."""
    parameters = _parameters(spec, task) if technique == "lora" and search.base.world_size == 1 else None
    if parameters is None:
        return None
    floor = parameters * LORA_BASE_BYTES
    return floor if floor + search.profile.non_pytorch_bytes > search.usable else None


def _parameters(spec: ModelSpec, task: str) -> int | None:
    """The model's parameters, or ``None`` for an architecture that cannot be built on the meta device (its
    setups are traced as usual)."""
    try:
        return parameter_count(spec, task)
    except Exception:
        return None


STATE_BYTES = {"adamw": 8, "adamw8bit": 2}
"""Optimizer state per trained parameter on the card, for :func:`_states_exceed` (none counted otherwise)."""


def _states_exceed(search: Search, base: TrainConfig, spec: ModelSpec, task: str) -> bool:
    """Whether every parameter's fp32 weight, gradient and optimizer state alone, with the card's memory outside
    PyTorch, exceed the usable budget (decides only what the planner traces first, never whether a setup fits)."""
    if base.world_size > 1 or base.lora_rank or base.freeze_embeddings or base.train_top_layers \
            or base.offload_optimizer:
        return False
    parameters = _parameters(spec, task)
    if parameters is None:
        return False
    needs = parameters * (8 + STATE_BYTES.get(base.optimizer, 0)) + search.profile.non_pytorch_bytes
    return needs > search.usable


def adapter_problem(technique: str, profile: DeviceProfile) -> str | None:
    """Why ``technique`` (``lora``/``qlora``) cannot be planned for ``profile``, or ``None``."""
    if importlib.util.find_spec("peft") is None:
        return "needs PEFT (pip install 'memfit[lora]') to be planned"
    if technique != "qlora":
        return None
    if importlib.util.find_spec("bitsandbytes") is None:
        return "needs bitsandbytes (pip install 'memfit[lora]') to be planned"
    return bitsandbytes_problem(profile)


def planned_precisions(profile: DeviceProfile) -> tuple[str, ...]:
    """What ``--precision`` may name in a plan for ``profile``: its own precisions, and ``bf16-true`` where the
    card has bf16 (otherwise planned only as ``--allow-bf16-true``'s opt-in)."""
    return (*profile.precisions(), *(("bf16-true",) if profile.has_native_bf16 else ()))


def asked_for(allow: Allowed, base: TrainConfig, precisions: tuple[str, ...] | None) -> Allowed:
    """``allow`` and what the run itself asks for: a technique the user chose is no opt-in of the plan's."""
    return dataclasses.replace(
        allow, bf16_true=allow.bf16_true or "bf16-true" in (precisions or ()),
        optimizer_in_backward=allow.optimizer_in_backward or base.optimizer_in_backward,
        eight_bit_optimizer=allow.eight_bit_optimizer or "8bit" in base.optimizer,
        offload=allow.offload or base.offload_optimizer or base.offload_activations
        or base.optimizer == "paged-adamw8bit",
        lora=allow.lora or (base.lora_rank > 0 and base.quantize_base == "none"),
        qlora=allow.qlora or base.quantize_base != "none")
