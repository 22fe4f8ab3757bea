"""Trainer rank 0's side of weight sync: each gathered version, published for the collectors.

`WeightPublisher` is the sending side inside a trainer (`PyTorchActorModel` holds one, and its
actor methods delegate to it). It turns a gathered state dict into the payload the driver
(`grpo.weights.sync.WeightSync`) moves: the version, the checksum both ends compute, the
trainer's probe logprobs, and what the transport the driver uses makes of the tensors
(`grpo.weights.base.TrainerEnd.publish`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch

from grpo.weights.checksum import state_dict_checksum
from grpo.weights.collective import ChannelSender, CollectiveTransport
from grpo.weights.transports import trainer_ends


class WeightPublisher:
    """Publishes the trainer's weights through every transport's trainer end.

    Args:
        owner (str): The trainer's name (``trainer[0]``), for errors.
        device (str): Where its tensors live: ``"cpu"`` or ``"cuda"`` (the collective
            transport's buckets, hence its backend, follow it).
    """

    def __init__(self, owner: str, device: str) -> None:
        self.ends = trainer_ends(owner, device)

    def publish(
        self,
        transport: str,
        version: int,
        weights: Mapping[str, torch.Tensor],
        probe: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """Publish ``weights`` of ``version`` through ``transport``.

        Args:
            transport (str): The transport the driver uses (``weight_sync.transport``).
            version (int): Their policy version.
            weights (Mapping[str, torch.Tensor]): The full state dict under HF names.
            probe (dict | None): The trainer's logprobs of a probe sequence
                (`grpo.weights.engine.WeightUpdate`), which the collectors reproduce.

        Returns:
            dict: The payload ``{"weights", "version", "checksum", "probe", "specs"}``;
            ``weights`` and ``specs`` are the transport's (`TrainerEnd.publish`).
        """
        return {
            "version": version,
            "checksum": state_dict_checksum(weights),
            "probe": probe,
            **self.ends[transport].publish(version, weights),
        }

    @property
    def channels(self) -> ChannelSender:
        """The collective transport's end: one channel per collector, opened and sent over
        by the driver's calls."""
        return cast(ChannelSender, self.ends[CollectiveTransport.name])

    def close(self) -> None:
        """Close every end (the collective transport's channels)."""
        for end in self.ends.values():
            end.close()
