import pytest
import torch

from grpo.types import ScoredTrajectory
from grpo.workers.replay_buffer import ReplayBuffer


def scored(sequence_id: str, policy_version: int = 0, group_id: int = 0) -> ScoredTrajectory:
    return ScoredTrajectory(
        prompt_tokens=torch.tensor([1, 2]),
        response_tokens=torch.tensor([3]),
        prompt_len=2,
        response_len=1,
        logprobs=torch.tensor([-0.5]),
        ref_logprobs=torch.tensor([-0.6]),
        rewards=torch.tensor([1.0]),
        advantages=torch.tensor(0.5),
        successes=torch.tensor([1.0]),
        answer="3",
        sequence_id=sequence_id,
        group_id=group_id,
        reward_metadata={"func_names": ["math"]},
        policy_version=policy_version,
    )


def group(prefix: str, size: int, policy_version: int = 0) -> list[ScoredTrajectory]:
    return [scored(f"{prefix}-{i}", policy_version) for i in range(size)]


@pytest.mark.parametrize("sampling", ["fifo", "random"])
def test_each_trajectory_is_trained_exactly_once(sampling):
    buffer = ReplayBuffer(capacity=64, max_policy_lag=10, sampling=sampling, seed=3)
    for g in range(8):
        assert buffer.add(group(f"g{g}", 4))
    seen = []
    while (batch := buffer.sample(4, current_policy_version=0)) is not None:
        seen += [t.sequence_id for t in batch]
    assert len(seen) == 32
    assert len(set(seen)) == 32
    assert len(buffer) == 0


def test_reuse_count_trains_each_trajectory_that_many_times():
    buffer = ReplayBuffer(capacity=8, max_policy_lag=10, reuse_count=2)
    buffer.add(group("g", 4))
    seen = []
    while (batch := buffer.sample(2, current_policy_version=0)) is not None:
        seen += [t.sequence_id for t in batch]
    assert sorted(seen) == sorted([f"g-{i}" for i in range(4)] * 2)


def test_not_enough_data_returns_none_and_removes_nothing():
    buffer = ReplayBuffer(capacity=8, max_policy_lag=1)
    buffer.add(group("g", 3))
    assert buffer.sample(4, current_policy_version=0) is None
    assert len(buffer) == 3


def test_stale_trajectories_are_dropped_and_counted():
    buffer = ReplayBuffer(capacity=16, max_policy_lag=1)
    buffer.add(group("old", 4, policy_version=0))
    buffer.add(group("new", 4, policy_version=2))
    batch = buffer.sample(4, current_policy_version=2)
    assert {t.sequence_id for t in batch} == {f"new-{i}" for i in range(4)}
    stats = buffer.stats()
    assert stats["dropped_stale"] == 4
    assert stats["policy_age_mean"] == 0.0
    # A lag of exactly max_policy_lag is still allowed.
    buffer.add(group("edge", 2, policy_version=1))
    assert buffer.sample(2, current_policy_version=2) is not None
    assert buffer.stats()["policy_age_max"] == 1


def test_groups_are_added_whole_or_not_at_all():
    buffer = ReplayBuffer(capacity=6, max_policy_lag=0)
    assert buffer.add(group("a", 4))
    assert not buffer.add(group("b", 4))
    assert len(buffer) == 4
    assert buffer.stats()["rejected_full"] == 1
    assert buffer.free_slots() == 2
    with pytest.raises(ValueError, match="replay_buffer_size"):
        buffer.add(group("huge", 7))


def test_state_dict_round_trip_continues_identically():
    def run(buffer, n):
        return [[t.sequence_id for t in buffer.sample(3, 0)] for _ in range(n)]

    original = ReplayBuffer(capacity=32, max_policy_lag=5, sampling="random", seed=7)
    for g in range(6):
        original.add(group(f"g{g}", 4))
    run(original, 2)
    restored = ReplayBuffer(capacity=32, max_policy_lag=5, sampling="random", seed=0)
    restored.load_state_dict(original.state_dict())
    assert run(restored, 3) == run(original, 3)
    assert restored.stats() == original.stats()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"capacity": 0, "max_policy_lag": 0}, "replay_buffer_size"),
        ({"capacity": 4, "max_policy_lag": -1}, "max_policy_lag"),
        ({"capacity": 4, "max_policy_lag": 0, "sampling": "lifo"}, "sampling"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReplayBuffer(**kwargs)
