"""The ``object_store`` transport: trainer rank 0 puts the HF state dict into Ray's object store
once, and the same reference reaches every collector.

Three parts, each in the process that runs it:

* `ObjectStoreSender`, inside trainer rank 0: puts each version into the object store;
* `ObjectStoreReceiver`, inside a collector: takes the weights as they come (Ray resolves the
  reference of a call's argument before the call runs);
* `ObjectStoreTransport`, in the driver: hands the reference to each collector and waits for
  its receipt.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ray.exceptions import RayActorError

from grpo.weights.base import CollectorEnd, TrainerEnd, WeightTransport
from grpo.weights.concurrency import COLLECTOR_WEIGHTS_GROUP

if TYPE_CHECKING:
    import torch

log = logging.getLogger("grpo")


class ObjectStoreSender(TrainerEnd):
    """Trainer rank 0's end: each version put into Ray's object store once."""

    def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Put ``weights`` into the object store (when Ray runs; otherwise pass them as they are).

        Put once, from here: the driver handles only the reference and every collector reads
        the same object.
        """
        import ray

        return {"weights": ray.put(weights) if ray.is_initialized() else weights, "specs": None}


class ObjectStoreReceiver(CollectorEnd):
    """A collector's end: the weights are what arrived."""

    def fetch(self, sent: Any) -> Any:
        """``sent`` itself: the state dict (Ray resolved the reference the driver passed), or a
        reference a caller passed inside the process, resolved when the update is applied."""
        return sent


class ObjectStoreTransport(WeightTransport):
    """Driver side: the trainer's object reference to every collector, one receipt each."""

    name = "object_store"
    trainer_end = ObjectStoreSender
    collector_end = ObjectStoreReceiver

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # By collector actor id: the receipt of the update sent to it, until finished.
        self._receipts: dict[str, tuple[str, Any]] = {}

    def send(self, sender: Any, name: str, collector: Any, payload: dict[str, Any]) -> None:
        receive = collector.receive_weights.options(concurrency_group=COLLECTOR_WEIGHTS_GROUP)
        receipt = receive.remote(
            payload["weights"], payload["version"], payload["checksum"], payload["probe"], self.name
        )
        self._receipts[collector._actor_id.hex()] = (name, receipt)

    def finish(self, collector: Any) -> None:
        name, receipt = self._receipts.pop(collector._actor_id.hex(), (None, None))
        if receipt is None:
            return
        try:
            self.wait(name, [receipt])
        except RayActorError:
            # Dead: its generation call finds it and has it replaced (the replacement catches up).
            log.warning("%s died while receiving weights; it will be replaced", name)

    def forget(self, name: str) -> None:
        for key in [key for key, (owner, _) in self._receipts.items() if owner == name]:
            del self._receipts[key]
