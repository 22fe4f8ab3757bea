"""The replay buffer between the reference actor and the trainer.

It samples without replacement (each trajectory is trained on once by default), drops and
counts trajectories more than `max_policy_lag` training steps stale, and adds whole groups or
nothing, so a caller facing a full buffer waits and retries rather than losing data.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from typing import Any

from grpo.config.options import checked_options
from grpo.config.sections import BufferCapacity, PolicyLag
from grpo.types import ScoredTrajectory


class ReplayBuffer:
    """A bounded buffer of scored trajectories, sampled without replacement.

    Args:
        capacity: Most trajectories held at once.
        max_policy_lag: Trajectories more than this many training steps behind the
            trainer's version are dropped at sampling time.
        sampling: ``"fifo"`` (oldest first, deterministic) or ``"random"`` (seeded).

    Raises:
        ValueError: On a non-positive capacity or reuse count, a negative lag or an unknown
            sampling mode.
    """

    @checked_options  # the bounds the config declares for its options
    def __init__(
        self,
        capacity: BufferCapacity,
        max_policy_lag: PolicyLag,
        sampling: str = "fifo",
        seed: int = 0,
        reuse_count: int = 1,
    ) -> None:
        if sampling not in ("fifo", "random"):
            raise ValueError(f"sampling must be 'fifo' or 'random', got {sampling!r}")
        if reuse_count < 1:
            raise ValueError(f"reuse_count must be >= 1, got {reuse_count}")
        self.capacity = capacity
        self.max_policy_lag = max_policy_lag
        self.sampling = sampling
        self.reuse_count = reuse_count
        self._rng = random.Random(seed)
        # Each entry is [trajectory, times it may still be sampled].
        self._items: deque[list[Any]] = deque()
        self.num_added = 0
        self.num_sampled = 0
        self.num_dropped_stale = 0
        self.num_rejected_full = 0
        self._last_policy_ages: list[int] = []

    def __len__(self) -> int:
        return len(self._items)

    def add(self, trajectories: list[ScoredTrajectory]) -> bool:
        """Add a whole group, or nothing if it does not fit.

        Returns:
            bool: False if the buffer had no room (nothing was added).

        Raises:
            ValueError: If the group alone is larger than the capacity (it could never fit).
        """
        if len(trajectories) > self.capacity:
            raise ValueError(
                f"a group of {len(trajectories)} trajectories can never fit a replay buffer "
                f"of capacity {self.capacity}: raise orchestration.replay_buffer_size"
            )
        if len(self._items) + len(trajectories) > self.capacity:
            self.num_rejected_full += 1
            return False
        for trajectory in trajectories:
            self._items.append([trajectory, self.reuse_count])
        self.num_added += len(trajectories)
        return True

    def add_groups(
        self,
        groups: list[list[ScoredTrajectory]],
        first: int = 0,
        skip_sequence_ids: frozenset[str] | set[str] = frozenset(),
    ) -> int:
        """Add ``groups[first:]`` in order, whole groups, until one does not fit.

        Args:
            first: Index of the first group not yet added by an earlier call.
            skip_sequence_ids: Sequence ids to leave out (duplicates, or already trained).

        Returns:
            int: How many groups, from ``first`` on, were taken (added or skipped); fewer
            than ``len(groups) - first`` when the buffer is full.
        """
        taken = 0
        for group in groups[first:]:
            kept = [t for t in group if t.sequence_id not in skip_sequence_ids]
            if kept and not self.add(kept):
                break
            taken += 1
        return taken

    def _drop_stale(self, current_policy_version: int) -> None:
        oldest_allowed = current_policy_version - self.max_policy_lag
        kept = deque(item for item in self._items if item[0].policy_version >= oldest_allowed)
        self.num_dropped_stale += len(self._items) - len(kept)
        self._items = kept

    def sample(self, n: int, current_policy_version: int) -> list[ScoredTrajectory] | None:
        """Take ``n`` trajectories without replacement, after dropping stale ones.

        Returns:
            list[ScoredTrajectory] | None: ``n`` trajectories, or None if fewer are available
            (nothing is removed then).

        Raises:
            ValueError: If ``n`` < 1.
        """
        if n < 1:
            raise ValueError(f"sample size must be >= 1, got {n}")
        self._drop_stale(current_policy_version)
        if len(self._items) < n:
            return None
        if self.sampling == "fifo":
            positions = list(range(n))
        else:
            positions = sorted(self._rng.sample(range(len(self._items)), n))
        items = list(self._items)
        chosen = [items[i] for i in positions]
        for item in chosen:
            item[1] -= 1
        self._items = deque(item for item in items if item[1] > 0)
        batch = [item[0] for item in chosen]
        self.num_sampled += n
        self._last_policy_ages = [current_policy_version - t.policy_version for t in batch]
        return batch

    def stats(self) -> dict[str, float]:
        """Size, counters and the policy age of the last sampled batch."""
        ages = self._last_policy_ages
        return {
            "size": len(self._items),
            "capacity": self.capacity,
            "added": self.num_added,
            "sampled": self.num_sampled,
            "dropped_stale": self.num_dropped_stale,
            "rejected_full": self.num_rejected_full,
            "policy_age_mean": sum(ages) / len(ages) if ages else 0.0,
            "policy_age_max": max(ages) if ages else 0,
        }

    def free_slots(self) -> int:
        """How many more trajectories fit."""
        return self.capacity - len(self._items)

    def state_dict(self) -> dict[str, Any]:
        """Contents, counters and sampler state, for checkpointing."""
        return {
            "items": [(trajectory, remaining) for trajectory, remaining in self._items],
            "rng_state": self._rng.getstate(),
            "counters": {
                "num_added": self.num_added,
                "num_sampled": self.num_sampled,
                "num_dropped_stale": self.num_dropped_stale,
                "num_rejected_full": self.num_rejected_full,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self._items = deque([trajectory, remaining] for trajectory, remaining in state["items"])
        self._rng.setstate(state["rng_state"])
        for name, value in state["counters"].items():
            setattr(self, name, value)


class ReplayBufferActor(ReplayBuffer):
    """`ReplayBuffer` as an async Ray actor whose sampling waits for data inside the actor.

    Call `sample_batch` with ``.options(num_returns=2)``: a small summary for the driver, and
    the batch, which the driver hands to the trainers without fetching it. Every method is a
    coroutine on one event loop, so none interleave except at `sample_batch`'s wait.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Created on the actor's event loop (the constructor runs outside it).
        self._changed: asyncio.Condition | None = None
        # Bumped by `release_waiters`: a waiting sample that sees it change returns None.
        self._release_count = 0

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self) -> None:
        condition = self._condition()
        async with condition:
            condition.notify_all()

    async def add_groups(  # type: ignore[override]
        self,
        groups: list[list[ScoredTrajectory]],
        first: int = 0,
        skip_sequence_ids: frozenset[str] | set[str] = frozenset(),
    ) -> int:
        """`ReplayBuffer.add_groups`, then wake a waiting `sample_batch`."""
        taken = ReplayBuffer.add_groups(self, groups, first, skip_sequence_ids)
        if taken:
            await self._notify()
        return taken

    async def sample_batch(
        self, n: int, current_policy_version: int, timeout_s: float
    ) -> tuple[dict[str, Any], list[ScoredTrajectory] | None]:
        """Wait up to ``timeout_s`` for ``n`` fresh trajectories, then take them.

        Args:
            timeout_s: Most seconds to wait; 0 looks once.

        Returns:
            tuple[dict, list | None]: The summary (the batch's ``sequence_ids``,
            ``group_ids``, ``policy_versions``, or None each; ``stats``; ``wait_s``) and the
            batch, or None when the time ran out or `release_waiters` was called.
        """
        start = time.perf_counter()
        release_count = self._release_count
        condition = self._condition()
        batch = self.sample(n, current_policy_version)
        async with condition:
            while batch is None and self._release_count == release_count:
                remaining = timeout_s - (time.perf_counter() - start)
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(condition.wait(), remaining)
                except asyncio.TimeoutError:
                    break
                batch = self.sample(n, current_policy_version)
        summary: dict[str, Any] = {
            "sequence_ids": None,
            "group_ids": None,
            "policy_versions": None,
            "stats": self.stats(),
            "wait_s": time.perf_counter() - start,
        }
        if batch is not None:
            summary["sequence_ids"] = [t.sequence_id for t in batch]
            summary["group_ids"] = [t.group_id for t in batch]
            summary["policy_versions"] = [t.policy_version for t in batch]
        return summary, batch

    async def release_waiters(self) -> None:
        """Make every waiting `sample_batch` return None now (the run is stopping)."""
        self._release_count += 1
        await self._notify()

    async def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """`ReplayBuffer.state_dict`, on the event loop."""
        return ReplayBuffer.state_dict(self)

    async def load_state_dict(self, state: dict[str, Any]) -> None:  # type: ignore[override]
        """`ReplayBuffer.load_state_dict`, then wake a waiting `sample_batch`."""
        ReplayBuffer.load_state_dict(self, state)
        await self._notify()
