"""Reading option files: a run's ``--config`` and a ``--device`` profile share one TOML/YAML/JSON reader.

It sits below both :mod:`memfit.config` and :mod:`memfit.devices`, so neither needs the other to read a file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from memfit.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def load_option_file(path: str, *, flag: str = "--config", section: str | None = "train") -> dict[str, Any]:
    """Read a TOML, YAML or JSON file into a mapping of option names to values.

    ``flag`` names the option the file was given to, so every message points at it; ``section``: a table of
    that name, when the file has one, holds the options (``[train]`` in a run's config).
    """
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{flag} {path}: no such file; check the path")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{flag} {path}: cannot read it ({error}); pass a readable UTF-8 text file") from None
    try:
        if file.suffix == ".toml":
            loaded: Any = tomllib.loads(text)
        elif file.suffix in (".yaml", ".yml"):
            import yaml

            loaded = yaml.safe_load(text) or {}
        elif file.suffix == ".json":
            loaded = json.loads(text)
        else:
            raise ConfigError(f"{flag} {path}: use a .toml, .yaml/.yml or .json file")
    except ConfigError:
        raise
    except Exception as error:  # each parser has its own error type; all mean the same to the user
        raise ConfigError(f"{flag} {path}: cannot parse: {str(error).splitlines()[0]}; fix the syntax "
                          "there") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{flag} {path}: expected a table of option = value")
    return dict(loaded.get(section, loaded)) if section is not None else loaded
