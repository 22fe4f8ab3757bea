"""The interfaces of a weight transport: its driver side and its two ends.

A transport is how the trainer's weights reach the collectors' engines. Each transport is one
module holding its three parts, each run in its own process:

* `TrainerEnd`, inside trainer rank 0: what it makes of each gathered version
  (`grpo.weights.publisher.WeightPublisher` calls it);
* `CollectorEnd`, inside a collector: what it makes of what the driver sent
  (`grpo.weights.receiver.EngineWeights` calls it);
* `WeightTransport`, in the driver: gathers, sends and waits; `grpo.weights.sync.WeightSync`
  drives it through this interface only.

Which transport runs is the one lookup in `grpo.weights.transports`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from grpo.config.sections import WeightSyncConfig
from grpo.errors import WeightTransferError

if TYPE_CHECKING:
    import torch

# `ray.get` that names a failed actor (`ActorSupervisor.get_all`).
GetAll = Callable[[list[Any], str], list[Any]]


class TrainerEnd(ABC):
    """A transport's end inside trainer rank 0.

    Args:
        owner (str): The trainer's name (``trainer[0]``), for errors.
        device (str): Where the trainer's tensors live: ``"cpu"`` or ``"cuda"``.
    """

    def __init__(self, owner: str, device: str) -> None:
        self.owner = owner
        self.device = device

    @abstractmethod
    def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Make ``weights`` the version this end hands out, until the next one.

        Args:
            version (int): Their policy version.
            weights (Mapping[str, torch.Tensor]): The full state dict under HF names.

        Returns:
            dict: The payload's ``weights`` (what the driver passes on to each collector's
            end, or None) and ``specs`` (the tensors' names, shapes and dtypes, or None).
        """

    def close(self) -> None:  # noqa: B027 - an end that holds nothing has nothing to close
        """Release what this end holds (open channels)."""


class CollectorEnd(ABC):
    """A transport's end inside a collector.

    Args:
        owner (str): The collector's name (``collector[0]``), for errors.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner

    @abstractmethod
    def fetch(self, sent: Any) -> Any:
        """The weights of one update, from what the driver sent for them.

        Runs on the collector's ``weights`` thread, beside generation.

        Args:
            sent: What the transport's driver side passed to the collector's
                ``receive_weights``.

        Returns:
            ``dict[str, Tensor]`` under HF names, or a Ray ``ObjectRef`` to one (resolved when
            the update is applied).
        """

    def close(self) -> None:  # noqa: B027 - an end that holds nothing has nothing to close
        """Release what this end holds (its channel)."""


class WeightTransport(ABC):
    """Moves one gathered version of the weights from trainer rank 0 to collectors.

    A subclass names its transport (``name``, the value of ``weight_sync.transport``) and its
    two ends (``trainer_end``, ``collector_end``).

    Args:
        config (WeightSyncConfig): The ``weight_sync:`` options.
        get_all (GetAll): `ray.get` that names a failed actor.
    """

    name: ClassVar[str]
    trainer_end: ClassVar[type[TrainerEnd]]
    collector_end: ClassVar[type[CollectorEnd]]

    def __init__(self, config: WeightSyncConfig, get_all: GetAll) -> None:
        self.config = config
        self._get_all = get_all

    def gather(self, trainers: list[Any]) -> list[Any]:
        """Start the gather on every trainer rank (it is collective); rank 0 publishes the
        weights through this transport's `TrainerEnd`.

        Returns:
            list: One ObjectRef per rank; rank 0's resolves to the payload
            (``{"weights", "version", "checksum", "probe", "specs"}``,
            `grpo.weights.publisher.WeightPublisher.publish`), the others' to None.
        """
        return [trainer.publish_weights.remote(self.name) for trainer in trainers]

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
