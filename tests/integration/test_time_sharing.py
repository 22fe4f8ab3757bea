"""Time-sharing one GPU with the trainer in a whole run: the tests that start a Ray cluster or a vLLM
engine.

The tests without either: tests/unit/test_time_sharing.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from grpo.observability.metric_names import (
    INFERENCE_TIME_ASLEEP,
    INFERENCE_TIME_TO_WAKE,
    TRAIN_LOSS,
)
from tests.unit.test_time_sharing import SYNCHRONOUS


def run_steps(model_dir: Path, run_dir: Path, *overrides: str) -> tuple[list[list[str]], list]:
    """Three steps of a tiny run, ended as `grpo run` ends one (a checkpoint, which syncs the
    weights of step 3, then the weight check); the collector's sleep events after each step
    and after the check, and the run's recoveries."""
    import ray

    from grpo.testing import start_tiny_run

    run = start_tiny_run(model_dir, run_dir, 3, *SYNCHRONOUS, *overrides)
    events: list[list[str]] = []

    def after_step(state: object) -> None:
        events.append(ray.get(run.collectors[0].engine_sleep_events.remote()))

    try:
        run.run(on_step=after_step)
        run.save_checkpoint()
        assert run.verify_weight_sync()
        after_step(None)
    finally:
        run.shutdown()
    return events, run.recoveries


def trained(run_dir: Path) -> list[tuple[list[str], list[int]]]:
    from grpo.testing import read_jsonl

    return [
        (r["sequence_ids"], r["policy_versions"]) for r in read_jsonl(run_dir / "trained.jsonl")
    ]


def metrics(run_dir: Path, name: str) -> list[float]:
    from grpo.testing import read_jsonl

    return [r[name] for r in read_jsonl(run_dir / "metrics.jsonl") if name in r]


@pytest.mark.slow
def test_a_run_that_sleeps_while_training_wakes_loads_and_probes_in_order(
    tiny_model_dir, tmp_path, monkeypatch, ray_shared
):
    """Three synchronous steps with the engine asleep while each trains: it sleeps before
    every training step and wakes before every generation as weights, load (or reload),
    KV cache, probe, and trains batches at most one step old (a version counts steps). (That a sleeping run trains exactly what
    an awake one does is checked by tests/integration/lora/test_runs.py, whose resumed run is awake.)"""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    sleeping = tmp_path / "sleeping"
    events, recoveries = run_steps(tiny_model_dir, sleeping, "inference.sleep_while_training=true")
    assert not recoveries

    def woken(load: str, version: int) -> list[str]:
        return ["wake(weights)", load, "wake(kv_cache)", f"probe(v{version})"]

    # Generation 1 ran on the weights the engine started with; then, after each step:
    step_1 = ["sleep(2)"]  # before training step 1
    step_2 = [*woken("reload(v0)", 0), "sleep(2)"]  # generation 2: nothing synced after step 1
    step_3 = [*woken("load(v2)", 2), "sleep(2)"]  # generation 3: v2 synced after step 2
    end = woken("load(v3)", 3)  # the weight check after the final checkpoint (synced v3)
    assert events == [
        step_1,
        step_1 + step_2,
        step_1 + step_2 + step_3,
        step_1 + step_2 + step_3 + end,
    ]
    # A probe of the version it then held ended every wake.
    wakes = [i for i, event in enumerate(events[-1]) if event == "wake(weights)"]
    assert [events[-1][i + 3] for i in wakes] == ["probe(v0)", "probe(v2)", "probe(v3)"]
    assert len(metrics(sleeping, INFERENCE_TIME_ASLEEP)) == 2  # logged at the sleeps of steps 2, 3
    assert len(metrics(sleeping, INFERENCE_TIME_TO_WAKE)) == 2

    assert [versions for _, versions in trained(sleeping)] == [[0] * 32, [0] * 32, [2] * 32]
    assert all(math.isfinite(loss) for loss in metrics(sleeping, TRAIN_LOSS))
