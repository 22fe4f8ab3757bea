"""The configs under ``configs/``: listed, loaded, and valid against the real components."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo.config import (
    compose_config,
    configs_dir,
    list_configs,
    repo_root,
)
from grpo.preflight import validate_run_config
from grpo.testing import make_fake_model_dir


def test_shipped_configs_are_listed_and_load():
    names = list_configs()
    assert configs_dir() == repo_root() / "configs"
    assert {"tiny_arithmetic_cpu", "qwen2_5_0_5b_gsm8k"} <= set(names)
    for name in names:
        cfg = compose_config(name)
        assert Path(cfg.base_model_path).is_absolute()
        assert "tokenizer" not in cfg and "model" not in cfg


@pytest.mark.parametrize("name", list_configs())
def test_shipped_configs_validate_against_the_real_components(name, tmp_path):
    # The real components (grpo.objective.loss, grpo.models, ...) are imported: this catches a config
    # keyword the code does not take. The model folder and cluster size stand in for the real
    # ones, which this machine does not have.
    model_dir = make_fake_model_dir(tmp_path / "model", max_position_embeddings=32768)
    (model_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    overrides = [f"base_model_path={model_dir}", f"output_dir={tmp_path / 'run'}"]
    if compose_config(name).ref.teacher_model_path is not None:
        # A distillation teacher must have the policy's tokenizer: the stand-in's own.
        overrides.append(f"ref.teacher_model_path={model_dir}")
    cfg = compose_config(name, [*overrides, "ray.num_cpus=64", "ray.num_gpus=8"])
    validate_run_config(cfg)
    # grpo validate reads the same components from their source, importing none of them.
    validate_run_config(cfg, import_components=False)


def test_tiny_config_points_at_the_shipped_model():
    cfg = compose_config("tiny_arithmetic_cpu")
    assert cfg.base_model_path.endswith("assets/tiny_arithmetic_qwen2")
    assert cfg.inference.group_size >= 2
    assert cfg.training.num_gpus == 0 and cfg.inference.num_gpus == 0
