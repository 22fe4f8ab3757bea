"""The weight transports by config name: the one place a transport is chosen."""

from __future__ import annotations

from grpo.config.sections import WeightSyncConfig
from grpo.weights.base import GetAll, WeightTransport
from grpo.weights.collective import CollectiveTransport
from grpo.weights.object_store import ObjectStoreTransport

TRANSPORT_CLASSES: dict[str, type[WeightTransport]] = {
    "collective": CollectiveTransport,
    "object_store": ObjectStoreTransport,
}


def make_transport(config: WeightSyncConfig, get_all: GetAll) -> WeightTransport:
    """The driver side of the transport ``weight_sync.transport`` names.

    Args:
        config (WeightSyncConfig): The ``weight_sync:`` options.
        get_all (GetAll): `ray.get` that names a failed actor.

    Returns:
        WeightTransport: A fresh transport.
    """
    return TRANSPORT_CLASSES[config.transport](config, get_all)
