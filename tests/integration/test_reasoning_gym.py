"""reasoning-gym in a short run: the tests that start a Ray cluster or a vLLM engine.

The tests without either: tests/unit/test_reasoning_gym.py.
"""

from __future__ import annotations

import pytest

from grpo.testing import RANDOM_MODEL_OVERRIDES, read_jsonl  # noqa: E402


@pytest.mark.slow
def test_a_short_run_on_two_tasks_logs_each_tasks_reward(
    tiny_model_dir, tmp_path, monkeypatch, ray_shared
):
    from grpo.cli import main as grpo_main

    monkeypatch.setenv("WANDB_MODE", "disabled")
    run_dir = tmp_path / "run"
    status = grpo_main(
        [
            *("run", "async_grpo", "--config", "tiny_reasoning_gym_cpu"),
            f"base_model_path={tiny_model_dir}",
            *RANDOM_MODEL_OVERRIDES,
            f"output_dir={run_dir}",
            "orchestration.num_steps=2",
            "environment.size=64",
            # Held-out rows of its own: evaluated through the environment, per task.
            "environment.eval_size=8",
            "eval_every_n_steps=2",
            "eval_samples_per_example=2",
            "eval_temperature=1.0",
            "inference.batch_size=2",
            "inference.group_size=4",
            "inference.max_generated_tokens=8",
            "training.batch_size=8",
            "orchestration.replay_buffer_size=64",
            # The random model never writes an <answer> block: a token it does write gives the
            # groups rewards that differ.
            "reward_functions=[{_component_: grpo.rewards.TokenPresenceReward, token: '7'}]",
        ]
    )
    assert status == 0
    records = read_jsonl(run_dir / "metrics.jsonl")
    for task in ("chain_sum", "basic_arithmetic"):
        values = [r[f"inference/env_{task}_reward"] for r in records if f"inference/env_{task}_reward" in r]  # fmt: skip
        assert values and all(0.0 <= value <= 1.0 for value in values)
    evaluations = [r for r in records if "eval/pass@2" in r]
    assert evaluations and all(r["eval/num_examples"] == 8 for r in evaluations)
    assert all(r["eval/pass@2"] >= r["eval/avg@2"] for r in evaluations)
    tasks = {key.split("/")[1] for r in evaluations for key in r if key.startswith("eval/task_")}
    assert tasks <= {"task_chain_sum", "task_basic_arithmetic"} and tasks, tasks
