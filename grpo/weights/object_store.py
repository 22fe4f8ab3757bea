"""The ``object_store`` transport: trainer rank 0 puts the state dict into Ray's object store
once and every collector receives the same reference; nothing to connect or send per collector.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from grpo.weights.base import ReceivingEnd, SendingEnd

if TYPE_CHECKING:
    import torch


class ObjectStoreSender(SendingEnd):
    """Trainer rank 0's end: each version put into Ray's object store once."""

    name = "object_store"

    def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> Any:
        """A reference to ``weights`` in the object store, or ``weights`` without Ray."""
        import ray

        return ray.put(weights) if ray.is_initialized() else weights


class ObjectStoreReceiver(ReceivingEnd):
    """A collector's end: the weights are what arrived."""

    name = "object_store"

    def receive(self, published: Any, connection: Any = None) -> Any:
        """``published`` itself: the state dict Ray resolved, or a reference resolved later."""
        return published
