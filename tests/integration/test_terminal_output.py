"""What actors and a whole run print on the terminal: the tests that start a Ray cluster or a vLLM
engine.

The tests without either: tests/unit/test_terminal_output.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from grpo.config import repo_root
from grpo.observability.logs import with_output_to
from tests.unit.test_terminal_output import VLLM_LINE


@pytest.mark.slow
def test_an_actor_that_fails_to_start_leaves_its_error_once_without_colour_codes(
    ray_cluster, tmp_path
):
    class FailsToStart:  # local: Ray's workers get it by value, not by importing this file
        """Raises in its constructor, as a collector does when its engine cannot start."""

        def __init__(self) -> None:
            print("starting")
            raise KeyError("anwser")

    log_file = tmp_path / "logs" / "fails_to_start.log"
    # Threaded, like the collector (Ray handles a threaded actor's failed start differently).
    actor_class = ray_cluster.remote(max_concurrency=2)(with_output_to(FailsToStart, log_file))
    actor = actor_class.remote()
    with pytest.raises(ray_cluster.exceptions.RayActorError) as error:
        ray_cluster.get(actor.__ray_ready__.remote(), timeout=120)
    assert error.value.actor_init_failed  # the loop stops the run on it: no replacement
    text = log_file.read_text()
    assert text.startswith("starting\n")
    assert text.count("KeyError: 'anwser'") == 1, text
    assert "\x1b[" not in text, text


@pytest.mark.slow
def test_a_run_prints_progress_and_results_and_nothing_else(tmp_path):
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "grpo",
        "run",
        "async_grpo",
        "--config",
        "tiny_arithmetic_cpu",
        "orchestration.num_steps=3",
        "eval_num_examples=32",
        f"output_dir={run_dir}",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(repo_root()),
        "WANDB_MODE": "offline",
        # vLLM's default level: the INFO lines this test looks for in the collector's log.
        "VLLM_LOGGING_LEVEL": "INFO",
    }
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    out, err = result.stdout, result.stderr
    terminal = out + err

    # No vLLM, Ray or W&B output on the terminal, on either stream.
    assert not [line for line in terminal.splitlines() if VLLM_LINE.search(line)], terminal
    for noise in ("ParallelLMHead", "pid=", "wandb:", "Started a local Ray instance"):
        assert noise not in terminal, f"{noise!r} reached the terminal:\n{terminal}"
    assert len(terminal.splitlines()) <= 15, terminal

    # Start lines, one progress line per step (stdout is not a terminal here), results.
    assert f"Run folder: {run_dir}" in out
    assert f"Logs: {run_dir / 'logs'}/" in out
    assert "W&B: offline" in out
    for step in (1, 2, 3):
        line = next(line for line in out.splitlines() if line.startswith(f"step {step}/3 "))
        for field in ("reward=", "loss=", "eval_acc=", "eta="):
            assert field in line, line
    assert "Run finished: 3 steps" in out
    assert "Held-out accuracy: " in out and "at step 3" in out
    assert f"Final policy: {run_dir / 'final'}" in out
    assert f"Metrics: {run_dir / 'metrics.jsonl'}" in out

    # What the terminal did not show is in the run folder's logs.
    logs = run_dir / "logs"
    collector_log = (logs / "inference_0.log").read_text()
    assert [line for line in collector_log.splitlines() if VLLM_LINE.search(line)]
    assert "wandb" in (logs / "metric_logger.log").read_text()
    assert "ray" in (logs / "driver.log").read_text()
    for name in ("training_0", "ref_0", "replay_buffer"):
        assert (logs / f"{name}.log").is_file()
    assert (run_dir / "metrics.jsonl").stat().st_size > 0

    # Resumed for one more step with evaluation off: the results say what this invocation
    # ran, the accuracies are marked as older, and W&B goes on in the same run.
    wandb_run = json.loads((run_dir / "wandb_run.json").read_text())
    resume = ["resume_from_checkpoint=true", "orchestration.num_steps=4", "eval_every_n_steps=null"]
    result = subprocess.run(
        [*command, *resume], capture_output=True, text=True, env=env, timeout=900
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"W&B: offline, project 'grpo-tiny', run {wandb_run['id']} resumed, in " in out
    assert f"Resumed from {run_dir / 'checkpoints' / 'step_000003'} at step 3" in out
    assert "Run finished: step 4 (1 step this run, resumed from step 3) in " in out
    assert re.search(r"Held-out accuracy: .* at step 3, before this run's resume\n", out), out
    assert json.loads((run_dir / "wandb_run.json").read_text()) == wandb_run
    offline_runs = list((run_dir / "wandb").glob(f"offline-run-*-{wandb_run['id']}*"))
    assert len(offline_runs) == 2, list((run_dir / "wandb").iterdir())
