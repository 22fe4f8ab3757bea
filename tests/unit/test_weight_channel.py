"""The weight channel: a two-rank gloo group per collector, flat buckets, timeouts."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from grpo.weights.channel import (
    ALIGN_BYTES,
    RECEIVER_RANK,
    SENDER_RANK,
    WeightChannel,
    WeightChannelError,
    plan_buckets,
    tensor_specs,
)

HOST = "127.0.0.1"


def mixed_state_dict() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(64, 32, generator=generator),
        "norm.weight": torch.randn(3, generator=generator, dtype=torch.float32).bfloat16(),
        "scale": torch.tensor(2.5, dtype=torch.float16),
        "big.weight": torch.randn(256, 64, generator=generator),  # 64 KiB: a bucket alone
        "steps": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


def open_pair(name: str, timeout_s: float) -> tuple[WeightChannel, WeightChannel]:
    sender = WeightChannel(name, SENDER_RANK, HOST, 0, timeout_s=timeout_s)
    receiver = WeightChannel(name, RECEIVER_RANK, HOST, sender.port, timeout_s=timeout_s)
    return sender, receiver


def test_buckets_are_aligned_and_cover_every_tensor():
    specs = tensor_specs(mixed_state_dict())
    buckets = plan_buckets(specs, bucket_bytes=16 * 1024)
    placed = [spec for bucket in buckets for spec, _ in bucket.entries]
    assert placed == specs
    for bucket in buckets:
        assert all(offset % ALIGN_BYTES == 0 for _, offset in bucket.entries)
        spec, offset = bucket.entries[-1]
        assert bucket.nbytes == offset + spec.nbytes
        # A bucket holds more than its budget only when it is one tensor bigger than that.
        assert bucket.nbytes <= 16 * 1024 or len(bucket.entries) == 1
    assert [len(b.entries) for b in buckets] == [3, 1, 2]


def test_tensors_arrive_exactly_as_views_into_the_buckets():
    weights = mixed_state_dict()
    sender, receiver = open_pair("inference[0]", timeout_s=30)
    received: list[dict[str, torch.Tensor]] = []
    thread = threading.Thread(
        target=lambda: received.extend(
            receiver.receive(tensor_specs(weights), 16 * 1024) for _ in range(2)
        )
    )
    thread.start()
    try:
        sender.send(weights, 16 * 1024)
        staging = sender._staging.data_ptr()
        weights = {
            name: tensor + 1 if tensor.is_floating_point() else tensor
            for name, tensor in weights.items()
        }
        sender.send(weights, 16 * 1024)  # a second transfer over the same group
        assert sender._staging.data_ptr() == staging  # packed into the same buffer
    finally:
        thread.join(30)
        sender.close()
        receiver.close()
    got = received[1]
    assert list(got) == list(weights)
    for name, tensor in weights.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    # Views, not copies: the tensors of one bucket share its storage.
    storage = got["embed.weight"].untyped_storage().data_ptr()
    assert got["norm.weight"].untyped_storage().data_ptr() == storage
    assert got["big.weight"].untyped_storage().data_ptr() != storage


def test_a_peer_that_never_joins_times_out_naming_the_collector():
    sender = WeightChannel("inference[3]", SENDER_RANK, HOST, 0, timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(WeightChannelError, match=r"inference\[3\].*rendezvous"):
        sender.send(mixed_state_dict(), 1024)
    assert time.monotonic() - start < 15


def test_a_peer_that_stops_receiving_times_out_and_closes_the_channel():
    sender, receiver = open_pair("inference[1]", timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(WeightChannelError, match=r"inference\[1\].*broadcast of bucket 0"):
        sender.send(mixed_state_dict(), 1024)
    assert time.monotonic() - start < 15
    # The pair is torn down: a new transfer needs a new channel.
    with pytest.raises(WeightChannelError, match=r"inference\[1\]"):
        sender.send(mixed_state_dict(), 1024)
    receiver.close()


def test_joining_a_store_that_is_not_there_names_the_collector():
    with pytest.raises(WeightChannelError, match=r"inference\[2\]"):
        WeightChannel("inference[2]", RECEIVER_RANK, HOST, 1, timeout_s=1.0)
