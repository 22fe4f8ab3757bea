"""Config loading, overrides, validation, instantiation and the schema reference.

`grpo.config.validate_config` checks a config alone; what users see from ``grpo validate`` and
at a run's start is `grpo.preflight.validate_run_config`, which also checks what the config
names (model folder, datasets, run folder, resume target): most tests here check through it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import DictConfig, OmegaConf

from grpo.config import (
    REQUIRED,
    ConfigError,
    InferenceConfig,
    InstantiationError,
    RunConfig,
    Section,
    compose_config,
    config_reference_markdown,
    configs_dir,
    instantiate,
    list_configs,
    load_config,
    locate,
    repo_root,
    validate_config,
)
from grpo.config.schema import component_spec, default_of, section_type
from grpo.config.sections import DEFAULT_LOSS
from grpo.preflight import validate_run_config
from grpo.recipe import parse, run_recipe_cli
from grpo.testing import make_fake_model_dir

# Small stand-ins for the real components, so these tests import nothing heavy.
COMPONENTS_SOURCE = """
class Template:
    def __init__(self, chat=False):
        self.chat = chat


def make_dataset(num_examples=10, seed=0, template=None):
    return {"num_examples": num_examples, "seed": seed, "template": template}


class Reward:
    def __init__(self, weight=1.0, name=None):
        self.weight = weight


class Loss:
    def __init__(self, epsilon_low=0.2, epsilon_high=0.2, kl_coeff=0.0, kl_estimator="k3",
                 aggregation="token_mean"):
        self.epsilon_low = epsilon_low


class Logger:
    def __init__(self, log_dir=None, project="grpo", mode="offline"):
        self.log_dir = log_dir


def explode(value=0):
    raise RuntimeError("boom")
