"""What a plan is asked: ``memfit plan``'s options as one typed value, filled by the command line or by
``memfit serve``'s query string, and planned by one function, so both answer the same inputs with the same plan.

The query string takes the command's option names without their dashes (``?model=llama-3.2-1b&seq-len=1024&
device=1080ti&allow-lora=1``); a flag is on when given as ``1``, ``true``, ``yes``, ``on`` or empty. Values are
converted here, one line per problem; what they mean is checked where the command checks it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memfit.config import PLANNED_LORA_RANK, PRECISIONS, TASKS, TrainConfig, from_mapping
from memfit.errors import ConfigError, Problems
from memfit.planner.allowed import FLAGS, NOTHING, Allowed
from memfit.units import fraction

if TYPE_CHECKING:
    from memfit.memory.estimate import Estimate
    from memfit.planner.report import Plan

OPTIMIZER_CHOICES = ("adamw", "sgd")
DISTRIBUTED_CHOICES = ("auto", "ddp", "fsdp")
DEFAULT_DEVICE = "1080ti"
DEFAULT_MARGIN = 0.05
TRUE, FALSE = ("1", "true", "yes", "on", ""), ("0", "false", "no", "off")
SERVED_TOKENS = 2**24
"""Tokens per optimizer step (effective batch x sequence length) a server plans at most."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanRequest:
    """The inputs of one plan (``memfit plan``'s options); ``None``: the training option's default."""

    model: str | None = None
    task: str | None = None
    seq_len: int | None = None
    image_size: int | None = None
    effective_batch: int | None = None
    num_labels: int = 2
    max_target_length: int | None = None
    device: str = DEFAULT_DEVICE
    """A device profile's name (or a profile file, from the command line)."""
    budget: str | None = None
    """Memory to fit, e.g. ``11GiB`` (default: the device's)."""
    margin: float = DEFAULT_MARGIN
    gpus: int | None = None
    gpus_per_node: int | None = None
    """GPUs of one machine, where ``gpus`` fill several (``None``: one machine)."""
    host_memory: str | None = None
    """One machine's host memory, e.g. ``256GiB``: what its ranks offload must fit (``None``: not checked)."""
    distributed: str | None = None
    precision: str = "auto"
    optimizer: str | None = None
    allow: Allowed = NOTHING
    lora_rank: int = PLANNED_LORA_RANK
    exact_trace: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)
    """Training options from a config file (``--config``), below the ones given here."""

    def config(self) -> TrainConfig:
        """The training options planned for: the config file's, then the ones given."""
        given = {name: getattr(self, name) for name in ("model", "effective_batch", "optimizer", "distributed",
                                                        "task", "max_target_length") if getattr(self, name) is not None}
        if self.seq_len is not None:
            given["max_length"] = self.seq_len
        return from_mapping({**self.options, **given})

    def run(self, *, progress: Callable[[str], None] | None = None, cache: dict[Any, Estimate] | None = None,
            suggest: bool = True) -> Plan:
        """The plan (:func:`memfit.planner.plan`); ``progress(technique)`` is told after each trace;
        ``suggest=False``: when nothing fits, no trace of what the opt-ins not allowed would need."""
        from memfit.planner.choose import plan

        return plan(self.config(), device=self.device, budget=self.budget, seq_len=self.seq_len,
                    image_size=self.image_size, margin=self.margin, allow=self.allow, lora_rank=self.lora_rank,
                    precisions=None if self.precision == "auto" else (self.precision,), num_labels=self.num_labels,
                    gpus=self.gpus, exact_trace=self.exact_trace, cache=cache, progress=progress, suggest=suggest,
                    gpus_per_node=self.gpus_per_node, host_memory=self.host_memory)

    @classmethod
    def from_query(cls, query: Mapping[str, str], *, served: bool = False) -> PlanRequest:
        """The request a query string (or a form) asks; every problem in one :class:`ConfigError`. ``served``:
        asked of a server, which takes only a built-in device profile (no file path) and at most
        :data:`SERVED_TOKENS` tokens per optimizer step (the trace's inputs are made as real host tensors)."""
        problems = Problems()
        values: dict[str, Any] = {}
        allowed: dict[str, bool] = {}
        opt_ins = {flag.removeprefix("--"): name for name, flag in FLAGS.items()}
        for key, raw in query.items():
            text, name = raw.strip(), key.replace("-", "_")
            try:
                if key in opt_ins:
                    allowed[opt_ins[key]] = _flag(key, text)
                elif name in QUERY_CONVERTERS:
                    if text:  # an empty field is "not given": the default
                        values[name] = QUERY_CONVERTERS[name](text, key=key)
                else:
                    problems.add(f"unknown input {key!r}; the inputs are {', '.join(QUERY_KEYS)}")
            except ConfigError as error:
                problems.extend(error)
        if served:
            problems.lines.extend(_served_problems(values))
        problems.raise_if_any()
        return cls(**values, allow=Allowed(**allowed))

    def to_query(self) -> dict[str, str]:
        """The query string that asks this request (its inverse; options of a config file are not carried)."""
        query: dict[str, str] = {}
        for name in QUERY_CONVERTERS:
            value, default = getattr(self, name), DEFAULTS[name]
            if value != default:
                query[name.replace("_", "-")] = str(value)
        query.update({flag.removeprefix("--"): "1" for flag in self.allow.flags})
        return query


