"""The transformers floor: an older install is named in one line, with the upgrade, before any work."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import memfit
from memfit import dependencies
from memfit.errors import ConfigError
from tests.helpers import run_main

FLOOR = ".".join(map(str, dependencies.TRANSFORMERS_FLOOR))


def test_an_older_transformers_stops_the_command_line_with_the_upgrade(monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(dependencies, "installed_version", lambda package: "4.57.1")
    assert run_main(["devices"], capsys) == (
        2, "", f"memfit: error: memfit needs transformers>={FLOOR} (found 4.57.1): pip install -U "
               f"'transformers>={FLOOR}'\n")


@pytest.mark.parametrize(("found", "accepted"), [("5.13.1", False), ("5.0.0", False), (None, False),
                                                 ("5.14.0", True), ("5.14.0.dev0", True), ("5.25.0", True),
                                                 ("6.0", True)])
def test_the_library_checks_before_loading_its_parts(monkeypatch: pytest.MonkeyPatch, found: str | None,
                                                     accepted: bool) -> None:
    monkeypatch.setattr(dependencies, "installed_version", lambda package: found)
    if accepted:
        assert memfit.estimate is not None
    else:
        with pytest.raises(ConfigError, match=rf"^memfit needs transformers>={re.escape(FLOOR)} \(found "
                                              rf"{found or 'none'}\): pip install -U"):
            memfit.estimate  # noqa: B018  (the lazy attribute loads torch and transformers)


def test_pyproject_states_the_same_floor() -> None:
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert re.findall(r'"transformers>=([0-9.]+)"', pyproject) == [FLOOR]
