"""Keep third-party notes out of memfit's output, at their source.

Importing transformers' model code imports its quantizer registry, which imports torchao when it is
installed; torchao then logs a warning for each optional CUDA kernel library it cannot load on this machine
(``Failed to load ..._C_mxfp8.so``) and makes torch log two pytree deprecation warnings. None of them concern
memfit's run. :func:`quiet_imports` performs those imports once with exactly those loggers raised to ERROR,
then restores them: later warnings of the same libraries still reach the user.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def raised_loggers(*names: str, level: int = logging.ERROR) -> Iterator[None]:
    """Only records at ``level`` or above from the loggers ``names`` (and their children) while inside."""
    loggers = [logging.getLogger(name) for name in names]
    saved = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, previous in zip(loggers, saved, strict=True):
            logger.setLevel(previous)


@functools.cache
def quiet_imports() -> None:
    """Import, once and quietly, the optional libraries that transformers loads when it builds a model."""
    with raised_loggers(*NOISY_LOGGERS):
        try:
            import transformers.modeling_utils  # noqa: F401  (imports its quantizers, and they torchao)
        except ImportError:  # pragma: no cover - an older transformers without the registry
            pass
