"""MetricLogger: JSONL records, non-finite handling, tables, config, stdout, W&B routing."""

from __future__ import annotations

import itertools
import json
import logging
import math
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from grpo.observability.metric_logger import MetricLogger
from grpo.observability.metric_names import (
    EVAL_ACCURACY,
    GLOBAL_STEP,
    INFERENCE_STEP,
    INFERENCE_TOKENS_PER_SECOND,
    METRIC_NAMES,
    REF_PERF_NAMESPACE,
    REF_PERF_PCT_TIME_MODEL_RUNNING,
    REF_PERF_TIME_WAITING_BUFFER,
    REF_STEP,
    REPLAY_BUFFER_SIZE,
    REWARDS_MEAN,
    ROLLOUT_QUEUE_SIZE,
    STEP_METRIC_RULES,
    TRAIN_LOSS,
    TRAIN_LR,
    TRAINING_STEP,
    is_known_metric,
    ratio_metrics,
    reward_metric_names,
    step_metric_for,
)
from grpo.observability.metrics import records_after_rewinds


def _strict_json_lines(path: Path) -> list[dict]:
    """Parse a JSONL file, failing on NaN/Infinity tokens (which are not JSON)."""

    def reject(token: str) -> None:
        raise AssertionError(f"{path} holds the non-JSON token {token}")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def _logger(tmp_path: Path, **kwargs) -> MetricLogger:
    kwargs.setdefault("use_wandb", False)
    kwargs.setdefault("stdout_every_n", 0)
    return MetricLogger(log_dir=tmp_path / "run", **kwargs)


# ---------------------------------------------------------------- JSONL


def test_log_dict_writes_one_record_per_call_with_steps_as_given(tmp_path):
    logger = _logger(tmp_path)
    before = time.time()
    logger.log_dict(
        {TRAIN_LOSS: 0.25, REPLAY_BUFFER_SIZE: 12},
        step=5,
        actor="training",
    )
    # The ref actor runs behind the trainer: its lower step is kept as given.
    logger.log_dict({REWARDS_MEAN: 0.5}, step=2, actor="ref")
    logger.log_dict({"custom/value": 3, "custom/name": "gsm8k", "custom/flag": True}, step=7)
    after = time.time()
    logger.close()

    records = _strict_json_lines(logger.get_log_path())
    assert logger.get_log_path() == (tmp_path / "run" / "metrics.jsonl").resolve()
    assert [r["step"] for r in records] == [5, 2, 7]
    assert [r.get("actor") for r in records] == ["training", "ref", None]
    assert "actor" not in records[2]
    assert records[0][TRAIN_LOSS] == 0.25
    assert records[0][REPLAY_BUFFER_SIZE] == 12
    assert records[1][REWARDS_MEAN] == 0.5
    assert records[2] == {
        **records[2],
        "custom/value": 3,
        "custom/name": "gsm8k",
        "custom/flag": True,
    }
    for record in records:
        assert before <= record["time"] <= after
        assert list(record)[:2] == ["step", "time"]


def test_every_write_is_on_disk_before_close(tmp_path):
    # A killed run keeps its log: each record is flushed when written.
    logger = _logger(tmp_path)
    for step in range(3):
        logger.log_dict({TRAIN_LOSS: float(step)}, step=step, actor="training")
        on_disk = _strict_json_lines(logger.get_log_path())
        assert [r["step"] for r in on_disk] == list(range(step + 1))
    logger.close()


def test_reopening_appends(tmp_path):
    first = _logger(tmp_path)
    first.log_dict({EVAL_ACCURACY: 0.1}, step=0, actor="eval")
    first.close()
    second = _logger(tmp_path)
    second.log_dict({EVAL_ACCURACY: 0.2}, step=10, actor="eval")
    second.close()
    records = _strict_json_lines(second.get_log_path())
    assert [(r["step"], r[EVAL_ACCURACY]) for r in records] == [(0, 0.1), (10, 0.2)]