"""
COMPONENTS = "grpo_test_config_components"


@pytest.fixture(scope="module", autouse=True)
def fake_components(tmp_path_factory):
    folder = tmp_path_factory.mktemp("components")
    (folder / f"{COMPONENTS}.py").write_text(COMPONENTS_SOURCE)
    sys.path.insert(0, str(folder))
    yield
    sys.path.remove(str(folder))
    sys.modules.pop(COMPONENTS, None)


def valid_config(model_dir: Path, output_dir: Path) -> dict:
    """A small config that passes validation, built from the stand-in components."""
    return {
        "base_model_path": str(model_dir),
        "output_dir": str(output_dir),
        "target_tokens_per_batch": 256,
        "eval_every_n_steps": 2,
        "ray": {"num_cpus": 8, "num_gpus": 0},
        "orchestration": {"num_steps": 3, "replay_buffer_size": 64},
        "inference": {
            "batch_size": 2,
            "group_size": 4,
            "max_prompt_tokens": 32,
            "max_generated_tokens": 16,
            "engine_args": {"enforce_eager": True, "max_model_len": 128},
        },
        "training": {
            "batch_size": 8,
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3, "weight_decay": 0.0},
            "loss": {"_component_": f"{COMPONENTS}.Loss", "kl_estimator": "k2"},
        },
        "reward_functions": [
            {"_component_": f"{COMPONENTS}.Reward"},
            {"_component_": f"{COMPONENTS}.Reward", "weight": 0.5},
        ],
        "dataset": {
            "_component_": f"{COMPONENTS}.make_dataset",
            "seed": "${seed}",
            "template": {"_component_": f"{COMPONENTS}.Template", "chat": True},
        },
        "eval_dataset": {"_component_": f"{COMPONENTS}.make_dataset", "num_examples": 3},
        "metric_logger": {"_component_": f"{COMPONENTS}.Logger", "log_dir": "${output_dir}"},
    }


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def config_path(tmp_path, fake_model_dir) -> Path:
    return write_config(tmp_path / "run.yaml", valid_config(fake_model_dir, tmp_path / "out"))


def problems_of(cfg, **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_run_config(cfg, **kwargs)
    return info.value.problems


# ------------------------------------------------------------------------------ loading


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


def test_shipped_configs_are_listed_and_load():
    names = list_configs()
    assert configs_dir() == repo_root() / "configs"
    assert {"tiny_arithmetic_cpu", "qwen2_5_0_5b_gsm8k"} <= set(names)
    for name in names:
        cfg = compose_config(name)
        assert Path(cfg.base_model_path).is_absolute()
        assert "tokenizer" not in cfg and "model" not in cfg


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


# ------------------------------------------------------------------------------ validation


def test_valid_config_passes(config_path):
    validate_run_config(compose_config(config_path))


def test_every_problem_is_reported_at_once(config_path, tmp_path):
    cfg = compose_config(
        config_path,
        [
            "inference.group_size=1",
            "inference.temperature=0",
            "inference.top_p=1.5",
            "orchestration.max_policy_lag=-1",
            "orchestration.num_ref_workers=0",
            "training.loss.aggregation=token_sum",
            "seed=abc",
            f"base_model_path={tmp_path / 'missing_model'}",
        ],
    )
    cfg.inference.grup_size = 4  # a typo in the file
    problems = problems_of(cfg)
    expected_keys = [
        "inference.grup_size",
        "inference.group_size",
        "inference.temperature",
        "inference.top_p",
        "orchestration.max_policy_lag",
        "orchestration.num_ref_workers",
        "training.loss.aggregation",
        "seed",
        "base_model_path",
    ]
    assert len(problems) == len(expected_keys), problems
    for key in expected_keys:
        assert sum(problem.startswith(f"{key}:") for problem in problems) == 1, (key, problems)
    text = "\n".join(problems)
    assert "did you mean inference.group_size?" in text
    assert str(tmp_path / "missing_model") in text
    assert "did you mean 'token_mean'" in text


def test_relations_between_keys(config_path):
    cfg = compose_config(
        config_path,
        [
            "target_tokens_per_batch=40",  # < 32 prompt + 16 generated
            "orchestration.num_training_workers=3",  # 8 trajectories do not split in 3
            "orchestration.replay_buffer_size=4",  # < training.batch_size
            "inference.engine_args.max_model_len=32",
            "~eval_dataset",  # eval_every_n_steps is still set
            "inference.engine_args.model=/elsewhere",
        ],
    )
    problems = problems_of(cfg)
    text = "\n".join(problems)
    assert len(problems) == 6, problems
    assert "target_tokens_per_batch: 40" in text and "= 48" in text
    assert "training.batch_size: 8 is not divisible" in text
    assert "orchestration.replay_buffer_size: 4" in text
    assert "inference.engine_args.max_model_len: 32" in text
    assert "eval_every_n_steps" in text
    assert "inference.engine_args.model" in text


def test_training_batch_need_not_be_a_multiple_of_group_size(config_path):
    # Advantages are computed per group before the buffer, so a step may mix groups.
    validate_run_config(
        compose_config(config_path, ["training.batch_size=6", "inference.group_size=4"])
    )


def test_prompt_bound_falls_back_to_max_model_len_then_the_model(config_path, tmp_path):
    # As the collectors do: a null max_prompt_tokens lets prompts fill max_model_len.
    cfg = compose_config(config_path, ["inference.max_prompt_tokens=null"])
    validate_run_config(cfg)  # max_model_len (128) <= 256
    cfg = compose_config(
        config_path, ["inference.max_prompt_tokens=null", "target_tokens_per_batch=100"]
    )
    problems = problems_of(cfg)
    assert len(problems) == 1 and problems[0].startswith("target_tokens_per_batch: 100")
    assert "inference.engine_args.max_model_len (128)" in problems[0]
    cfg = compose_config(
        config_path,
        ["inference.max_prompt_tokens=null", "inference.engine_args.max_model_len=16"],
    )
    problems = problems_of(cfg)
    assert len(problems) == 1 and "leaves no room for a prompt" in problems[0]

    # Neither set: vLLM uses the model's context, max_position_embeddings of config.json.
    model_dir = make_fake_model_dir(tmp_path / "long", max_position_embeddings=4096)
    overrides = [
        f"base_model_path={model_dir}",
        "inference.max_prompt_tokens=null",
        "~inference.engine_args.max_model_len",
    ]
    problems = problems_of(compose_config(config_path, overrides))
    assert len(problems) == 1 and problems[0].startswith("target_tokens_per_batch: 256")
    assert "max_position_embeddings (4096)" in problems[0]
    validate_run_config(compose_config(config_path, [*overrides, "target_tokens_per_batch=4096"]))
    # Without the model folder nothing bounds the sequences: nothing to check.
    validate_config(compose_config(config_path, overrides))

    model_dir = make_fake_model_dir(tmp_path / "short", max_position_embeddings=64)
    problems = problems_of(
        compose_config(
            config_path, [f"base_model_path={model_dir}", "inference.max_prompt_tokens=null"]
        )
    )
    assert len(problems) == 1
    assert problems[0].startswith("inference.engine_args.max_model_len: inference.engine_args")
    assert "max_position_embeddings (64)" in problems[0]


def test_keys_nothing_declares_are_refused_as_unknown(config_path, tmp_path):
    config = yaml.safe_load(config_path.read_text())
    config["tokenizer"] = {"_component_": "grpo.models.load_tokenizer", "max_seq_len": 64}
    path = write_config(tmp_path / "old.yaml", config)
    (problem,) = problems_of(compose_config(path))
    assert problem.startswith("tokenizer: unknown key"), problem
    with pytest.raises(ConfigError, match="no key tokenizer in the config"):
        compose_config(config_path, ["tokenizer.max_seq_len=64"])


def test_model_folder_files_and_positions(tmp_path, config_path):
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "config.json").write_text("{}")
    problems = problems_of(compose_config(config_path, [f"base_model_path={incomplete}"]))
    assert len(problems) == 1
    assert str(incomplete) in problems[0]
    for name in ("tokenizer.json", "*.safetensors"):
        assert name in problems[0]

    short = make_fake_model_dir(tmp_path / "short", max_position_embeddings=40)
    problems = problems_of(compose_config(config_path, [f"base_model_path={short}"]))
    assert len(problems) == 1 and "max_position_embeddings (40)" in problems[0]


def test_the_config_alone_reads_no_file(config_path, tmp_path):
    overrides = [f"base_model_path={tmp_path / 'nowhere'}", "resume_from_checkpoint=true"]
    cfg = compose_config(config_path, overrides)
    validate_config(cfg)
    assert load_config(config_path, overrides).base_model_path == str(tmp_path / "nowhere")
    # What a run needs of the disk is checked above the config.
    assert [problem.split(":")[0] for problem in problems_of(cfg)] == [
        "base_model_path",
        "resume_from_checkpoint",
    ]


def test_component_paths_and_keywords_are_checked(config_path):
    cfg = compose_config(
        config_path,
        [
            f"dataset._component_={COMPONENTS}.make_datset",
            "training.loss.epsilon=0.1",
            "reward_functions.1.wieght=2",
            "metric_logger._component_=no_such_package.Logger",
            "eval_dataset._component_=torch.optim.NoSuchOptimizer",
        ],
    )
    problems = problems_of(cfg)
    text = "\n".join(problems)
    assert len(problems) == 5, problems
    assert f"dataset._component_: cannot import '{COMPONENTS}.make_datset'" in text
    assert "did you mean 'make_dataset'" in text
    assert "training.loss.epsilon:" in text and "did you mean epsilon_" in text
    assert "reward_functions[1].wieght:" in text and "did you mean weight" in text
    assert "metric_logger._component_: cannot import 'no_such_package.Logger'" in text
    assert "eval_dataset._component_" in text and "NoSuchOptimizer" in text
    # Without importing, only the structure is checked.
    validate_run_config(cfg, check_components=False)


def test_nested_component_nodes_are_checked(config_path):
    cfg = compose_config(config_path, ["dataset.template.chatty=true"])
    problems = problems_of(cfg)
    assert len(problems) == 1 and problems[0].startswith("dataset.template.chatty:")


def test_missing_required_keys_and_bad_nodes(config_path):
    cfg = compose_config(config_path, ["~dataset", "~orchestration.num_steps"])
    cfg.reward_functions = []
    cfg.metric_logger = "not a node"
    problems = problems_of(cfg)
    text = "\n".join(problems)
    assert len(problems) == 4, problems
    assert "dataset: required" in text
    assert "orchestration.num_steps: required" in text
    assert "reward_functions: empty, but nothing else scores the episodes" in text
    assert "metric_logger: expected a mapping with a _component_ key" in text


def test_broken_interpolation_names_the_key(config_path):
    cfg = compose_config(config_path, ["output_dir=${no_such_key}/x"])
    problems = problems_of(cfg)
    # Reported at the key itself and at metric_logger.log_dir, which interpolates it.
    assert any(p.startswith("output_dir:") and "no_such_key" in p for p in problems)
    assert all("no_such_key" in p for p in problems), problems


def test_local_ray_cluster_must_fit_the_actors(config_path):
    cfg = compose_config(config_path, ["ray.num_cpus=2", "orchestration.num_inference_workers=2"])
    problems = problems_of(cfg)
    assert len(problems) == 1 and problems[0].startswith("ray.num_cpus: the actors need 4")
    # Joining an existing cluster: its size is not known here, so no check.
    validate_run_config(compose_config(config_path, ["ray.num_cpus=2", "ray.address=auto"]))
    cfg = compose_config(config_path, ["training.num_gpus=1", "ray.num_gpus=0.5"])
    assert problems_of(cfg)[0].startswith("ray.num_gpus: the actors need 1")


def test_ray_address_and_reward_weights(config_path):
    cfg = compose_config(config_path, ["ray.address=localhost", "ref.reward_weights=[1.0]"])
    text = "\n".join(problems_of(cfg))
    assert "ray.address: must be null" in text
    assert "ref.reward_weights: give the weights by reward name" in text
    for address in ("auto", "ray://head:10001", "10.0.0.1:6379"):
        validate_run_config(compose_config(config_path, [f"ray.address={address}"]))


def test_validate_accepts_a_plain_dict(tmp_path, fake_model_dir):
    validate_run_config(valid_config(fake_model_dir, tmp_path / "out"))


def test_resume_path_must_exist(config_path, tmp_path):
    problems = problems_of(compose_config(config_path, [f"resume_from_checkpoint={tmp_path}/ckpt"]))
    assert len(problems) == 1 and problems[0].startswith("resume_from_checkpoint:")
    (tmp_path / "ckpt").mkdir()
    problems = problems_of(compose_config(config_path, [f"resume_from_checkpoint={tmp_path}/ckpt"]))
    assert problems == [
        f"resume_from_checkpoint: {tmp_path}/ckpt is not a checkpoint folder (no state.json)"
    ]
    (tmp_path / "ckpt" / "state.json").write_text("{}")
    validate_run_config(compose_config(config_path, [f"resume_from_checkpoint={tmp_path}/ckpt"]))
    # true: the latest checkpoint of output_dir, which must have one.
    assert problems_of(compose_config(config_path, ["resume_from_checkpoint=true"]))
    latest = tmp_path / "out" / "checkpoints" / "latest"
    latest.parent.mkdir(parents=True)
    latest.write_text("step_000001")
    validate_run_config(compose_config(config_path, ["resume_from_checkpoint=true"]))


def test_a_resume_may_not_change_what_its_checkpoint_was_made_for(config_path, tmp_path):
    """A checkpoint records the config it ran with: a resume that would train nothing, or that
    changes a setting the checkpoint's state was made for, is refused naming the key; other
    settings (the optimizer's lr, a longer run) may change."""
    checkpoint = tmp_path / "out" / "checkpoints" / "step_000003"
    checkpoint.mkdir(parents=True)
    state = {"step": 3, "policy_version": 3, "eval_history": []}
    (checkpoint / "state.json").write_text(json.dumps(state))
    ran = validate_run_config(compose_config(config_path))
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(ran.model_dump(), sort_keys=False))
    (checkpoint.parent / "latest").write_text(checkpoint.name)
    resume = ["resume_from_checkpoint=true"]

    [problem] = problems_of(compose_config(config_path, resume))
    assert problem == (
        f"orchestration.num_steps: 3 does not go beyond step 3 of the checkpoint {checkpoint}, "
        "so the resume would train nothing; give a larger num_steps to extend the run"
    )
    changed = [
        "orchestration.num_steps=5",
        "orchestration.num_inference_workers=2",
        "training.optimizer._component_=torch.optim.SGD",
    ]
    problems = problems_of(compose_config(config_path, [*resume, *changed]))
    assert [p.split(":")[0] for p in problems] == [
        "orchestration.num_inference_workers",
        "training.optimizer._component_",
    ]
    assert problems[0].startswith(
        f"orchestration.num_inference_workers: the checkpoint {checkpoint} ran with 1, this "
        "config has 2; it cannot change on resume"
    )
    longer = ["orchestration.num_steps=5", "training.optimizer.lr=1e-5", "inference.group_size=8"]
    assert validate_run_config(compose_config(config_path, [*resume, *longer])).training.optimizer[
        "lr"
    ] == pytest.approx(1e-5)


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


