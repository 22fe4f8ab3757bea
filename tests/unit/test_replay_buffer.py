"""The replay buffer (`grpo.workers.replay_buffer`) in this process.

The tests that start a Ray cluster or a vLLM engine: tests/integration/test_replay_buffer.py.
"""

import asyncio
import time
from typing import Any

import pytest
import torch

from grpo.types import ScoredTrajectory
from grpo.workers.replay_buffer import ReplayBuffer, ReplayBufferActor


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


def test_add_groups_skips_ids_and_stops_at_the_first_group_that_does_not_fit():
    buffer = ReplayBuffer(capacity=10, max_policy_lag=0)
    groups = [group("a", 4), group("b", 4), group("c", 4)]
    # "b" loses two trajectories to the skip list, so a, b fit (6) and c (4) fits too: 10.
    assert buffer.add_groups(groups, skip_sequence_ids={"b-0", "b-1"}) == 3
    assert len(buffer) == 10
    ids = [t.sequence_id for t in buffer.sample(10, current_policy_version=0)]
    assert ids == ["a-0", "a-1", "a-2", "a-3", "b-2", "b-3", "c-0", "c-1", "c-2", "c-3"]

    # Full: the call takes the groups before the one that does not fit and says how many;
    # the caller resumes from there. A group skipped entirely counts as taken.
    buffer = ReplayBuffer(capacity=8, max_policy_lag=0)
    groups = [group("a", 4), group("b", 4), group("c", 4), group("d", 4)]
    assert buffer.add_groups(groups, skip_sequence_ids={f"b-{i}" for i in range(4)}) == 3
    assert buffer.add_groups(groups, first=3) == 0
    buffer.sample(4, current_policy_version=0)
    assert buffer.add_groups(groups, first=3) == 1
    assert [t.sequence_id for t in buffer.sample(8, 0)] == [
        f"{p}-{i}" for p in "cd" for i in range(4)
    ]


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


def test_the_lag_counts_training_steps_between_syncs():
    """Synced every 2 steps with max_policy_lag 1: the weights published after step 2 (version
    2) sample for the steps that update the weights of steps 2 and 3 (ages 0 and 1), and what
    they sampled is stale once the trainer's weights have taken 4 steps."""
    buffer = ReplayBuffer(capacity=16, max_policy_lag=1)
    buffer.add(group("base", 2, policy_version=0))
    buffer.add(group("synced", 6, policy_version=2))
    assert [t.sequence_id for t in buffer.sample(2, current_policy_version=1)] == [
        "base-0",
        "base-1",
    ]
    assert buffer.sample(2, current_policy_version=2) is not None
    assert buffer.stats()["policy_age_max"] == 0
    assert buffer.sample(2, current_policy_version=3) is not None
    assert buffer.stats()["policy_age_max"] == 1
    assert buffer.sample(2, current_policy_version=4) is None
    assert buffer.stats()["dropped_stale"] == 2 and len(buffer) == 0


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
        ({"capacity": 0, "max_policy_lag": 0}, "capacity: expected an int >= 1, got 0"),
        ({"capacity": 4, "max_policy_lag": -1}, "max_policy_lag: expected an int >= 0, got -1"),
        ({"capacity": 4, "max_policy_lag": 0, "sampling": "lifo"}, "sampling"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReplayBuffer(**kwargs)


def sample_now(buffer: ReplayBufferActor, n: int, version: int = 0, timeout_s: float = 0.0):
    return asyncio.run(buffer.sample_batch(n, version, timeout_s))


def test_actor_sample_returns_the_batch_and_a_summary_with_stats():
    buffer = ReplayBufferActor(capacity=8, max_policy_lag=1)
    asyncio.run(buffer.add_groups([group("a", 2), [scored("b-0", policy_version=1, group_id=5)]]))
    summary, batch = sample_now(buffer, 3, version=1)
    assert [t.sequence_id for t in batch] == summary["sequence_ids"] == ["a-0", "a-1", "b-0"]
    assert summary["group_ids"] == [0, 0, 5]
    assert summary["policy_versions"] == [0, 0, 1]
    assert summary["stats"]["size"] == 0 and summary["stats"]["sampled"] == 3
    assert summary["stats"]["policy_age_max"] == 1


def test_actor_sample_drops_stale_data_and_returns_none_when_time_runs_out():
    buffer = ReplayBufferActor(capacity=8, max_policy_lag=1)
    asyncio.run(buffer.add_groups([group("old", 4, policy_version=0)]))
    start = time.perf_counter()
    summary, batch = sample_now(buffer, 2, version=2, timeout_s=0.2)
    assert batch is None and summary["sequence_ids"] is None
    assert time.perf_counter() - start >= 0.2
    assert summary["stats"]["dropped_stale"] == 4 and summary["stats"]["size"] == 0


def test_actor_sample_waits_until_an_add_brings_enough():
    async def scenario() -> tuple[list[str], float]:
        buffer = ReplayBufferActor(capacity=8, max_policy_lag=0)
        await buffer.add_groups([group("a", 2)])
        waiting = asyncio.ensure_future(buffer.sample_batch(4, 0, timeout_s=30.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # 2 of 4 there: it waits
        await buffer.add_groups([group("b", 2)])
        summary, _ = await asyncio.wait_for(waiting, 5.0)
        return summary["sequence_ids"], summary["wait_s"]

    ids, wait_s = asyncio.run(scenario())
    assert ids == ["a-0", "a-1", "b-0", "b-1"]
    assert 0.05 <= wait_s < 5.0


def test_actor_release_waiters_ends_a_wait_empty_and_keeps_the_data():
    async def scenario() -> tuple[Any, int]:
        buffer = ReplayBufferActor(capacity=8, max_policy_lag=0)
        await buffer.add_groups([group("a", 2)])
        waiting = asyncio.ensure_future(buffer.sample_batch(4, 0, timeout_s=30.0))
        await asyncio.sleep(0.05)
        await buffer.release_waiters()
        _, batch = await asyncio.wait_for(waiting, 5.0)
        return batch, len(buffer)

    batch, size = asyncio.run(scenario())
    assert batch is None and size == 2
