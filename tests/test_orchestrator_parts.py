"""The orchestrator's parts on their own: the in-flight ledger, step metrics, call dispatch.

The loop that wires them runs in tests/test_pipeline.py and tests/test_reliability.py; these
check each part's bookkeeping without Ray (object references are stand-in strings).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from grpo.orchestrator import InFlightLedger, RunState, step_metrics
from grpo.orchestrator.state import CallKind


def scored_result(tag: str, group_ids: list[int], policy_version: int = 0) -> dict:
    """What a reference call reports: two sequences per group, ids ``{tag}{group}-{i}``."""
    return {
        "group_ids": group_ids,
        "sequence_ids": [[f"{tag}{g}-{i}" for i in range(2)] for g in group_ids],
        "policy_version": policy_version,
    }


def trajectory(sequence_id: str) -> SimpleNamespace:
    return SimpleNamespace(sequence_id=sequence_id)


def test_ledger_marks_regenerated_groups_and_holds_batches_until_sampled():
    ledger = InFlightLedger()
    first = ledger.scored("ref-a", scored_result("a", [0, 1]))
    # A replaced collector regenerated group 1 (new sequence ids, same group id): its
    # trajectories are skipped, and counted once.
    second = ledger.scored("ref-b", scored_result("b", [1, 2]))
    assert ledger.num_duplicate_groups == 1
    assert second.skip == {"b1-0", "b1-1"}
    assert ledger.next_to_add() is first

    ledger.added(first, 1)  # the buffer had room for one group only
    assert ledger.buffer_full and ledger.next_to_add() is None
    assert set(ledger.in_buffer) == {"a0-0", "a0-1"}

    ledger.sampled([trajectory("a0-0")])
    assert not ledger.buffer_full and ledger.next_to_add() is first
    ledger.added(first, 1)
    ledger.added(second, 2)
    assert ledger.next_to_add() is None and not ledger.to_buffer
    # Held until sampled: not the sampled one, not the duplicates.
    assert set(ledger.in_buffer) == {"a0-1", "a1-0", "a1-1", "b2-0", "b2-1"}

    # A rebuilt buffer gets each batch once, minus what was sampled or skipped.
    contents = dict(ledger.buffer_contents())
    assert contents["ref-a"] == {"a0-0"}
    assert contents["ref-b"] == {"b1-0", "b1-1"}


def test_ledger_lets_go_of_stale_batches_only():
    ledger = InFlightLedger()
    old = ledger.scored("old", scored_result("o", [0], policy_version=0))
    new = ledger.scored("new", scored_result("n", [1], policy_version=3))
    ledger.added(old, 1)
    ledger.added(new, 1)
    ledger.release_stale(oldest_allowed_version=2)
    assert set(ledger.in_buffer) == {"n1-0", "n1-1"}


def test_step_metrics_adds_queue_sizes_and_time_shares():
    metrics = step_metrics(
        {
            "train_actor_performance/total_step_time (s)": 4.0,
            "train_actor_performance/time_grpo_steps (s)": 3.0,
            "train_actor_performance/time_waiting_buffer (s)": 0.5,
            "train_actor_performance/time_weight_sync (s)": 0.25,
        },
        {"size": 12, "dropped_stale": 2},
        {"queues/rollout_queue_size": 3.0},
    )
    assert metrics["queues/train_replay_buffer_size"] == 12.0
    assert metrics["queues/replay_buffer_dropped_stale"] == 2.0
    assert metrics["queues/rollout_queue_size"] == 3.0
    assert metrics["train_actor_performance/pct_time_grpo_steps (%)"] == pytest.approx(75.0)
    assert metrics["train_actor_performance/pct_time_waiting_buffer (%)"] == pytest.approx(12.5)
    assert metrics["train_actor_performance/pct_time_weight_sync (%)"] == pytest.approx(6.25)
    # A timing the step did not report gets no share.
    assert "train_actor_performance/pct_time_weight_gather (%)" not in metrics


def test_run_state_round_trips():
    state = RunState(step=7, policy_version=5, eval_history=[(0, {"eval/accuracy": 0.5})])
    restored = RunState()
    restored.load_state_dict(state.state_dict())
    assert (restored.step, restored.policy_version) == (7, 5)
    assert restored.eval_history == [(0, {"eval/accuracy": 0.5})]


def test_every_kind_of_call_has_a_handler(tmp_path):
    from grpo.config import load_config
    from grpo.orchestrator import Orchestrator

    cfg = load_config("tiny_arithmetic_cpu", [f"output_dir={tmp_path}"])
    run = Orchestrator(cfg, tmp_path)
    assert set(run._handlers) == set(CallKind)
    # A replaced collector, reference actor or buffer redoes its call; a dead trainer or
    # rollout queue stops the run, so their calls are never redone.
    assert set(run._redo) == set(CallKind) - {CallKind.TAKE, CallKind.TRAIN}