# ------------------------------------------------------------------------------ instantiate


def test_instantiate_builds_nested_components(config_path):
    cfg = compose_config(config_path)
    dataset = instantiate(cfg.dataset)
    assert dataset["seed"] == cfg.seed  # interpolation resolved
    assert type(dataset["template"]).__name__ == "Template"  # nested node built first
    assert dataset["template"].chat is True
    rewards = [instantiate(node) for node in cfg.reward_functions]
    assert [reward.weight for reward in rewards] == [1.0, 0.5]


def test_instantiate_positional_args_and_kwarg_overrides(config_path):
    cfg = compose_config(config_path)
    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizer = instantiate(cfg.training.optimizer, params, lr=0.5)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.param_groups[0]["lr"] == 0.5  # the keyword wins over the config
    assert optimizer.param_groups[0]["weight_decay"] == 0.0  # from the config
    assert (
        instantiate({"_component_": f"{COMPONENTS}.make_dataset"}, num_examples=4)["num_examples"]
        == 4
    )


def test_instantiate_none_is_none():
    assert instantiate(None) is None


def test_instantiate_bad_path_names_key_and_component(config_path):
    cfg = compose_config(config_path, [f"training.loss._component_={COMPONENTS}.Los"])
    with pytest.raises(InstantiationError) as info:
        instantiate(cfg.training.loss)
    message = str(info.value)
    assert message.startswith("training.loss._component_:")
    assert f"{COMPONENTS}.Los" in message and "did you mean 'Loss'" in message


