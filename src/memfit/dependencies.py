"""The oldest transformers memfit runs with, checked before any work (without importing transformers).

memfit builds its presets with ``rope_parameters`` and loads with ``dtype=`` (transformers 5), and its
estimator reads transformers' mask decisions through ``masking_utils._ignore_causal_mask_sdpa`` with the
query offset it takes from 5.14 on (earlier 5.x releases fail inside every decoder trace). An older install
would fail late, deep in a trace or with silently different presets; this check names the fix up front.
``pyproject.toml`` states the same floor. (The ``activation_checkpointing`` names of 5.23 are used where they
exist, the older ``gradient_checkpointing`` ones before.)
"""

from __future__ import annotations

import importlib.metadata
import re

from memfit.errors import ConfigError

TRANSFORMERS_FLOOR = (5, 14)


def installed_version(package: str) -> str | None:
    """The installed version of ``package`` (``None`` when it is not installed), read from its metadata."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``"5.14.0.dev0"`` -> ``(5, 14, 0)``."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group().split(".")) if match else ()


def check_transformers() -> None:
    """Raise a :class:`ConfigError` naming the upgrade when transformers is missing or older than the floor."""
    floor = ".".join(map(str, TRANSFORMERS_FLOOR))
    found = installed_version("transformers")
    if found is None or release(found) < TRANSFORMERS_FLOOR:
        raise ConfigError(f"memfit needs transformers>={floor} (found {found or 'none'}): "
                          f"pip install -U 'transformers>={floor}'")
