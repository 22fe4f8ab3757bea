"""Where a component guards an option that the config also bounds, both read one declaration
(`grpo.config.sections.BufferCapacity`, ...): the value `grpo validate` refuses at the bound
the component refuses, and the next the component takes, so a config that validates never
fails in an actor's constructor."""

from __future__ import annotations

import pytest

from grpo.config import ConfigError
from grpo.observability.metric_logger import MetricLogger
from grpo.preflight import load_run_config
from grpo.workers.replay_buffer import ReplayBuffer

# config key: (the component built with a value of it, the value at the bound refused, the
# next value, which the component takes; the config may refuse it for a relation to another
# key, e.g. a buffer smaller than a batch)
CASES = {
    "orchestration.replay_buffer_size": (
        lambda value, _: ReplayBuffer(capacity=value, max_policy_lag=0),
        0,
        1,
    ),
    "orchestration.max_policy_lag": (
        lambda value, _: ReplayBuffer(capacity=8, max_policy_lag=value),
        -1,
        0,
    ),
    "metric_logger.stdout_every_n": (
        lambda value, folder: MetricLogger(folder, stdout_every_n=value, use_wandb=False),
        -1,
        0,
    ),
}


@pytest.mark.parametrize("key", sorted(CASES))
def test_the_config_and_the_component_refuse_the_same_values(key, tmp_path):
    build, refused, taken = CASES[key]
    fresh = f"output_dir={tmp_path / 'out'}"
    with pytest.raises(ConfigError) as info:
        load_run_config("tiny_arithmetic_cpu", [fresh, f"{key}={refused}"])
    bound = f"must be >= {refused + 1}, got {refused}"
    assert [p for p in info.value.problems if p.startswith(f"{key}:") and bound in p], (
        info.value.problems
    )
    with pytest.raises(ValueError, match=f">= {refused + 1}"):
        build(refused, tmp_path / "logs")
    component = build(taken, tmp_path / "logs")
    if isinstance(component, MetricLogger):
        component.close()
