"""Loading a config by path or name, command-line overrides (typed like YAML, ``~`` removals,
suggestions for misspelt keys, interpolations), and a recipe's command line.
"""

from __future__ import annotations

import pytest
from omegaconf import DictConfig

from grpo.config import (
    ConfigError,
    InferenceConfig,
    compose_config,
    instantiate,
    list_configs,
    repo_root,
)
from grpo.recipe import parse, run_recipe_cli
from grpo.testing import make_fake_model_dir
from tests.unit.config.helpers import COMPONENTS, valid_config, write_config


def test_load_by_path_fills_schema_defaults(config_path):
    cfg = compose_config(config_path)
    assert isinstance(cfg, DictConfig)
    assert cfg.inference.group_size == 4  # from the file
    assert cfg.inference.top_p == InferenceConfig().top_p  # absent from the file: its default
    assert cfg.training.lr_scheduler is None  # optional component, default null
    # A component node in the file is never merged with the schema's default node.
    assert cfg.training.loss._component_ == f"{COMPONENTS}.Loss"
    assert set(cfg.training.loss) == {"_component_", "kl_estimator"}


def test_load_by_name_from_configs_dir(tmp_path, fake_model_dir, monkeypatch):
    monkeypatch.setenv("GRPO_CONFIGS_DIR", str(tmp_path))
    write_config(tmp_path / "my_run.yaml", valid_config(fake_model_dir, tmp_path / "out"))
    assert list_configs() == ["my_run"]
    assert compose_config("my_run").orchestration.num_steps == 3


def test_unknown_config_name_lists_available_names():
    with pytest.raises(ConfigError) as info:
        compose_config("tiny_arithmetic")
    message = str(info.value)
    assert "did you mean 'tiny_arithmetic_cpu'" in message.lower()
    for name in list_configs():
        assert name in message


def test_missing_config_path_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        compose_config(tmp_path / "nope.yaml")


def test_config_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        compose_config(path)


def test_overrides_are_typed_like_yaml(config_path):
    cfg = compose_config(
        config_path,
        [
            "inference.group_size=16",
            "training.optimizer.lr=1e-5",
            "debug_logging_enabled=true",
            "eval_every_n_steps=null",
            "training.optimizer.betas=[0.8, 0.95]",
            "inference.temperature=0.7",
            "output_dir=${base_model_path}/out",
            "seed=None",
        ],
    )
    assert cfg.inference.group_size == 16 and isinstance(cfg.inference.group_size, int)
    assert cfg.training.optimizer.lr == pytest.approx(1e-5)
    assert isinstance(cfg.training.optimizer.lr, float)
    assert cfg.debug_logging_enabled is True
    assert cfg.eval_every_n_steps is None
    assert list(cfg.training.optimizer.betas) == [0.8, 0.95]
    assert cfg.inference.temperature == pytest.approx(0.7)
    assert cfg.output_dir == f"{cfg.base_model_path}/out"
    assert cfg.seed is None


def test_overrides_may_add_keys_inside_open_nodes(config_path):
    cfg = compose_config(
        config_path,
        [
            "training.optimizer.fused=false",  # a component keyword
            "inference.engine_args.max_num_seqs=32",  # passed through to vLLM
            "inference.max_prompt_tokens=48",  # a schema key
            "reward_functions.1.weight=2.0",
            "reward_functions[0].name=correct",
        ],
    )
    assert cfg.training.optimizer.fused is False
    assert cfg.inference.engine_args.max_num_seqs == 32
    assert cfg.inference.max_prompt_tokens == 48
    assert cfg.reward_functions[1].weight == 2.0
    assert cfg.reward_functions[0].name == "correct"


def test_component_shorthand_replaces_the_component(config_path):
    cfg = compose_config(config_path, [f"dataset={COMPONENTS}.build_model"])
    assert cfg.dataset._component_ == f"{COMPONENTS}.build_model"
    assert cfg.dataset.seed == cfg.seed  # the other keys stay


def test_new_component_node_from_overrides(tmp_path, fake_model_dir):
    config = valid_config(fake_model_dir, tmp_path / "out")
    config["eval_dataset"] = None
    cfg = compose_config(
        write_config(tmp_path / "c.yaml", config),
        [f"eval_dataset._component_={COMPONENTS}.make_dataset", "eval_dataset.num_examples=2"],
    )
    assert instantiate(cfg.eval_dataset)["num_examples"] == 2


