"""The search: trace families in the order of their best possible speed, fit a line per family, predict
every micro-batch, confirm the fastest fitting setups with exact traces."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memfit.config import TrainConfig
from memfit.devices import DeviceProfile
from memfit.memory.estimate import Estimate, estimate
from memfit.planner.families import CHECKPOINTING, Candidate, Family
from memfit.planner.speed import STEPS, StepCost, step_seconds
from memfit.planner.workers import side_by_side, side_by_side_usable, worker_count
from memfit.rank0_load import load_host_bytes
from memfit.report import format_bytes
from memfit.techniques.precision import Precision

if TYPE_CHECKING:
    from memfit.models import ModelSpec

BAND = 0.10
"""A fitted setup this close above the usable budget is traced exactly before it is rejected."""
SMALLEST_BAND = 0.10
"""Families whose line at micro-batch 1 is this close above the lowest are traced there too."""
LOW_FIRST = 0.5
"""A family checkpointing less than one whose least need (micro-batch 1, traced exactly) takes at least this
share of the usable budget is traced at its own least need first (:meth:`Search.low_first`)."""
Request = tuple[Family, int, bool, bool]
"""A trace the search asks for: (family, micro-batch, accumulate, lean)."""

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

    def host_at(self, micro: int) -> int:
        """Host bytes at ``micro`` (offloaded activations grow with it; shards and states do not)."""
        if self.high is None:
            return self.low.host_bytes
        slope = (self.high.host_bytes - self.low.host_bytes) / (self.high.micro_batch_size - self.low.micro_batch_size)
        return max(0, int(self.low.host_bytes + slope * (micro - self.low.micro_batch_size)))


class Search:
    def __init__(self, base: TrainConfig, profile: DeviceProfile, *, usable_bytes: int, seq_len: int | None,
                 image_size: int | None, num_labels: int, cache: dict[Any, Estimate] | None = None,
                 exact_trace: bool = False, progress: Callable[[str], None] | None = None,
                 per_node: int | None = None, host_memory: int | None = None, spec: ModelSpec | None = None,
                 task: str | None = None) -> None:
        self.base, self.profile, self.usable = base, profile, usable_bytes
        self.per_node = per_node if per_node is not None and per_node < base.world_size else None
        """GPUs per machine where the plan's fill several (``None``: all on one)."""
        self.host_memory = host_memory
        """Host memory of one machine a setup's offloaded bytes, and its model while loaded, must fit (``None``:
        not checked)."""
        self.spec, self.task = spec, task
        self.loads: dict[Family, int] = {}
        self.exact_trace = exact_trace
        """Trace every step in full (``--exact-trace``) rather than a shortened trace replayed at full length."""
        self.progress = progress
        """Told after each trace (a progress bar)."""
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
        self.ruled_out: dict[Family, Candidate] = {}
        """Families not traced because a family that checkpoints more does not fit at its least micro-batch (the
        candidate that shows it)."""
        self.least: Candidate | None = None
        """The least any setup without opt-ins needs, once traced and found over the budget (the opt-ins build on
        its family)."""
        self.guessed: dict[Any, Estimate] = {}
        """Traces made ahead of any request (:meth:`prefetch`'s guesses), by the shared cache's key: moved into
        the cache when the search asks for one (:meth:`trace`), read nowhere else, so that neither this search's
        decisions nor a later plan sharing the cache see a trace no search asked for."""
        self.upcoming: Callable[[], Iterable[Request]] | None = None
        """Traces the plan will likely ask for later (the opt-ins' and adapters' least needs): a batch traced side
        by side takes them where it would leave a process idle."""

    def ranks(self, family: Family) -> int:
        return self.world_size if family.ranks else 1

    # --- tracing ---
    def trace(self, family: Family, micro: int, *, accumulate: bool, lean: bool = False) -> Estimate:
        """A trace; ``accumulate``: windows of two micro-steps (exact for any accumulation >= 2, with the
        window's other inputs added); ``lean``: a one-micro-batch first step (the fit's points: the same
        allocated peak for a quarter fewer ops; the allocator's reserve can differ, so confirmations are not
        lean and equal ``memfit estimate``)."""
        key, shared, config = self._request(family, micro, accumulate=accumulate, lean=lean)
        if key not in self.traces:
            if shared not in self.cache:
                guessed = self.guessed.pop(shared, None)
                self.cache[shared] = guessed if guessed is not None else self._estimate(config, lean=key[3])
                self._told(family)
            self.traces[key] = self.cache[shared]
        return self.traces[key]

    def traced(self, family: Family, micro: int, *, accumulate: bool) -> Estimate | None:
        """The exact trace of ``family`` at ``micro`` if it was traced already (by this search or one sharing its
        cache), else ``None``: nothing is traced."""
        key, shared, _ = self._request(family, micro, accumulate=accumulate, lean=False)
        if key not in self.traces and shared in self.cache:
            self.traces[key] = self.cache[shared]
        return self.traces.get(key)

    def prefetch(self, requests: Iterable[Request], *, upcoming: bool = False, fill: bool = True) -> None:
        """Trace ``requests`` (family, micro-batch, accumulate, lean) not traced yet side by side
        (:mod:`memfit.planner.workers`), ahead of the search asking for them one by one; a trace that fails
        is left for the search to run, and raise, itself. A batch that would leave a process idle (fewer traces
        than processes, or a last round short of one) also takes *guesses*, the traces likely asked for next: the
        setups a confirmation traces (the fastest unconfirmed ones), then :attr:`upcoming` (all of it when
        ``upcoming``; none when not ``fill``). A guess is kept in :attr:`guessed` until the search asks for it."""
        if not side_by_side_usable():  # one at a time: the search traces each when it needs it
            return
        missing: dict[Any, tuple[Family, TrainConfig, bool]] = {}

        def add(request: Request) -> None:
            key, shared, config = self._request(*request)
            if shared not in self.cache and shared not in self.guessed:
                missing.setdefault(shared, (request[0], config, key[3]))

        for request in requests:
            add(request)
        needed = len(missing)
        if not needed:
            return
        workers = worker_count()
        guesses = self._fillers(everything_upcoming=upcoming)
        while upcoming or (fill and len(missing) % workers):
            guess = next(guesses, None)
            if guess is None:
                break
            add(guess)
        if len(missing) < 2:
            return
        jobs = [functools.partial(self._estimate, config, lean=lean) for _, config, lean in missing.values()]
        for index, result in side_by_side(jobs, needed=needed):
            if result is not None:
                shared, (family, _, _) = list(missing.items())[index]
                if index < needed:
                    self.cache[shared] = result
                    self._told(family)
                else:  # told when the search takes it
                    self.guessed[shared] = result

    def _fillers(self, *, everything_upcoming: bool) -> Iterator[Request]:
        """The traces a batch takes beside what it was asked for (see :meth:`prefetch`), likeliest first;
        ``everything_upcoming``: only, and all of, :attr:`upcoming`."""
        if not everything_upcoming:
            ranked = sorted(self.candidates.values(), key=lambda c: -c.predicted_samples_per_second)
            yield from (self.exact_request(c.family, c.micro_batch_size) for c in ranked if self._unconfirmed(c))
        if self.upcoming is not None:
            yield from self.upcoming()

    def _ahead(self, ranked: list[Family]) -> list[Request]:
        """The first family's traces, and, where they leave trace processes idle, the next families' first
        untraced ones: a family fitted next usually (one whose bound a fit leaves below the best), a trace wasted
        on an idle core otherwise."""
        requests, missing = [], 0
        for index, family in enumerate(ranked):
            for request in self.fit_requests(family):
                untraced = not self._cached(request[0], request[1], accumulate=request[2], lean=request[3])
                if index == 0 or (untraced and missing < worker_count()):
                    requests.append(request)
                    missing += untraced
            if missing >= worker_count():
                break
        return requests

    def _cached(self, family: Family, micro: int, *, accumulate: bool, lean: bool) -> bool:
        """Whether that trace was made already (by this search or one sharing its cache)."""
        return self._request(family, micro, accumulate=accumulate, lean=lean)[1] in self.cache

    def _request(self, family: Family, micro: int, accumulate: bool,
                 lean: bool) -> tuple[Request, Any, TrainConfig]:
        """(the search's key, the shared cache's key, the config traced) of a trace."""
        accumulate = accumulate and not family.optimizer_in_backward  # a window of one micro-batch there
        lean = lean and accumulate  # a window of one micro-batch is lean already
        config = family.configure(self.base, micro_batch_size=micro,
                                  effective_batch=(2 * micro if accumulate else micro) * self.ranks(family))
        shared = (json.dumps(config.to_dict(), sort_keys=True), self.profile, self.seq_len, self.image_size,
                  self.num_labels, lean, self.exact_trace)  # a lean trace's reserve can differ
        return (family, micro, accumulate, lean), shared, config

    def _estimate(self, config: TrainConfig, *, lean: bool) -> Estimate:
        return estimate(config, device=self.profile, seq_len=self.seq_len, image_size=self.image_size,
                        num_labels=self.num_labels, steps=STEPS, count_flops=True, lean_warmup=lean,
                        exact_trace=self.exact_trace)

    def _told(self, family: Family) -> None:
        if self.progress is not None:
            self.progress(family.technique_label)

    def line_request(self, family: Family, micro: int) -> Request:
        return family, micro, True, True

    def line_micros(self, family: Family) -> list[int]:
        """The micro-batches :meth:`fit` traces for ``family``'s line: its two largest with accumulation, or the
        largest alone where its least need (micro-batch 1) was traced already and is the other point."""
        accumulated = [micro for micro in self.micros if math.ceil(self.effective / micro) > 1]
        if accumulated and self._cached(family, 1, accumulate=True, lean=False):
            return [micro for micro in accumulated[:1] if micro > 1]
        return accumulated[:2]

    def fit_requests(self, family: Family) -> list[Request]:
        """The traces :meth:`fit` asks for first (what a search may trace ahead, beside another family's)."""
        if family.optimizer_in_backward:
            return [self.exact_request(family, self.effective)]
        if not any(math.ceil(self.effective / micro) > 1 for micro in self.micros):
            return [self.exact_request(family, 1)]
        least = self.cache.get(self._request(family, 1, accumulate=True, lean=False)[1])
        if least is None and self.low_first(family):
            return [self.exact_request(family, 1)]
        if least is None and family.reduce_every:  # traced first (:meth:`fit`), fully checkpointed first
            leanest = self._leanest(family)
            known = self._cached(leanest, 1, accumulate=True, lean=False)
            return [self.exact_request(family if known else leanest, 1)]
        if least is not None and self.least_decides(family) and least.total_bytes > self.usable:
            return []  # its fit ends at its least need, which does not fit
        return [self.line_request(family, micro) for micro in self.line_micros(family)]

    def exact_request(self, family: Family, micro: int) -> Request:
        return family, micro, math.ceil(self.effective / micro) > 1, False

    def line_point(self, family: Family, micro: int) -> Estimate:
        """A point of ``family``'s line at ``micro``: a lean trace (at the model's full depth: a deep model's
        trace is a shortened one replayed, :mod:`memfit.memory.repeats`)."""
        return self.trace(family, micro, accumulate=True, lean=True)

    def exact(self, family: Family, micro: int) -> Estimate:
        _, _, accumulate, _ = self.exact_request(family, micro)
        return self.trace(family, micro, accumulate=accumulate)

    def fit(self, family: Family) -> None:
        """Trace ``family`` at its two largest micro-batches with accumulation and predict every split (a
        step in backward: its one split, the whole window in one micro-batch). Where its least need
        (micro-batch 1, with accumulation) was traced already, it is the line's low point and only the largest
        micro-batch is traced; where that least need does not fit, nothing more is traced: no split fits."""
        if family.optimizer_in_backward:
            self.lines[family] = _Line(self.exact(family, self.effective), None)
            self.costs[family] = self.step_cost(family, self.lines[family].low)
            self.predict(family, self.effective)
            return
        accumulated = [micro for micro in self.micros if math.ceil(self.effective / micro) > 1]
        if accumulated and family.reduce_every:  # the least need first: over the budget, no split fits
            self.exact_candidate(self._leanest(family), 1)
            if (proof := self.ruling_out(family)) is not None:
                self.ruled_out[family] = proof
                return
            self.exact(family, 1)
        least = self.traced(family, 1, accumulate=True) if accumulated else None
        if least is None and accumulated and self.low_first(family):
            least = self.exact(family, 1)
        if least is not None and self.least_decides(family):  # a stage's least need: when it does not fit, none does
            self.lines[family], self.costs[family] = _Line(least, None), self.step_cost(family, least)
            if not self.predict(family, 1).fits:  # a larger micro-batch keeps more
                return
        if accumulated:
            points = self.line_micros(family)
            self.prefetch(self.line_request(family, micro) for micro in points)
            traces = sorted([*(self.line_point(family, micro) for micro in points), *([least] if least else [])],
                            key=lambda trace: -trace.micro_batch_size)
            self.lines[family] = _Line(traces[-1], traces[0] if len(traces) > 1 else None)
        else:  # an effective batch of 1: one setup, traced exactly
            self.lines[family] = _Line(self.exact(family, 1), None)
        self.costs[family] = self.step_cost(family, self.lines[family].low)
        for micro in self.micros:
            self.predict(family, micro)
        whole = self.candidates.get((family, self.effective))  # a twin's split (:meth:`predict`): not kept
        if whole is not None and family.strategy.startswith("fsdp") and not whole.fits and not whole.exact:
            # FSDP2 keeps unsharded gradients across a window's no-sync micro-steps, which a window of one
            # micro-batch never holds: the line, through accumulating windows, overstates that split
            self.exact(family, self.effective)
            self.predict(family, self.effective)

    def predict(self, family: Family, micro: int) -> Candidate:
        assert micro == self.effective or not family.optimizer_in_backward, "a step in backward cannot accumulate"
        steps = math.ceil(self.effective / micro)
        full, lean = (family, micro, steps > 1, False), (family, micro, steps > 1, steps > 1)
        if full in self.traces or lean in self.traces:
            trace = self.traces.get(full) or self.traces[lean]
            peak, allocated, phase, host = trace.total_bytes, trace.peak_bytes, trace.peak_phase, trace.host_bytes
            exact = full in self.traces
        else:
            trace = self.lines[family].low
            (peak, allocated, phase), exact = self.lines[family].at(micro), False
            host = self.lines[family].host_at(micro)
        if steps > 1:  # traced with a window of 2 micro-batches: the rest of the window's inputs
            extra = int(trace.breakdown["inputs"] / (2 * trace.micro_batch_size) * (self.effective - 2 * micro))
            peak, allocated = peak + extra, allocated + extra
        seconds = step_seconds(self.costs[family], self.profile, family.precision,
                               effective_batch=self.effective, accumulation_steps=steps, **self._ranks_of(family),
                               reduce_every=family.reduce_every and steps > 1)
        candidate = Candidate(family=family, micro_batch_size=micro, accumulation_steps=steps,
                              predicted_peak_bytes=peak, predicted_allocated_bytes=allocated, peak_phase=phase,
                              predicted_samples_per_second=self.global_batch / seconds, exact=exact,
                              fits=peak <= self.usable and self.host_fits(family, host), world_size=self.ranks(family),
                              trainable_parameters=trace.trainable_parameters, parameters=trace.parameters,
                              predicted_host_bytes=host)
        if not (family.reduce_every and steps == 1 and dataclasses.replace(family, reduce_every=False)
                in self.considered):  # the same setup as its twin's, which is kept
            self.candidates[(family, micro)] = candidate
        return candidate

    def step_cost(self, family: Family, trace: Estimate) -> StepCost:
        """The family's step cost from its trace. FSDP's optimizer step runs on DTensors, whose inner ops a
        trace does not see: it costs at least the ops of a replica's step with the same optimizer."""
        cost = StepCost.of(trace)
        if not family.strategy.startswith("fsdp"):
            return cost
        replicas = [known.ops_per_optimizer_step for other, known in self.costs.items()
                    if other.strategy in ("none", "ddp") and (other.kernels, other.optimizer, other.freeze)
                    == (family.kernels, family.optimizer, family.freeze)]
        return dataclasses.replace(cost, ops_per_optimizer_step=max([cost.ops_per_optimizer_step, *replicas]))

    # --- search ---
    def lower_bound_seconds(self, family: Family) -> float:
        """No setup of ``family`` is faster than this, by what is known from the traced families: FLOPs grow
        with checkpointing, ops with checkpointing and with autocast's casts."""
        rank = CHECKPOINTING.index(family.checkpointing)
        known = [(other, cost) for other, cost in self.costs.items()
                 if (other.freeze, other.optimizer, other.lora_rank, other.quantize_base, other.offload_optimizer,
                     other.optimizer_in_backward, other.kahan, other.offload_activations)
                 == (family.freeze, family.optimizer, family.lora_rank, family.quantize_base,
                     family.offload_optimizer, family.optimizer_in_backward, family.kahan,
                     family.offload_activations)
                 and CHECKPOINTING.index(other.checkpointing) <= rank
                 and other.loss_chunk in (None, family.loss_chunk)  # chunking only adds work
                 and other.strategy in (family.strategy, "none", "ddp")]  # a replica's step: the least ops
        flops = max((cost.flops_per_sample for _, cost in known), default=0.0)
        ops = max((cost.ops_per_micro_step for other, cost in known
                   if other.precision in (family.precision, "fp32")), default=0.0)
        step_ops = min((cost.ops_per_optimizer_step for other, cost in known if other.kernels == family.kernels),
                       default=0.0)
        trainable = min((cost.trainable_parameters for _, cost in known), default=0)
        parameters = min((cost.parameters for _, cost in known), default=0)
        bound = StepCost(flops_per_sample=flops, ops_per_micro_step=ops, ops_per_optimizer_step=step_ops,
                         trainable_parameters=trainable, parameters=parameters)
        return step_seconds(bound, self.profile, family.precision, effective_batch=self.effective,
                            accumulation_steps=1, **self._ranks_of(family))

    def _ranks_of(self, family: Family) -> dict[str, Any]:
        """The cost model's inputs for ``family``'s ranks and where its optimizer step runs."""
        return {"strategy": family.strategy, "world_size": self.world_size, "offload": family.offload_optimizer,
                "kahan": family.kahan, "paged": family.paged, "per_node": self.per_node,
                "shard_group": family.shard_group or self.base.shard_group}

    def host_per_node(self, family: Family, host_bytes: int) -> int:
        """Host bytes one machine holds for ``family``: each of its ranks' step (``host_bytes`` per rank), or,
        where the host memory is checked, its model while the ranks load it if that is more."""
        ranks = min(self.ranks(family), self.per_node or self.ranks(family))
        if self.host_memory is None or self.spec is None or self.task is None:
            return host_bytes * ranks
        if family not in self.loads:
            config = family.configure(self.base, micro_batch_size=1, effective_batch=self.global_batch)
            self.loads[family] = load_host_bytes(config, self.spec, self.task,
                                                 Precision(family.precision, self.profile.kind).low_dtype,
                                                 strategy=config.distributed, ranks=ranks)
        return max(host_bytes * ranks, self.loads[family])

    def over_host(self, candidate: Candidate) -> str:
        """What a need line adds where ``candidate`` fits the card but not the host: its host memory."""
        host = self.host_per_node(candidate.family, candidate.predicted_host_bytes)
        if self.host_fits(candidate.family, candidate.predicted_host_bytes) or \
                (candidate.predicted_peak_bytes or 0) > self.usable:
            return ""
        limit = format_bytes(self.host_memory or 0)
        return f" on the card and {format_bytes(host)} of host memory per machine, over {limit}"

    def host_fits(self, family: Family, host_bytes: int) -> bool:
        """Whether one machine's host memory holds what ``family`` keeps there (always, unchecked)."""
        return self.host_memory is None or self.host_per_node(family, host_bytes) <= self.host_memory

    def best(self, *, confirmed: bool, where: Callable[[Family], bool] | None = None) -> Candidate | None:
        """The fastest fitting setup (``confirmed``: traced exactly; ``where``: of the families it accepts)."""
        fitting = [c for c in self.candidates.values() if c.fits and (c.exact or not confirmed)
                   and (where is None or where(c.family))]
        return max(fitting, key=lambda c: c.predicted_samples_per_second, default=None)

    def search(self, families: list[Family]) -> None:
        """Fit families in the order of their best possible speed until none can beat the best fitting setup,
        then confirm the top setups exactly; repeat while a confirmation changes the answer."""
        order = {family: index for index, family in enumerate(families)}
        self.considered.extend(family for family in families if family not in self.considered)
        while True:
            best = self.best(confirmed=False)
            best_seconds = self.global_batch / best.predicted_samples_per_second if best else math.inf
            for family in families:
                if family not in self.lines and family not in self.ruled_out and (proof := self.ruling_out(family)):
                    self.ruled_out[family] = proof
            open_families = [family for family in families if family not in self.lines
                             and family not in self.ruled_out
                             and self.lower_bound_seconds(family) < best_seconds * (1 - 1e-9)
                             and self.twin_leaves_room(family, best_seconds)]
            if open_families:
                ranked = sorted(open_families, key=lambda f: (self.lower_bound_seconds(f), order[f]))
                self.prefetch(self._ahead(ranked))
                self.fit(ranked[0])
                continue
            if not self.confirm():
                return

    def twin_leaves_room(self, family: Family, best_seconds: float) -> bool:
        """Whether ``family`` may beat ``best_seconds`` beside its twin, the same family reducing gradients in the
        window's last micro-step only. Reducing every micro-step changes only the accumulating splits, each
        slower than the twin's and keeping less: worth fitting where one of the twin's does not fit and would
        beat the best (always, for any other family or a twin not fitted yet)."""
        twin = dataclasses.replace(family, reduce_every=False)
        if not family.reduce_every or twin not in self.lines:
            return True
        return any(not c.fits and self.global_batch / c.predicted_samples_per_second < best_seconds * (1 - 1e-9)
                   for micro in self.micros if (c := self.candidates.get((twin, micro))) is not None
                   and c.accumulation_steps > 1)

    def confirm(self) -> bool:
        """Trace exactly the two fastest fitting setups, and any faster one within ``BAND`` above the budget.
        Returns whether any prediction changed."""
        changed = False
        confirmed = 0
        ranked = sorted(self.candidates.values(), key=lambda c: -c.predicted_samples_per_second)
        # not filled: the plan usually ends with these, and a guess would only keep it waiting
        self.prefetch((self.exact_request(c.family, c.micro_batch_size) for c in self._to_confirm(ranked)),
                      fill=False)
        for candidate in ranked:
            if confirmed == 2:
                break
            if self._unconfirmed(candidate):
                self.exact(candidate.family, candidate.micro_batch_size)
                updated = self.predict(candidate.family, candidate.micro_batch_size)
                changed = changed or updated.fits != candidate.fits
                candidate = updated
            if candidate.fits:
                confirmed += 1
        return changed

    def ruling_out(self, family: Family) -> Candidate | None:
        """An exact trace showing ``family`` cannot fit, or ``None``: the same family checkpointing more, over
        the budget at its least micro-batch (its least need). More checkpointing keeps less of a micro-batch,
        and a larger micro-batch more, so no setup of ``family`` fits either; it is not traced. (The split
        without accumulation is judged from that accumulated trace, as a family's line judges it. Not with
        the activations offloaded, where checkpointing keeps a whole block on the card and no checkpointing
        one node's; nor under FSDP, whose accumulation keeps unsharded gradients that one window does not.)"""
        if not self.least_decides(family):
            return None
        return next((least for least in self._leaner_least_needs(family) if least.fits is False), None)

    def _leaner_least_needs(self, family: Family) -> Iterator[Candidate]:
        """The least needs traced exactly of ``family`` checkpointing more, the leanest last."""
        for checkpointing in CHECKPOINTING[CHECKPOINTING.index(family.checkpointing) + 1:]:
            leaner = dataclasses.replace(family, checkpointing=checkpointing)
            candidate = self.candidates.get((leaner, self.least_micro(leaner)))
            if candidate is not None and candidate.exact:
                yield candidate

    def low_first(self, family: Family) -> bool:
        """Whether :meth:`fit` traces ``family`` at its least need (micro-batch 1, exactly) before its line: where
        the same family checkpointing more needs at least :data:`LOW_FIRST` of the budget there, keeping more of
        a micro-batch often does not fit even at micro-batch 1, and then that one trace shows no split fits
        (its line's two points would have been traced for nothing). Where it does fit, it is the line's low
        point: the line costs one trace more only by its fourth micro-step."""
        if not self.least_decides(family) or family.reduce_every or family.optimizer_in_backward:
            return False
        return any((least.predicted_peak_bytes or 0) >= LOW_FIRST * self.usable
                   for least in self._leaner_least_needs(family))

    @staticmethod
    def _leanest(family: Family) -> Family:
        """``family`` checkpointing every block: its least need, where ``family``'s checks first."""
        return dataclasses.replace(family, checkpointing=CHECKPOINTING[-1])

    @staticmethod
    def least_decides(family: Family) -> bool:
        """Whether a least need over the budget shows that no setup of ``family`` fits (see :meth:`ruling_out`).
        An FSDP family reducing every micro-step: its one split without accumulation is its twin's, fitted
        with the twin; its accumulating ones keep more as the micro-batch grows, as one GPU's do."""
        return not (family.offload_activations or (family.strategy.startswith("fsdp") and not family.reduce_every))

    def _to_confirm(self, ranked: list[Candidate]) -> list[Candidate]:
        """The setups :meth:`confirm` traces if every one confirmed fits as predicted."""
        chosen: list[Candidate] = []
        fitting = 0
        for candidate in ranked:
            if fitting == 2:
                break
            if self._unconfirmed(candidate):
                chosen.append(candidate)
            fitting += bool(candidate.fits)
        return chosen

    def _unconfirmed(self, candidate: Candidate) -> bool:
        """A predicted setup that fits, or comes within ``BAND`` above the budget: :meth:`confirm` traces it."""
        near = candidate.predicted_peak_bytes is not None and \
            candidate.predicted_peak_bytes <= self.usable * (1 + BAND)
        return not candidate.exact and (bool(candidate.fits) or near)

    def exact_candidates(self, families: Iterable[Family], *, upcoming: bool = False) -> list[Candidate]:
        """Each of ``families`` at its least micro-batch from an exact trace, traced side by side (``upcoming``:
        with everything :attr:`upcoming` names)."""
        families = list(families)
        self.prefetch((self.exact_request(family, self.least_micro(family)) for family in families),
                      upcoming=upcoming)
        return [self.exact_candidate(family, self.least_micro(family)) for family in families]

    def exact_candidate(self, family: Family, micro: int) -> Candidate:
        """``family`` at ``micro`` from an exact trace (without fitting the family's line)."""
        trace = self.exact(family, micro)
        self.costs.setdefault(family, self.step_cost(family, trace))
        return self.predict(family, micro)

    def smallest(self, families: list[Family]) -> Candidate:
        """The least memory any of ``families`` needs, traced exactly: micro-batch 1 of every family whose line
        comes within ``SMALLEST_BAND`` of the lowest there, and of every family with a chunked loss (a line
        through larger micro-batches can misjudge micro-batch 1, e.g. autocast's cached 16-bit weight copies
        against fp32's larger activations)."""
        fitted = [family for family in families if family in self.lines]
        predicted = [self.predict(family, self.least_micro(family)) for family in fitted]
        lowest = min(c.predicted_peak_bytes or 0 for c in predicted)
        near = [c.family for c in predicted if (c.predicted_peak_bytes or 0) <= lowest * (1 + SMALLEST_BAND)
                or c.family.loss_chunk is not None]  # their lines miss micro-batch 1 most (logits per chunk)
        return min(self.exact_candidates(near), key=lambda c: c.predicted_peak_bytes or 0)

    def least_micro(self, family: Family) -> int:
        """The micro-batch of ``family``'s least need at this effective batch: 1, or the whole window for a step
        in backward (which cannot accumulate)."""
        return self.effective if family.optimizer_in_backward else 1

    def largest_window(self, family: Family) -> tuple[int, Estimate]:
        """A step in backward: (the largest effective batch per rank, at most this one, whose window of one
        micro-batch fits, 0 when none does; the trace of the least it needs, a window of one sample)."""
        least = self.trace(family, 1, accumulate=False)
        largest = 0
        if least.total_bytes <= self.usable:
            for micro in sorted(self.micros):
                if self.trace(family, micro, accumulate=False).total_bytes > self.usable:
                    break
                largest = micro
        return largest, least
