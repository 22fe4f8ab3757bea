"""The ``object_store`` transport: trainer rank 0 puts the HF state dict into Ray's object store
once, and the same reference reaches every collector, which resolves it when it applies it."""

from __future__ import annotations

import logging
from typing import Any

from ray.exceptions import RayActorError

from grpo.weights.base import COLLECTOR_WEIGHTS_GROUP, WeightTransport

log = logging.getLogger("grpo")


class ObjectStoreTransport(WeightTransport):
    """Weights as one object in Ray's object store (`PyTorchActorModel.gather_hf_weights`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # By collector actor id: the receipt of the update sent to it, until finished.
        self._receipts: dict[str, tuple[str, Any]] = {}

    def gather(self, trainers: list[Any]) -> list[Any]:
        return [trainer.gather_hf_weights.remote() for trainer in trainers]

    def send(self, sender: Any, name: str, collector: Any, payload: dict[str, Any]) -> None:
        receive = collector.receive_weights.options(concurrency_group=COLLECTOR_WEIGHTS_GROUP)
        receipt = receive.remote(
            payload["weights"], payload["version"], payload["checksum"], payload["probe"]
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
