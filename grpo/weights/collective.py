"""The ``collective`` transport: trainer rank 0 broadcasts the weights to each collector over a
two-rank process group of their own (`grpo.weights.channel`: gloo on CPU, NCCL on GPU).

Three sides, each in the process that runs it:

* `ChannelSender`, inside trainer rank 0: holds the gathered weights of the latest version and
  one open channel per collector, and broadcasts them on request;
* `ChannelReceiver`, inside a collector: joins a channel and receives one version at a time;
* `CollectiveTransport`, in the driver: opens channels (a replacement collector gets a new
  one), starts each transfer as a pair of calls (the trainer sends, the collector receives a
  `ChannelTransfer`), and waits for it before the next on the same channel, which keeps
  versions in order.

Only tensor bytes cross the channel; names, shapes and dtypes (`TensorSpec`) travel once
through Ray, in the gathered payload.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grpo.errors import TrainerDiedError
from grpo.weights.base import CollectorEnd, TrainerEnd, WeightTransport
from grpo.weights.channel import (
    RECEIVER_RANK,
    SENDER_RANK,
    TensorSpec,
    WeightChannel,
    WeightChannelError,
    tensor_specs,
)
from grpo.weights.concurrency import COLLECTOR_WEIGHTS_GROUP, TRAINER_CHANNEL_GROUP

log = logging.getLogger("grpo")


@dataclass(frozen=True)
class ChannelTransfer:
    """What a collector needs to receive one version over its channel.

    Args:
        specs (Sequence[TensorSpec]): Names, shapes and dtypes, in the sender's order.
        bucket_bytes (int): The sender's bucket size.
        join (dict | None): ``{"host", "port", "device", "timeout_s"}`` of a new channel
            (`ChannelSender.open`) to join first, replacing any old one; None: the open one.
    """

    specs: Sequence[TensorSpec]
    bucket_bytes: int
    join: dict[str, Any] | None = None


class ChannelSender(TrainerEnd):
    """Trainer rank 0's end: the weights of the latest gather and the open channels.

    Args:
        owner (str): The trainer's name, for errors (``trainer[0]``).
        device (str): Where the buckets live: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL).
    """

    def __init__(self, owner: str, device: str) -> None:
        super().__init__(owner, device)
        self._channels: dict[str, WeightChannel] = {}
        self._outgoing: tuple[int, Mapping[str, torch.Tensor]] | None = None

    def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Hold ``weights`` as what every channel sends until the next gather (a replacement
        collector's new channel included).

        Returns:
            dict: ``weights`` None (the tensors stay here) and ``specs``, the `TensorSpec` of
            each held tensor, for the collectors to rebuild them.
        """
        self._outgoing = (version, weights)
        return {"weights": None, "specs": tensor_specs(weights)}

    def open(self, collector: str, timeout_s: float) -> dict[str, Any]:
        """Start the rendezvous of a new channel to ``collector``; an older one is closed.

        Returns at once with the address the collector joins; the group is built in the
        background and `send` waits for it.

        Returns:
            dict: ``{"host", "port", "device"}`` for the collector's `ChannelTransfer.join`.
        """
        import ray

        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        self.close_channel(collector)
        channel = WeightChannel(collector, SENDER_RANK, host, 0, self.device, timeout_s)
        self._channels[collector] = channel
        return {"host": channel.host, "port": channel.port, "device": channel.device.type}

    def send(self, collector: str, version: int, bucket_bytes: int) -> float:
        """Broadcast the held weights over ``collector``'s channel.

        Returns:
            float: Seconds the transfer took.

        Raises:
            WeightChannelError: No such channel, or the transfer failed or timed out (a dead
                collector); the channel is then closed and a new one must be opened.
            ValueError: The weights held are not of ``version``.
        """
        channel = self._channels.get(collector)
        if channel is None:
            raise WeightChannelError(f"{self.owner} has no weight channel to {collector}")
        held_version, hf_state = self._outgoing or (None, None)
        if held_version != version:
            # Closed, so that the collector waiting on the other end fails now rather than at
            # its timeout; the next send opens a new channel.
            self.close_channel(collector)
            raise ValueError(
                f"send to {collector}: asked for version {version}, {self.owner} holds "
                f"version {held_version} (gather the weights for the collective transport first)"
            )
        start = time.perf_counter()
        try:
            channel.send(hf_state, bucket_bytes)
        except WeightChannelError:
            if self._channels.get(collector) is channel:  # not yet replaced by a new one
                del self._channels[collector]
            raise
        return time.perf_counter() - start

    def close_channel(self, collector: str) -> None:
        """Close the channel to ``collector``, if there is one."""
        channel = self._channels.pop(collector, None)
        if channel is not None:
            channel.close()

    def close(self) -> None:
        """Close every channel."""
        for collector in list(self._channels):
            self.close_channel(collector)


