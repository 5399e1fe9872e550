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
import warnings
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


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings and progress bars off while memfit works, restored on the way out.

    memfit reports in its own words; a user's own transformers code in the same process (a Trainer script
    with memfit's callback, a notebook) keeps the verbosity and progress bars it had. Nested uses restore in
    order. huggingface_hub's progress bars, which transformers switches together with its own, are restored too.
    """
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers_bars = transformers.utils.logging.is_progress_bar_enabled()
    hub_bars = hub_progress_bars(False)
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():  # it switches the Hub's bars too, which may warn under HF_HUB_* settings
        warnings.simplefilter("ignore")
        transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        if transformers_bars:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                transformers.utils.logging.enable_progress_bar()
        hub_progress_bars(hub_bars)


def hub_progress_bars(enabled: bool) -> bool:
    """Turn huggingface_hub's progress bars on or off (an ``HF_HUB_DISABLE_PROGRESS_BARS`` setting wins, without
    a warning); return whether they were on."""
    from huggingface_hub.utils.tqdm import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_enabled = not are_progress_bars_disabled()
    if enabled != was_enabled:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable_progress_bars() if enabled else disable_progress_bars()
    return was_enabled