def _served_problems(values: Mapping[str, Any]) -> list[str]:
    from memfit.names import PROFILES

    problems = []
    device = values.get("device")
    if device is not None and device not in PROFILES:
        problems.append(f"device={device!r}: choose one of {', '.join(PROFILES)}")
    tokens = (values.get("effective_batch") or 1) * (values.get("seq_len") or 1)
    if tokens > SERVED_TOKENS:
        problems.append(f"effective-batch x seq-len = {tokens:,} tokens per step; the page plans at most "
                        f"{SERVED_TOKENS:,} (memfit plan has no such bound)")
    return problems


def _flag(key: str, text: str) -> bool:
    if text.lower() in TRUE:
        return True
    if text.lower() in FALSE:
        return False
    raise ConfigError(f"{key}={text!r}: give 1 or 0")


def _whole(text: str, *, key: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{key}={text!r} is not a whole number") from None


def _text(text: str, *, key: str) -> str:
    return text


def _choice(choices: tuple[str, ...]) -> Callable[..., str]:
    def convert(text: str, *, key: str) -> str:
        if text not in choices:
            raise ConfigError(f"{key}={text!r}: choose one of {', '.join(choices)}")
        return text

    return convert


def _margin(text: str, *, key: str) -> float:
    try:
        return fraction(text)
    except ConfigError as error:
        raise ConfigError(f"{key}={error.problems[0]}") from None


def _switch(text: str, *, key: str) -> bool:
    return _flag(key, text)


QUERY_CONVERTERS: dict[str, Callable[..., Any]] = {
    "model": _text, "task": _choice(TASKS), "seq_len": _whole, "image_size": _whole, "effective_batch": _whole,
    "num_labels": _whole, "max_target_length": _whole, "device": _text, "budget": _text, "margin": _margin,
    "gpus": _whole, "gpus_per_node": _whole, "host_memory": _text,
    "distributed": _choice(DISTRIBUTED_CHOICES), "precision": _choice(PRECISIONS),
    "optimizer": _choice(OPTIMIZER_CHOICES), "lora_rank": _whole, "exact_trace": _switch}
"""How each input of a query string becomes its field (every field but ``allow`` and ``options``)."""
QUERY_KEYS = (*(name.replace("_", "-") for name in QUERY_CONVERTERS), *(flag.removeprefix("--")
                                                                         for flag in FLAGS.values()))
DEFAULTS = {item.name: item.default for item in dataclasses.fields(PlanRequest) if item.name in QUERY_CONVERTERS}
