"""The replay buffer as a Ray actor: the tests that start a Ray cluster or a vLLM engine.

The tests without either: tests/unit/test_replay_buffer.py.
"""

from __future__ import annotations

import pytest

from grpo.workers.replay_buffer import ReplayBufferActor
from tests.unit.test_replay_buffer import group


@pytest.mark.slow
def test_actor_in_ray_hands_the_batch_out_as_its_own_object(ray_cluster):
    """Through Ray: the summary and the batch are separate objects, and an add from another
    caller wakes a sample that waits inside the actor."""
    ray = ray_cluster
    buffer = ray.remote(num_cpus=0)(ReplayBufferActor).remote(capacity=8, max_policy_lag=0)
    summary_ref, batch_ref = buffer.sample_batch.options(num_returns=2).remote(4, 0, 30.0)
    ray.get(buffer.add_groups.remote([group("a", 2)]))
    assert not ray.wait([summary_ref], timeout=0.2)[0]  # still waiting for 4
    ray.get(buffer.add_groups.remote([group("b", 2)]))
    summary = ray.get(summary_ref, timeout=10)
    assert summary["sequence_ids"] == ["a-0", "a-1", "b-0", "b-1"]
    assert [t.sequence_id for t in ray.get(batch_ref)] == summary["sequence_ids"]
    state = ray.get(buffer.state_dict.remote())
    assert state["items"] == [] and state["counters"]["num_sampled"] == 4
    ray.kill(buffer)
