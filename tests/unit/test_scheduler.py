"""The scheduler's handlers on their own, with fake actors (the loop's faults run for real in
tests/integration/test_hangs.py and test_reliability.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from grpo.orchestrator import scheduler as scheduler_module
from grpo.orchestrator.ledger import InFlightLedger, Where
from grpo.orchestrator.scheduler import Scheduler
from grpo.orchestrator.state import Call, CallKind, RunState
from grpo.orchestrator.supervisor import Role
from grpo.types import GroupRecord


class FakeCollector:
    """Records the calls made on it, in order, as ``(method, args)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, method: str) -> Any:
        def remote(*args: Any) -> str:
            self.calls.append((method, args))
            return f"{method}-ref-{len(self.calls)}"

        return SimpleNamespace(remote=remote)


def scheduler_with(
    collector: FakeCollector, state: dict[str, Any], replay_buffer: Any = None
) -> Scheduler:
    ignore = SimpleNamespace(batch=lambda *args: None, check=lambda: None)
    actors = SimpleNamespace(
        collectors=[collector],
        collector_states=[state],
        rollout_queue="queue",
        replay_buffer=replay_buffer,
        returned=lambda *args: None,
    )
    actors.actor = lambda role, index=0: {
        Role.INFERENCE: actors.collectors[index],
        Role.REPLAY_BUFFER: actors.replay_buffer,
    }[role]
    cfg = SimpleNamespace(inference=SimpleNamespace(batch_size=2))
    return Scheduler(
        cfg, actors, InFlightLedger(), RunState(), None, lambda *args: None, ignore, ignore, ignore
    )


def batch_result(first_group: int, counter: int) -> dict[str, Any]:
    records = [
        GroupRecord(g, ({"question": f"q{g}"}, [g]), [f"w0-{2 * g}", f"w0-{2 * g + 1}"], 0)
        for g in (first_group, first_group + 1)
    ]
    state = {"group_counter": counter, "sequence_counter": 2 * counter}
    return {"metrics": {}, "state": state, "records": records}


def test_a_batch_that_finished_before_its_collector_was_replaced_is_not_generated_again():
    dead, replacement = FakeCollector(), FakeCollector()
    # The replacement was caught up to the state after groups 0-1 (the last batch the loop had
    # seen) while the dead collector's batch of groups 2-3 was finishing.
    scheduler = scheduler_with(replacement, {"group_counter": 2, "sequence_counter": 4})
    call = Call(CallKind.GENERATE, 0, dead, queue="queue", group_ids=[2, 3])
    scheduler._on_generated(call, batch_result(2, counter=4), relaunch=True)

    # The replacement goes on from the finished batch, before its next batch: groups 4-5.
    new_state = {"group_counter": 4, "sequence_counter": 8}
    assert [method for method, _ in replacement.calls] == [
        "load_state_dict",
        "generate_batch_with_state",
    ]
    assert replacement.calls[0][1] == (new_state,)
    assert [c.group_ids for c in scheduler.calls.values()] == [[4, 5]]
    assert scheduler.inflight.where == {2: Where.QUEUED, 3: Where.QUEUED}
    assert not dead.calls


def test_a_batch_of_the_current_collector_only_updates_its_state():
    collector = FakeCollector()
    scheduler = scheduler_with(collector, {"group_counter": 2, "sequence_counter": 4})
    call = Call(CallKind.GENERATE, 0, collector, queue="queue", group_ids=[2, 3])
    scheduler._on_generated(call, batch_result(2, counter=4), relaunch=True)
    assert [method for method, _ in collector.calls] == ["generate_batch_with_state"]
    assert scheduler.actors.collector_states[0]["group_counter"] == 4


@pytest.mark.parametrize("kind", [CallKind.ADD, CallKind.SAMPLE])
def test_an_add_or_sample_read_after_its_buffer_was_replaced_is_redone_on_the_new_one(
    kind, monkeypatch
):
    """What the old buffer added or sampled went with it, and the ledger generates those groups
    again: counted as added they would be lost, trained they would be trained twice."""
    old_buffer, new_buffer = FakeCollector(), FakeCollector()
    scheduler = scheduler_with(FakeCollector(), {}, replay_buffer=new_buffer)
    ledger = scheduler.inflight
    ledger.generated(0, [batch_result(0, counter=2)["records"][0]])
    ledger.taken([0])
    scored = ledger.scored("scored-ref", {
        "group_ids": [0], "sequence_ids": [["w0-0", "w0-1"]], "dropped_group_ids": [],
    })  # fmt: skip
    results = {
        CallKind.ADD: 1,  # the old buffer took the one group
        CallKind.SAMPLE: {"stats": {}, "sequence_ids": ["w0-0"], "group_ids": [0]},
    }
    call = Call(kind, 0, old_buffer, scored=scored, batch_ref="batch-ref")
    scheduler.calls["ref"] = call
    monkeypatch.setattr(scheduler_module.ray, "get", lambda ref: results[kind])
    scheduler.finish(["ref"], relaunch=True)

    assert [(f.call, f.failure.current) for f in scheduler.failed] == [(call, False)]
    assert "replaced" in str(scheduler.failed[0].failure.error)
    assert scored.added == 0 and ledger.to_buffer[0] is scored  # still to offer the new buffer
    assert scheduler.batch is None  # nothing to train from the old buffer
    assert not new_buffer.calls and not old_buffer.calls  # the loop redoes it (`redo`)
