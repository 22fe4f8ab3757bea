"""Trajectories survive pickling (how they cross Ray) exactly, as tensors, without torch's
per-tensor storage protocol."""

from __future__ import annotations

import pickle

import torch

from grpo.types import GroupedUnscoredTrajectories, ScoredTrajectory, UnscoredTrajectory


def unscored(index: int) -> UnscoredTrajectory:
    return UnscoredTrajectory(
        prompt_tokens=torch.tensor([5, 6, 7]),
        response_tokens=torch.tensor([8, 9, 10, 11]),
        prompt_len=3,
        response_len=4,
        logprobs=torch.tensor([-0.5, -1.0, 0.0, -2.0]),
        answer="42",
        sequence_id=f"s{index}",
        policy_version=3,
        group_id=1,
        response_mask=torch.tensor([True, False, False, True]),
        env_rewards={"tool": 1.0},
        last_policy_version=4,
    )


def scored() -> ScoredTrajectory:
    return ScoredTrajectory(
        prompt_tokens=torch.tensor([5, 6, 7]),
        response_tokens=torch.tensor([8, 9]),
        prompt_len=3,
        response_len=2,
        logprobs=torch.tensor([-0.5, -1.0]),
        ref_logprobs=None,
        rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor(0.75),
        successes=torch.tensor([1.0, 0.0]),
        answer="42",
        sequence_id="s",
        group_id=1,
        reward_metadata={"func_names": ["a", "b"]},
        policy_version=2,
        episode_stats={"turns": 2.0},
    )


def assert_same(copy, original) -> None:
    assert type(copy) is type(original)
    assert copy.__dict__.keys() == original.__dict__.keys()
    for name, value in original.__dict__.items():
        if isinstance(value, torch.Tensor):
            got = getattr(copy, name)
            assert isinstance(got, torch.Tensor), name
            assert got.dtype == value.dtype and got.shape == value.shape, name
            assert torch.equal(got, value), name
        elif not isinstance(value, list):
            assert getattr(copy, name) == value, name


def out_of_band_round_trip(obj):
    """Pickle protocol 5 with read-only out-of-band buffers, as Ray's zero-copy reads give;
    the copy and the buffers' bytes."""
    buffers = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    stored = [bytes(b.raw()) for b in buffers]
    copy = pickle.loads(data, buffers=[memoryview(b).toreadonly() for b in stored])
    return copy, stored


def test_trajectories_round_trip_as_arrays():
    group = GroupedUnscoredTrajectories.from_trajectories([unscored(0), unscored(1)])
    for original in (unscored(0), scored(), group):
        data = pickle.dumps(original)
        assert b"_rebuild_tensor" not in data  # no torch storage pickling
        for copy in (pickle.loads(data), out_of_band_round_trip(original)[0]):
            if isinstance(original, GroupedUnscoredTrajectories):
                assert copy.group_id == original.group_id
                for got, expected in zip(copy.trajectories, original.trajectories):
                    assert_same(got, expected)
            else:
                assert_same(copy, original)


def test_read_only_buffers_become_writable_tensors():
    copy, stored = out_of_band_round_trip(unscored(0))
    assert stored, "numpy arrays go out of band"
    before = [bytearray(b) for b in stored]  # copies
    for value in copy.__dict__.values():
        if isinstance(value, torch.Tensor):
            value.zero_()  # a tensor over the read-only buffer would write into it
    assert [bytearray(b) for b in stored] == before


def test_tensors_numpy_cannot_hold_pickle_as_tensors():
    trajectory = unscored(0)
    trajectory.logprobs = trajectory.logprobs.to(torch.bfloat16)
    copy = pickle.loads(pickle.dumps(trajectory))
    assert copy.logprobs.dtype == torch.bfloat16
    assert torch.equal(copy.logprobs, trajectory.logprobs)