def test_instantiate_bad_keyword_names_key_and_component(config_path):
    cfg = compose_config(config_path, ["training.loss.kl_coef=0.1"])
    with pytest.raises(InstantiationError) as info:
        instantiate(cfg.training.loss)
    message = str(info.value)
    assert message.startswith("training.loss:")
    assert f"{COMPONENTS}.Loss" in message
    assert "'kl_coef' (did you mean 'kl_coeff'?)" in message


def test_instantiate_error_in_a_list_item_names_its_index(config_path):
    cfg = compose_config(config_path, ["reward_functions.1.wieght=2"])
    with pytest.raises(InstantiationError, match=r"^reward_functions\[1\]: cannot call "):
        instantiate(cfg.reward_functions[1])
    # A plain dict (as actors receive nodes) has no key: the message names the component.
    node = OmegaConf.to_container(cfg.reward_functions[1])
    with pytest.raises(InstantiationError, match=rf"^cannot call {COMPONENTS}\.Reward: "):
        instantiate(node)


def test_instantiate_nested_failure_names_the_nested_key(config_path):
    cfg = compose_config(config_path, ["dataset.template.chatty=1"])
    with pytest.raises(InstantiationError, match=r"^dataset\.template: "):
        instantiate(cfg.dataset)


def test_instantiate_without_component_key():
    with pytest.raises(InstantiationError, match="_component_"):
        instantiate(OmegaConf.create({"lr": 1.0}))


