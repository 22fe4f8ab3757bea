"""The recipe's up-front data check (before any actor starts)."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_recipe():
    spec = importlib.util.spec_from_file_location("async_grpo", REPO / "recipes" / "async_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gsm8k_config(path: Path):
    return SimpleNamespace(
        dataset={"_component_": "grpo.data.gsm8k_dataset", "source": str(path)},
        eval_dataset=None,
    )


def single_turn():
    """The environment of a run that names none: its reward functions score each response."""
    from grpo.envs import build_environment

    return build_environment(None, [{"_component_": "grpo.rewards.MathCorrectnessReward"}], 5.0)


def test_bad_rows_are_skipped_and_reported(tmp_path, capsys):
    rows = [
        {"question": "One plus one?", "answer": "1 + 1 = 2\n#### 2"},
        {"question": "", "answer": "#### 3"},
        {"question": "Two plus two?", "answer": "no final answer"},
        {"question": "Three plus three?", "answer": "#### 6"},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    load_recipe().build_datasets(gsm8k_config(path), single_turn())
    err = capsys.readouterr().err
    assert "dataset: skipped 2 rows" in err
    assert "row 2" in err and "row 3" in err


def test_a_dataset_with_no_usable_row_fails_before_the_run(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": "", "answer": ""}) + "\n")
    with pytest.raises(ValueError, match="train.jsonl"):
        load_recipe().build_datasets(gsm8k_config(path), single_turn())


def test_a_reward_weight_no_reward_has_is_refused_before_the_run():
    """Names the config cannot tell (a reward class that inherits its name, an environment's
    scores) are checked once the rewards and the environment are built, before Ray starts."""
    from grpo.config import ConfigError
    from grpo.rewards import TokenPresenceReward
    from grpo.testing.tools import EchoUserEnv

    check = load_recipe().check_reward_weights
    rewards = [
        {"_component_": "grpo.rewards.MathCorrectnessReward"},
        {"_component_": "grpo.rewards.TokenPresenceReward", "token": "7", "name": "seven"},
    ]

    def config(weights):
        return SimpleNamespace(
            ref=SimpleNamespace(reward_weights=weights), reward_functions=rewards
        )

    from grpo.envs import build_environment

    single_turn = build_environment(None, rewards, 5.0)
    check(config({"math_correctness": 1.0, "seven": 0.5}), single_turn)
    with pytest.raises(ConfigError, match="no reward named 'format'; the rewards are math_corr"):
        check(config({"format": 1.0}), single_turn)
    environment = EchoUserEnv(reward_functions=[TokenPresenceReward(token="7")])
    check(config({"token_presence": 2.0}), environment)
    with pytest.raises(ConfigError, match="the rewards are token_presence"):
        check(config({"seven": 2.0}), environment)


def test_a_prompt_limit_no_prompt_fits_is_refused_before_the_run(tiny_model_dir):
    """Llama 3's template writes a system header of about 25 tokens: a limit below every prompt
    is one line at start, not a collector that stops once the actors run."""
    from grpo.config import ConfigError
    from grpo.data import arithmetic_dataset
    from grpo.models import load_tokenizer

    check = load_recipe().check_prompt_lengths
    dataset = arithmetic_dataset(num_examples=16, seed=0)
    tokenizer = load_tokenizer(tiny_model_dir)

    def config(limit):
        return SimpleNamespace(inference=SimpleNamespace(max_prompt_tokens=limit))

    check(config(64), dataset, tokenizer)
    check(config(None), dataset, tokenizer)
    with pytest.raises(ConfigError, match=r"inference.max_prompt_tokens: 3 is shorter than every"):
        check(config(3), dataset, tokenizer)
