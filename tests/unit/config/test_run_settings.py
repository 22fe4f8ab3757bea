"""What a run needs, checked before it starts: the model, datasets and components it names, reward
weights, sampling and off-policy correction settings, and the token budget of an episode.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from grpo.config import (
    ConfigError,
    compose_config,
    validate_config,
)
from grpo.preflight import validate_run_config
from grpo.testing import make_fake_model_dir
from tests.unit.config.helpers import COMPONENTS, problems_of


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
