"""Dynamic sampling in whole runs: the tests that start a Ray cluster or a vLLM engine.

The tests without either: tests/unit/test_dynamic_sampling.py. A run that trains with the filter
(full batches of informative, unique groups, counts that add up) is the end-to-end run of
tests/integration/test_pipeline.py, which checks it too.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from grpo.orchestrator import NoInformativeGroupsError
from grpo.testing import read_jsonl


@pytest.mark.slow
def test_synchronous_run_whose_rewards_never_differ_stops_naming_the_cause(
    tiny_model_dir, tmp_path, monkeypatch, caplog, ray_shared
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
        # Waited out in full: short. One generation batch (16 prompts x 4) holds the first 64
        # episodes, reported well before it; the queue holds a whole batch (a synchronous run
        # scores only once the batch is generated).
        "orchestration.equal_rewards_timeout_s=5",
        "training.batch_size=16",
        "inference.group_size=4",
        "inference.batch_size=16",
        "inference.queue_maxsize=16",
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
