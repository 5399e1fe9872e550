"""Run ``memfit`` in a process that interrupts itself at an exact point (used by test_resume.py).

``INTERRUPT=kill:7`` sends SIGKILL to itself at the 7th training forward, ``term:5`` and ``int:6`` send
SIGTERM/SIGINT there, ``save:2`` sends SIGKILL in the middle of the 2nd checkpoint save (its files written,
its completion marker not yet). ``PROBE=FILE`` appends every window's sample indices to FILE, one JSON list per
line, as the engine cuts it into micro-batches. Under torchrun, ``INTERRUPT_RANK=1`` interrupts that rank only.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import memfit.checkpoints
import memfit.step
import memfit.windows
from memfit.cli import main

SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "int": signal.SIGINT}


def install() -> None:
    mode, _, count = os.environ.get("INTERRUPT", "").partition(":")
    if os.environ.get("INTERRUPT_RANK", os.environ.get("RANK", "0")) != os.environ.get("RANK", "0"):
        mode = ""  # another rank is the one interrupted
    calls = {"n": 0}
    if mode in SIGNALS:
        real_loss_sum = memfit.step.loss_sum

        def loss_sum(model: Any, batch: Any) -> Any:
            if model.training:
                calls["n"] += 1
                if calls["n"] == int(count):
                    os.kill(os.getpid(), SIGNALS[mode])
            return real_loss_sum(model, batch)

        memfit.step.loss_sum = loss_sum
    elif mode == "save":
        real_fsync = memfit.checkpoints._fsync

        def fsync(path: Any) -> None:
            real_fsync(path)
            if path.name == memfit.checkpoints.PROGRESS:
                calls["n"] += 1
                if calls["n"] == int(count):
                    os.kill(os.getpid(), signal.SIGKILL)

        memfit.checkpoints._fsync = fsync
    probe = os.environ.get("PROBE")
    if probe:
        real_cut = memfit.windows.cut

        def cut(indices: Any, size: int) -> Any:
            if isinstance(indices, list):  # a training window (evaluation cuts a range)
                with open(probe, "a") as file:
                    file.write(json.dumps(indices) + "\n")
            return real_cut(indices, size)

        memfit.windows.cut = cut


if __name__ == "__main__":
    install()
    sys.exit(main(sys.argv[1:]))
