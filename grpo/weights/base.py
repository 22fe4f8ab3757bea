"""The two ends of a weight transport: `SendingEnd` in trainer rank 0, `ReceivingEnd` in a
collector.

A transport is how the trainer's weights reach the collectors' engines; each is one module
holding its two ends (`grpo.weights.object_store`, `grpo.weights.collective`), and each actor
builds only the end of the transport in use (`grpo.weights.transports`). Every transfer has
the same three calls, which the driver (`grpo.weights.sync.WeightSync`) makes whatever the
transport:

* ``connect`` (trainer rank 0, once per collector, and again after a failure): what the
  collector's end needs to reach the sending end (an address to join), or None;
* ``send`` (trainer rank 0, each version, each collector) beside ``receive`` (the collector):
  the collector's end turns what ``publish`` made of the version (passed on through Ray) into
  the weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


class SendingEnd(ABC):
    """A transport's end inside trainer rank 0.

    Args:
        owner (str): The trainer's name (``trainer[0]``), for errors.
        device (str): Where the trainer's tensors live: ``"cpu"`` or ``"cuda"``.
    """

    name: ClassVar[str]  # the transport's, as ``weight_sync.transport`` names it

    def __init__(self, owner: str, device: str) -> None:
        self.owner = owner
        self.device = device

    @abstractmethod
    def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> Any:
        """Make ``weights`` the version this end sends, until the next one.

        Args:
            version (int): Their policy version.
            weights (Mapping[str, torch.Tensor]): The full state dict under HF names.

        Returns:
            What every collector's `ReceivingEnd.receive` is handed for this version (through
            Ray): the payload's ``weights``.
        """

    def connect(self, collector: str, timeout_s: float, bucket_bytes: int) -> Any:
        """Prepare transfers to ``collector``, replacing any earlier connection to it.

        Returns:
            What its `ReceivingEnd.receive` needs to connect (an address), or None.
        """
        return None

    def send(self, collector: str, version: int) -> float:
        """This end's part of a transfer of ``version`` to ``collector``; the seconds it took."""
        return 0.0

    def close(self) -> None:  # noqa: B027 - an end that holds nothing has nothing to close
        """Release what this end holds (open channels)."""


class ReceivingEnd(ABC):
    """A transport's end inside a collector.

    Args:
        owner (str): The collector's name (``collector[0]``), for errors.
    """

    name: ClassVar[str]

    def __init__(self, owner: str) -> None:
        self.owner = owner

    @abstractmethod
    def receive(self, published: Any, connection: Any = None) -> Any:
        """The weights of one update. Runs on the collector's ``weights`` thread, beside
        generation.

        Args:
            published: What the sending end's `SendingEnd.publish` returned.
            connection: What its `SendingEnd.connect` returned, for a new connection; None:
                the one open.

        Returns:
            ``dict[str, Tensor]`` under HF names, or a Ray ``ObjectRef`` to one (resolved when
            the update is applied).
        """

    def close(self) -> None:  # noqa: B027 - an end that holds nothing has nothing to close
        """Release what this end holds (its channel)."""