def test_nonfinite_values_are_null_and_counted(tmp_path, caplog):
    logger = _logger(tmp_path)
    with caplog.at_level(logging.WARNING, logger="grpo.observability.metric_logger"):
        logger.log_dict({"a": float("nan"), "b": float("inf"), "c": 1.5}, step=0)
        logger.log_dict(
            {"a": torch.tensor(float("nan")), "b": -math.inf, "c": np.float32("nan")}, step=1
        )
    records = _strict_json_lines(logger.get_log_path())
    assert records[0]["a"] is None and records[0]["b"] is None and records[0]["c"] == 1.5
    assert records[1]["a"] is None and records[1]["b"] is None and records[1]["c"] is None
    assert logger.get_nonfinite_counts() == {"a": 2, "b": 2, "c": 1}
    # Reported once per metric, not once per value.
    warnings = [r.getMessage() for r in caplog.records if "written as null" in r.getMessage()]
    assert len(warnings) == 3
    logger.close()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["logger/nonfinite_values"] == 5


def test_tensors_and_numpy_scalars_become_numbers(tmp_path):
    logger = _logger(tmp_path)
    logger.log_dict(
        {"t": torch.tensor(0.5), "n": np.float32(0.25), "i": np.int64(7), "one": torch.ones(1)},
        step=np.int64(3),
    )
    logger.close()
    (record,) = _strict_json_lines(logger.get_log_path())
    assert record["step"] == 3
    assert (record["t"], record["n"], record["i"], record["one"]) == (0.5, 0.25, 7, 1.0)


def test_bad_inputs_are_rejected_with_their_name(tmp_path):
    logger = _logger(tmp_path)
    with pytest.raises(TypeError, match="'training/ratios'"):
        logger.log_dict({"training/ratios": torch.ones(3)}, step=0)
    with pytest.raises(ValueError, match="'step'"):
        logger.log_dict({"step": 1}, step=0)
    with pytest.raises(TypeError, match="step must be an int"):
        logger.log_dict({"x": 1.0}, step=1.5)
    logger.close()
    with pytest.raises(RuntimeError, match="closed"):
        logger.log_dict({"x": 1.0}, step=0)


def test_log_table_writes_rows_per_step(tmp_path):
    logger = _logger(tmp_path)
    columns = ["Sequence ID", "Response", "Advantages", "Pi Logprob"]
    logger.log_table(
        [["s0", "42", torch.tensor(1.0), -0.5], ["s1", "41", -1.0, float("nan")]],
        columns,
        "per_sample_debug_table",
        step=3,
        actor="training",
    )
    logger.log_table(
        [["s2", "7", 0.0, torch.tensor([-0.5, -0.25])]], columns, "per_sample_debug_table", step=4
    )
    with pytest.raises(ValueError, match="row 0 has 2 cells, expected 4"):
        logger.log_table([["s3", "1"]], columns, "per_sample_debug_table", step=5)
    with pytest.raises(ValueError, match="table name '../evil'"):
        logger.log_table([], columns, "../evil", step=5)
    logger.close()

    records = _strict_json_lines(tmp_path / "run" / "tables" / "per_sample_debug_table.jsonl")
    assert [r["step"] for r in records] == [3, 4]
    assert records[0]["actor"] == "training"
    assert records[0]["columns"] == columns
    assert records[0]["rows"] == [["s0", "42", 1.0, -0.5], ["s1", "41", -1.0, None]]
    assert records[1]["rows"] == [["s2", "7", 0.0, [-0.5, -0.25]]]
    assert logger.get_nonfinite_counts() == {"table/per_sample_debug_table": 1}
    # Tables do not go into the scalar log.
    assert _strict_json_lines(logger.get_log_path()) == []