def test_unknown_override_key_suggests_the_right_one(config_path):
    with pytest.raises(ConfigError) as info:
        compose_config(config_path, ["inference.grup_size=4", "group_size=4", "bogus.key=1"])
    problems = info.value.problems
    assert len(problems) == 3  # every bad override, at once
    assert "inference.grup_size" in problems[0]
    assert "did you mean inference.group_size?" in problems[0]
    assert "did you mean inference.group_size?" in problems[1]
    assert "bogus" in problems[2]


def test_a_key_of_a_component_node_is_suggested_before_a_look_alike():
    # `lr` is a documented keyword of training.optimizer; `lora` only looks like it.
    with pytest.raises(ConfigError) as info:
        compose_config("tiny_arithmetic_cpu", ["training.lr=1e-5", "lr=1e-5", "training.lorra=1"])
    assert info.value.problems == [
        "training.lr=1e-5: unknown key training.lr; did you mean training.optimizer.lr?",
        "lr=1e-5: unknown key lr; did you mean training.optimizer.lr?",
        "training.lorra=1: unknown key training.lorra; did you mean training.lora?",
    ]


def test_malformed_overrides(config_path):
    with pytest.raises(ConfigError, match="key=value"):
        compose_config(config_path, ["inference.group_size"])
    with pytest.raises(ConfigError, match="is a value"):
        compose_config(config_path, ["seed.value=3"])
    with pytest.raises(ConfigError, match="index"):
        compose_config(config_path, ["reward_functions.5.weight=1"])


def test_tilde_removes_keys(config_path):
    cfg = compose_config(
        config_path,
        ["~training.optimizer.weight_decay", "~eval_dataset", "~inference.group_size"],
    )
    assert "weight_decay" not in cfg.training.optimizer
    # Keys the schema knows fall back to their default.
    assert cfg.eval_dataset is None
    assert cfg.inference.group_size == InferenceConfig().group_size


def test_tilde_on_a_missing_key_is_an_error(config_path):
    with pytest.raises(ConfigError, match="did you mean training.optimizer.weight_decay"):
        compose_config(config_path, ["~training.optimizer.weight_decy"])


def test_interpolation_follows_overrides(config_path, tmp_path):
    other = make_fake_model_dir(tmp_path / "other_model")
    cfg = compose_config(config_path, [f"base_model_path={other}"])
    assert cfg.base_model_path == str(other)
    assert cfg.metric_logger.log_dir == cfg.output_dir
    assert cfg.dataset.seed == cfg.seed


def test_relative_model_path_resolves_against_cwd_then_repo(tmp_path, config_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_fake_model_dir(tmp_path / "local_model")
    cfg = compose_config(config_path, ["base_model_path=local_model", "output_dir=runs/a"])
    assert cfg.base_model_path == str(tmp_path / "local_model")
    assert cfg.output_dir == str(tmp_path / "runs/a")
    # Not in the current directory, but in the repo: the repo's folder.
    cfg = compose_config(config_path, ["base_model_path=configs"])
    assert cfg.base_model_path == str(repo_root() / "configs")
    # Nowhere: kept relative to the current directory, so the error names that path.
    cfg = compose_config(config_path, ["base_model_path=no_such_model"])
    assert cfg.base_model_path == str(tmp_path / "no_such_model")


def test_run_recipe_cli_and_parse_decorator(config_path, capsys):
    received = []

    def recipe_main(cfg):
        received.append(cfg)

    def exit_status(argv):
        with pytest.raises(SystemExit) as info:
            run_recipe_cli(recipe_main, argv)
        return info.value.code

    assert exit_status(["--config", str(config_path), "inference.group_size=8"]) == 0
    assert received[0].inference.group_size == 8
    # Overrides may come before --config too; the last one wins.
    assert exit_status(["seed=3", "--config", str(config_path), "seed=4"]) == 0
    assert received[1].seed == 4

    assert exit_status(["--config", str(config_path), "inference.grup_size=8"]) == 2
    assert len(received) == 2  # config errors never reach the recipe
    err = capsys.readouterr().err
    assert "did you mean inference.group_size?" in err and "Traceback" not in err

    wrapped = parse(recipe_main)
    wrapped(received[0])  # called with a config (as `grpo run` does): runs the recipe
    assert received[-1] is received[0]
