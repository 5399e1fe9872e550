"""The optimizer step inside backward (``--optimizer-in-backward``, "gradient release").

Each trained parameter has an optimizer of its own, stepped by a post-accumulate-grad hook as soon as the
parameter's gradient is complete; the gradient is freed right after. No full set of gradients ever exists:
at any moment of backward at most the gradients of the parameters whose backward is running are alive (the
largest single one, e.g. the embedding, sets the floor). For full fine-tuning that removes 2 bytes
(bf16-true) or 4 bytes (fp32 weights) per parameter from the peak.

What is learned is the same as with the ordinary step when the window is one micro-batch and there is no
clipping: the same optimizer on the same gradient, element by element (tested bit for bit). Trade-offs and
what is refused:

- No accumulation: a parameter is updated during the first micro-batch's backward, so a window must be one
  micro-batch (``--micro-batch-size`` equal to the effective batch). Refused otherwise, in one line; the
  planner says which effective batch would fit instead.
- No clipping by the global norm: the norm is known only when every gradient exists. Refused unless
  ``--max-grad-norm none``.
- No fp16 GradScaler (its unscale and overflow check span all gradients together): use bf16-true, bf16 or
  fp32.
- The non-finite guard works per parameter: a gradient is checked (its norm, one reduction and one host read)
  before its update, and a parameter whose gradient is not finite keeps its weights and state; the others are
  updated. The step is reported as skipped with those parameters' names, and ``--max-nonfinite-steps`` still
  stops a run that keeps producing them. On a GPU the host read is one synchronisation per parameter (not
  measured here).
- A sharded checkpoint saves each shard's state; AdamW's step counter is one number per parameter, saved once
  for all ranks, so after a step where only some ranks kept a shard (a non-finite gradient there) the resumed
  ranks share one rank's count.
- No out-of-memory recovery: an OOM inside backward can come after some parameters were updated, and
  replaying the window would update them twice. The run stops with the last checkpoint as the place to
  resume from (said before the run starts); plan with a margin.
- Under FSDP (``--distributed fsdp``), each rank updates its own shard of a parameter when FSDP hands it the
  reduced shard of the gradient (FSDP2 runs post-accumulate-grad hooks on its sharded parameters after the
  reduce-scatter, with ``--cpu-offload`` too, where the shard is on the host) and frees it: only the unit being
  back-propagated holds its unreduced gradients, no rank keeps a set of reduced ones. Each rank checks its own
  shard, so a shard whose gradient is not finite keeps its values while the parameter's other shards are
  updated. The step's gradient norm is summed over the ranks that shard it (one all-reduce of one number per
  step, on the group's device, no collective per parameter), so every rank sees the same norm and counts a
  non-finite step alike. Not under DDP (nor ``--distributed auto``, which may choose it): its gradient buckets
  are all-reduced after the hooks would have updated the parameters with this rank's own gradient. Not with
  ``--offload-optimizer`` (one process; FSDP's ``--cpu-offload`` is the one that offloads here).

Works with AdamW (fused, foreach or a loop), SGD, bitsandbytes' 8-bit AdamW and torch-optimi's Kahan AdamW
(:mod:`memfit.techniques.bf16_true`): each parameter's optimizer is the run's optimizer over that one parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

BuildOptimizer = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
"""Builds the run's optimizer over parameter groups (here: one parameter)."""


def gradient_is_finite(grad: torch.Tensor) -> tuple[bool, torch.Tensor]:
    """(whether ``grad`` holds only finite values, its L2 norm): one reduction, read on the host. A sharded
    gradient (FSDP's) is checked on this rank's shard: no collective."""
    norm = torch.linalg.vector_norm(local_part(grad)).float()
    return bool(torch.isfinite(norm)), norm


def assume_finite_gradient(grad: torch.Tensor) -> tuple[bool, torch.Tensor]:
    """For traces with fake tensors, which hold no values: the same tensors, the branch that updates."""
    norm = torch.linalg.vector_norm(local_part(grad)).float()
    torch.isfinite(norm)
    return True, norm


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP's parameters and gradients), else ``tensor`` itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def shard_group(parameter: torch.Tensor) -> Any:
    """The process group ``parameter`` is sharded over (FSDP: all ranks; HSDP: the ranks of one shard group),
    or ``None`` for a whole tensor."""
    placements = getattr(parameter, "placements", None)
    if placements is None:
        return None
    dims = [dim for dim, placement in enumerate(placements) if placement.is_shard()]
    return parameter.device_mesh.get_group(dims[0]) if dims else None  # type: ignore[attr-defined]