def test_config_written_as_yaml_and_json(tmp_path):
    from omegaconf import OmegaConf

    config = OmegaConf.create(
        {"model": {"path": "tiny"}, "lr": 1e-5, "group_size": 4, "out": "${model.path}/out"}
    )
    logger = _logger(tmp_path, config=config)
    logger.close()
    expected = {"model": {"path": "tiny"}, "lr": 1e-5, "group_size": 4, "out": "tiny/out"}
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == expected
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text()) == expected

    plain = MetricLogger(
        tmp_path / "plain", config={"dir": tmp_path, "ids": (1, 2)}, use_wandb=False
    )
    plain.close()
    assert json.loads((tmp_path / "plain" / "config.json").read_text()) == {
        "dir": str(tmp_path),
        "ids": [1, 2],
    }


def test_summary_merges_and_close_is_idempotent(tmp_path):
    logger = _logger(tmp_path)
    logger.log_summary({"final/accuracy": torch.tensor(0.75)})
    logger.log_summary({"total_steps": 100, "final/accuracy": 0.8})
    logger.close()
    logger.close()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary == {"final/accuracy": 0.8, "total_steps": 100}
    with pytest.raises(RuntimeError, match="closed"):
        logger.log_summary({"x": 1})
    resumed = _logger(tmp_path)
    resumed.log_summary({"total_steps": 200})
    resumed.close()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary == {"final/accuracy": 0.8, "total_steps": 200}


def test_stdout_prints_selected_keys_every_n_steps(tmp_path, capsys):
    logger = _logger(
        tmp_path,
        stdout_every_n=2,
        stdout_keys=[TRAIN_LOSS, "ref_rewards/rewards_func_*"],
    )
    logger.log_dict(
        {TRAIN_LOSS: 0.123456, TRAIN_LR: 1e-5},
        step=1,
        actor="training",
    )
    logger.log_dict({TRAIN_LOSS: 0.5, TRAIN_LR: 1e-5}, step=2, actor="training")
    logger.log_dict(
        {"ref_rewards/rewards_func_math_mean": 0.25, REWARDS_MEAN: 0.3},
        step=4,
        actor="ref",
    )
    logger.log_dict({INFERENCE_TOKENS_PER_SECOND: 100.0}, step=4, actor="inference")
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["[training 2] loss=0.5", "[ref 4] rewards_func_math_mean=0.25"]


def test_bad_constructor_arguments(tmp_path):
    with pytest.raises(ValueError, match="W&B mode must be one of"):
        MetricLogger(tmp_path, mode="sometimes", use_wandb=True)
    with pytest.raises(ValueError, match="stdout_every_n"):
        MetricLogger(tmp_path, stdout_every_n=-1, use_wandb=False)


# ---------------------------------------------------------------- helpers and names


def test_ratio_metrics_matches_seed_names_and_guards_zero_total():
    metrics = ratio_metrics(
        "training_perf",
        {"time_grpo_steps": 1.5, "time_weight_sync (s)": 0.25, "time_waiting_buffer": 0.0},
        total=2.0,
    )
    assert metrics == {
        "training_perf/pct_time_grpo_steps (%)": 75.0,
        "training_perf/pct_time_weight_sync (%)": 12.5,
        "training_perf/pct_time_waiting_buffer (%)": 0.0,
    }
    assert all(key in METRIC_NAMES["training"] for key in metrics)
    ref = ratio_metrics("ref_perf", {"time_model_running": 1.0}, total=0.0)
    assert ref == {REF_PERF_PCT_TIME_MODEL_RUNNING: 0.0}
    assert set(ref) <= set(METRIC_NAMES["ref"])
    nan_total = ratio_metrics("p", {"time_x": 1.0}, total=float("nan"))
    assert nan_total == {"p/pct_time_x (%)": 0.0}
    # A timing may be keyed by its full metric name: the namespace goes with the unit.
    full = ratio_metrics(REF_PERF_NAMESPACE, {REF_PERF_TIME_WAITING_BUFFER: 1.0}, total=4.0)
    assert full == {"ref_perf/pct_time_waiting_buffer (%)": 25.0}


