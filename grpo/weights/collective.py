"""The ``collective`` transport: trainer rank 0 broadcasts the weights to each collector over a
two-rank process group of their own (gloo on CPU, NCCL on GPU).

Only tensor bytes cross the channel; names, shapes and dtypes travel through Ray.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from grpo.weights.base import ReceivingEnd, SendingEnd
from grpo.weights.channel import (
    RECEIVER_RANK,
    SENDER_RANK,
    TensorSpec,
    WeightChannel,
    WeightChannelError,
    tensor_specs,
)


class ChannelSender(SendingEnd):
    """Trainer rank 0's end: the weights of the latest gather and the open channels.

    Args:
        device: Where the buckets live: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL).
    """

    name = "collective"

    def __init__(self, owner: str, device: str) -> None:
        super().__init__(owner, device)
        self._channels: dict[str, tuple[WeightChannel, int]] = {}  # with its bucket size
        self._outgoing: tuple[int, Mapping[str, torch.Tensor]] | None = None

    def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
        """Hold ``weights`` as what every channel sends until the next gather.

        Returns:
            list[TensorSpec]: The specs the collectors rebuild the tensors from.
        """
        self._outgoing = (version, weights)
        return tensor_specs(weights)

    def connect(self, collector: str, timeout_s: float, bucket_bytes: int) -> dict[str, Any]:
        """Start the rendezvous of a new channel to ``collector``, closing any older one.

        Returns at once; the group is built in the background and `send` waits for it.

        Returns:
            dict: The address and settings the collector's `ChannelReceiver.receive` joins.
        """
        import ray

        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        self.close_channel(collector)
        channel = WeightChannel(collector, SENDER_RANK, host, 0, self.device, timeout_s=timeout_s)
        self._channels[collector] = (channel, bucket_bytes)
        return {
            "host": channel.host,
            "port": channel.port,
            "device": channel.device.type,
            "timeout_s": timeout_s,
            "bucket_bytes": bucket_bytes,
        }

    def send(self, collector: str, version: int) -> float:
        """Broadcast the held weights over ``collector``'s channel.

        Returns:
            float: Seconds the transfer took.

        Raises:
            WeightChannelError: No such channel, or the transfer failed or timed out (a dead
                collector); the channel is then closed and a new one must be opened.
            ValueError: The weights held are not of ``version``.
        """
        channel, bucket_bytes = self._channels.get(collector, (None, 0))
        if channel is None:
            raise WeightChannelError(f"{self.owner} has no weight channel to {collector}")
        held_version, hf_state = self._outgoing or (None, None)
        if held_version != version:
            # Closed so the collector waiting on the other end fails now, not at its timeout.
            self.close_channel(collector)
            raise ValueError(
                f"send to {collector}: asked for version {version}, {self.owner} holds "
                f"version {held_version} (gather the weights for the collective transport first)"
            )
        start = time.perf_counter()
        try:
            channel.send(hf_state, bucket_bytes)
        except WeightChannelError:
            if self._channels.get(collector, (None,))[0] is channel:  # not yet replaced
                del self._channels[collector]
            raise
        return time.perf_counter() - start

    def close_channel(self, collector: str) -> None:
        """Close the channel to ``collector``, if there is one."""
        channel, _ = self._channels.pop(collector, (None, 0))
        if channel is not None:
            channel.close()

    def close(self) -> None:
        """Close every channel."""
        for collector in list(self._channels):
            self.close_channel(collector)


class ChannelReceiver(ReceivingEnd):
    """A collector's end: one channel, one transfer at a time, in call order."""

    name = "collective"

    def __init__(self, owner: str) -> None:
        super().__init__(owner)
        self._lock = threading.Lock()
        self._channel: WeightChannel | None = None
        self._bucket_bytes = 0

    def receive(
        self, published: list[TensorSpec], connection: dict[str, Any] | None = None
    ) -> dict[str, torch.Tensor]:
        """Join a new channel if asked, then receive one broadcast version.

        Args:
            connection: `ChannelSender.connect`'s address of a new channel to join first;
                None: the open one.

        Returns:
            dict[str, torch.Tensor]: The received tensors (views into the received buckets).

        Raises:
            WeightChannelError: No channel, or the rendezvous or a broadcast failed or timed
                out.
        """
        with self._lock:
            if connection is not None:
                self.close()
                self._channel = WeightChannel(
                    self.owner,
                    RECEIVER_RANK,
                    connection["host"],
                    connection["port"],
                    device=connection["device"],
                    timeout_s=connection["timeout_s"],
                )
                self._bucket_bytes = connection["bucket_bytes"]
            if self._channel is None:
                raise WeightChannelError(f"{self.owner} has no weight channel; join one first")
            try:
                return self._channel.receive(published, self._bucket_bytes)
            except WeightChannelError:
                self._channel = None
                raise

    def close(self) -> None:
        """Close the channel, if there is one."""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
