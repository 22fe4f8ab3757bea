"""Held-out evaluation of the demo model with ``grpo eval``: the tests that start a Ray cluster or a
vLLM engine.

The tests without either: tests/unit/test_evaluation.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from grpo.config import repo_root


@pytest.mark.slow
def test_grpo_eval_writes_eval_json_for_the_demo_model(tmp_path):
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "grpo", "eval", "tiny_arithmetic_cpu", f"output_dir={run_dir}",
        "eval_num_examples=16", "eval_samples_per_example=2", "eval_temperature=1.0",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(repo_root())}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "eval/pass@2" in result.stdout and "eval/avg@2" in result.stdout
    report = json.loads((run_dir / "eval.json").read_text())
    metrics = report["metrics"]
    for key in ("eval/accuracy", "eval/avg@2", "eval/pass@2", "eval/response_tokens_mean"):
        assert 0 <= metrics[key], key
    assert metrics["eval/pass@2"] >= metrics["eval/avg@2"]
    assert metrics["eval/num_examples"] == 16 and len(report["examples"]) == 16
    assert all(len(example["samples"]) == 2 for example in report["examples"])