def test_metric_names_hold_the_seed_contract():
    # Spelled out rather than named by their constants: dashboards read these very strings, so
    # this pins the values that a constant's rename must not change.
    seed_train = [
        "training/loss",
        "training/policy_loss",
        "training/kl_loss",
        "training/ratios",
        "training/clipfrac",
        "training/approx_policy_kls",
        "training/response_lengths",
        "training_perf/total_step_time (s)",
        "training_perf/time_grpo_steps (s)",
        "training_perf/tokens_per_second",
        "training_perf/time_weight_sync (s)",
        "training_perf/padded_tokens_percentage (%)",
        "training_perf/time_waiting_buffer (s)",
        "training_perf/pct_time_waiting_buffer (%)",
        "training_perf/time_weight_gather (s)",
        "queues/replay_buffer_size",
    ]
    seed_ref = [
        "ref_perf/total_rollout_time (s)",
        "ref_perf/time_model_running (s)",
        "ref_perf/time_waiting_buffer (s)",
        "ref_perf/total_tokens_processed",
        "queues/rollout_queue_size",
        "ref_rewards/rewards_mean",
        "ref_rewards/successes_mean",
    ]
    assert set(seed_train) <= set(METRIC_NAMES["training"])
    assert set(seed_ref) <= set(METRIC_NAMES["ref"])
    for extra in [
        "training/policy_age_mean",
        "training/grad_norm",
        "training/lr",
        "queues/replay_buffer_dropped_stale",
    ]:
        assert extra in METRIC_NAMES["training"]
    assert "eval/accuracy" in METRIC_NAMES["eval"]
    assert "inference/tokens_per_second" in METRIC_NAMES["inference"]
    rewards_key, successes_key = reward_metric_names("math_correct")
    assert rewards_key == "ref_rewards/rewards_func_math_correct_mean"
    assert successes_key == "ref_rewards/successes_func_math_correct_mean"
    assert is_known_metric(rewards_key) and is_known_metric(successes_key)
    assert not is_known_metric("ref_rewards/rewards_func_math_correct")
    assert not is_known_metric("training/typo")
    # No name appears under two actors.
    all_names = [name for names in METRIC_NAMES.values() for name in names]
    assert len(all_names) == len(set(all_names))


def test_every_listed_metric_has_its_actors_step():
    expected = {
        "training": TRAINING_STEP,
        "ref": REF_STEP,
        "inference": INFERENCE_STEP,
        "eval": TRAINING_STEP,
    }
    for actor, names in METRIC_NAMES.items():
        for name in names:
            assert step_metric_for(name.replace("{name}", "f")) == expected[actor], name


def test_step_metric_for_rules_and_fallbacks():
    assert step_metric_for(ROLLOUT_QUEUE_SIZE) == REF_STEP
    assert step_metric_for(REPLAY_BUFFER_SIZE) == TRAINING_STEP
    assert step_metric_for("training_perf/memory/peak_alloc") == TRAINING_STEP
    assert step_metric_for("per_sample_debug_table", actor="training") == TRAINING_STEP
    assert step_metric_for("custom/restarts", actor="inference") == INFERENCE_STEP
    assert step_metric_for("custom/restarts") == GLOBAL_STEP
    assert step_metric_for("custom/restarts", actor="somebody") == GLOBAL_STEP
    # A rule beats the caller's actor: the ref actor reporting a training key keeps training_step.
    assert step_metric_for(TRAIN_LOSS, actor="ref") == TRAINING_STEP


# ---------------------------------------------------------------- W&B (fake module)


_RUN_IDS = itertools.count()


