"""The weight transports by config name (``weight_sync.transport``): the one place a transport
is chosen; each actor builds only its own end of it."""

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
    """Trainer rank 0's end of ``transport`` (a `SENDING_ENDS` key)."""
    return SENDING_ENDS[transport](owner, device)


def receiving_end(transport: str, owner: str) -> ReceivingEnd:
    """A collector's end of ``transport`` (a `RECEIVING_ENDS` key)."""
    return RECEIVING_ENDS[transport](owner)
