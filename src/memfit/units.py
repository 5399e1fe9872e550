"""Memory sizes as users write them: ``300MiB``, ``11GiB``, ``1.5GB``.

Parsed strictly: a number and a unit are both required, and the unit must be one of ``B``, ``KB``, ``MB``,
``GB``, ``TB`` (powers of 1000) or ``KiB``, ``MiB``, ``GiB``, ``TiB`` (powers of 1024), in any letter case.
``11G`` or a bare ``11`` are refused rather than guessed: GB and GiB differ by 7 %, which is the margin
between fitting and not.
"""

from __future__ import annotations

import math
import re

from memfit.errors import ConfigError

UNITS = {"b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
         "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+)\s*")


def parse_bytes(text: str, *, option: str) -> int:
    """``"300MiB"`` -> 314572800; raises :class:`ConfigError` naming ``option`` and the accepted units."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in UNITS:
        raise ConfigError(f"{option} {text!r} is not a memory size; write a number and a unit, e.g. 300MiB or "
                          "11GiB (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    value = float(match.group(1)) * UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise ConfigError(f"{option} {text!r} must be at least 1 byte")
    return int(value)


def fraction(text: str) -> float:
    """A margin such as ``5%`` or ``0.05`` (at most half the budget)."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ConfigError(f"{text!r} is not a fraction; give e.g. 5% or 0.05") from None
    if not 0.0 <= value < 0.5:
        raise ConfigError(f"{text!r} must be between 0 and 50%")
    return value
