"""Dynamic sampling (``ref.filter_zero_variance_groups``): groups whose rewards are all
equal are dropped before the replay buffer, counted per step, and the trainer still gets full
batches of informative, unique trajectories.

The tests that start a Ray cluster or a vLLM engine: tests/integration/test_dynamic_sampling.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

from grpo.objective.advantages import group_advantages, zero_variance_groups
from grpo.observability.metric_names import (
    GROUPS_KEPT,
    GROUPS_SCORED,
    REF_PERF_SHARED_PROMPT_TOKENS_SAVED,
    REWARDS_MEAN,
    ZERO_VARIANCE_GROUPS,
)
from grpo.orchestrator import NoInformativeGroupsError
from grpo.orchestrator.group_counts import GroupCounts
from grpo.types import GroupedUnscoredTrajectories, UnscoredTrajectory


def trajectory(sequence_id: str, group_id: int, answer: str) -> UnscoredTrajectory:
    """A scored sample whose reward is its answer read as a number (the test chooses it)."""
    return UnscoredTrajectory(
        prompt_tokens=torch.tensor([5, 6, 7]),
        response_tokens=torch.tensor([8, 9]),
        prompt_len=3,
        response_len=2,
        logprobs=torch.zeros(2),
        answer=answer,
        sequence_id=sequence_id,
        policy_version=0,
        group_id=group_id,
        env_rewards={"answer": float(answer)},
        env_successes={"answer": float(answer == "1")},
    )


def group(group_id: int, answers: list[str]) -> GroupedUnscoredTrajectories:
    return GroupedUnscoredTrajectories.from_trajectories(
        [trajectory(f"g{group_id}-{i}", group_id, a) for i, a in enumerate(answers)]
    )


# ---------------------------------------------------------------- the filter itself


def test_zero_variance_groups_flags_exactly_the_groups_with_equal_rewards():
    rewards = torch.tensor([[1.0, 0.0, 1.0], [2.0, 2.0, 2.0], [0.0, 0.0, 1e-6], [0.0, 0.0, 0.0]])
    assert zero_variance_groups(rewards).tolist() == [False, True, False, True]
    assert bool(zero_variance_groups(torch.tensor([0.5, 0.5])))
    # One sample has nothing to be compared with: no signal, flagged.
    assert bool(zero_variance_groups(torch.tensor([1.0])))
    # A NaN reward differs from everything: not taken for a constant group.
    assert not bool(zero_variance_groups(torch.tensor([float("nan"), float("nan")])))
    # Exactly the groups whose advantages are all zero.
    advantages = group_advantages(rewards)
    assert (advantages == 0).all(dim=-1).tolist() == zero_variance_groups(rewards).tolist()
    with pytest.raises(ValueError, match="zero_variance_groups"):
        zero_variance_groups(torch.zeros(2, 0))


@pytest.mark.parametrize("filtering", [True, False], ids=["filter", "no_filter"])
def test_ref_actor_drops_exactly_the_zero_variance_groups(filtering, tiny_model_dir):
    from grpo.config import RefConfig
    from grpo.workers.ref import RefActor

    actor = RefActor(
        model_dir=str(tiny_model_dir),
        target_tokens_per_batch=64,
        config=RefConfig(filter_zero_variance_groups=filtering),
    )
    groups = [
        group(0, ["1", "0", "1", "0"]),  # mixed: kept
        group(1, ["1", "1", "1", "1"]),  # all right: zero variance
        group(2, ["0", "0", "0", "0"]),  # all wrong: zero variance
        group(3, ["0", "0", "0", "1"]),  # one right: kept
        group(4, ["1"]),  # one sample: zero variance
    ]
    info, scored = actor.score(groups)

    assert info["num_zero_variance_groups"] == 3
    kept_ids = [0, 3] if filtering else [0, 1, 2, 3, 4]
    assert info["group_ids"] == kept_ids
    assert [[t.group_id for t in g] for g in scored] == [
        [g] * len(groups[g].trajectories) for g in kept_ids
    ]
    assert info["sequence_ids"] == [[t.sequence_id for t in g] for g in scored]
    dropped = [1, 2, 4] if filtering else []
    assert info["dropped_group_ids"] == dropped
    assert info["dropped_sequence_ids"] == [
        [t.sequence_id for t in groups[g].trajectories] for g in dropped
    ]
    # Every group's total rewards, kept or not, for the driver's report of the first episodes.
    assert info["group_rewards"] == [[1, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 1], [1]]
    # Kept groups keep their advantages; the reward metrics cover every group scored.
    assert [float(t.advantages) > 0 for t in scored[0]] == [True, False, True, False]
    assert info["metrics"][REWARDS_MEAN] == pytest.approx(8 / 17)


def test_ref_actor_shares_prompts_of_kept_groups_only(tiny_model_dir):
    from grpo.config import RefConfig
    from grpo.workers.ref import RefActor

    groups = [group(0, ["1", "0", "1", "0"]), group(1, ["1", "1"]), group(2, ["0", "0", "1"])]
    scored_by_sharing = {}
    for share_prompts in (False, True):
        actor = RefActor(
            model_dir=str(tiny_model_dir),
            target_tokens_per_batch=64,
            config=RefConfig(filter_zero_variance_groups=True),
            share_prompts=share_prompts,
        )
        info, scored = actor.score(groups)
        saved = info["metrics"][REF_PERF_SHARED_PROMPT_TOKENS_SAVED]
        scored_by_sharing[share_prompts] = scored
        # Kept: groups 0 and 2, 7 sequences of 3 prompt + 2 response tokens (35 tokens).
        # Shared, each group's prompt is packed once: 2 x 3 + 7 x 2 = 20 computed, 15 saved.
        assert saved == (pytest.approx(100 * 15 / 35) if share_prompts else 0.0)
    for alone, shared in zip(*scored_by_sharing.values()):
        for a, b in zip(alone, shared):
            torch.testing.assert_close(a.ref_logprobs, b.ref_logprobs, atol=1e-5, rtol=0)


def test_without_a_kl_term_the_ref_actor_loads_no_model_and_scores_the_same(tiny_model_dir):
    """kl_coeff 0: no reference model, the same rewards and advantages, and trajectories
    without ref_logprobs that pack and train (the loss needs none)."""
    from grpo.config import RefConfig, load_config
    from grpo.objective.loss import GRPOLoss
    from grpo.packing.packs import pack_sequences
    from grpo.workers.ref import RefActor

    assert not load_config("tiny_arithmetic_cpu").uses_reference_model()
    assert load_config("tiny_arithmetic_cpu", ["training.loss.kl_coeff=0.1"]).uses_reference_model()
    groups = [group(0, ["1", "0", "1", "0"]), group(1, ["0", "1"])]
    scored = {}
    for load_model in (True, False):
        actor = RefActor(
            model_dir=str(tiny_model_dir),
            target_tokens_per_batch=64,
            config=RefConfig(filter_zero_variance_groups=True),
            load_model=load_model,
        )
        assert (actor.model is None) == (not load_model)
        info, scored[load_model] = actor.score(groups)
        assert info["group_ids"] == [0, 1]
    for with_model, without in zip(*(sum(scored[k], []) for k in (True, False))):
        assert with_model.ref_logprobs is not None and without.ref_logprobs is None
        assert float(with_model.advantages) == float(without.advantages)
        assert with_model.rewards.tolist() == without.rewards.tolist()

    packed = pack_sequences(sum(scored[False], []), "cpu", 0)
    assert packed.ref_logprobs is None
    num_tokens = packed.targets.numel()
    pi = torch.full((num_tokens,), -1.0, requires_grad=True)
    loss = GRPOLoss(kl_coeff=0.0).compute_loss_from_logprobs(
        pi, packed.ref_logprobs, packed.advantages, packed.behavior_logprobs
    )
    loss.loss.backward()
    assert torch.isfinite(pi.grad).all() and pi.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="some sequences have ref_logprobs"):
        pack_sequences([*scored[True][0], *scored[False][1]], "cpu", 0)


# ---------------------------------------------------------------- the driver's bookkeeping


def test_group_counts_per_step_and_reset():
    counts = GroupCounts(filtering=True, timeout_s=60.0)
    counts.scored(4, num_zero_variance=3, num_dropped=3)
    counts.scored(4, num_zero_variance=1, num_dropped=1)
    assert counts.step_metrics() == {
        GROUPS_SCORED: 8.0,
        GROUPS_KEPT: 4.0,
        ZERO_VARIANCE_GROUPS: 4.0,
    }
    assert counts.step_metrics() == {
        GROUPS_SCORED: 0.0,
        GROUPS_KEPT: 0.0,
        ZERO_VARIANCE_GROUPS: 0.0,
    }
    # Without the filter, zero-variance groups are counted but kept.
    unfiltered = GroupCounts(filtering=False, timeout_s=60.0)
    unfiltered.scored(4, num_zero_variance=4, num_dropped=0)
    metrics = unfiltered.step_metrics()
    assert metrics[GROUPS_KEPT] == metrics[ZERO_VARIANCE_GROUPS] == 4.0


def test_guard_names_equal_rewards_after_the_timeout_of_waiting(monkeypatch, caplog):
    now = [100.0]
    monkeypatch.setattr("grpo.orchestrator.group_counts.time.monotonic", lambda: now[0])
    counts = GroupCounts(filtering=True, timeout_s=10.0)
    waiting_since = 95.0

    def warnings() -> int:
        return len([r for r in caplog.records if "equal rewards" in r.message])

    with caplog.at_level(logging.WARNING, logger="grpo"):
        for _ in range(3):  # 12 groups in a row dropped at once: normal, no warning yet
            counts.scored(4, num_zero_variance=4, num_dropped=4)
        counts.check(waiting_since)
        assert warnings() == 0
        now[0] = 103.0  # a quarter of the timeout without an informative group: warned once
        counts.check(waiting_since)
        now[0] = 109.0
        counts.check(waiting_since)  # 9 s of dropping: not yet stopped
    assert warnings() == 1
    now[0] = 111.0
    with pytest.raises(NoInformativeGroupsError) as error:
        counts.check(waiting_since)
    message = str(error.value)
    assert "every group had equal rewards" in message and "12 groups in a row" in message
    assert "ref.filter_zero_variance_groups" in message

    # One informative group ends the streak.
    counts.scored(4, num_zero_variance=3, num_dropped=3)
    counts.check(waiting_since)
    # Time spent not waiting for a batch (training, evaluation) does not count.
    counts.scored(4, num_zero_variance=4, num_dropped=4)
    now[0] = 200.0
    counts.check(waiting_since=195.0)
    # Nothing is dropped without the filter, so it never stops a run.
    unfiltered = GroupCounts(filtering=False, timeout_s=0.0)
    unfiltered.scored(4, num_zero_variance=4, num_dropped=0)
    now[0] = 1000.0
    unfiltered.check(waiting_since=0.0)


ALL_WRONG = [[0.0] * 4] * 4  # one reference call: 4 groups of 4 episodes, every reward 0


def test_first_episodes_whose_groups_are_all_equal_are_reported_at_once_with_advice(
    monkeypatch, caplog
):
    """A task the model cannot yet score on: after the first 64 episodes (not after minutes of
    waiting) one warning gives their reward distribution and what to change; the run then
    stops after equal_rewards_timeout_s of waiting, without a second warning."""
    now = [100.0]
    monkeypatch.setattr("grpo.orchestrator.group_counts.time.monotonic", lambda: now[0])
    counts = GroupCounts(filtering=True, timeout_s=120.0)
    with caplog.at_level(logging.INFO, logger="grpo"):
        for _ in range(3):  # 48 episodes: too few to say
            counts.scored(4, num_zero_variance=4, num_dropped=4, group_rewards=ALL_WRONG)
        assert not caplog.records
        now[0] = 105.0
        counts.scored(4, num_zero_variance=4, num_dropped=4, group_rewards=ALL_WRONG)
        counts.scored(4, num_zero_variance=4, num_dropped=4, group_rewards=ALL_WRONG)
        now[0] = 190.0  # past a quarter of the timeout: the report was this streak's warning
        counts.check(waiting_since=100.0)
    [record] = caplog.records
    assert record.levelno == logging.WARNING and record.name == "grpo"
    message = record.getMessage()
    assert message.startswith(
        "rewards of the first 64 episodes: mean 0.00, all 16 groups equal (0.0: 64). Every "
        "advantage is zero"
    )
    for advice in (
        "raise inference.group_size",
        "add partial-credit or format rewards to reward_functions",
        "start from a stronger model",
        "raise inference.temperature",
        "orchestration.equal_rewards_timeout_s (120 s)",
        "ref.filter_zero_variance_groups=false trains on them",
    ):
        assert advice in message, advice
    now[0] = 221.0
    with pytest.raises(NoInformativeGroupsError) as error:
        counts.check(waiting_since=100.0)
    assert str(error.value).startswith(
        "no training batch for 121 s: every group had equal rewards (20 groups in a row; "
        "rewards mean 0.00, all 20 groups equal (0.0: 80))"
    )
    assert "orchestration.equal_rewards_timeout_s=120" in str(error.value)

    # Without the filter the run trains on such groups: the warning says so.
    caplog.clear()
    unfiltered = GroupCounts(filtering=False, timeout_s=120.0)
    with caplog.at_level(logging.INFO, logger="grpo"):
        unfiltered.scored(16, 16, 0, [[1.0] * 4] * 6 + [[0.0] * 4] * 10)
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith(
        "rewards of the first 64 episodes: mean 0.38, all 16 groups equal (0.0: 40, 1.0: 24). "
    )
    assert "the run trains on such groups" in record.getMessage()

    # Groups that differ: the distribution goes to the driver's log only, once.
    caplog.clear()
    healthy = GroupCounts(filtering=True, timeout_s=120.0)
    with caplog.at_level(logging.INFO, logger="grpo"):
        healthy.scored(16, 10, 10, [[1.0, 0.0, 0.0, 0.5]] * 6 + [[0.0] * 4] * 10)
        healthy.scored(16, 16, 16, [[0.0] * 4] * 16)
    [record] = caplog.records
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        "rewards of the first 64 episodes: mean 0.14, 6 of 16 groups differ "
        "(0.0: 52, 0.5: 6, 1.0: 6)"
    )


def test_the_warning_about_the_first_episodes_reaches_the_terminal(tmp_path, capsys):
    """The terminal shows the grpo logger's warnings (`grpo.observability.logs.DriverLog`):
    the report of a task every group scores alike on is there, in one line."""
    from grpo.observability.logs import DriverLog

    with DriverLog() as driver_log:
        driver_log.start(str(tmp_path / "run"), "info")
        counts = GroupCounts(filtering=True, timeout_s=120.0)
        for _ in range(4):
            counts.scored(4, num_zero_variance=4, num_dropped=4, group_rewards=ALL_WRONG)
    [line] = [line for line in capsys.readouterr().err.splitlines() if "first 64" in line]
    assert line.startswith(
        "WARNING: rewards of the first 64 episodes: mean 0.00, all 16 groups equal (0.0: 64). "
    )
