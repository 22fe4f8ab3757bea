"""The metric logger as a Ray actor, and the run starting the logger class its config names."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from grpo.observability.metric_logger import MetricLogger
from grpo.observability.metric_names import REWARDS_MEAN, TRAIN_LOSS
from tests.unit.test_metric_logger import _strict_json_lines


@pytest.mark.slow
def test_logger_works_as_a_ray_actor(tmp_path, ray_cluster):
    ray = ray_cluster
    RemoteLogger = ray.remote(num_cpus=0)(MetricLogger)
    logger = RemoteLogger.remote(log_dir=str(tmp_path / "run"), use_wandb=False, stdout_every_n=0)
    # Two "actors" writing, one behind the other; fire-and-forget then a barrier.
    refs = [
        logger.log_dict.remote({TRAIN_LOSS: 1.0 / (s + 1)}, step=s, actor="training")
        for s in range(5)
    ]
    refs += [logger.log_dict.remote({REWARDS_MEAN: float("nan")}, step=0, actor="ref")]
    ray.get(refs)
    path = ray.get(logger.get_log_path.remote())
    ray.get(logger.close.remote())
    ray.get(logger.close.remote())
    records = _strict_json_lines(Path(path))
    assert Path(path) == (tmp_path / "run" / "metrics.jsonl").resolve()
    assert [(r["actor"], r["step"]) for r in records] == [("training", s) for s in range(5)] + [
        ("ref", 0)
    ]
    assert records[-1][REWARDS_MEAN] is None
    with pytest.raises(ray.exceptions.RayTaskError, match="closed"):
        ray.get(logger.log_dict.remote({"x": 1.0}, step=9))


class RecordingLogger(MetricLogger):
    """A user's own logger class: MetricLogger's methods, one more option, a record of calls."""

    def __init__(self, log_dir, tag="", project="grpo", mode="disabled", config=None):
        super().__init__(log_dir, project=project, mode=mode, config=config, use_wandb=False)
        self.tag = tag
        self.logged = []

    def log_dict(self, metrics, step, actor=None):
        self.logged.append((dict(metrics), step))
        super().log_dict(metrics, step, actor)

    def report(self):
        return {
            "class": type(self).__name__,
            "tag": self.tag,
            "logged": self.logged,
            "log_dir": str(self.log_dir),
            "has_config": self.config is not None,
        }


@pytest.mark.slow
def test_the_run_uses_the_logger_class_the_config_names(tmp_path, ray_cluster):
    from ray import cloudpickle

    from grpo.config import load_config
    from grpo.orchestrator.supervisor import ActorSupervisor

    # Ray workers cannot import this test module: send its classes by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray = ray_cluster
    cfg = load_config(
        "tiny_arithmetic_cpu",
        [
            f"output_dir={tmp_path / 'run'}",
            f"metric_logger._component_={__name__}.RecordingLogger",
            "metric_logger.tag=mine",
            "metric_logger.mode=disabled",
        ],
        check_components=True,
    )
    # load_config checked the class's own keywords (tag) against its signature.
    supervisor = ActorSupervisor(cfg, tmp_path / "run", current_step=lambda: 0, dataset=[])
    logger = supervisor.start_metric_logger()
    try:
        ray.get(logger.log_dict.remote({"train/loss": 0.5}, step=1))
        report = ray.get(logger.report.remote())
    finally:
        ray.get(logger.close.remote())
        ray.kill(logger)
    assert report["class"] == "RecordingLogger" and report["tag"] == "mine"
    assert report["logged"] == [({"train/loss": 0.5}, 1)]
    assert report["log_dir"] == str(tmp_path / "run") and report["has_config"]
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("train/loss") == 1
