"""Run plots: reading metrics.jsonl, smoothing, PNG output, skipped plots, errors."""

from __future__ import annotations

import fnmatch
import logging
import math
import random
from pathlib import Path

import numpy as np
import pytest

from grpo.observability.metric_logger import MetricLogger
from grpo.observability.metric_names import (
    EVAL_ACCURACY,
    EVAL_NUM_EXAMPLES,
    FAULTS_STEPS_REDONE,
    INFERENCE_EPISODE_ENV_TOKEN_FRACTION,
    INFERENCE_EPISODE_TRUNCATED,
    INFERENCE_EPISODE_TURNS_MEAN,
    INFERENCE_TOKENS_PER_SECOND,
    INFERENCE_TOOL_CALLS_PER_EPISODE,
    INFERENCE_TOOL_ERRORS,
    METRIC_NAMES,
    REWARDS_MEAN,
    TRAIN_APPROX_POLICY_KLS,
    TRAIN_KL_LOSS,
    TRAIN_LOSS,
    TRAIN_PERF_TOKENS_PER_SECOND,
    TRAIN_POLICY_AGE_MAX,
    TRAIN_POLICY_AGE_MEAN,
    TRAIN_RESPONSE_LENGTHS,
    is_known_metric,
)
from grpo.observability.plotting import (
    PLOTS,
    default_smoothing_window,
    moving_average,
    plot_run,
    read_metrics,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_synthetic_run(
    run_dir: Path, with_eval: bool = True, with_rewards: bool = True, with_episodes: bool = True
) -> None:
    """A small run as the actors would log it: interleaved actors, each on its own step."""
    rng = random.Random(0)
    logger = MetricLogger(run_dir, use_wandb=False, stdout_every_n=0)
    for step in range(60):
        logger.log_dict(
            {
                TRAIN_LOSS: 1.0 / (step + 1) + rng.gauss(0, 0.05),
                TRAIN_KL_LOSS: 1e-3 * step + rng.gauss(0, 1e-3),
                TRAIN_APPROX_POLICY_KLS: 2e-3 * step + rng.gauss(0, 1e-3),
                TRAIN_RESPONSE_LENGTHS: 40 + step + rng.gauss(0, 5),
                TRAIN_POLICY_AGE_MEAN: rng.uniform(0, 2),
                TRAIN_POLICY_AGE_MAX: float(rng.randint(1, 3)),
                TRAIN_PERF_TOKENS_PER_SECOND: 900 + rng.gauss(0, 50),
            },
            step=step,
            actor="training",
        )
        if with_eval and step % 10 == 0:
            logger.log_dict(
                {EVAL_ACCURACY: step / 100, EVAL_NUM_EXAMPLES: 64}, step=step, actor="eval"
            )
        if with_rewards:
            for ref_step in (2 * step, 2 * step + 1):
                logger.log_dict(
                    {
                        "ref_rewards/rewards_func_math_mean": min(1, ref_step / 120)
                        + rng.gauss(0, 0.1),
                        "ref_rewards/rewards_func_format_mean": 0.5 + rng.gauss(0, 0.1),
                        "ref_rewards/successes_func_math_mean": rng.random(),
                        # A non-finite value (null in the file) must not break the plot.
                        "ref_rewards/successes_func_format_mean": (
                            float("nan") if ref_step == 7 else rng.random()
                        ),
                    },
                    step=ref_step,
                    actor="ref",
                )
        episodes = {
            # A multi-turn environment's batch metrics (grpo.envs).
            INFERENCE_EPISODE_TURNS_MEAN: 1 + min(1, step / 40),
            INFERENCE_TOOL_CALLS_PER_EPISODE: min(1, step / 40),
            INFERENCE_TOOL_ERRORS: float(rng.randint(0, 2)),
            INFERENCE_EPISODE_ENV_TOKEN_FRACTION: 0.1 + 0.2 * min(1, step / 40),
            INFERENCE_EPISODE_TRUNCATED: float(rng.randint(0, 1)),
        }
        logger.log_dict(
            {
                INFERENCE_TOKENS_PER_SECOND: 2000 + rng.gauss(0, 100),
                **(episodes if with_episodes else {}),
            },
            step=step,
            actor="inference",
        )
    logger.close()


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 10_000, f"{path} is only {len(data)} bytes"
    # IHDR: width and height as big-endian ints at bytes 16..24.
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 600 and height >= 300, (path, width, height)


def test_plot_run_writes_every_plot_as_png(tmp_path):
    run_dir = tmp_path / "run"
    _write_synthetic_run(run_dir)
    paths = plot_run(run_dir)
    assert [p.name for p in paths] == [f"{spec.filename}.png" for spec in PLOTS]
    for path in paths:
        assert path.parent == run_dir / "plots"
        _assert_png(path)


def test_plot_run_skips_absent_metrics_and_says_which(tmp_path, caplog):
    run_dir = tmp_path / "run"
    _write_synthetic_run(run_dir, with_eval=False, with_rewards=False, with_episodes=False)
    with caplog.at_level(logging.INFO, logger="grpo.observability.plotting"):
        paths = plot_run(run_dir, out_dir=tmp_path / "elsewhere")
    names = {p.name for p in paths}
    assert names == {"kl.png", "response_length.png", "tokens_per_second.png", "policy_age.png"}
    assert all(p.parent == tmp_path / "elsewhere" for p in paths)
    assert not (run_dir / "plots").exists()
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping")]
    assert len(skipped) == 4
    assert any("eval_accuracy" in m and EVAL_ACCURACY in m for m in skipped)
    assert any("episodes" in m and INFERENCE_EPISODE_TURNS_MEAN in m for m in skipped)
    assert any("rewards_per_function" in m for m in skipped)
    assert any("successes_per_function" in m for m in skipped)


def test_missing_metrics_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope" / "metrics.jsonl")):
        plot_run(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(tmp_path)


def test_read_metrics_keeps_numbers_in_file_order(tmp_path):
    logger = MetricLogger(tmp_path, use_wandb=False, stdout_every_n=0)
    logger.log_dict({"a": 1.0, "s": "text", "flag": True}, step=5, actor="training")
    logger.log_dict({"a": float("nan"), "b": 2}, step=6, actor="training")
    logger.log_dict({"a": 3.0}, step=1, actor="ref")
    logger.close()
    series = read_metrics(tmp_path)
    assert series == {"a": [(5, 1.0), (1, 3.0)], "b": [(6, 2.0)]}
    assert read_metrics(tmp_path / "metrics.jsonl") == series


def test_read_metrics_reads_only_the_standing_values_after_a_rewind(tmp_path):
    """A trainer died in step 3 and the run went back to step 1's checkpoint: steps 2 and 3
    were logged twice; the plots read the redone values, once per step."""
    logger = MetricLogger(tmp_path, use_wandb=False, stdout_every_n=0)
    for step in (1, 2, 3):
        logger.log_dict({TRAIN_LOSS: float(step)}, step=step, actor="training")
    logger.log_dict({REWARDS_MEAN: 0.5}, step=2, actor="ref")
    logger.rewound(1, from_step=3)
    logger.log_dict({FAULTS_STEPS_REDONE: 2.0}, step=1)
    for step in (2, 3, 4):
        logger.log_dict({TRAIN_LOSS: 10.0 * step}, step=step, actor="training")
    logger.close()
    series = read_metrics(tmp_path)
    assert series == {
        TRAIN_LOSS: [(1, 1.0), (2, 20.0), (3, 30.0), (4, 40.0)],
        FAULTS_STEPS_REDONE: [(1, 2.0)],
    }
    # The file keeps the superseded values, then the rewind line.
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text.count('"training/loss"') == 6 and '"rewound_to": 1' in text


def test_read_metrics_tolerates_only_a_truncated_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "time": 1.0, "a": 1.0}\n{"step": 1, "time": 2.0, "a": 2.\n')
    assert read_metrics(tmp_path) == {"a": [(0, 1.0)]}
    path.write_text('{"step": 0, "a": 1.0}\n{"a": 2.0}\n{"step": 2, "a": 3.0}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: bad metrics record"):
        read_metrics(tmp_path)


def test_moving_average_matches_a_direct_computation():
    rng = np.random.default_rng(0)
    values = rng.normal(size=37)
    for window in (1, 2, 3, 4, 7, 50):
        before, after = (window - 1) // 2, window // 2
        expected = [
            values[max(0, i - before) : min(len(values), i + after + 1)].mean()
            for i in range(len(values))
        ]
        np.testing.assert_allclose(moving_average(values, window), expected, rtol=1e-12)
    np.testing.assert_array_equal(moving_average([2.0] * 9, 5), [2.0] * 9)
    assert moving_average([], 3).size == 0
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        moving_average([1.0], 0)


def test_smoothing_is_light():
    assert default_smoothing_window(5) == 1
    assert default_smoothing_window(100) == 10
    assert default_smoothing_window(10_000) == 25


def test_plotted_metrics_are_named_in_metric_names():
    templates = [n.replace("{name}", "*") for names in METRIC_NAMES.values() for n in names]
    for spec in PLOTS:
        for pattern in spec.patterns:
            if "*" in pattern:
                assert pattern in templates, pattern
                assert is_known_metric(pattern.replace("*", "some_func"))
            else:
                assert is_known_metric(pattern), pattern
                assert not any(fnmatch.fnmatchcase(pattern, t) for t in templates if "*" in t)


def test_plot_survives_single_points_and_constant_series(tmp_path):
    logger = MetricLogger(tmp_path, use_wandb=False, stdout_every_n=0)
    logger.log_dict({EVAL_ACCURACY: 0.5}, step=0, actor="eval")
    logger.log_dict(
        {TRAIN_KL_LOSS: 0.0, TRAIN_APPROX_POLICY_KLS: math.inf},
        step=0,
        actor="training",
    )
    logger.close()
    paths = plot_run(tmp_path)
    assert {p.name for p in paths} == {"eval_accuracy.png", "kl.png"}
    for path in paths:
        assert path.read_bytes()[:8] == PNG_MAGIC
