"""DDP's gradient buckets on fake tensors: what a DDP rank's step keeps beside its gradients.

DDP cannot be built on fake tensors, so the estimator's trace of a DDP rank stands its reducer in with these
buckets: the same flat buffers, filled and viewed as the reducer fills and views them. Trade-off of the
technique itself (``gradient_as_bucket_view``): the gradients are views of the buckets, so the buckets cost one
gradient-sized copy, not two.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from memfit.memory.tracker import StorageTracker
from memfit.step import PhaseTracker

DDP_FIRST_BUCKET_BYTES = 1024 * 1024
DDP_BUCKET_BYTES = 25 * 1024 * 1024


class DdpBuckets:
    """Stand-ins for DDP's gradient buckets (``gradient_as_bucket_view``), made before the first step and
    alive to the end: flat buffers filled in reverse parameter order, the first up to 1 MiB, the others up to
    25 MiB (DDP's defaults). Micro-steps under ``no_sync()`` accumulate into ordinary ``.grad`` tensors; in the
    synchronised backward each gradient is copied into its bucket and ``.grad`` becomes the bucket's view, as
    DDP's reducer does. (DDP itself cannot be built on fake tensors.) ``tracker``: told which parameters each
    bucket serves (a shortened trace copies a block's buckets with the block)."""

    def __init__(self, trained: list[tuple[str, torch.nn.Parameter]], phases: PhaseTracker,
                 tracker: StorageTracker | None = None) -> None:
        self.synchronising = True
        groups: list[list[torch.nn.Parameter]] = []
        cap, filled = DDP_FIRST_BUCKET_BYTES, 0
        for _, parameter in reversed(trained):
            if not groups or filled >= cap:
                cap = DDP_FIRST_BUCKET_BYTES if not groups else DDP_BUCKET_BYTES
                groups.append([])
                filled = 0
            groups[-1].append(parameter)
            filled += parameter.numel() * parameter.element_size()
        self.buckets = []
        for group in groups:
            with tracker.made_for(group) if tracker is not None else contextlib.nullcontext():
                self.buckets.append(self._bucket(group, phases))

    def _bucket(self, group: list[torch.nn.Parameter], phases: PhaseTracker) -> torch.Tensor:
        bucket = torch.empty(sum(p.numel() for p in group), dtype=group[0].dtype)
        phases.track(bucket, category="gradients")
        offset = 0
        for parameter in group:
            view = bucket.narrow(0, offset, parameter.numel()).view(parameter.shape)
            parameter.register_post_accumulate_grad_hook(functools.partial(self._into_bucket, view=view))
            offset += parameter.numel()
        return bucket

    @contextlib.contextmanager
    def sync(self, enabled: bool) -> Iterator[None]:
        self.synchronising = enabled
        yield

    def _into_bucket(self, parameter: torch.Tensor, *, view: torch.Tensor) -> None:
        grad = parameter.grad
        if self.synchronising and grad is not None and \
                grad.untyped_storage()._cdata != view.untyped_storage()._cdata:
            view.copy_(grad)
            parameter.grad = view
