"""When nothing accuracy-neutral fits: the opt-ins, in their order of fidelity, each on top of the ones before.

The order (the first that fits and is allowed wins; each says what it needs at least):

1. the optimizer step inside backward, where the run does not clip (it changes nothing learned then);
2. the optimizer on the host (one CUDA card; the same update, slower steps);
3. the saved activations on the host (one CUDA card; the same step, PCIe traffic);
4. the optimizer step inside backward where the run clips by the global norm (clipping dropped);
5. 16-bit weights with Kahan-summed updates (``bf16-true``, a card with bf16);
6. 8-bit AdamW states;
7. the same states paged (bitsandbytes' paged AdamW: CUDA unified memory, which the driver pages out to the host
   when the card runs short; the allocator does not count it, so neither does the card's peak);
8. freezing: the embeddings, then all but the top half, then all but the top quarter of the layers.

(1 and 4 are one technique, placed by whether the run clips.) 1, 3 to 7 build on each other when allowed, as
the fine-tuning recipes that fit 8B models on one 24 GB card stack them (16-bit weights, the step in backward,
8-bit states, activations on the host); the host optimizer and freezing are tried alone on top of those. A
step in backward cannot accumulate: its setups compute the whole window in one micro-batch, and when only a
smaller window would fit, the advice says which effective batch does.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from memfit.config import TrainConfig, runs_sharded
from memfit.devices import DeviceProfile
from memfit.errors import ConfigError
from memfit.planner.allowed import Advice, Allowed, over_by_weights
from memfit.planner.families import (
    CHECKPOINTING,
    Candidate,
    Family,
    default_kernels,
    least_first,
    runs_on,
    with_chunked_loss,
    with_sharded_gradients,
)
from memfit.planner.search import Request, Search
from memfit.report import format_bytes
from memfit.techniques.optim import optimizer_problems

Change = Callable[[Family], Family | None]
"""An opt-in applied to a family (``None`` where it cannot apply)."""


@dataclass(frozen=True, slots=True)
class Stage:
    flag: str
    allowed: bool
    change: Change
    builds: bool = True
    """Later stages build on this one when it is allowed (else each is tried alone)."""
    beside: bool = False
    """Its setups join the ones before instead of replacing them (the step in backward, which cannot
    accumulate: the setups that can stay tried beside it)."""


def stages(search: Search, num_layers: int, allow: Allowed) -> list[Stage]:
    """The opt-ins for this search's card and run, in order (see the module docstring)."""
    profile, clips = search.profile, search.base.max_grad_norm is not None

    def in_backward(family: Family) -> Family | None:
        if family.strategy == "ddp" or family.optimizer_in_backward:  # FSDP steps each rank's shards in backward
            return None
        return dataclasses.replace(family, optimizer_in_backward=True, drops_clipping=clips, offload_optimizer=False,
                                   reduce_every=False,
                                   precision="fp32" if family.precision == "fp16" else family.precision)

    def offload(family: Family) -> Family | None:
        if profile.kind != "cuda" or family.ranks or family.lora_rank or family.optimizer_in_backward \
                or family.precision == "bf16-true":
            return None
        return dataclasses.replace(family, offload_optimizer=True)

    def offload_activations(family: Family) -> Family | None:
        if profile.kind != "cuda" or family.ranks or family.offload_activations:
            return None
        return dataclasses.replace(family, offload_activations=True)

    def bf16_true(family: Family) -> Family | None:
        if not profile.has_native_bf16 or family.strategy == "ddp" or family.offload_optimizer:
            return None  # several GPUs: FSDP shards the bf16 weights and state, on the cards or on the host
        kahan = "8bit" not in family.optimizer and importlib.util.find_spec("optimi") is not None
        return dataclasses.replace(family, precision="bf16-true", kahan=kahan,
                                   kernels=default_kernels(family.optimizer, family.strategy, profile, kahan=kahan))

    def eight_bit(family: Family, optimizer: str = "adamw8bit") -> Family | None:
        if family.offload_optimizer or (optimizer.startswith("paged") and profile.kind != "cuda"):
            return None
        strategy, group = family.strategy, family.shard_group
        if strategy.startswith("fsdp") and not runs_sharded(optimizer):  # replicated instead
            if search.base.distributed == "fsdp":
                return None
            if not runs_on(family.precision, "ddp") or family.optimizer_in_backward:  # DDP cannot step in backward
                return None
            strategy, group = "ddp", None
        return dataclasses.replace(family, optimizer=optimizer, kahan=False, strategy=strategy, shard_group=group,
                                   reduce_every=family.reduce_every and strategy.startswith("fsdp"),
                                   kernels=default_kernels(optimizer, strategy, profile))

    def paged(family: Family) -> Family | None:
        return eight_bit(family, "paged-adamw8bit")

    step_in_backward = Stage("--allow-optimizer-in-backward", allow.optimizer_in_backward, in_backward, beside=True)
    order = [Stage("--allow-offload", allow.offload, offload, builds=False),
             Stage("--allow-offload (activations)", allow.offload, offload_activations)]
    order = [*order, step_in_backward] if clips else [step_in_backward, *order]
    order.append(Stage("--allow-bf16-true", allow.bf16_true, bf16_true))
    if not optimizer_problems("adamw8bit") and not bitsandbytes_problem(profile):
        order.append(Stage("--allow-8bit-optimizer", allow.eight_bit_optimizer, eight_bit))
        order.append(Stage("--allow-8bit-optimizer and --allow-offload (paged states)",
                           allow.eight_bit_optimizer and allow.offload, paged))
    for freeze in dict.fromkeys(["embeddings", f"top-{max(1, num_layers // 2)}", f"top-{max(1, num_layers // 4)}"]):
        order.append(Stage(f"--allow-freeze ({freeze})", allow.freeze, _freezing(freeze), builds=False))
    return order


def _freezing(part: str) -> Change:
    def change(family: Family) -> Family:
        return dataclasses.replace(family, freeze=part)
    return change


def opt_ins(search: Search, smallest: Candidate | None, num_layers: int, allow: Allowed, *, suggest: bool,
            task: str) -> tuple[Candidate | None, list[Advice]]:
    """The fastest setup of the first allowed opt-in that fits, or ``None``; and what each one tried needs at
    least (``suggest=False``: only the allowed ones are tried)."""
    assert smallest is not None
    bases: list[Family] = [smallest.family]
    advice: list[Advice] = []
    tried = _tried(search, num_layers, allow, suggest=suggest)
    weights = _Weights.of(search, smallest)
    search.prefetch(_need_requests(search, tried, bases, task, weights))
    for stage in tried:
        changed = [family for family in map(stage.change, bases) if family is not None]
        if not changed:
            continue
        families = _stage_families(changed, search.base, task)
        try:
            need = weights.exceeded(stage.flag, families) or _need(search, stage.flag, families)
        except ConfigError as error:  # not for this model (--allow-freeze's top layers of an encoder-decoder)
            advice.append(Advice(f"{stage.flag} does not apply: {error.problems[0]}"))
            continue
        except Exception as error:  # bitsandbytes' kernels may not run on fake tensors; say so, plan the rest
            if not any("8bit" in family.optimizer for family in changed):
                raise
            advice.append(Advice(f"{stage.flag} could not be traced ({type(error).__name__}); it is not planned"))
            continue
        advice.append(need)
        if need.fits and stage.allowed:
            search.search(_unchunked_too(families, search.base, task))
            chosen = search.best(confirmed=True, where=lambda family: allow.permits(family.opt_ins))
            if chosen is not None:
                return chosen, advice
        if stage.allowed and stage.builds:
            bases = [*bases, *changed] if stage.beside else changed
    if optimizer_problems("adamw8bit"):
        advice.append(Advice("--allow-8bit-optimizer needs bitsandbytes (pip install 'memfit[lora]') to be planned"))
    elif problem := bitsandbytes_problem(search.profile):
        advice.append(Advice(f"--allow-8bit-optimizer: {problem}"))
    if not search.profile.has_native_bf16 and (allow.bf16_true or suggest):
        advice.append(Advice(f"--allow-bf16-true: {search.profile.description} has no native bf16"))
    return None, advice


def _stage_families(changed: list[Family], base: TrainConfig, task: str) -> list[Family]:
    return with_chunked_loss([dataclasses.replace(family, checkpointing=c) for family in changed
                              for c in CHECKPOINTING], base, task)


@dataclass(frozen=True, slots=True)
class _Weights:
    """The weights of the least need found without opt-ins: what every setup that stores its weights the same
    way keeps on the card for the whole step, whatever else it changes."""

    family: Family
    weights_bytes: int
    """The weights' bytes: trained, frozen and quantised, as traced."""
    outside_bytes: int
    """The card's memory outside PyTorch (the CUDA context)."""
    usable_bytes: int

    @staticmethod
    def of(search: Search, smallest: Candidate) -> _Weights:
        breakdown = search.exact(smallest.family, smallest.micro_batch_size).breakdown
        weights = sum(breakdown[name] for name in ("parameters", "frozen_parameters", "quantized_weights"))
        return _Weights(smallest.family, weights, search.profile.non_pytorch_bytes, search.usable)

    def exceeded(self, flag: str, families: list[Family]) -> Advice | None:
        """The advice for ``families`` when they store their weights as the least need does and those alone
        exceed the budget: no trace can show them fitting (else ``None``: they are traced)."""
        if self.weights_bytes + self.outside_bytes <= self.usable_bytes or \
                any(_stored(f) != _stored(self.family) for f in families):
            return None
        return over_by_weights(flag, "its weights alone need", self.weights_bytes, self.outside_bytes)