class InBackwardOptimizer(torch.optim.Optimizer):
    """The run's optimizer, stepped per parameter inside backward. Its parameter groups are the model's, so
    learning-rate schedules work on it as on any optimizer (each update takes its group's current values);
    :meth:`step` has nothing left to do. ``state`` shows every parameter's state (the per-parameter
    optimizers' own dictionaries), so checkpoints and the estimator read it as usual."""

    def __init__(self, groups: list[dict[str, Any]], build: BuildOptimizer, *, lr: float) -> None:
        super().__init__(groups, {"lr": lr})
        self.check: Callable[[torch.Tensor], tuple[bool, torch.Tensor]] = gradient_is_finite
        """How a gradient is checked before its update (the estimator sets :func:`assume_finite_gradient`)."""
        self.per_parameter: dict[nn.Parameter, torch.optim.Optimizer] = {}
        self._group_of: dict[nn.Parameter, dict[str, Any]] = {}
        self.skipped: list[nn.Parameter] = []
        """Parameters whose gradient was not finite since :meth:`take_skipped` last ran."""
        self.squared_norm: torch.Tensor | None = None
        """The window's gradient norm, squared, summed as each gradient is checked (for logging)."""
        for group in self.param_groups:
            hyper = {key: value for key, value in group.items() if key != "params"}
            for parameter in group["params"]:
                inner = build([{**hyper, "params": [parameter]}])
                self.per_parameter[parameter] = inner
                self._group_of[parameter] = group
                parameter.register_post_accumulate_grad_hook(self._step_parameter)
        sharded = next((parameter for parameter in self.per_parameter if shard_group(parameter) is not None), None)
        self.group = None if sharded is None else shard_group(sharded)
        """The ranks whose shards make up each parameter (FSDP), over which the step's norm is summed."""
        self._reduce_on = None if sharded is None else torch.device(sharded.device_mesh.device_type)  # type: ignore[attr-defined]
        """Where that sum runs: the group's device (with FSDP's CPU offload the gradients are on the host)."""
        first = next(iter(self.per_parameter.values()))
        self.defaults.update({key: value for key, value in first.defaults.items() if key in ("fused", "foreach")})

    @torch.no_grad()
    def _step_parameter(self, parameter: torch.Tensor) -> None:
        grad = parameter.grad
        if grad is None:
            return
        finite, norm = self.check(grad)
        squared = norm.square()
        self.squared_norm = squared if self.squared_norm is None else self.squared_norm + squared
        if finite:
            inner = self.per_parameter[parameter]  # type: ignore[index]
            self._share_group(parameter, inner)  # type: ignore[arg-type]
            inner.step()
            self.state[parameter] = inner.state[parameter]  # (its first step makes it: an empty one would tell
            # torch's distributed state dicts that a state exists)
        else:
            self.skipped.append(parameter)  # type: ignore[arg-type]
        parameter.grad = None  # released: the next gradient may take its memory

    @property
    def paged_states(self) -> tuple[torch.Tensor, ...]:
        """The per-parameter optimizers' states in CUDA unified memory (a paged 8-bit AdamW's)."""
        return tuple(state for inner in self.per_parameter.values() for state in getattr(inner, "paged_states", ()))

    def take_skipped(self) -> list[nn.Parameter]:
        """The parameters left unchanged since the last call (their gradients were not finite)."""
        skipped, self.skipped = self.skipped, []
        return skipped

    def take_norm(self) -> torch.Tensor:
        """The global gradient norm of the window's updates (a device tensor; zero before any gradient), summed
        over the ranks that shard the parameters: not finite where any rank left a shard unchanged."""
        squared, self.squared_norm = self.squared_norm, None
        if self.group is not None:
            import torch.distributed as dist

            # no shard of this rank had a gradient: it still takes part in the sum
            squared = torch.zeros((), device=self._reduce_on) if squared is None else squared.to(self._reduce_on)
            dist.all_reduce(squared, group=self.group)
        return torch.zeros(()) if squared is None else squared.sqrt()

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Nothing to do: every parameter was updated in backward."""
        return closure() if closure is not None else None

    def state_dict(self) -> dict[str, Any]:
        groups = [{key: value for key, value in group.items() if key != "params"} for group in self.param_groups]
        return {"groups": groups, "per_parameter": [inner.state_dict() for inner in self.per_parameter.values()]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for group, saved in zip(self.param_groups, state_dict["groups"], strict=True):
            group.update(saved)
        for (parameter, inner), saved in zip(self.per_parameter.items(), state_dict["per_parameter"], strict=True):
            inner.load_state_dict(saved)
            self._link_state(parameter, inner)

    def _link_state(self, parameter: nn.Parameter, inner: torch.optim.Optimizer) -> None:
        """Show ``parameter``'s state (once its optimizer has one) as the run's."""
        if parameter in inner.state:
            self.state[parameter] = inner.state[parameter]

    def _share_group(self, parameter: nn.Parameter, inner: torch.optim.Optimizer) -> None:
        """Give ``parameter``'s optimizer its group's current hyperparameters (a schedule changes the run's)."""
        group = self._group_of[parameter]
        inner.param_groups[0].update({key: value for key, value in group.items() if key != "params"})

    def parameter_optimizers(self, *, saving: bool) -> list[torch.optim.Optimizer]:
        """The per-parameter optimizers, each with its group's current hyperparameters: what a sharded
        checkpoint saves and loads (torch's distributed state dicts key their states by parameter name).
        ``saving``: one that has no state yet (its parameter never updated) shows an empty one, so that torch's
        state dicts do not make one by stepping it (they step an optimizer without state, to have its layout)."""
        for parameter, inner in self.per_parameter.items():
            self._share_group(parameter, inner)
            if saving:
                inner.state.setdefault(parameter, {})
        return list(self.per_parameter.values())

    def loaded_per_parameter(self) -> None:
        """After the per-parameter optimizers' states were loaded on their own (a sharded checkpoint): take
        their states and hyperparameters (the learning rate the schedule had reached) as the run's."""
        for parameter, inner in self.per_parameter.items():
            self._link_state(parameter, inner)
            self._group_of[parameter].update(
                {key: value for key, value in inner.param_groups[0].items() if key != "params"})
