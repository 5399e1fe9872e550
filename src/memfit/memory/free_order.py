"""Frees in a row put in one order, so that a group of blocks (or micro-steps) and its copy compare event for
event (:func:`memfit.memory.repeats.expand`)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, TypeVar, cast

Event = TypeVar("Event", bound=tuple[Any, ...])
"""An event of :mod:`memfit.memory.repeats`' record."""


def frees_in_order(events: list[Event], axis: int, owner: dict[Hashable, int | None],
                   place: dict[Hashable, tuple[Hashable, ...]], period: int, *, blocks: bool) -> list[Event]:
    """``events`` with each run of consecutive frees in one order: by owner, then by the freed storage's place.
    Frees in a row commute (each only lowers the live bytes, and the allocator's free blocks merge to the same
    set in any order), and some come in an order of no pattern (non-reentrant checkpointing drops a forward's
    unsaved tensors of every block at once). A run that frees the storages of more blocks than a block and its
    neighbours (the end of the forward dropping every block's KV cache) is placed by the owners of what it
    frees, so that each copy frees its own. Owners come in the order the blocks run: up the model, and down it
    in a backward (where a block's last frees can follow the next block's first, as FSDP's post-backward's do)."""
    out: list[Event] = []
    start, phases = 0, [None]  # the phases entered and not yet left
    while start < len(events):
        end = start
        while end < len(events) and events[end][0] in ("f", "g"):
            end += 1
        batch = events[start:end]
        if len(batch) > 1:
            freed = {owner.get(event[1]) for event in batch} - {None}
            if len(freed) > period + 1:
                batch = [_owned_by(event, axis, owner.get(event[1])) for event in batch]
            down = -1 if blocks and phases[-1] == "backward" else 1  # the blocks' own order
            out.extend(sorted(batch, key=lambda event: (
                event[axis] is None, down * cast(int, event[axis] or 0), repr(place.get(event[1], ())))))
        else:
            out.extend(batch)
        if end < len(events):
            out.append(events[end])
            if events[end][0] == "p":
                phases.append(events[end][3])
            elif events[end][0] == "q" and len(phases) > 1:
                phases.pop()
        start = end + 1
    return out


def _owned_by(event: Event, axis: int, owner: int | None) -> Event:
    moved = list(event)
    moved[axis] = owner
    return cast(Event, tuple(moved))
