"""The in-flight ledger: where each group between a collector and the trainers is, by id.

The driver keeps no copy of the data: per group a `GroupRecord` (its prompt and ids) and where
the group is. What a dead queue or buffer held is generated again under the same ids, without
what was trained on already. The results of the driver's own take and score calls pass through
it unfetched (`unscored`, `to_buffer`; Ray gives a call's result to its caller), so a dead
reference actor's or buffer's call is redone from them. Of a replaced collector's unfinished
call, which its replacement generates again, the first copy scored of each group is kept.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import ray

from grpo.types import GroupRecord


class Where(enum.Enum):
    """Where a group is on its way to the trainers."""

    QUEUED = "queued"  # on the rollout queue
    TAKEN = "taken"  # in a take the driver holds, or being scored
    SCORED = "scored"  # scored, waiting for room in the buffer
    BUFFERED = "buffered"  # some of its trajectories are in the buffer
    REGENERATING = "regenerating"  # lost with an actor; being generated again


@dataclass(eq=False)  # identity: batches are told apart by object
class ScoredBatch:
    """Scored groups one reference call returned, until the buffer has taken them all."""

    groups_ref: Any
    group_ids: list[int]
    sequence_ids: list[list[str]]
    skip: set[str] = field(default_factory=set)  # trajectories left out (duplicates, trained)
    duplicate_groups: set[int] = field(default_factory=set)
    added: int = 0  # groups the buffer has taken so far

    @property
    def num_groups(self) -> int:
        return len(self.sequence_ids)


class InFlightLedger:
    """Where each generated group is until it is trained on or dropped.

    Args:
        num_collectors: Collectors of the run; group ``g`` is collector ``g % num_collectors``'s.
    """

    def __init__(self, num_collectors: int = 1) -> None:
        self.num_collectors = num_collectors
        self.records: dict[int, GroupRecord] = {}
        self.where: dict[int, Where] = {}
        self.in_buffer: dict[int, set[str]] = {}  # per buffered group, its ids still there
        self.unscored: deque[Any] = deque()
        self.to_buffer: deque[ScoredBatch] = deque()
        # Per collector, the lost groups it generates again before its next batch.
        self.to_regenerate: dict[int, list[GroupRecord]] = {}
        self.buffer_full = False
        # Per collector, groups scored before the call that generated them came back.
        self.open_scored: dict[int, set[int]] = {}
        # A replaced collector's unfinished call: the first copy scored of these is kept ...
        self.first_wins: set[int] = set()
        # ... and the next copy of these is skipped.
        self.duplicates: set[int] = set()
        self.num_duplicate_groups = 0

    # ------------------------------------------------------------------ what became of groups

    def generated(self, collector: int, records: list[GroupRecord]) -> None:
        """A collector's call came back: its groups are on the queue (or passed it already)."""
        scored_meanwhile = self.open_scored.pop(collector, set())
        for record in records:
            group_id = record.group_id
            if old := self.records.get(group_id):
                record.exclude |= old.exclude
            if group_id in self.duplicates or group_id in scored_meanwhile:
                if group_id in self.where:  # still on its way: keep the record for it
                    self.records[group_id] = record
                continue
            self.records[group_id] = record
            if self.where.get(group_id) in (None, Where.REGENERATING):
                self.where[group_id] = Where.QUEUED

    def collector_replaced(self, collector: int, group_ids: list[int]) -> None:
        """Collector ``collector`` died in a call generating ``group_ids``, which its replacement
        generates again: copies scored already stand, and of the others the first scored."""
        scored = self.open_scored.pop(collector, set())
        for group_id in group_ids:
            (self.duplicates if group_id in scored else self.first_wins).add(group_id)

    def taken(self, group_ids: list[int]) -> None:
        """A take from the queue came back with these groups."""
        for group_id in group_ids:
            if group_id not in self.duplicates:
                self.where[group_id] = Where.TAKEN

    def scored(self, groups_ref: Any, result: dict[str, Any]) -> ScoredBatch | None:
        """Hold what a reference call returned until the buffer takes it.

        Args:
            groups_ref: The call's scored-groups ObjectRef.
            result: The call's info: ``group_ids``, ``sequence_ids``, ``dropped_group_ids``.

        Returns:
            ScoredBatch | None: The batch, queued for the buffer; None if it holds no group.
        """
        batch = ScoredBatch(groups_ref, result["group_ids"], result["sequence_ids"])
        for group_id, ids in zip(result["group_ids"], result["sequence_ids"]):
            if self._is_duplicate(group_id):
                batch.skip.update(ids)
                batch.duplicate_groups.add(group_id)
                continue
            if record := self.records.get(group_id):
                batch.skip.update(record.exclude)
            self.where[group_id] = Where.SCORED
        for group_id in result["dropped_group_ids"]:
            if not self._is_duplicate(group_id):
                self._done(group_id)
        if not batch.num_groups:
            return None
        self.to_buffer.append(batch)
        return batch

    def _is_duplicate(self, group_id: int) -> bool:
        """Counts a copy scored now; True if an earlier copy was kept."""
        if group_id not in self.records or self.where.get(group_id) is Where.REGENERATING:
            # The call that generated it has not come back: its collector could die yet.
            collector = group_id % self.num_collectors
            self.open_scored.setdefault(collector, set()).add(group_id)
        if group_id in self.duplicates:
            self.duplicates.discard(group_id)
            self.num_duplicate_groups += 1
            return True
        if group_id in self.first_wins:
            self.first_wins.discard(group_id)
            self.duplicates.add(group_id)
        return False

    def next_to_add(self) -> ScoredBatch | None:
        """The batch to offer the buffer now, or None (nothing waits, or the buffer is full)."""
        if not self.to_buffer or self.buffer_full:
            return None
        return self.to_buffer[0]

    def added(self, batch: ScoredBatch, count: int) -> None:
        """The buffer took ``count`` more groups of ``batch`` (the oldest waiting one)."""
        first, last = batch.added, batch.added + count
        for group_id, ids in zip(batch.group_ids[first:last], batch.sequence_ids[first:last]):
            if group_id in batch.duplicate_groups:
                continue
            kept = {sid for sid in ids if sid not in batch.skip}
            if kept:
                self.in_buffer[group_id] = kept
                self.where[group_id] = Where.BUFFERED
            else:
                self._done(group_id)
        batch.added = last
        if batch.added == batch.num_groups:
            self.to_buffer.popleft()
        else:
            self.buffer_full = True  # retried after the next sample frees room

    def sampled(self, sequence_ids: list[str], group_ids: list[int]) -> None:
        """Trajectories left the buffer for the trainers."""
        for sequence_id, group_id in zip(sequence_ids, group_ids):
            if (pending := self.in_buffer.get(group_id)) is None:
                continue
            pending.discard(sequence_id)
            if record := self.records.get(group_id):
                record.exclude.add(sequence_id)
            if not pending:
                self._done(group_id)
        self.buffer_full = False

    def release_stale(self, oldest_allowed_version: int) -> None:
        """Forget buffered groups the buffer drops as stale anyway."""
        for group_id in list(self.in_buffer):
            record = self.records.get(group_id)
            if record is not None and record.policy_version < oldest_allowed_version:
                self._done(group_id)

    def _done(self, group_id: int) -> None:
        self.records.pop(group_id, None)
        self.where.pop(group_id, None)
        self.in_buffer.pop(group_id, None)

    # ------------------------------------------------------------------ losses

    def lost_in_queue(self) -> list[GroupRecord]:
        """The rollout queue died (and every take from it came back): the groups it held."""
        return self._regenerate([g for g, where in self.where.items() if where is Where.QUEUED])

    def lost_with_batch(self, records: list[GroupRecord]) -> list[GroupRecord]:
        """A call came back after the queue it put onto died: those of its groups no take
        reached."""
        return self._regenerate(
            [r.group_id for r in records if self.where.get(r.group_id) is Where.QUEUED]
        )

    def lost_in_buffer(self) -> list[GroupRecord]:
        """The buffer died: the groups it held. Scored batches it had not wholly taken go to
        the new one from where the old one stopped."""
        self.buffer_full = False
        lost = list(self.in_buffer)
        self.in_buffer.clear()
        return self._regenerate(lost)

    def _regenerate(self, group_ids: list[int]) -> list[GroupRecord]:
        """Queue the groups for their collectors to generate again (`to_regenerate`)."""
        records = []
        for group_id in group_ids:
            if (record := self.records.get(group_id)) is not None:
                self.where[group_id] = Where.REGENERATING
                self.duplicates.discard(group_id)
                self.first_wins.discard(group_id)
                collector = group_id % self.num_collectors
                self.to_regenerate.setdefault(collector, []).append(record)
                records.append(record)
        return records

    # ------------------------------------------------------------------ Stateful

    def state_dict(self) -> dict[str, Any]:
        """Groups not scored yet, scored groups not in the buffer yet, and the records and
        places of every group on its way. Called with the pipeline quiesced: every group is
        taken (the queue emptied into ``unscored``), scored, buffered, or waiting to be
        generated again."""
        unscored = self._unscored_to_keep(
            group for groups in ray.get(list(self.unscored)) for group in groups
        )
        unbuffered = []
        for batch, groups in zip(self.to_buffer, ray.get([b.groups_ref for b in self.to_buffer])):
            for group in groups[batch.added :]:
                kept = [t for t in group if t.sequence_id not in batch.skip]
                if kept and group[0].group_id not in batch.duplicate_groups:
                    unbuffered.append(kept)
        return {
            "unscored_groups": unscored,
            "unbuffered_groups": unbuffered,
            "group_records": [r for g, r in self.records.items() if g in self.where],
            "regenerate_records": [r for rs in self.to_regenerate.values() for r in rs],
            "buffered_sequence_ids": {str(g): sorted(ids) for g, ids in self.in_buffer.items()},
        }

    def _unscored_to_keep(self, groups: Iterable[Any]) -> list[Any]:
        """The taken, unscored groups a checkpoint holds: one copy of each, and none of a group
        whose kept copy was scored already (a replaced collector's, `duplicates`).

        The checkpoint does not hold which copies a live run would skip: restored, a second
        copy would be scored and trained again.
        """
        kept, seen = [], set()
        for group in groups:
            if group.group_id in self.duplicates or group.group_id in seen:
                continue
            seen.add(group.group_id)
            kept.append(group)
        return kept

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Hold a checkpoint's groups again, as in a run that never stopped."""
        self.records = {r.group_id: r for r in state.get("group_records", [])}
        self.in_buffer = {
            int(g): set(ids) for g, ids in state.get("buffered_sequence_ids", {}).items()
        }
        self.where = {g: Where.BUFFERED for g in self.in_buffer}
        if unscored := state["unscored_groups"]:
            self.unscored.append(ray.put(unscored))
            self.where.update({group.group_id: Where.TAKEN for group in unscored})
        self._regenerate([r.group_id for r in state.get("regenerate_records", [])])
        if groups := state["unbuffered_groups"]:
            group_ids = [group[0].group_id for group in groups]
            sequence_ids = [[t.sequence_id for t in group] for group in groups]
            self.to_buffer.append(ScoredBatch(ray.put(groups), group_ids, sequence_ids))
            self.where.update({group_id: Where.SCORED for group_id in group_ids})
