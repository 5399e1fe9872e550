"""The command that runs a setup: ``memfit train`` with each option that differs from its default, launched by
``torchrun`` for several GPUs. Made from the command line's own parser, so each option is one ``memfit train``
reads (the tests parse the command back into the same config).
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from memfit.config import TrainConfig
from memfit.docs_reference import commands
from memfit.options import NO_CLIP, build_parser

LAUNCHED = ("world_size",)
"""Options torchrun's launch sets (the number of processes), not given to ``memfit train``."""


def train_words(config: TrainConfig) -> list[str]:
    """``memfit train`` and the options that make ``config`` (``torchrun ... -m memfit train`` for several
    ranks)."""
    parser = commands(build_parser())["train"]
    defaults = TrainConfig().to_dict()
    words: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest not in defaults or action.dest in LAUNCHED:
            continue
        value = getattr(config, action.dest)
        if value != defaults[action.dest]:
            words += _option(action, value)
    return [*launcher(config.world_size), "train", *words]


def launcher(ranks: int) -> list[str]:
    """What runs memfit on ``ranks`` processes: ``memfit``, or ``torchrun --nproc-per-node=N -m memfit``."""
    return ["torchrun", f"--nproc-per-node={ranks}", "-m", "memfit"] if ranks > 1 else ["memfit"]


def train_command(config: TrainConfig) -> str:
    """:func:`train_words` as one shell line."""
    return " ".join(shlex.quote(word) for word in train_words(config))


def _option(action: argparse.Action, value: Any) -> list[str]:
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag if value else f"--no-{flag.removeprefix('--')}"]
    if action.nargs == 0:  # store_true
        return [flag] if value else []
    if value is None:
        return [flag, NO_CLIP]
    if isinstance(value, list | tuple):
        return [flag, *(str(item) for item in value)]
    return [flag, str(value)]