def _stored(family: Family) -> tuple[object, ...]:
    """What decides how a family's weights are stored on the card: sharded or not, 16-bit or fp32 (mixed
    precision keeps fp32 weights), adapters and a quantised base."""
    return family.strategy, family.shard_group, family.precision == "bf16-true", family.lora_rank, family.quantize_base


def need_requests(search: Search, smallest: Candidate, num_layers: int, allow: Allowed, *, suggest: bool,
                  task: str) -> list[Request]:
    """The least needs :func:`opt_ins` traces first, side by side: those of the stages up to the first allowed
    one (until a stage is allowed, every stage builds on the same setups)."""
    return _need_requests(search, _tried(search, num_layers, allow, suggest=suggest), [smallest.family], task,
                          _Weights.of(search, smallest))


def _tried(search: Search, num_layers: int, allow: Allowed, *, suggest: bool) -> list[Stage]:
    """The stages a plan tries: the allowed ones, and with ``suggest`` the others too (to say what they need)."""
    return [stage for stage in stages(search, num_layers, allow) if stage.allowed or suggest]


def _need_requests(search: Search, tried: list[Stage], bases: list[Family], task: str,
                   weights: _Weights) -> list[Request]:
    requests = []
    for stage in tried:
        changed = [family for family in map(stage.change, bases) if family is not None]
        families = _stage_families(changed, search.base, task)
        if not weights.exceeded(stage.flag, families):
            requests += [search.exact_request(family, search.least_micro(family))
                         for family in families if family.checkpointing == "full"]
        if stage.allowed:
            break
    return requests


def _need(search: Search, flag: str, families: list[Family]) -> Advice:
    """Whether the least of ``families`` fits the budget at this effective batch, and the advice line: fully
    checkpointed, micro-batch 1 (a step in backward: the whole window; when that does not fit, the largest
    window that does)."""
    least = [family for family in families if family.checkpointing == "full"]
    needs = search.exact_candidates(least)
    best = min(needs, key=least_first)
    if best.fits:
        return Advice(f"{flag} would fit: it needs at least {format_bytes(best.predicted_peak_bytes or 0)}",
                      fits=best.family.opt_ins)
    released = [family for family in least if family.optimizer_in_backward]
    windows = [search.largest_window(family) for family in released]
    largest = max((window[0] * search.ranks(family) for window, family in zip(windows, released, strict=True)),
                  default=0)  # per rank times the ranks: the effective batch the user gives
    if largest:
        return Advice(f"{flag}: full fine-tuning would fit at an effective batch of at most {largest} with the "
                      "optimizer step in backward, which cannot accumulate (at "
                      f"{search.base.effective_batch} it needs {format_bytes(best.predicted_peak_bytes or 0)})")
    floor = min([best.predicted_peak_bytes or 0, *(window[1].total_bytes for window in windows)])
    host = search.over_host(best) if floor == best.predicted_peak_bytes else ""
    return Advice(f"{flag} would not fit either: it needs at least {format_bytes(floor)}{host}")


BITSANDBYTES_CAPABILITY = (6, 0)


def bitsandbytes_problem(profile: DeviceProfile) -> str | None:
    """Why bitsandbytes' 8-bit states and 4-bit weights cannot run on ``profile``'s card, or ``None``: its CUDA
    kernels need compute capability 6.0 (Pascal) or newer. (torchao's low-bit optimizers, which compile Triton
    kernels, would need 7.0: memfit does not use them, so a 1080 Ti gets bitsandbytes' states.)"""
    capability = profile.compute_capability
    if capability is not None and capability < BITSANDBYTES_CAPABILITY:
        return (f"bitsandbytes' CUDA kernels need compute capability 6.0 or newer; {profile.description} has "
                f"{capability[0]}.{capability[1]}")
    return None


def _unchunked_too(families: list[Family], base: TrainConfig, task: str) -> list[Family]:
    """The families a stage searches: each checkpointing without a chunked loss too (a least need found with
    the loss in chunks says nothing of which setup is fastest), and each FSDP one reducing gradients in the
    last micro-step too (the least need reduces them in every one)."""
    plain = [dataclasses.replace(family, reduce_every=False) for family in families]  # twins added back below
    if base.loss_chunk is None:
        plain = with_chunked_loss(list(dict.fromkeys(dataclasses.replace(f, loss_chunk=None) for f in plain)),
                                  base, task)
    return with_sharded_gradients(plain, base)
