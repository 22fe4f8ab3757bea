"""The interface every weight transport implements (driver side).

A transport is how the trainer's weights reach the collectors' engines. The driver
(`grpo.weights.sync.WeightSync`) gathers, sends and waits through this interface only; which
transport runs is the one lookup in `grpo.weights.sync.make_transport`. Each implementation
keeps its trainer- and collector-side helpers in its own module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from grpo.config.sections import WeightSyncConfig

# `ray.get` that names a failed actor (`ActorSupervisor.get_all`).
GetAll = Callable[[list[Any], str], list[Any]]


class WeightTransport(ABC):
    """Moves one gathered version of the weights from trainer rank 0 to collectors.

    Args:
        config (WeightSyncConfig): The ``weight_sync:`` options.
        get_all (GetAll): `ray.get` that names a failed actor.
    """

    def __init__(self, config: WeightSyncConfig, get_all: GetAll) -> None:
        self.config = config
        self._get_all = get_all

    @abstractmethod
    def gather(self, trainers: list[Any]) -> list[Any]:
        """Start the gather on every trainer rank (it is collective).

        Returns:
            list: One ObjectRef per rank; rank 0's resolves to the payload
            (``{"weights", "version", "checksum", "probe", "specs"}``), the others' to None.
        """

    @abstractmethod
    def send(self, sender: Any, name: str, collector: Any, payload: dict[str, Any]) -> None:
        """Start sending ``payload`` from trainer rank 0 (``sender``) to one collector."""

    @abstractmethod
    def finish(self, collector: Any) -> None:
        """Wait until the send in flight to ``collector`` (if any) is done.

        A collector that died meanwhile is left to be replaced (its generation call finds it
        dead); a live actor's failure stops the run.

        Raises:
            ActorFailedError: A live collector or the trainer failed; names which.
        """

    @abstractmethod
    def forget(self, name: str) -> None:
        """Drop what the transport holds for a collector that was replaced."""
