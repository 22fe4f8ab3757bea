"""Dynamic sampling in whole runs: the tests that start a Ray cluster or a vLLM engine.

The tests without either: tests/unit/test_dynamic_sampling.py.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from pathlib import Path

import pytest

from grpo.observability.metric_names import (
    GROUPS_KEPT,
    GROUPS_SCORED,
    ZERO_VARIANCE_GROUPS,
)
from grpo.orchestrator import NoInformativeGroupsError
from grpo.testing import read_jsonl


@pytest.mark.slow
def test_run_with_filter_trains_full_batches_of_informative_unique_groups(
    tiny_model_dir, tmp_path, monkeypatch, ray_cleanup
):
    """A tiny asynchronous run with the filter: every step trains on ``batch_size`` unique
    trajectories from groups with differing rewards, and the counts add up."""
    from grpo.testing import start_tiny_run

    monkeypatch.setenv("WANDB_MODE", "disabled")
    run_dir = tmp_path / "run"
    num_steps, batch_size, group_size = 3, 16, 4
    run = start_tiny_run(
        tiny_model_dir,
        run_dir,
        num_steps,
        "ref.filter_zero_variance_groups=true",
        f"training.batch_size={batch_size}",
        f"inference.group_size={group_size}",
        "inference.batch_size=8",
        "inference.max_generated_tokens=8",
        "orchestration.stall_timeout_s=120",
        # The random tiny model emits a '7' sometimes: some groups vary, many do not.
        "reward_functions=[{_component_: grpo.rewards.TokenPresenceReward, token: '7'}]",
        "ref.reward_weights=null",
        "debug_logging_enabled=true",
        f"debug_num_samples_per_step={batch_size}",
    )
    try:
        state = run.run()
    finally:
        run.shutdown()
    assert state.step == num_steps

    trained = read_jsonl(run_dir / "trained.jsonl")
    scored_records = read_jsonl(run_dir / "scored.jsonl")
    scored = {sid for r in scored_records for sid in r["sequence_ids"]}
    dropped = {sid for r in scored_records for sid in r["dropped_sequence_ids"]}
    trained_ids = [sid for r in trained for sid in r["sequence_ids"]]
    assert [len(r["sequence_ids"]) for r in trained] == [batch_size] * num_steps
    assert len(set(trained_ids)) == len(trained_ids), "a trajectory was trained on twice"
    assert set(trained_ids) <= scored - dropped
    assert dropped, "no group had equal rewards: the filter was not exercised"

    # Every trained group is whole and its rewards differ (from the debug table's rows).
    group_of = {sid: g for r in trained for sid, g in zip(r["sequence_ids"], r["group_ids"])}
    rewards: dict[int, list[float]] = defaultdict(list)
    for table in read_jsonl(run_dir / "tables" / "per_sample_debug_table.jsonl"):
        columns = table["columns"]
        for row in table["rows"]:
            sid = row[columns.index("Sequence ID")]
            rewards[group_of[sid]].append(row[columns.index("Reward_token_presence")])
    assert sum(len(r) for r in rewards.values()) == num_steps * batch_size
    for group_id, values in rewards.items():
        assert len(values) == group_size and len(set(values)) > 1, (group_id, values)

    # The per-step counts add up to what scored.jsonl holds, up to the calls that finished
    # after the last step.
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if ZERO_VARIANCE_GROUPS in r]
    assert [r["step"] for r in steps] == list(range(1, num_steps + 1))
    assert all(r[GROUPS_KEPT] == r[GROUPS_SCORED] - r[ZERO_VARIANCE_GROUPS] for r in steps)
    logged_dropped = sum(r[ZERO_VARIANCE_GROUPS] for r in steps)
    assert 0 < logged_dropped <= len(dropped) // group_size
    assert sum(r[GROUPS_SCORED] for r in steps) <= len(scored) // group_size


@pytest.mark.slow
def test_synchronous_run_whose_rewards_never_differ_stops_naming_the_cause(
    tiny_model_dir, tmp_path, monkeypatch, caplog, ray_cleanup
):
    """A constant reward with the filter: a synchronous run generates round after round,
    warns with the first 64 episodes' rewards and what to change, then stops after
    equal_rewards_timeout_s with an error that says every group had equal rewards."""
    from grpo.testing import start_tiny_run

    monkeypatch.setenv("WANDB_MODE", "disabled")
    run_dir = tmp_path / "run"
    run = start_tiny_run(
        tiny_model_dir,
        run_dir,
        2,
        "ref.filter_zero_variance_groups=true",
        "orchestration.synchronous=true",
        "orchestration.equal_rewards_timeout_s=15",
        "training.batch_size=16",
        "inference.group_size=4",
        "inference.batch_size=4",
        "inference.max_generated_tokens=4",
        "reward_functions=[{_component_: grpo.rewards.TokenPresenceReward, token: '7', "
        "reward: 0.0}]",
        "ref.reward_weights=null",
    )
    try:
        with (
            caplog.at_level(logging.WARNING, logger="grpo"),
            pytest.raises(NoInformativeGroupsError, match="every group had equal rewards"),
        ):
            run.run()
    finally:
        run.shutdown()
    assert run.state.step == 0
    [first] = [r.getMessage() for r in caplog.records if "rewards of the first" in r.getMessage()]
    # Groups of 4, at least 64 episodes: those of the reference calls up to the 64th.
    said = re.match(
        r"rewards of the first (\d+) episodes: mean 0\.00, all (\d+) groups equal \(0\.0: \1\)\. "
        r"Every advantage is zero",
        first,
    )
    assert said and int(said[1]) >= 64 and int(said[1]) == 4 * int(said[2]), first
    assert "raise inference.group_size" in first
    records = read_jsonl(Path(run_dir) / "scored.jsonl")
    # Several generation rounds, all of them scored and dropped, none trained.
    assert len(records) >= 2
    assert all(r["sequence_ids"] == r["dropped_sequence_ids"] for r in records)
    assert not read_jsonl(Path(run_dir) / "trained.jsonl")
