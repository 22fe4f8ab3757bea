"""The typed sections of the run config: options checked when built in code, the typed config a
load returns, defaults declared once, and keys in the wrong section.
"""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from grpo.config import (
    ConfigError,
    InferenceConfig,
    RunConfig,
    compose_config,
    load_config,
    locate,
    validate_config,
)
from grpo.config.sections import DEFAULT_LOSS
from grpo.testing import make_fake_model_dir
from tests.unit.config.helpers import COMPONENTS, problems_of, write_config


def test_typed_section_checks_every_option_when_built_in_code():
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        InferenceConfig(group_size=1, top_p=1.5, max_generated_tokens="many")
    assert {error["loc"][0] for error in info.value.errors()} == {
        "group_size",
        "top_p",
        "max_generated_tokens",
    }
    with pytest.raises(ValidationError, match="grup_size"):
        InferenceConfig(grup_size=4)


def test_load_config_returns_the_typed_run_config(config_path):
    run = load_config(config_path, ["inference.temperature=0.5"])
    assert isinstance(run, RunConfig) and isinstance(run.inference, InferenceConfig)
    assert run.inference.temperature == 0.5 and run.inference.group_size == 4
    assert run.training.loss == {"_component_": f"{COMPONENTS}.Loss", "kl_estimator": "k2"}
    assert run.orchestration.num_steps == 3
    assert run.metric_logger["log_dir"] == run.output_dir  # interpolation resolved
    assert run.reward_timeout_s == RunConfig.model_fields["reward_timeout_s"].default
    with pytest.raises(Exception, match="frozen"):
        run.inference.temperature = 2.0  # a loaded config is read, never changed


def test_every_environment_takes_the_run_s_reward_timeout_default_and_bound(config_path):
    """``reward_timeout_s`` is declared once (`grpo.config.sections.RewardTimeout`): the run
    config and every environment that scores with reward functions share its default and
    refuse the same values."""
    import inspect

    from grpo.config.options import option_problems
    from grpo.envs import (
        AgentEnv,
        MultiTurnEnv,
        ReasoningGymEnv,
        SingleTurnEnv,
        TextArenaEnv,
        ToolEnv,
    )

    default = RunConfig.model_fields["reward_timeout_s"].default
    for env in (MultiTurnEnv, SingleTurnEnv, ToolEnv, AgentEnv, ReasoningGymEnv, TextArenaEnv):
        parameter = inspect.signature(env).parameters["reward_timeout_s"]
        assert parameter.default == default, env.__name__
        (refused,) = option_problems(env, {"reward_timeout_s": 0})
        assert refused.startswith("reward_timeout_s: ") and "> 0" in refused, env.__name__
    (refused,) = problems_of(compose_config(config_path, ["reward_timeout_s=0"]))
    assert refused.startswith("reward_timeout_s: ") and "> 0" in refused


def test_loading_a_config_imports_no_torch(config_path):
    import subprocess

    code = (
        "import sys; from grpo.config import load_config; "
        f"load_config({str(config_path)!r}); "
        # The default loss's kl_coeff default is the config's own: the loss is not imported.
        "assert not load_config('tiny_arithmetic_cpu', ['~training.loss.kl_coeff'])"
        ".uses_reference_model(); "
        "print(sorted(m for m in ('torch', 'ray', 'vllm', 'grpo.objective') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_default_loss_takes_the_defaults_the_config_declares():
    """The config reads the default loss's defaults without importing it (`LossArgs`): they
    must be the loss's own."""
    import inspect

    from grpo.config.sections import DEFAULT_LOSS, LossArgs

    parameters = inspect.signature(locate(DEFAULT_LOSS)).parameters
    for name, info in LossArgs.model_fields.items():
        assert parameters[name].default == info.default, name


def test_a_loss_of_your_own_says_whether_it_uses_the_reference_model(config_path):
    def uses(*overrides):
        return load_config(config_path, list(overrides)).uses_reference_model()

    assert not uses()  # the stand-in Loss: kl_coeff=0.0 in its signature
    assert uses("training.loss.kl_coeff=0.1")
    assert uses("training.loss={_component_: builtins.dict}")  # no kl_coeff keyword at all
    assert not uses(f"training.loss={{_component_: {DEFAULT_LOSS}}}")
    assert uses(f"training.loss={{_component_: {DEFAULT_LOSS}, kl_coeff: 0.01}}")


def test_a_key_in_the_wrong_section_names_where_it_is_declared(config_path, tmp_path):
    config = yaml.safe_load(config_path.read_text())
    config["training"]["save_every_n_steps"] = 5
    config["training"]["filter_zero_variance_groups"] = True
    problems = problems_of(compose_config(write_config(tmp_path / "old.yaml", config)))
    assert sorted(problems) == [
        "training.filter_zero_variance_groups: unknown key; did you mean "
        "ref.filter_zero_variance_groups?",
        "training.save_every_n_steps: unknown key; did you mean checkpoint.save_every_n_steps?",
    ]
    # On the command line too, before anything is validated.
    with pytest.raises(ConfigError, match="did you mean checkpoint.save_every_n_steps"):
        compose_config(config_path, ["training.save_every_n_steps=2"])


def test_flow_mapping_overrides_parse_with_interpolations(config_path):
    cfg = compose_config(
        config_path,
        [f"dataset.template={{_component_: {COMPONENTS}.Template, chat: ${{seed}}}}"],
    )
    run = validate_config(cfg)
    assert run.dataset["template"] == {"_component_": f"{COMPONENTS}.Template", "chat": 0}
    with pytest.raises(ConfigError) as info:
        compose_config(config_path, ["dataset.template={_component_: a, b: [1}"])
    (problem,) = info.value.problems
    assert "\n" not in problem and "dataset.template._component_=" in problem


def test_dtype_option_accepts_exactly_the_dtypes_the_actors_know():
    from grpo.choices import DTYPE_CHOICES, MODEL_TYPES
    from grpo.models import DTYPES, SUPPORTED_MODEL_TYPES

    # The config cannot import torch, so it spells the names out: keep them equal.
    assert sorted(DTYPE_CHOICES) == sorted(DTYPES)
    assert MODEL_TYPES == SUPPORTED_MODEL_TYPES


def test_unsupported_model_type_is_named_before_anything_starts(config_path, tmp_path):
    from grpo.models import SUPPORTED_MODEL_TYPES

    folder = make_fake_model_dir(tmp_path / "mistral")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    problems = problems_of(compose_config(config_path, [f"base_model_path={folder}"]))
    assert len(problems) == 1, problems
    assert problems[0].startswith("base_model_path:")
    assert "'mistral'" in problems[0] and str(folder / "config.json") in problems[0]
    assert all(name in problems[0] for name in SUPPORTED_MODEL_TYPES)
