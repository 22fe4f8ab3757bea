"""The bounded queue between the collectors and the reference actors.

A ``ray.util.queue.Queue`` (collectors feel back-pressure when it is full) plus `put_all`, one
round trip for a whole generation batch, and `take`, whose first return names the groups taken
and whose second (the groups) the driver hands to a reference actor unfetched, and to its
replacement if that actor dies.
"""

from __future__ import annotations

import asyncio
import queue
from typing import Any

import ray
from ray.util.queue import Queue, _QueueActor

from grpo.workers.gc_pause import resumes_gc


class _RolloutQueueActor(_QueueActor):
    def __init__(self, maxsize: int) -> None:
        # The groups it holds unpickle into torch tensors: torch and the trajectory types are
        # imported while the run starts, not in the collector's first put, which waits on it.
        import grpo.types  # noqa: F401

        super().__init__(maxsize)

    async def put_all(self, items: list[Any], timeout_s: float) -> int:
        """Queue ``items`` in order, waiting up to ``timeout_s`` for room for each one.

        Returns:
            int: How many were queued: all of them, or the count before the one that waited
            ``timeout_s`` for room in vain (the rest are not queued).
        """
        for count, item in enumerate(items):
            try:
                await asyncio.wait_for(self.queue.put(item), timeout_s)
            except asyncio.TimeoutError:
                return count
        return len(items)

    async def take(self, max_items: int, timeout_s: float) -> tuple[list[Any], list[Any]]:
        """Up to ``max_items`` groups, waiting at most ``timeout_s`` for the first one, and
        their group ids."""
        items: list[Any] = []
        if self.queue.empty():
            if timeout_s <= 0:
                return [], items
            try:
                items.append(await asyncio.wait_for(self.queue.get(), timeout_s))
            except asyncio.TimeoutError:
                return [], items
        while len(items) < max_items and not self.queue.empty():
            items.append(self.queue.get_nowait())
        return [getattr(item, "group_id", None) for item in items], items


class RolloutQueue(Queue):
    """A ``ray.util.queue.Queue`` whose actor also has `take` (see the module docstring).

    Args:
        maxsize: Capacity in groups; ``put`` blocks (or times out) when full.
    """

    def __init__(self, maxsize: int = 0, actor_options: dict[str, Any] | None = None) -> None:
        self.maxsize = maxsize
        actor_cls = ray.remote(resumes_gc(_RolloutQueueActor))
        self.actor = actor_cls.options(**(actor_options or {})).remote(maxsize)

    def put_all(self, items: list[Any], timeout_s: float) -> int:
        """Queue ``items`` in one round trip; how many went in (`_RolloutQueueActor.put_all`)."""
        return ray.get(self.actor.put_all.remote(items, timeout_s))

    def take(self, max_items: int, timeout_s: float) -> tuple[Any, Any]:
        """Start a take: ``(group_ids_ref, groups_ref)``, both owned by the caller."""
        return self.actor.take.options(num_returns=2).remote(max_items, timeout_s)


def put_all(rollout_queue: Any, items: list[Any], timeout_s: float) -> int:
    """Queue ``items`` in order on any queue, each waiting up to ``timeout_s`` for room.

    Returns:
        int: How many were queued: all of them, or the count before the one that timed out.
    """
    if hasattr(rollout_queue, "put_all"):
        return rollout_queue.put_all(items, timeout_s)
    for count, item in enumerate(items):
        try:
            rollout_queue.put(item, block=True, timeout=timeout_s)
        except queue.Full:  # ray.util.queue.Full subclasses queue.Full
            return count
    return len(items)
