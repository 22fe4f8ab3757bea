"""Config loading, overrides, validation, instantiation and the schema reference.

`grpo.config.validate_config` checks a config alone; what users see from ``grpo validate`` and
at a run's start is `grpo.preflight.validate_run_config`, which also checks what the config
names (model folder, datasets, run folder, resume target): most tests here check through it.
"""

from __future__ import annotations

import json

import pytest
import yaml

from grpo.config import (
    ConfigError,
    compose_config,
    load_config,
    validate_config,
)
from grpo.preflight import validate_run_config
from grpo.testing import make_fake_model_dir
from tests.unit.config.helpers import COMPONENTS, problems_of, valid_config, write_config


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


def test_a_synchronous_round_that_overfills_the_rollout_queue_is_refused(config_path):
    """A synchronous round scores once every collector finished its batch: a collector blocked
    on a full queue would wait forever, so the queue must hold every collector's batch."""
    sync = ["orchestration.synchronous=true", "orchestration.num_inference_workers=2"]
    overrides = [*sync, "inference.batch_size=5", "inference.queue_maxsize=9"]
    problems = problems_of(compose_config(config_path, overrides))
    assert problems == [
        "inference.queue_maxsize: 9 groups is less than a synchronous round puts on the queue "
        "before any is scored (inference.batch_size 5 x orchestration.num_inference_workers "
        "2 = 10); raise queue_maxsize or lower batch_size"
    ]
    validate_run_config(compose_config(config_path, [*sync, "inference.batch_size=5"]))
    # Asynchronous, the queue is taken from while the collectors generate.
    asynchronous = ["inference.batch_size=5", "inference.queue_maxsize=9"]
    validate_run_config(compose_config(config_path, asynchronous))