def test_errors_inside_a_component_keep_their_type_and_gain_a_note():
    node = OmegaConf.create({"thing": {"_component_": f"{COMPONENTS}.explode"}})
    with pytest.raises(RuntimeError, match="boom") as info:
        instantiate(node.thing)
    if sys.version_info >= (3, 11):
        assert any("thing" in note and "explode" in note for note in info.value.__notes__)


# ------------------------------------------------------------------------------ recipes


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


# ------------------------------------------------------------------------------ reference


def _schema_entries(model: type[Section] = RunConfig, prefix: str = ""):
    for key, info in model.model_fields.items():
        nested = section_type(info)
        if nested is not None:
            yield from _schema_entries(nested, f"{prefix}{key}.")
        else:
            yield prefix + key, info


def test_reference_markdown_documents_every_key():
    markdown = config_reference_markdown()
    entries = list(_schema_entries())
    assert len(entries) > 40
    for path, info in entries:
        rows = [line for line in markdown.splitlines() if line.startswith(f"| `{path}` |")]
        assert len(rows) == 1, path
        assert " ".join(info.description.split()) in rows[0], path
        default = default_of(info)
        spec = component_spec(info)
        if spec is None and default is not REQUIRED:
            assert f"`{json.dumps(default)}`" in rows[0], path
        if spec is not None and isinstance(default, dict):
            assert default["_component_"] in rows[0]
        if spec is not None and spec.args is not None:
            for name, arg in spec.args.model_fields.items():
                assert f"| `{path}.{name}` |" in markdown
                assert " ".join(arg.description.split()) in markdown
        if spec is not None and spec.many:
            assert "list of components" in rows[0]


