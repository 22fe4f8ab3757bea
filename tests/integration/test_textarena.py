"""TextArena in a short run: the tests that start a Ray cluster or a vLLM engine.

The tests without either: tests/unit/test_textarena.py.
"""

from __future__ import annotations

import pytest

from grpo.testing import RANDOM_MODEL_OVERRIDES, read_jsonl  # noqa: E402


@pytest.mark.slow
def test_a_short_run_plays_the_game_and_logs_its_reward(
    tiny_model_dir, tmp_path, monkeypatch, ray_shared
):
    from grpo.cli import main as grpo_main

    monkeypatch.setenv("WANDB_MODE", "disabled")
    run_dir = tmp_path / "run"
    status = grpo_main(
        [
            *("run", "async_grpo", "--config", "tiny_textarena_cpu"),
            f"base_model_path={tiny_model_dir}",
            *RANDOM_MODEL_OVERRIDES,
            f"output_dir={run_dir}",
            "orchestration.num_steps=2",
            "environment.size=64",
            "environment.eval_size=4",
            "eval_every_n_steps=null",
            "inference.batch_size=2",
            "inference.group_size=4",
            "inference.max_generated_tokens=8",
            "environment.max_turns=2",
            # The random model never closes a bracket: a turn that reaches the token limit ends
            # its episode (truncated), so common letters end its turns and the game answers.
            "environment.stop=[e, a, o, i, t, ' ']",
            "reward_functions=[{_component_: grpo.rewards.TokenPresenceReward, token: n}]",
            "training.batch_size=8",
            "orchestration.replay_buffer_size=64",
        ]
    )
    assert status == 0
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert len([r for r in records if "training/loss" in r]) >= 2  # it trained
    rewards = [r["ref_rewards/rewards_func_textarena_mean"] for r in records if "ref_rewards/rewards_func_textarena_mean" in r]  # fmt: skip
    assert rewards and all(0.0 <= value <= 1.0 for value in rewards)
    turns = [r["inference/episode_turns_mean"] for r in records if "inference/episode_turns_mean" in r]  # fmt: skip
    assert turns and max(turns) > 1.0  # the game answered: episodes of more than one turn
    assert any("inference/env_textarena_finished" in r for r in records)
