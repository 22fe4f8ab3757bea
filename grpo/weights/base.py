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
from grpo.errors import WeightTransferError

# `ray.get` that names a failed actor (`ActorSupervisor.get_all`).
GetAll = Callable[[list[Any], str], list[Any]]

# The collector actor's concurrency groups beside its default one (generation, evaluation):
# weights arrive on a thread of their own and the driver's heartbeat is answered on another,
# so neither ever waits for a free thread behind generation or behind a slow transfer.
COLLECTOR_WEIGHTS_GROUP = "weights"
COLLECTOR_HEALTH_GROUP = "health"
COLLECTOR_CONCURRENCY_GROUPS = {COLLECTOR_WEIGHTS_GROUP: 1, COLLECTOR_HEALTH_GROUP: 1}


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
        """Wait until the send in flight to ``collector`` (if any) is done, at most
        `wait_limit_s`.

        A collector that died meanwhile is left to be replaced (its generation call finds it
        dead).

        Raises:
            WeightTransferError: The transfer failed or did not finish in time (`WeightSync`
                retries it on a fresh channel, then replaces the collector).
            TrainerDiedError: Trainer rank 0 died sending.
        """

    def wait_limit_s(self) -> float:
        """How long `finish` waits: the transfer's own timeout, and time to report it."""
        return 1.5 * self.config.timeout_s + 10.0

    def wait(self, name: str, refs: list[Any]) -> None:
        """Wait for a transfer's calls in order, within `wait_limit_s` in all; a failure or a
        timeout is a `WeightTransferError` (the first call's failure is seen before the next
        is waited for: a collector that died does not wait out the trainer's timeout).

        Raises:
            WeightTransferError: Naming the collector and the cause.
            RayActorError: The actor of a call died.
        """
        import time

        import ray

        deadline = time.monotonic() + self.wait_limit_s()
        for ref in refs:
            ray.wait([ref], timeout=max(deadline - time.monotonic(), 0.0))
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError as error:
                raise WeightTransferError(
                    f"weight transfer to {name} did not finish within {self.wait_limit_s():.0f} s "
                    f"(weight_sync.timeout_s={self.config.timeout_s:g})"
                ) from error
            except ray.exceptions.RayActorError:
                raise
            except ray.exceptions.RayError as error:  # the call raised, or its result was lost
                cause = getattr(error, "cause", None)
                lines = str(cause if cause is not None else error).splitlines()
                raise WeightTransferError(
                    f"weight transfer to {name} failed: {lines[-1] if lines else error}"
                ) from error

    @abstractmethod
    def forget(self, name: str) -> None:
        """Drop what the transport holds for a collector that was replaced."""
