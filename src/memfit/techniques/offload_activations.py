"""Activation offload (``--offload-activations``): what autograd saves for backward goes to host memory in
forward and comes back to the card when backward needs it.

Trade-off: the card no longer holds a micro-batch's saved activations between its forward and its backward;
it holds them only one backward node at a time (each node's saved tensors are copied back when it runs and
freed after it). The host pays a copy of every offloaded tensor (pinned, so the copies are asynchronous) for
the whole micro-step, and the step pays PCIe traffic: each offloaded byte crosses the link twice. memfit's
copies run on the compute stream, so they serialise with the kernels rather than overlap them (torchtune's
``OffloadActivations`` overlaps them on side streams); worth it when activations are what does not fit and
the step is compute-bound enough to hide the link, pointless on the CPU, whose activations are in host memory
already (refused there). The result is unchanged: the copies are exact, so gradients are bit-identical.

What moves and what stays:

- Offloaded: every tensor saved inside the forward (:func:`memfit.step.accumulate_window` enters the context
  around the forward and the loss only) of at least :data:`MIN_OFFLOAD_BYTES`. Under autocast, that includes
  the 16-bit copies of fp32 weights (made per forward; the card frees them after the forward instead of after
  the backward). With activation checkpointing, the checkpointed blocks' inputs are what the forward saves,
  and they are offloaded too; the activations recomputed in backward stay on the card (the context is not
  active in backward).
- Kept on the card: parameters and views of them (a ``Linear`` saves its weight, transposed, for the input's
  gradient): copying a weight to the host would free nothing, since the model keeps it; frozen and quantised
  weights are parameters too. Tensors under :data:`MIN_OFFLOAD_BYTES` (norm statistics, masks, indices),
  whose copies would cost more in per-copy overhead than they free (the caching allocator rounds each to 512
  bytes anyway).
  Tensors a custom autograd Function keeps as attributes instead of saving them (bitsandbytes' 8-bit matmul
  keeps its input so) never reach the hooks and stay too; the estimate traces the same step, so it agrees.
- Deduplicated: one tensor saved by several ops (a block's normalised input, saved by the q, k and v
  projections) is copied once; each backward node still gets its own copy back.

Host copies are made with the layout of the saved tensor (``empty_like``, dense strides kept), pinned only
when the tensor is on a CUDA card. ``host_context`` wraps the host side of each copy: the estimator sets it so
that the copies count as host memory, not the card's; the copies brought back in backward count on the card.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, NamedTuple

import torch
from torch import nn

MIN_OFFLOAD_BYTES = 1024
"""Saved tensors smaller than this stay on the card (torchtune's default threshold)."""


def activation_offload_problems(enabled: bool, device_kind: str | None) -> list[str]:
    """``--offload-activations`` needs a CUDA card (``device_kind``, when known)."""
    if enabled and device_kind not in (None, "cuda"):
        return [f"--offload-activations moves saved activations from a CUDA card to host memory; on a {device_kind} "
                f"device they are in host memory already: drop --offload-activations"]
    return []


class _Offloaded(NamedTuple):
    """A saved tensor's host copy and the device it came from."""

    host: torch.Tensor
    device: torch.device


def is_weight(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a parameter or a view of one (what a matmul saves of its weight)."""
    return isinstance(tensor._base if tensor._base is not None else tensor, nn.Parameter)


class ActivationOffload:
    """A context manager for the forward: saved tensors go to host copies while it is active, and come back
    in backward. One instance serves a whole run; :attr:`peak_bytes` is the most host memory its copies held
    at once (one micro-batch's offloaded activations), what the run summary reports."""

    def __init__(self, *, min_bytes: int = MIN_OFFLOAD_BYTES) -> None:
        self.min_bytes = min_bytes
        self.host_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
        self.live_bytes = 0
        """Bytes of the host copies alive now (freed with the backward nodes that saved them)."""
        self.peak_bytes = 0
        self._copies: dict[tuple[Any, ...], tuple[weakref.ref[Any], _Offloaded]] = {}
        """This forward's copies by what they copy: a tensor saved twice is copied once."""
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def __enter__(self) -> ActivationOffload:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(kind, error, traceback)
        self._hooks = None
        self._copies.clear()  # the graph holds the copies now; the next forward's tensors are new ones

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Offloaded:
        if tensor.layout != torch.strided or is_weight(tensor) or \
                tensor.numel() * tensor.element_size() < self.min_bytes:
            return tensor
        storage = tensor.untyped_storage()
        key = (storage._cdata, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype,
               tensor._version)
        known = self._copies.get(key)
        if known is not None and known[0]() is storage:  # the same tensor (its storage is alive: not a reuse)
            return known[1]
        with torch.no_grad(), self.host_context():
            host = torch.empty_like(tensor, device="cpu", pin_memory=tensor.is_cuda)
            host.copy_(tensor, non_blocking=tensor.is_cuda)  # on the compute stream: ordered
        offloaded = _Offloaded(host, tensor.device)
        self._copies[key] = (weakref.ref(storage), offloaded)
        self._count(host)
        return offloaded

    @staticmethod
    def _unpack(packed: torch.Tensor | _Offloaded) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device_copy = torch.empty_like(packed.host, device=packed.device)  # a new tensor on the card
        return device_copy.copy_(packed.host, non_blocking=packed.device.type == "cuda")

    def _count(self, host: torch.Tensor) -> None:
        nbytes = host.numel() * host.element_size()
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(host, self._release, nbytes)

    def _release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes
