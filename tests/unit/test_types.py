"""Trajectories survive pickling (how they cross Ray) exactly, as tensors, without torch's
per-tensor storage protocol; a copy unpacks its tensors only when one is read."""

from __future__ import annotations

import pickle

import numpy as np
import torch

from grpo.types import GroupedUnscoredTrajectories, ScoredTrajectory, UnscoredTrajectory

PACKED = "_packed_tensors"


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
    for name, value in original.__dict__.items():
        if isinstance(value, torch.Tensor):
            got = getattr(copy, name)
            assert isinstance(got, torch.Tensor), name
            assert got.dtype == value.dtype and got.shape == value.shape, name
            assert torch.equal(got, value), name
        elif not isinstance(value, list):
            assert getattr(copy, name) == value, name
    assert copy.__dict__.keys() == original.__dict__.keys()  # unpacked by the reads above


def out_of_band_round_trip(obj):
    """Pickle protocol 5 with read-only out-of-band buffers, as Ray's zero-copy reads give;
    the copy and the buffers' bytes."""
    buffers = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    stored = [bytes(b.raw()) for b in buffers]
    copy = pickle.loads(data, buffers=[memoryview(b).toreadonly() for b in stored])
    return copy, stored


def test_trajectories_round_trip_in_one_buffer():
    group = GroupedUnscoredTrajectories.from_trajectories([unscored(0), unscored(1)])
    empty = unscored(2)
    empty.response_tokens, empty.logprobs = torch.tensor([], dtype=torch.long), torch.tensor([])
    empty.response_len, empty.response_mask = 0, None
    for original in (unscored(0), scored(), group, empty):
        data = pickle.dumps(original)
        assert b"_rebuild_tensor" not in data  # no torch storage pickling
        for copy in (pickle.loads(data), out_of_band_round_trip(original)[0]):
            if isinstance(original, GroupedUnscoredTrajectories):
                assert copy.group_id == original.group_id
                for got, expected in zip(copy.trajectories, original.trajectories):
                    assert_same(got, expected)
            else:
                assert_same(copy, original)


def test_a_copy_passed_on_unread_keeps_its_buffer_and_reads_its_ids():
    original = scored()
    copy = pickle.loads(pickle.dumps(original))
    # What the rollout queue and the replay buffer read: no tensor among them.
    assert (copy.sequence_id, copy.group_id, copy.policy_version) == ("s", 1, 2)
    assert not hasattr(copy, "no_such_field")
    assert PACKED in copy.__dict__ and "logprobs" not in copy.__dict__
    passed_on = pickle.loads(pickle.dumps(copy))
    assert passed_on.__dict__[PACKED].data == copy.__dict__[PACKED].data
    assert_same(passed_on, original)
    assert PACKED not in passed_on.__dict__


def test_a_tensor_field_with_a_default_reads_as_sent_first():
    # ``response_mask`` defaults to None: read first, it must not read as that default.
    copy = pickle.loads(pickle.dumps(unscored(0)))
    assert PACKED in copy.__dict__
    assert torch.equal(copy.response_mask, torch.tensor([True, False, False, True]))
    fields = {k: v for k, v in unscored(0).__dict__.items() if k != "response_mask"}
    assert UnscoredTrajectory(**fields).response_mask is None  # the default still applies
    without_mask = unscored(1)
    without_mask.response_mask = None
    copy = pickle.loads(pickle.dumps(without_mask))
    assert copy.response_mask is None and PACKED in copy.__dict__  # still packed, unread


def test_a_field_set_on_a_packed_copy_keeps_its_new_value():
    copy = pickle.loads(pickle.dumps(scored()))
    copy.advantages = torch.tensor(-1.0)  # set while the others are still packed
    assert torch.equal(copy.logprobs, torch.tensor([-0.5, -1.0]))  # unpacks the others
    assert float(copy.advantages) == -1.0
    again = pickle.loads(pickle.dumps(copy))
    assert float(again.advantages) == -1.0 and torch.equal(again.rewards, scored().rewards)


def test_unpacked_tensors_are_writable_and_apart():
    original = unscored(0)
    copy, stored = out_of_band_round_trip(original)
    before = [bytearray(b) for b in stored]
    copy.logprobs.zero_()
    copy.response_tokens.fill_(-1)
    assert torch.equal(copy.prompt_tokens, original.prompt_tokens)  # its neighbour kept
    assert torch.equal(copy.response_mask, original.response_mask)
    assert original.logprobs.abs().sum() > 0  # the original is not shared
    assert [bytearray(b) for b in stored] == before


def test_trajectories_pickled_with_numpy_arrays_still_load():
    # The state an earlier version wrote (a checkpoint's unscored groups): numpy arrays.
    original = unscored(0)
    old_state = {
        name: value.numpy() if isinstance(value, torch.Tensor) else value
        for name, value in original.__dict__.items()
    }
    assert isinstance(old_state["logprobs"], np.ndarray)
    copy = UnscoredTrajectory.__new__(UnscoredTrajectory)
    copy.__setstate__(old_state)
    assert_same(copy, original)


def test_bfloat16_tensors_round_trip():
    trajectory = unscored(0)
    trajectory.logprobs = trajectory.logprobs.to(torch.bfloat16)
    copy = pickle.loads(pickle.dumps(trajectory))
    assert copy.logprobs.dtype == torch.bfloat16
    assert torch.equal(copy.logprobs, trajectory.logprobs)
