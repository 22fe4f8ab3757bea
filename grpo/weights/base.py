"""The two ends of a weight transport: `SendingEnd` in trainer rank 0, `ReceivingEnd` in a
collector. ``connect`` is called once per collector (again after a failure), then ``send``
beside ``receive``.
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
        owner: The trainer's name (``training[0]``), for errors.
        device: Where the trainer's tensors live: ``"cpu"`` or ``"cuda"``.
    """

    name: ClassVar[str]  # the transport's, as ``weight_sync.transport`` names it

    def __init__(self, owner: str, device: str) -> None:
        self.owner = owner
        self.device = device

    @abstractmethod
    def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> Any:
        """Make ``weights`` the version this end sends, until the next one.

        ``weights`` is the full state dict under HF names.

        Returns:
            What every collector's `ReceivingEnd.receive` is handed for this version.
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
    """A transport's end inside a collector; ``owner`` (``inference[0]``) names it in errors."""

    name: ClassVar[str]

    def __init__(self, owner: str) -> None:
        self.owner = owner

    @abstractmethod
    def receive(self, published: Any, connection: Any = None) -> Any:
        """The weights of one update (on the collector's ``weights`` thread).

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
