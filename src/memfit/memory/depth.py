"""How shallow a copy of a model can stand for it: the blocks that repeat, checked on the model's structure.

A step is replayed at full depth from a copy of ``k`` blocks (:mod:`memfit.memory.repeats`) only where the
model's blocks really repeat: every block of the full-depth model must have the structure (module classes,
their settings, parameter shapes) of the block of the copy it is replayed from. The structure is read from
the model built on the ``meta`` device (no memory, about a second for an 8B model; kept per config). Blocks
checkpointed every N-th repeat with a period of N blocks, blocks that alternate in kind (Gemma-2's and
gpt-oss's sliding and full attention) with a period of two (the least common multiple of the two where both
hold); a different first block (DeepSeek's dense first
layers) moves the repeating part up. The copy is as shallow as the record allows: the first block, the group
copied and the group before it, one block after. Where a block's frees refer to its lower neighbour's storages
and the first block allocates differently in a way the record's places cannot line up (QLoRA's first block, which
allocates more before its ordinary work, can: :func:`memfit.memory.repeats.expand`), the group before must sit on
an ordinary block: the copy then keeps a *spacer*, one period more (:func:`memfit.memory.shortened.needs_spacer`
remembers which runs needed it). With the top K blocks trained and the rest frozen, each of the two runs is
cut and copied on its own (two groups), where every block is of one kind.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import torch
from torch import nn

from memfit.config import TrainConfig
from memfit.errors import ConfigError
from memfit.memory.repeats import Repeat
from memfit.models import ModelSpec, _layer_count, is_encoder_decoder, transformer_layers, with_depth

MAX_PERIOD = 8
MAX_KINDS = 2
"""Blocks of at most two kinds that alternate are copied (checked on Gemma-2 and gpt-oss); a longer pattern (three
sliding-window blocks to one global, as Cohere2's) is traced in full."""
MAX_OFFSET = 4
MAX_CACHED = 16
MIN_LAYERS = 5
"""The shallowest copy traced is 4 blocks deep (a first block, two groups, one after): a model must be deeper
for a copy to save anything."""
SETTINGS = (int, float, str, bool, type(None), tuple)


@dataclass(frozen=True, slots=True)
class DepthCut:
    """Trace ``layers`` blocks; ``repeats`` say which groups are copied to reach the model's depth (the highest
    first: each expansion renumbers only the blocks above its group); ``train_top_layers``: the copy's own
    number of trained top blocks (where the model's top blocks train and the rest are frozen)."""

    layers: int
    repeats: tuple[Repeat, ...]
    train_top_layers: int | None = None

    def renumbered(self, owner: int) -> int:
        """The full model's block of the copy's block ``owner`` (the first of its copies)."""
        for repeat in self.repeats:
            owner = repeat.renumbered(owner) or 0
        return owner


def depth_cut(spec: ModelSpec, config: TrainConfig, task: str, *, tail: int = 1,
              spacer: bool = False) -> DepthCut | str | None:
    """The shallow copy to trace for ``spec`` under ``config``, or why the model is traced at its full depth
    (``None``: it is too shallow for a copy to be shallower). ``tail``: the blocks kept above the copied group
    (two under FSDP, whose last block's and its neighbour's gathers are freed at the end of the forward);
    ``spacer``: one period between the first block and the groups (see the module docstring)."""
    if is_encoder_decoder(spec):
        return "an encoder-decoder's two stacks of blocks are traced in full"
    if spec.num_layers < MIN_LAYERS + tail - 1 + spacer:
        return None
    if _layer_count(spec.hf_config) is None:
        return "the model's blocks have no single depth to cut"
    full = _signatures(spec, task)
    if full is None or len(full) != spec.num_layers:
        return "the model's repeated blocks are not its layers"
    kinds = _period(full, 1)
    if kinds is None:
        return "the model's blocks do not repeat"
    if kinds[1] > MAX_KINDS:  # one block after the copied group then misses a kind the copy needs
        return f"the model's blocks repeat only every {kinds[1]} blocks"
    every = config.checkpoint_every if config.checkpointing == "every-n" else 1
    structure = _period(full, every)
    if structure is None:
        return "the model's blocks do not repeat"
    if config.train_top_layers:
        cut = _frozen_below(spec.num_layers, config.train_top_layers, offset=structure[0], period=structure[1],
                            tail=tail, spacer=spacer)
    else:
        cut = _uniform(spec.num_layers, offset=structure[0], period=structure[1], tail=tail, spacer=spacer)
    if not isinstance(cut, DepthCut):
        return cut
    short = _signatures(with_depth(spec, cut.layers), task)
    if short is None or [full[cut.renumbered(i + 1) - 1] for i in range(cut.layers)] != short:
        return f"a copy of {cut.layers} blocks does not have the model's blocks"
    return cut


def _uniform(num_layers: int, *, offset: int, period: int, tail: int = 1, spacer: bool = False) -> DepthCut | None:
    first = offset + 2 + (period if spacer else 0)  # a first block may differ (its input), then the groups
    last = first + 2 * period - 1
    layers = last + tail + (num_layers - last - tail) % period
    copies = (num_layers - layers) // period
    if copies < 1:
        return None
    return DepthCut(layers=layers, repeats=(Repeat(first=first, period=period, copies=copies),))


REGION = 5
"""Blocks a copy keeps of a run of frozen or of trained blocks: its first, one before the groups, the two groups
(the second is copied), one after."""


def _frozen_below(num_layers: int, trained: int, *, offset: int, period: int, tail: int = 1,
                  spacer: bool = False) -> DepthCut | str | None:
    """``--train-top-layers``: the frozen blocks and the trained ones above them, each run cut to
    :data:`REGION` blocks (the top run ``tail - 1`` more) and its fourth copied to the run's length."""
    if offset or period > 1:  # checkpointed every n-th, or blocks of two kinds
        return "with --train-top-layers, only blocks that all repeat and are not checkpointed every n-th are cut"
    frozen = num_layers - trained
    if frozen < 1:  # every block trains: the model's own depth cut, every block of the copy trained too
        cut = _uniform(num_layers, offset=0, period=1, tail=tail, spacer=spacer)
        return dataclasses.replace(cut, train_top_layers=cut.layers) if cut is not None else None
    top = REGION + tail - 1
    kept_frozen, kept_trained = min(frozen, REGION), min(trained, top)
    repeats = [Repeat(first=kept_frozen + 3, period=1, copies=trained - top)] if trained > top else []
    repeats += [Repeat(first=3, period=1, copies=frozen - REGION)] if frozen > REGION else []
    if not repeats:
        return None
    return DepthCut(layers=kept_frozen + kept_trained, repeats=tuple(repeats), train_top_layers=kept_trained)


def _period(signatures: list[tuple[object, ...]], every: int) -> tuple[int, int] | None:
    """(offset, period): the smallest period (a multiple of ``every``) from which on the blocks repeat."""
    for period in range(1, MAX_PERIOD + 1):
        step = math.lcm(period, every)
        for offset in range(MAX_OFFSET + 1):
            if all(signatures[i] == signatures[i + step] for i in range(offset, len(signatures) - step)):
                return offset, step
    return None


@dataclass(frozen=True, slots=True)
class _Structure:
    signatures: list[tuple[object, ...]] | None
    """Each block's :func:`_signature`; ``None`` without a list of blocks."""
    parameters: int


_STRUCTURES: dict[tuple[str, str], _Structure] = {}
"""Model structures per (config, task): a plan asks for the same model's many times."""


def _structure(spec: ModelSpec, task: str) -> _Structure:
    """The model built on the ``meta`` device (no memory, about a second for an 8B model), read once."""
    key = (json.dumps(spec.hf_config.to_dict(), sort_keys=True, default=str), task)
    if key not in _STRUCTURES:
        from memfit.build import build_base
        from memfit.memory.build_values import no_init_weights

        with torch.device("meta"), no_init_weights():
            model = build_base(spec, seed=0, label_names=["0", "1"], pad_token_id=0, task=task, weights=False)
        try:
            blocks: list[nn.Module] | None = list(transformer_layers(model))
        except ConfigError:  # no list of repeated blocks at all
            blocks = None
        if len(_STRUCTURES) > MAX_CACHED:
            _STRUCTURES.clear()
        _STRUCTURES[key] = _Structure(signatures=None if blocks is None else [_signature(b) for b in blocks],
                                      parameters=sum(p.numel() for p in model.parameters()))
    return _STRUCTURES[key]


def _signatures(spec: ModelSpec, task: str) -> list[tuple[object, ...]] | None:
    return _structure(spec, task).signatures


def parameter_count(spec: ModelSpec, task: str) -> int:
    """The parameters of ``spec``'s model for ``task`` (its head included), counted on the ``meta`` device."""
    return _structure(spec, task).parameters


def _signature(block: nn.Module) -> tuple[object, ...]:
    """A block's structure: its modules' classes and plain settings (not their index), its parameters' and
    buffers' shapes."""
    modules = tuple((name, type(module).__name__, tuple(sorted(
        (key, value) for key, value in vars(module).items()
        if isinstance(value, SETTINGS) and not key.startswith("_") and "idx" not in key and "index" not in key
        and key not in ("layer_id", "layer_number"))))
        for name, module in block.named_modules())
    parameters = tuple((name, tuple(p.shape), p.dtype) for name, p in block.named_parameters())
    buffers = tuple((name, tuple(b.shape), b.dtype) for name, b in block.named_buffers())
    return modules, parameters, buffers
