"""The in-flight ledger on its own: where each group is, what a dead queue or buffer lost, and
which copy of a replaced collector's groups is trained (object references are strings)."""

from __future__ import annotations

from grpo.orchestrator.ledger import InFlightLedger, Where
from grpo.types import GroupRecord


def record(group_id: int, size: int = 2, version: int = 0) -> GroupRecord:
    sequence_ids = [f"g{group_id}-{i}" for i in range(size)]
    return GroupRecord(group_id, ({"question": f"q{group_id}"}, [group_id]), sequence_ids, version)


def scored(group_ids: list[int], dropped: list[int] = (), size: int = 2) -> dict:
    """What a reference call reports for these groups (ids as `record` names them)."""
    return {
        "group_ids": list(group_ids),
        "sequence_ids": [[f"g{g}-{i}" for i in range(size)] for g in group_ids],
        "dropped_group_ids": list(dropped),
        "dropped_sequence_ids": [[f"g{g}-{i}" for i in range(size)] for g in dropped],
    }


def test_a_group_is_followed_until_trained_and_then_forgotten():
    ledger = InFlightLedger()
    ledger.generated(0, [record(0), record(1)])
    assert ledger.where == {0: Where.QUEUED, 1: Where.QUEUED}
    ledger.taken([0, 1])
    batch = ledger.scored("scored-ref", scored([0], dropped=[1]))
    assert ledger.where == {0: Where.SCORED}  # a dropped group is done
    ledger.added(batch, 1)
    assert ledger.in_buffer == {0: {"g0-0", "g0-1"}} and not ledger.to_buffer
    ledger.sampled(["g0-0"], [0])
    assert ledger.where == {0: Where.BUFFERED}
    ledger.sampled(["g0-1"], [0])
    assert not ledger.where and not ledger.records and not ledger.in_buffer


def test_a_full_buffer_takes_the_oldest_batch_first_and_is_retried_after_a_sample():
    ledger = InFlightLedger()
    ledger.generated(0, [record(0), record(1), record(2)])
    first = ledger.scored("a", scored([0, 1]))
    second = ledger.scored("b", scored([2]))
    assert ledger.next_to_add() is first
    ledger.added(first, 1)
    assert ledger.buffer_full and ledger.next_to_add() is None
    ledger.sampled(["g0-0"], [0])
    assert ledger.next_to_add() is first
    ledger.added(first, 1)
    assert ledger.next_to_add() is second


def test_a_dead_queue_loses_only_the_groups_no_take_reached():
    ledger = InFlightLedger()
    ledger.generated(0, [record(0), record(1), record(2)])
    ledger.taken([0])
    lost = ledger.lost_in_queue()
    assert [r.group_id for r in lost] == [1, 2]
    assert ledger.where[0] is Where.TAKEN and ledger.where[1] is Where.REGENERATING
    assert ledger.to_regenerate == {0: lost}  # for collector 0, ahead of its next batch
    ledger.to_regenerate.clear()
    # Generated again under the same ids: on the new queue, followed as before.
    ledger.generated(0, [record(1), record(2)])
    assert ledger.where[1] is Where.QUEUED
    # A batch that put onto the dead queue and came back after it was replaced: those of its
    # groups a take reached before the queue died are not lost.
    ledger.generated(0, [record(3), record(4)])
    ledger.taken([3])
    assert [r.group_id for r in ledger.lost_with_batch([record(3), record(4)])] == [4]


def test_a_dead_buffer_loses_its_groups_which_come_again_without_what_was_trained():
    ledger = InFlightLedger()
    ledger.generated(0, [record(0, size=4), record(1)])
    batch = ledger.scored("a", scored([0, 1], size=4))
    ledger.added(batch, 1)  # group 1 waits for room
    ledger.sampled(["g0-0", "g0-1"], [0, 0])
    lost = ledger.lost_in_buffer()
    assert [r.group_id for r in lost] == [0] and lost[0].exclude == {"g0-0", "g0-1"}
    assert ledger.next_to_add() is batch and batch.added == 1  # group 1 goes to the new one
    # The regenerated group is scored whole (advantages over the group) and its trained
    # trajectories are left out of the buffer.
    ledger.generated(0, [record(0, size=4)])
    again = ledger.scored("again", scored([0], size=4))
    assert again.skip == {"g0-0", "g0-1"}
    ledger.added(batch, 1)
    ledger.added(again, 1)
    assert ledger.in_buffer == {0: {"g0-2", "g0-3"}, 1: {"g1-0", "g1-1", "g1-2", "g1-3"}}


