"""Settings that would train a wrong or useless signal are refused by `grpo validate`, in one
line naming the key, or train what they name: LoRA dropout, a temperature below vLLM's lowest,
a staleness bound the sync interval cannot meet, and Dr. GRPO's undivided advantages.
(The loss's own bounds and k1: tests/unit/test_loss.py.)"""

from __future__ import annotations

import pytest
import torch

from grpo.cli import main
from grpo.types import GroupedUnscoredTrajectories, UnscoredTrajectory

# A demo run in the shipped config's output_dir must not make validation refuse it.
FRESH = "overwrite_output_dir=true"


def refusal(capsys: pytest.CaptureFixture, config: str, *overrides: str) -> str:
    """The one line `grpo validate` refuses ``config`` with."""
    assert main(["validate", config, *overrides]) != 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    prefix = "grpo validate: error: "
    assert lines[0].startswith(prefix), lines[0]
    return lines[0].removeprefix(prefix)


def test_lora_dropout_is_refused(capsys):
    """Dropout would make the weight probe and the importance ratio random: every update
    failed verification and the run stopped."""
    line = refusal(capsys, "tiny_arithmetic_lora_cpu", "training.lora.dropout=0.3")
    assert line.startswith("training.lora.dropout: 0.3 is refused, only 0 trains"), line
    assert main(["validate", "tiny_arithmetic_lora_cpu", "training.lora.dropout=0.0", FRESH]) == 0


def test_a_temperature_vllm_would_raise_is_refused(capsys):
    line = refusal(capsys, "tiny_arithmetic_cpu", "inference.temperature=0.005")
    assert line.startswith("inference.temperature: 0.005 is below 0.01"), line
    assert "vLLM" in line
    assert main(["validate", "tiny_arithmetic_cpu", "inference.temperature=0.01", FRESH]) == 0


def test_a_lag_below_the_sync_interval_is_refused(capsys):
    """The lag counts training steps: synced every 2 steps, the weights the collectors sample
    with are one step old before each sync, so a bound of 0 would leave those steps with no
    batch."""
    line = refusal(
        capsys,
        "tiny_arithmetic_cpu",
        "orchestration.max_policy_lag=0",
        "weight_sync.every_n_steps=2",
    )
    assert line.startswith("orchestration.max_policy_lag: 0 is less than weight_sync."), line
    overrides = ["orchestration.max_policy_lag=1", "weight_sync.every_n_steps=2"]
    assert main(["validate", "tiny_arithmetic_cpu", *overrides, FRESH]) == 0
    overrides = ["orchestration.max_policy_lag=0", "weight_sync.every_n_steps=1"]
    assert main(["validate", "tiny_arithmetic_cpu", *overrides, FRESH]) == 0


def scored_group(group_id: int, rewards: list[float]) -> GroupedUnscoredTrajectories:
    return GroupedUnscoredTrajectories.from_trajectories(
        [
            UnscoredTrajectory(
                prompt_tokens=torch.tensor([5, 6, 7]),
                response_tokens=torch.tensor([8, 9]),
                prompt_len=3,
                response_len=2,
                logprobs=torch.zeros(2),
                answer="1",
                sequence_id=f"g{group_id}-{i}",
                policy_version=0,
                group_id=group_id,
                env_rewards={"score": reward},
            )
            for i, reward in enumerate(rewards)
        ]
    )


@pytest.mark.parametrize("std_normalization", [True, False])
def test_dr_grpo_advantages_are_the_rewards_minus_the_group_mean(tiny_model_dir, std_normalization):
    """``ref.advantage_std_normalization: false`` (Dr. GRPO, beside the seq_mean_token_sum_norm
    aggregation): r - mean of the group, undivided; true (GRPO): divided by the group's std."""
    from grpo.config import RefConfig
    from grpo.workers.ref import RefActor

    actor = RefActor(
        model_dir=str(tiny_model_dir),
        target_tokens_per_batch=64,
        config=RefConfig(advantage_std_normalization=std_normalization),
        load_model=False,
    )
    groups = {0: [1.0, 0.0, 0.0, 0.0], 1: [0.5, 0.2, 0.2, 0.3]}
    _, scored = actor.score([scored_group(g, rewards) for g, rewards in groups.items()])
    for group, (group_id, rewards) in zip(scored, groups.items()):
        rewards = torch.tensor(rewards)
        expected = rewards - rewards.mean()
        if std_normalization:
            expected = expected / (rewards.std() + 1e-4)
        advantages = torch.stack([t.advantages for t in group])
        assert [t.group_id for t in group] == [group_id] * 4
        torch.testing.assert_close(advantages, expected, rtol=1e-6, atol=1e-7)
