"""The weight transports by config name: the one place a transport is chosen.

Trainer rank 0 and each collector build the end of the transport the driver's first call names
(``weight_sync.transport``), and only that one.
"""

from __future__ import annotations

from grpo.weights.base import ReceivingEnd, SendingEnd
from grpo.weights.collective import ChannelReceiver, ChannelSender
from grpo.weights.object_store import ObjectStoreReceiver, ObjectStoreSender

SENDING_ENDS: dict[str, type[SendingEnd]] = {
    cls.name: cls for cls in (ChannelSender, ObjectStoreSender)
}
RECEIVING_ENDS: dict[str, type[ReceivingEnd]] = {
    cls.name: cls for cls in (ChannelReceiver, ObjectStoreReceiver)
}


def sending_end(transport: str, owner: str, device: str) -> SendingEnd:
    """Trainer rank 0's end of ``transport``.

    Args:
        transport (str): ``weight_sync.transport``.
        owner (str): The trainer's name (``trainer[0]``).
        device (str): Where its tensors live: ``"cpu"`` or ``"cuda"``.
    """
    return SENDING_ENDS[transport](owner, device)


def receiving_end(transport: str, owner: str) -> ReceivingEnd:
    """A collector's end of ``transport``.

    Args:
        transport (str): ``weight_sync.transport``.
        owner (str): The collector's name (``collector[0]``).
    """
    return RECEIVING_ENDS[transport](owner)
