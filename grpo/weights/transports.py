"""The weight transports by config name: the one place a transport is chosen.

The driver makes the transport ``weight_sync.transport`` names (`make_transport`); trainer rank
0 and each collector hold the ends of every transport (`trainer_ends`, `collector_ends`), and
the driver's calls name the one to use.
"""

from __future__ import annotations

from grpo.config.sections import WeightSyncConfig
from grpo.weights.base import CollectorEnd, GetAll, TrainerEnd, WeightTransport
from grpo.weights.collective import CollectiveTransport
from grpo.weights.object_store import ObjectStoreTransport

TRANSPORT_CLASSES: dict[str, type[WeightTransport]] = {
    cls.name: cls for cls in (CollectiveTransport, ObjectStoreTransport)
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


def trainer_ends(owner: str, device: str) -> dict[str, TrainerEnd]:
    """A trainer's end of every transport, by transport name.

    Args:
        owner (str): The trainer's name (``trainer[0]``).
        device (str): Where its tensors live: ``"cpu"`` or ``"cuda"``.
    """
    return {name: cls.trainer_end(owner, device) for name, cls in TRANSPORT_CLASSES.items()}


def collector_ends(owner: str) -> dict[str, CollectorEnd]:
    """A collector's end of every transport, by transport name.

    Args:
        owner (str): The collector's name (``collector[0]``).
    """
    return {name: cls.collector_end(owner) for name, cls in TRANSPORT_CLASSES.items()}