def test_a_replaced_collectors_groups_are_trained_once_whichever_copy_comes_first():
    """Collector 0 dies generating groups 0, 2, 4 and 6 (two collectors: even groups are its):
    group 0 was scored already, group 2 was queued, group 4 had not reached the queue and
    group 6 was dropped for equal rewards. Its replacement generates all of them again."""
    ledger = InFlightLedger(num_collectors=2)
    ledger.taken([0, 2])
    kept = ledger.scored("old-0", scored([0], dropped=[6]))
    ledger.collector_replaced(0, [0, 2, 4, 6])
    old_2 = ledger.scored("old-2", scored([2]))  # the dead one's copy, scored first: kept
    new = ledger.scored("new", scored([0, 2, 4], dropped=[6]))
    assert kept.skip == old_2.skip == set()
    assert new.duplicate_groups == {0, 2} and new.skip == {"g0-0", "g0-1", "g2-0", "g2-1"}
    assert ledger.num_duplicate_groups == 3  # groups 0, 2 and the dropped 6
    # The replacement's call comes back: its records now back the groups on their way.
    ledger.generated(0, [record(0), record(2), record(4), record(6)])
    assert set(ledger.records) == {0, 2, 4} and 6 not in ledger.where
    for batch in (kept, old_2, new):
        ledger.added(batch, batch.num_groups)
    assert set(ledger.in_buffer) == {0, 2, 4}
    # The dead one may have queued group 4 too: that copy is skipped if it comes.
    assert ledger.duplicates == {4} and not ledger.first_wins


def test_a_regenerated_group_is_not_mistaken_for_a_duplicate():
    ledger = InFlightLedger(num_collectors=1)
    ledger.taken([0])
    ledger.scored("old", scored([0]))
    ledger.collector_replaced(0, [0, 1])  # group 1 never reached the queue
    ledger.generated(0, [record(0), record(1)])
    ledger.taken([1])
    only = ledger.scored("new", scored([0, 1]))
    assert only.duplicate_groups == {0}
    # Group 1 is lost with the buffer later: its regenerated copy is trained, not skipped.
    ledger.added(ledger.to_buffer[0], 1)
    ledger.added(only, 2)
    assert [r.group_id for r in ledger.lost_in_buffer()] == [0, 1]
    ledger.generated(0, [record(0), record(1)])
    assert ledger.scored("again", scored([0, 1])).duplicate_groups == set()


def test_stale_groups_are_let_go_of_by_their_newest_version():
    ledger = InFlightLedger()
    ledger.generated(0, [record(0, version=0), record(1, version=3)])
    batch = ledger.scored("a", scored([0, 1]))
    ledger.added(batch, 2)
    ledger.release_stale(oldest_allowed_version=2)
    assert set(ledger.in_buffer) == {1} and set(ledger.records) == {1}


def test_a_checkpoint_holds_no_second_copy_of_a_replaced_collectors_groups(monkeypatch):
    """A frozen collector's groups 0 and 1 were scored and buffered; its replacement generated
    them again, and a checkpoint is saved while those copies are taken but not scored. Restored,
    the checkpoint would score and train them a second time: it holds only group 2's copy, the
    one no earlier copy stands for, and of two copies of a group one."""
    from types import SimpleNamespace

    from grpo.orchestrator import ledger as ledger_module

    ledger = InFlightLedger()
    # The frozen collector's call never comes back; groups 0 and 1 reached the queue.
    ledger.taken([0, 1])
    kept = ledger.scored("old", scored([0, 1]))
    ledger.added(kept, 2)
    ledger.collector_replaced(0, [0, 1, 2, 3])  # groups 2 and 3 never reached a take
    ledger.generated(0, [record(0), record(1), record(2), record(3)])
    takes = {
        "take": [SimpleNamespace(group_id=g) for g in (0, 1, 2, 3)],
        "old-3": [SimpleNamespace(group_id=3)],  # the dead one's copy of group 3, late
    }
    ledger.unscored.extend(takes)
    ledger.taken([0, 1, 2, 3])
    monkeypatch.setattr(ledger_module.ray, "get", lambda refs: [takes[ref] for ref in refs])

    state = ledger.state_dict()

    assert [group.group_id for group in state["unscored_groups"]] == [2, 3]
    assert state["buffered_sequence_ids"] == {"0": ["g0-0", "g0-1"], "1": ["g1-0", "g1-1"]}