class _FakeRun:
    def __init__(self, **init_kwargs):
        self.init_kwargs = init_kwargs
        self.id = init_kwargs.get("id") or f"fake{next(_RUN_IDS)}"
        self.name = init_kwargs.get("name") or "fake-run"
        self.defined: dict[str, str | None] = {}
        self.logged: list[dict] = []
        self.summary: dict = {}
        self.finished = 0
        self.fail_log = False

    def define_metric(self, name, step_metric=None, hidden=False):
        self.defined[name] = step_metric

    def log(self, data, step=None, commit=None):
        assert step is None, "the logger must not pass step= to W&B"
        if self.fail_log:
            raise ConnectionError("W&B backend went away")
        self.logged.append(dict(data))

    def finish(self):
        self.finished += 1


@pytest.fixture
def fake_wandb(monkeypatch):
    module = types.ModuleType("wandb")
    module.runs = []

    def init(**kwargs):
        run = _FakeRun(**kwargs)
        module.runs.append(run)
        return run

    module.init = init
    module.Table = lambda columns, data: ("table", tuple(columns), tuple(map(tuple, data)))
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return module


def test_wandb_gets_per_namespace_step_metrics(tmp_path, fake_wandb):
    logger = _logger(
        tmp_path, use_wandb=True, mode="offline", project="p", run_name="r", config={"lr": 0.1}
    )
    (run,) = fake_wandb.runs
    assert run.init_kwargs["mode"] == "offline"
    assert run.init_kwargs["project"] == "p" and run.init_kwargs["name"] == "r"
    assert run.init_kwargs["config"] == {"lr": 0.1}
    assert run.init_kwargs["dir"] == str((tmp_path / "run").resolve())
    for pattern, step_metric in STEP_METRIC_RULES:
        assert run.defined[pattern] == step_metric

    logger.log_dict(
        {TRAIN_LOSS: 1.0, REPLAY_BUFFER_SIZE: 3},
        step=10,
        actor="training",
    )
    logger.log_dict(
        {REWARDS_MEAN: float("nan"), ROLLOUT_QUEUE_SIZE: 2},
        step=4,
        actor="ref",
    )
    logger.log_dict({"custom/restarts": 1}, step=3, actor="inference")
    logger.log_table([[1, "a"]], ["id", "text"], "per_token_debug_table", step=10, actor="training")
    logger.log_summary({"final/accuracy": 0.5})
    logger.close()
    logger.close()

    train_call, ref_call, collector_call, table_call = run.logged
    assert train_call == {
        TRAIN_LOSS: 1.0,
        REPLAY_BUFFER_SIZE: 3,
        TRAINING_STEP: 10,
    }
    # An earlier step after a later one: carried by ref_step, so W&B keeps it. NaN goes to W&B
    # as NaN (W&B accepts it); only the JSONL needs null.
    assert ref_call[REF_STEP] == 4 and TRAINING_STEP not in ref_call
    assert math.isnan(ref_call[REWARDS_MEAN])
    assert collector_call == {"custom/restarts": 1, INFERENCE_STEP: 3}
    assert run.defined["custom/restarts"] == INFERENCE_STEP
    assert table_call == {
        "per_token_debug_table": ("table", ("id", "text"), ((1, "a"),)),
        TRAINING_STEP: 10,
    }
    assert run.summary == {"final/accuracy": 0.5}
    assert run.finished == 1