class ChannelReceiver(CollectorEnd):
    """A collector's end: one channel, one transfer at a time, in call order.

    Args:
        owner (str): The collector's name (``collector[0]``).
    """

    def __init__(self, owner: str) -> None:
        super().__init__(owner)
        self._lock = threading.Lock()
        self._channel: WeightChannel | None = None

    def fetch(self, sent: ChannelTransfer) -> dict[str, torch.Tensor]:
        """Join a new channel if asked, then receive one broadcast version.

        Args:
            sent (ChannelTransfer): The tensors' specs, the bucket size, and the channel to
                join first, if any.

        Returns:
            dict[str, torch.Tensor]: The received tensors (views into the received buckets).

        Raises:
            WeightChannelError: No channel, or the rendezvous or a broadcast failed or timed
                out.
        """
        join = sent.join
        with self._lock:
            if join is not None:
                self.close()
                self._channel = WeightChannel(
                    self.owner,
                    RECEIVER_RANK,
                    join["host"],
                    join["port"],
                    device=join["device"],
                    timeout_s=join["timeout_s"],
                )
            if self._channel is None:
                raise WeightChannelError(f"{self.owner} has no weight channel; join one first")
            try:
                return self._channel.receive(sent.specs, sent.bucket_bytes)
            except WeightChannelError:
                self._channel = None
                raise

    def close(self) -> None:
        """Close the channel, if there is one."""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()


class CollectiveTransport(WeightTransport):
    """Driver side: a channel per collector from trainer rank 0, one transfer in flight each."""

    name = "collective"
    trainer_end = ChannelSender
    collector_end = ChannelReceiver

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # By collector actor id (a replacement has the name of the collector it replaces):
        # the open channel's collector name, and the transfer in flight as (name, send, receive).
        self._channels: dict[str, str] = {}
        self._transfers: dict[str, tuple[str, Any, Any]] = {}

    def send(self, sender: Any, name: str, collector: Any, payload: dict[str, Any]) -> None:
        """Start a transfer; the previous one to ``collector`` must be finished (`finish`)."""
        config, key = self.config, collector._actor_id.hex()
        if key in self._transfers:
            raise RuntimeError(f"{name}: finish the weight transfer in flight before the next")
        join = None
        if key not in self._channels:
            opening = sender.open_weight_channel.options(
                concurrency_group=TRAINER_CHANNEL_GROUP
            ).remote(name, config.timeout_s)
            address = self._get_all([opening], f"trainer[0] opening the weight channel to {name}")
            join = {**address[0], "timeout_s": config.timeout_s}
            self._channels[key] = name
        version = payload["version"]
        sent = sender.send_weights.options(concurrency_group=TRAINER_CHANNEL_GROUP).remote(
            name, version, config.bucket_bytes
        )
        receive = collector.receive_weights.options(concurrency_group=COLLECTOR_WEIGHTS_GROUP)
        received = receive.remote(
            ChannelTransfer(payload["specs"], config.bucket_bytes, join),
            version,
            payload["checksum"],
            payload["probe"],
            self.name,
        )
        self._transfers[key] = (name, sent, received)

    def finish(self, collector: Any) -> None:
        """Wait for the transfer in flight to ``collector``, if any.

        A dead collector is left to its generation call, which finds it and has it replaced
        (the replacement catches up over a new channel; the trainer's send times out and
        closes the old one). Any other failure closes the channel: the next send opens a
        new one.

        Raises:
            WeightTransferError: The collector did not receive, or trainer[0] did not send,
                within the wait limit.
            TrainerDiedError: Trainer rank 0 died sending.
        """
        from ray.exceptions import RayActorError

        key = collector._actor_id.hex()
        transfer = self._transfers.pop(key, None)
        if transfer is None:
            return
        name, sent, received = transfer
        try:
            self.wait(name, [received, sent])
        except RayActorError as error:
            self._channels.pop(key, None)
            if self._died(received):
                log.warning("%s died during a weight transfer; it will be replaced", name)
                return
            raise TrainerDiedError(f"trainer[0] died sending weights to {name}: {error}") from error
        except Exception:
            self._channels.pop(key, None)
            raise

    @staticmethod
    def _died(ref: Any) -> bool:
        """Whether the call behind ``ref`` failed because its actor died."""
        import ray
        from ray.exceptions import RayActorError

        try:
            ray.get(ref, timeout=0)
        except RayActorError:
            return True
        except Exception:  # noqa: BLE001 - failed otherwise, or still running
            return False
        return False

    def forget(self, name: str) -> None:
        # The trainer closes its end of the old channel when the replacement's opens.
        for key in [key for key, channel in self._channels.items() if channel == name]:
            del self._channels[key]
            self._transfers.pop(key, None)
