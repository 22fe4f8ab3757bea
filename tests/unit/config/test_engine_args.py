"""Keys the config schema cannot check by itself: those passed through to a library.

Every other key of a shipped config is an attribute of a typed section (a key nothing declares
is refused when the config loads, and the sections are read as attributes, so an option no code
reads is an attribute no code mentions), or a keyword of a ``_component_`` node, which
`validate_config` checks against the component's signature
(``tests/unit/config/test_shipped_configs.py::test_shipped_configs_validate_against_the_real_components``).
``inference.engine_args`` is a free-form mapping handed to ``vllm.LLM``: its keys must be
``vllm.EngineArgs`` fields.
"""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from grpo.config import locate, repo_root

CONFIGS = sorted((repo_root() / "configs").glob("*.yaml"))


def test_every_shipped_config_is_walked():
    assert len(CONFIGS) >= 4
    assert {"tiny_arithmetic_cpu.yaml", "qwen2_5_0_5b_gsm8k.yaml"} <= {p.name for p in CONFIGS}


@pytest.mark.parametrize("config_path", CONFIGS, ids=lambda path: path.stem)
def test_engine_args_are_vllm_engine_arguments(config_path):
    engine_args = OmegaConf.load(config_path).inference.engine_args
    accepted = {
        field.name for field in dataclasses.fields(locate("vllm.engine.arg_utils.EngineArgs"))
    }
    unknown = sorted(set(engine_args) - accepted)
    assert not unknown, (
        f"{config_path.name}: inference.engine_args keys vLLM does not take: {unknown}"
    )
