"""Fixtures of the config tests: the stand-in components importable, and a valid config file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.unit.config.helpers import COMPONENTS, COMPONENTS_SOURCE, valid_config, write_config


@pytest.fixture(scope="module", autouse=True)
def fake_components(tmp_path_factory):
    folder = tmp_path_factory.mktemp("components")
    (folder / f"{COMPONENTS}.py").write_text(COMPONENTS_SOURCE)
    sys.path.insert(0, str(folder))
    yield
    sys.path.remove(str(folder))
    sys.modules.pop(COMPONENTS, None)


@pytest.fixture
def config_path(tmp_path, fake_model_dir) -> Path:
    return write_config(tmp_path / "run.yaml", valid_config(fake_model_dir, tmp_path / "out"))