def test_reference_markdown_tables_are_well_formed():
    # A "|" inside a description would split its row into extra cells.
    for line in config_reference_markdown().splitlines():
        if line.startswith("|"):
            assert line.count("|") == 5, line


# ------------------------------------------------------------------------------ typed sections


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


# ------------------------------------------------------------------------------ what a run needs


def test_validate_checks_what_the_run_will_need(config_path, tmp_path, fake_model_dir):
    """Each new-user mistake is one line naming the key, the file and what was expected."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1 + 1?", "answer": "2"}\n')
    dataset = [
        "dataset._component_=grpo.data.prompt_dataset",
        "~dataset.seed",
        f"dataset.source={data}",
        "~dataset.template",
        "dataset.template=answer_only",
    ]
    # A good local dataset passes.
    validate_run_config(compose_config(config_path, [*dataset, "dataset.prompt_key=question"]))

    missing = problems_of(compose_config(config_path, [*dataset, f"dataset.source={data}.gone"]))
    assert missing == [f"dataset.source: file {data}.gone does not exist"]

    column = problems_of(compose_config(config_path, [*dataset, "dataset.prompt_key=problem"]))
    assert len(column) == 1 and column[0].startswith("dataset.prompt_key: column 'problem'")
    assert "question, answer" in column[0]

    unwritable = problems_of(compose_config(config_path, ["output_dir=/proc/grpo_run"]))
    assert len(unwritable) == 1 and unwritable[0].startswith("output_dir: /proc/grpo_run")
    assert "not writable" in unwritable[0]

    no_checkpoint = problems_of(
        compose_config(config_path, ["resume_from_checkpoint=true", f"output_dir={tmp_path}/new"])
    )
    assert no_checkpoint == [
        f"resume_from_checkpoint: true, but {tmp_path}/new holds no checkpoint yet (no "
        "checkpoints/latest); start fresh with resume_from_checkpoint=false, or give a "
        "checkpoint folder"
    ]


def test_a_plain_template_value_becomes_a_component_node_by_dotted_overrides(config_path):
    cfg = compose_config(
        config_path,
        [
            "~dataset.template",
            "dataset.template=answer_only",
            f"dataset.template._component_={COMPONENTS}.Template",
            "dataset.template.chat=true",
        ],
    )
    assert OmegaConf.to_container(cfg.dataset.template) == {
        "_component_": f"{COMPONENTS}.Template",
        "chat": True,
    }
    # Any other key below a plain value is still an error.
    with pytest.raises(ConfigError, match="is a value, not a mapping"):
        compose_config(
            config_path,
            ["~dataset.template", "dataset.template=answer_only", "dataset.template.chat=1"],
        )


def test_validate_reads_component_signatures_without_importing(config_path):
    cfg = compose_config(
        config_path,
        [
            "training.optimizer._component_=torch.optim.AdamWW",
            "training.optimizer.lr=0.1",
            "training.loss.epsilon_lo=0.1",
        ],
    )
    problems = problems_of(cfg, import_components=False)
    assert problems == [
        "training.optimizer._component_: cannot import: module torch.optim has no 'AdamWW'; "
        "did you mean 'AdamW'?",
        f"training.loss.epsilon_lo: {COMPONENTS}.Loss takes no argument 'epsilon_lo'; did you "
        "mean epsilon_low?",
    ]


REWARDS = (
    "reward_functions=[{_component_: grpo.rewards.MathCorrectnessReward}, "
    "{_component_: grpo.rewards.FormatReward, think_required: false}]"
)


def test_reward_weights_are_by_name_and_unknown_names_are_refused(config_path):
    def problems(*overrides):
        cfg = compose_config(config_path, [REWARDS, *overrides])
        try:
            validate_run_config(cfg, check_components=False)
        except ConfigError as error:
            return error.problems
        return []

    # The names are read from the source (no import): the classes' own `name`.
    assert problems("ref.reward_weights={math_correctness: 1.0, format: 0.2}") == []
    assert problems("ref.reward_weights={correctness: 1.0, format: 0.2}") == [
        "ref.reward_weights: no reward named 'correctness'; the rewards are math_correctness, "
        "format"
    ]
    # A node's own name wins; an environment scoring with its reward functions uses theirs.
    renamed = "reward_functions=[{_component_: grpo.rewards.MathCorrectnessReward, name: exact}]"
    assert problems(renamed, "ref.reward_weights={exact: 2.0}") == []
    environment = (
        "environment={_component_: grpo.testing.tools.EchoUserEnv, reward_functions: "
        "[{_component_: grpo.rewards.TokenPresenceReward, token: '7'}]}"
    )
    [problem] = problems(environment, "ref.reward_weights={format: 1.0}")
    assert problem.endswith("no reward named 'format'; the rewards are token_presence")


def test_top_p_below_one_and_raw_behaviour_logprobs_are_refused(config_path):
    cfg = compose_config(
        config_path, ["inference.top_p=0.9", "inference.engine_args.logprobs_mode=raw_logprobs"]
    )
    problems = problems_of(cfg, check_components=False)
    assert len(problems) == 2, problems
    assert problems[0].startswith("inference.top_p: 0.9 is refused, only 1.0 trains")
    assert problems[1].startswith("inference.engine_args.logprobs_mode: 'raw_logprobs'")


def test_clip_settings_that_tis_with_one_epoch_ignores_are_named(config_path):
    loss = "training.loss={_component_: grpo.objective.loss.GRPOLoss, tis_cap: 2.0"
    [problem] = problems_of(
        compose_config(config_path, [f"{loss}, epsilon_high: 0.28, ratio_level: sequence}}"]),
        check_components=False,
    )
    assert problem.startswith(
        "training.loss.tis_cap: with training.ppo_epochs 1 the clipped ratio is taken against "
        "the current policy and is always 1, so epsilon_high, ratio_level: sequence have no "
        "effect"
    )
    # Meaningful: TIS alone with one epoch, or the clip with several epochs (decoupled PPO).
    validate_run_config(compose_config(config_path, [f"{loss}}}"]), check_components=False)
    # A clip range written at the loss's own default is no choice (the shipped configs list
    # theirs), and ppo_epochs left unset is 1.
    validate_run_config(
        compose_config(config_path, [f"{loss}, epsilon_low: 0.2}}"]), check_components=False
    )
    with pytest.raises(ConfigError, match="so epsilon_high has no effect"):
        validate_run_config(
            compose_config(config_path, [f"{loss}, epsilon_high: 0.3}}", "~training.ppo_epochs"]),
            check_components=False,
        )
    validate_run_config(
        compose_config(config_path, [f"{loss}, epsilon_high: 0.28}}", "training.ppo_epochs=2"]),
        check_components=False,
    )


@pytest.mark.parametrize("correction", ["tis", "mis", "icepop"])
def test_every_correction_with_one_epoch_names_the_clip_settings_it_ignores(
    config_path, correction
):
    loss = f"training.loss={{_component_: grpo.objective.loss.GRPOLoss, correction: {correction}"
    [problem] = problems_of(
        compose_config(config_path, [f"{loss}, epsilon_high: 0.28}}"]), check_components=False
    )
    assert problem.startswith(
        "training.loss.correction: with training.ppo_epochs 1 the clipped ratio is taken "
        "against the current policy and is always 1, so epsilon_high has no effect"
    )
    assert problem.endswith("or correction: none (the ratio to the behaviour policy is clipped)")
    validate_run_config(compose_config(config_path, [f"{loss}}}"]), check_components=False)


ENVIRONMENT = "environment={_component_: grpo.testing.tools.EchoUserEnv, max_turns: 8"


def test_an_episode_must_fit_the_token_budget_and_its_bound_the_context(config_path, tmp_path):
    def problems(*overrides):
        try:
            validate_config(compose_config(config_path, overrides))
        except ConfigError as error:
            return error.problems
        return []

    # An episode fills the engine's context (128) when nothing else bounds it, however short
    # one turn (32 + 16) is.
    [problem] = problems(f"{ENVIRONMENT}}}", "target_tokens_per_batch=100")
    assert problem == (
        "target_tokens_per_batch: 100 cannot hold the longest sequence, the longest episode, "
        "which fills inference.engine_args.max_model_len (128) (environment.max_episode_tokens "
        "is null)"
    )
    # max_episode_tokens bounds it: 32 + 64 = 96 fits.
    assert problems(f"{ENVIRONMENT}, max_episode_tokens: 64}}", "target_tokens_per_batch=100") == []
    # A bound the context cuts first is refused.
    [problem] = problems(f"{ENVIRONMENT}, max_episode_tokens: 200}}")
    assert problem.startswith(
        "environment.max_episode_tokens: inference.max_prompt_tokens (32) + 200 exceeds "
        "inference.engine_args.max_model_len (128)"
    )
    # Without max_model_len the collector sizes the context for the episode, not for one turn.
    [problem] = problems(
        f"{ENVIRONMENT}, max_episode_tokens: 200}}",
        "~inference.engine_args.max_model_len",
        "target_tokens_per_batch=200",
    )
    assert problem == (
        "target_tokens_per_batch: 200 cannot hold the longest sequence, the longest episode, "
        "inference.max_prompt_tokens (32) + environment.max_episode_tokens (200) = 232"
    )
    # Neither bound set: the episode may fill the model's context.
    model_dir = make_fake_model_dir(tmp_path / "long", max_position_embeddings=4096)
    cfg = compose_config(
        config_path,
        [
            f"{ENVIRONMENT}}}",
            f"base_model_path={model_dir}",
            "~inference.engine_args.max_model_len",
        ],
    )
    [problem] = problems_of(cfg, check_components=False)
    assert problem.startswith("target_tokens_per_batch: 256 cannot hold the longest sequence")
    assert "max_position_embeddings (4096)" in problem
    assert problem.endswith(
        "set environment.max_episode_tokens and inference.max_prompt_tokens, or "
        "inference.engine_args.max_model_len"
    )


def test_validate_refuses_the_stdout_interval_the_metric_logger_refuses(tmp_path):
    from grpo.observability.metric_logger import MetricLogger

    with pytest.raises(ValueError, match="stdout_every_n"):
        MetricLogger(tmp_path / "logs", stdout_every_n=-1, use_wandb=False)
    overrides = ["metric_logger.stdout_every_n=-1"]
    (problem,) = problems_of(compose_config("tiny_arithmetic_cpu", overrides))
    assert problem == "metric_logger.stdout_every_n: must be >= 0, got -1"