def test_wandb_mode_comes_from_the_environment_first(tmp_path, fake_wandb, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = _logger(tmp_path, use_wandb=True, mode="online")
    assert logger.mode == "offline"
    assert fake_wandb.runs[0].init_kwargs["mode"] == "offline"
    logger.close()
    monkeypatch.setenv("WANDB_MODE", "disabled")
    disabled = _logger(tmp_path, use_wandb=True, mode="online")
    assert len(fake_wandb.runs) == 1  # disabled: wandb not even started
    disabled.close()


def test_use_wandb_false_never_imports_wandb(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` would raise ImportError
    with caplog.at_level(logging.WARNING, logger="grpo.observability.metric_logger"):
        logger = _logger(tmp_path, use_wandb=False)
        logger.log_dict({"x": 1.0}, step=0)
        logger.close()
    assert not [r for r in caplog.records if "W&B" in r.getMessage()]
    assert _strict_json_lines(logger.get_log_path())[0]["x"] == 1.0


def test_wandb_init_failure_is_reported_once_and_logging_continues(tmp_path, fake_wandb, caplog):
    def broken_init(**kwargs):
        raise ConnectionError("no route to api.wandb.ai")

    fake_wandb.init = broken_init
    with caplog.at_level(logging.WARNING, logger="grpo.observability.metric_logger"):
        logger = _logger(tmp_path, use_wandb=True, mode="online")
        for step in range(3):
            logger.log_dict({TRAIN_LOSS: 0.1 * step}, step=step, actor="training")
        logger.close()
    failures = [r.getMessage() for r in caplog.records if "W&B failed" in r.getMessage()]
    assert len(failures) == 1
    assert "no route to api.wandb.ai" in failures[0] and "metrics.jsonl" in failures[0]
    assert [r["step"] for r in _strict_json_lines(logger.get_log_path())] == [0, 1, 2]


def test_missing_wandb_package_is_reported_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with caplog.at_level(logging.WARNING, logger="grpo.observability.metric_logger"):
        logger = _logger(tmp_path, use_wandb=True, mode="offline")
        logger.log_dict({"x": 1.0}, step=0)
        logger.close()
    failures = [r.getMessage() for r in caplog.records if "W&B failed" in r.getMessage()]
    assert len(failures) == 1 and "importing wandb" in failures[0]


def test_wandb_log_failure_turns_wandb_off_once(tmp_path, fake_wandb, caplog):
    logger = _logger(tmp_path, use_wandb=True, mode="online")
    run = fake_wandb.runs[0]
    run.fail_log = True
    with caplog.at_level(logging.WARNING, logger="grpo.observability.metric_logger"):
        for step in range(3):
            logger.log_dict({EVAL_ACCURACY: 0.5}, step=step, actor="eval")
    failures = [r.getMessage() for r in caplog.records if "W&B failed" in r.getMessage()]
    assert len(failures) == 1 and "logging step 0" in failures[0]
    logger.close()
    assert len(_strict_json_lines(logger.get_log_path())) == 3


def _log_three_steps_then_rewind(logger: MetricLogger) -> None:
    """Steps 1-3 logged (train and ref), then a trainer restart goes back to step 1."""
    for step in (1, 2, 3):
        logger.log_dict({TRAIN_LOSS: float(step)}, step=step, actor="training")
        logger.log_dict({REWARDS_MEAN: step / 10}, step=step - 1, actor="ref")
    logger.rewound(1, from_step=3)


def test_a_rewind_is_marked_and_forks_the_wandb_run_with_the_standing_values(tmp_path, fake_wandb):
    """The superseded values stay in metrics.jsonl (marked) and in the first W&B run; the
    W&B run that goes on holds each step's standing value once, its steps only increasing."""
    logger = _logger(tmp_path, use_wandb=True, mode="offline", run_name="r")
    logger.log_summary({"final/accuracy": 0.5})
    _log_three_steps_then_rewind(logger)
    logger.log_dict({TRAIN_LOSS: 20.0}, step=2, actor="training")
    logger.close()

    records = _strict_json_lines(logger.get_log_path())
    assert {"step": 1, "rewound_to": 1, "from_step": 3}.items() <= records[6].items()
    standing = records_after_rewinds(records)
    assert [(r["step"], r.get(TRAIN_LOSS)) for r in standing] == [
        (1, 1.0),
        (0, None),
        (1, None),
        (2, 20.0),
    ]

    first, second = fake_wandb.runs
    assert first.finished == 1 and len(first.logged) == 6
    assert first.summary["rewound_to_step"] == 1 and first.summary["from_step"] == 3
    assert second.init_kwargs["name"] == "r (from step 1)"
    assert second.defined[TRAINING_STEP] is None  # the step metrics are declared again
    train = [(c[TRAINING_STEP], c[TRAIN_LOSS]) for c in second.logged if TRAINING_STEP in c]
    ref = [(c[REF_STEP], c[REWARDS_MEAN]) for c in second.logged if REF_STEP in c]
    assert train == [(1, 1.0), (2, 20.0)]
    assert ref == [(0, 0.1), (1, 0.2)]
    assert second.summary == {"final/accuracy": 0.5}
    assert second.finished == 1


def test_a_resume_goes_on_in_the_same_wandb_run(tmp_path, fake_wandb):
    """One run and its resumes are one W&B run; a resume that redoes steps forks it, and the
    next resume goes on in the fork."""
    first = _logger(tmp_path, use_wandb=True, mode="offline", project="p")
    for step in (1, 2):
        first.log_dict({TRAIN_LOSS: float(step)}, step=step, actor="training")
    first.close()
    saved = json.loads((tmp_path / "run" / "wandb_run.json").read_text())
    assert saved == {"id": fake_wandb.runs[0].id, "name": "fake-run", "project": "p",
                     "first_record_offset": 0}  # fmt: skip

    # Stopped at its checkpoint of step 2 (Ctrl-C): the resume goes on in the same run.
    second = _logger(tmp_path, use_wandb=True, mode="offline", project="p")
    second.resumed(2)
    second.log_dict({TRAIN_LOSS: 3.0}, step=3, actor="training")
    second.close()
    assert len(fake_wandb.runs) == 2
    resumed = fake_wandb.runs[1]
    assert resumed.init_kwargs["id"] == fake_wandb.runs[0].id
    assert resumed.init_kwargs["resume"] == "allow" and resumed.finished == 1
    assert [c[TRAINING_STEP] for c in resumed.logged] == [3]

    # Killed after step 3 with its last checkpoint at step 2: step 3 is redone, a rewind.
    third = _logger(tmp_path, use_wandb=True, mode="offline", project="p")
    third.resumed(2)
    third.log_dict({TRAIN_LOSS: 30.0}, step=3, actor="training")
    third.close()
    going_on, forked = fake_wandb.runs[2:]
    assert going_on.init_kwargs["id"] == fake_wandb.runs[0].id
    assert going_on.summary == {"rewound_to_step": 2, "from_step": 3}
    assert "id" not in forked.init_kwargs and forked.name == "fake-run (from step 2)"
    # The fork holds the standing history of all three loggers, each step once.
    assert [(c[TRAINING_STEP], c[TRAIN_LOSS]) for c in forked.logged] == [(1, 1.0), (2, 2.0),
                                                                       (3, 30.0)]  # fmt: skip
    records = _strict_json_lines(tmp_path / "run" / "metrics.jsonl")
    assert [(r["step"], r.get(TRAIN_LOSS)) for r in records_after_rewinds(records)] == [
        (1, 1.0),
        (2, 2.0),
        (3, 30.0),
    ]

    fourth = _logger(tmp_path, use_wandb=True, mode="offline", project="p")
    fourth.resumed(3)
    fourth.close()
    assert fake_wandb.runs[4].init_kwargs["id"] == forked.id
    assert fake_wandb.runs[4].init_kwargs["name"] == "fake-run (from step 2)"
    # Another project cannot hold this run: a new one starts there.
    other = _logger(tmp_path, use_wandb=True, mode="offline", project="q")
    other.close()
    assert "id" not in fake_wandb.runs[5].init_kwargs


# ---------------------------------------------------------------- W&B (real, offline)


def _wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of an offline W&B run file (``run-*.wandb``: a LevelDB-style log of
    protobuf records, read here without W&B's server)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    [path] = run_dir.glob("run-*.wandb")
    data, rows, chunks = path.read_bytes(), [], []
    index = 7  # the file header: ":W&B", magic, version
    while index + 7 <= len(data):
        if (left := 32768 - index % 32768) < 7:  # a block's tail too short for a header
            index += left
            continue
        _, length, kind = struct.unpack("<IHB", data[index : index + 7])
        chunks.append(data[index + 7 : index + 7 + length])
        index += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                )
        elif kind == 0:
            break
    return rows


def test_a_rewind_forks_the_offline_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))
    logger = MetricLogger(
        tmp_path / "run", project="grpo-test", run_name="rewound", stdout_every_n=0
    )
    _log_three_steps_then_rewind(logger)
    logger.log_dict({TRAIN_LOSS: 20.0}, step=2, actor="training")
    logger.close()

    wandb_dir = tmp_path / "run" / "wandb"
    second = (wandb_dir / "latest-run").resolve()  # folder names may share their second
    [first] = [run for run in wandb_dir.glob("offline-run-*") if run.resolve() != second]
    rows = _wandb_history(second)
    assert [r["_step"] for r in rows] == list(range(len(rows)))
    train = [(r[TRAINING_STEP], r[TRAIN_LOSS]) for r in rows if TRAINING_STEP in r]
    assert train == [(1, 1.0), (2, 20.0)]
    superseded = [r[TRAIN_LOSS] for r in _wandb_history(first) if TRAINING_STEP in r]
    assert superseded == [1.0, 2.0, 3.0]


def test_a_resumed_run_logs_to_the_same_offline_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))
    ids = []
    for steps in ((1, 2), (3,)):  # a run, then its resume from the checkpoint of step 2
        logger = MetricLogger(tmp_path / "run", project="grpo-test", stdout_every_n=0)
        logger.resumed(steps[0] - 1)
        for step in steps:
            logger.log_dict({TRAIN_LOSS: float(step)}, step=step, actor="training")
        ids.append(logger._wandb_run.id)
        logger.close()
    assert ids[0] == ids[1]
    # W&B writes each invocation's offline run under the same id; `wandb sync` joins them.
    run_dirs = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 2 and all(d.name.split("-")[3] == ids[0] for d in run_dirs)


def test_wandb_offline_run_lands_in_the_log_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))
    started = time.perf_counter()
    logger = MetricLogger(
        tmp_path / "run",
        project="grpo-test",
        run_name="offline",
        mode="online",
        config={"lr": 1e-5},
        stdout_every_n=0,
        use_wandb=True,
    )
    assert logger.mode == "offline"
    logger.log_dict({TRAIN_LOSS: 0.5}, step=3, actor="training")
    logger.log_dict({REWARDS_MEAN: float("nan")}, step=1, actor="ref")
    logger.log_table(
        [["s0", 1.0]],
        ["Sequence ID", "Advantages"],
        "per_sample_debug_table",
        step=3,
        actor="training",
    )
    logger.close()
    logger.close()
    elapsed = time.perf_counter() - started

    run_dirs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1, list((tmp_path / "run").rglob("*"))
    assert len(list(run_dirs[0].glob("run-*.wandb"))) == 1
    assert list(run_dirs[0].rglob("per_sample_debug_table*.table.json"))
    records = _strict_json_lines(logger.get_log_path())
    assert [r["step"] for r in records] == [3, 1]
    assert elapsed < 30, f"offline W&B start + finish took {elapsed:.1f} s"


def test_a_logger_that_is_not_a_class_is_named(tmp_path):
    from grpo.config import InstantiationError, load_config
    from grpo.orchestrator.supervisor import ActorSupervisor

    cfg = load_config(
        "tiny_arithmetic_cpu",
        [f"output_dir={tmp_path}", "metric_logger._component_=grpo.config.load_config"],
    )
    supervisor = ActorSupervisor(cfg, tmp_path, current_step=lambda: 0, dataset=None)
    with pytest.raises(InstantiationError, match=r"metric_logger._component_: .* not a class"):
        supervisor.start_metric_logger()
