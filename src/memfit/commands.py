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
RENDEZVOUS = "${MASTER_ADDR}:29500"
"""Where the machines of a launch over several meet: the first machine's address (``MASTER_ADDR``, set on
each before running the command) and torchrun's default port."""


def train_words(config: TrainConfig, per_node: int | None = None) -> list[str]:
    """``memfit train`` and the options that make ``config`` (``torchrun ... -m memfit train`` for several
    ranks; ``per_node``: the ranks of one machine, where they fill several)."""
    return [*launcher(config.world_size, per_node), "train", *_train_options(config)]


def _train_options(config: TrainConfig) -> list[str]:
    """The ``memfit train`` options that make ``config`` (each one that differs from its default)."""
    parser = commands(build_parser())["train"]
    defaults = TrainConfig().to_dict()
    words: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest not in defaults or action.dest in LAUNCHED:
            continue
        value = getattr(config, action.dest)
        if value != defaults[action.dest]:
            words += _option(action, value)
    return words


def launcher(ranks: int, per_node: int | None = None) -> list[str]:
    """What runs memfit on ``ranks`` processes: ``memfit``, ``torchrun --nproc-per-node=N -m memfit`` on one
    machine, or, where ``per_node`` of them fill several, torchrun with a c10d rendezvous at
    :data:`RENDEZVOUS`, run the same on every machine."""
    if ranks <= 1:
        return ["memfit"]
    if per_node is None or per_node >= ranks:
        return ["torchrun", f"--nproc-per-node={ranks}", "-m", "memfit"]
    return ["torchrun", f"--nnodes={ranks // per_node}", f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={RENDEZVOUS}", "--rdzv-id=memfit", "-m", "memfit"]


def launch_line(ranks: int, per_node: int | None = None) -> str:
    """:func:`launcher` as the start of a shell line (the rendezvous address left for the shell to expand)."""
    return " ".join(f'"{word}"' if "$" in word else shlex.quote(word) for word in launcher(ranks, per_node))


def train_command(config: TrainConfig, per_node: int | None = None) -> str:
    """:func:`train_words` as one shell line."""
    options = (shlex.quote(word) for word in _train_options(config))
    return " ".join([launch_line(config.world_size, per_node), "train", *options])


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
