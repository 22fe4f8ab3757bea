"""A reward that fails in a whole run: the tests that start a Ray cluster or a vLLM engine.

The tests without either: tests/unit/test_rewards.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest


@pytest.mark.slow
def test_a_run_whose_reward_has_a_typo_stops_naming_the_error_and_its_line(
    tiny_model_dir, tmp_path, monkeypatch, capsys, ray_shared
):
    """A plain reward with a typo in its body (NameError on every call): the run stops within
    a minute of its first batch, naming the function, the exception and the line."""
    from grpo.cli import main as grpo_main
    from grpo.observability.metric_names import INFERENCE_EPISODES_DROPPED
    from grpo.testing import RANDOM_MODEL_OVERRIDES, read_jsonl
    from grpo.testing import rewards as user_rewards

    monkeypatch.setenv("WANDB_MODE", "disabled")
    run_dir = tmp_path / "run"
    started = time.time()
    status = grpo_main(
        [
            *("run", "async_grpo", "--config", "tiny_arithmetic_cpu"),
            f"base_model_path={tiny_model_dir}",
            *RANDOM_MODEL_OVERRIDES,
            f"output_dir={run_dir}",
            "orchestration.num_steps=20",
            "eval_every_n_steps=null",
            "reward_functions=[{_component_: grpo.testing.rewards.misspelt_short}]",
            "inference.batch_size=2",
            "inference.group_size=4",
            "training.batch_size=16",
        ]
    )
    stopped_at = time.time()
    err = capsys.readouterr().err
    assert status == 1, err
    batches = [r["time"] for r in read_jsonl(run_dir / "metrics.jsonl") if INFERENCE_EPISODES_DROPPED in r]  # fmt: skip
    assert stopped_at - min(batches) < 60, (stopped_at - min(batches), stopped_at - started)

    stopped = next(line for line in err.splitlines() if line.startswith("Run stopped: "))
    source = Path(user_rewards.__file__).read_text().splitlines()
    line = next(number for number, text in enumerate(source, start=1) if "completon" in text)
    assert "reward function 'misspelt_short' failed nearly every call" in stopped
    assert "NameError: name 'completon' is not defined (at " in stopped
    assert f"grpo/testing/rewards.py:{line} in misspelt_short" in stopped
    assert "Traceback (most recent call last)" not in err
    print(f"stopped {stopped_at - min(batches):.1f} s after the first batch, "
          f"{stopped_at - started:.1f} s after the start: {stopped}")  # fmt: skip
