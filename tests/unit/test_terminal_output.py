"""What a run prints on the terminal, and where everything else goes (`grpo.observability.logs`).

The tests that start a Ray cluster or a vLLM engine: tests/integration/test_terminal_output.py.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grpo.config import repo_root
from grpo.observability.logs import DriverLog, actor_log_path, with_output_to

# vLLM's log format: "(MainProcess pid=12) INFO 11-23 22:28:48 [model.py:733] ...".
VLLM_LINE = re.compile(r"\b(DEBUG|INFO|WARNING)\b.*\[[\w.]+\.py:\d+\]")


def test_actor_log_names_need_no_quoting(tmp_path):
    assert actor_log_path(tmp_path, "inference[0]") == tmp_path / "logs" / "inference_0.log"
    assert actor_log_path(tmp_path, "replay_buffer") == tmp_path / "logs" / "replay_buffer.log"


class Talker:
    """Prints from Python and from a child process, as vLLM and its C++ code do."""

    def __init__(self, word: str) -> None:
        print(f"python {word}")
        logging.getLogger("talker").info("logged %s", word)
        os.system(f"echo child {word} 1>&2")


def test_with_output_to_sends_the_process_output_to_the_file(tmp_path):
    log_file = tmp_path / "logs" / "talker.log"
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_terminal_output import Talker
        from grpo.observability.logs import with_output_to

        cls = with_output_to(Talker, {str(log_file)!r})
        assert cls.__name__ == "Talker" and issubclass(cls, Talker)
        cls("hello")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(repo_root())}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""
    text = log_file.read_text()
    assert "python hello" in text and "logged hello" in text and "child hello" in text


def test_with_output_to_keeps_the_class_usable():
    cls = with_output_to(Talker, os.devnull)
    assert cls.__qualname__ == Talker.__qualname__ and cls.__doc__ == Talker.__doc__


def test_driver_log_holds_records_until_it_knows_the_mode(tmp_path, capsys):
    cfg = {"output_dir": str(tmp_path / "run"), "log_level": "info"}
    with DriverLog() as driver_log:
        logging.getLogger("somelib").warning("early library warning")
        path = driver_log.start(**cfg)
        logging.getLogger("grpo.test").info("grpo info")
        logging.getLogger("grpo.test").warning("grpo warning")
    text = path.read_text()
    assert path == tmp_path / "run" / "logs" / "driver.log"
    for message in ("early library warning", "grpo info", "grpo warning"):
        assert message in text
    err = capsys.readouterr().err
    # Only the grpo logger's warnings reach the terminal.
    assert "grpo warning" in err
    assert "early library warning" not in err and "grpo info" not in err
    # Undone on exit: later records no longer reach the run's file.
    assert not any(
        getattr(h, "baseFilename", None) == str(path) for h in logging.getLogger().handlers
    )


def test_driver_log_in_debug_mode_shows_everything(tmp_path, capsys):
    cfg = {"output_dir": str(tmp_path / "run"), "log_level": "debug"}
    with DriverLog() as driver_log:
        logging.getLogger("somelib").warning("early library warning")
        driver_log.start(**cfg)
        logging.getLogger("grpo.test").debug("grpo debug")
    err = capsys.readouterr().err
    assert "early library warning" in err and "grpo debug" in err
    assert logging.getLogger("grpo").level == logging.NOTSET  # restored


def test_ctrl_c_while_ray_starts_exits_130_without_a_traceback(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """Ctrl-C before the run's own signal handlers exist (during ``ray.init``): no traceback
    through Ray's start-up, the status a shell gives an interrupted process."""
    import ray

    from grpo.cli import main
    from grpo.testing import RANDOM_MODEL_OVERRIDES

    if ray.is_initialized():
        ray.shutdown()  # else the recipe would join it instead of starting one

    def interrupted_start(**kwargs):
        signal.raise_signal(signal.SIGINT)  # the user's Ctrl-C, while Ray starts

    monkeypatch.setattr(ray, "init", interrupted_start)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        status = main(
            [
                *("run", "async_grpo", "--config", "tiny_arithmetic_cpu"),
                f"base_model_path={tiny_model_dir}",
                *RANDOM_MODEL_OVERRIDES,
                f"output_dir={tmp_path / 'run'}",
            ]
        )
    except KeyboardInterrupt:  # escaping, it would end the whole test session
        pytest.fail("Ctrl-C while Ray started escaped grpo run as a traceback")
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    assert status == 130
    assert err.endswith("grpo run: interrupted\n") and "Traceback" not in err, err


def _summary(tmp_path: Path, **fields) -> dict:
    """A recipe summary (`recipes/async_grpo.py`) of a run that reached step 100."""
    return {
        "steps": 100,
        "policy_version": 100,
        "eval": [(0, 0.172), (10, 0.221)],
        "final_checkpoint": str(tmp_path / "final"),
        "run_dir": str(tmp_path),
        "seconds": 7.2,
        "plots": [],
        "resumed_from": None,
        "resumed_at_step": None,
        "evals_before_resume": 0,
        **fields,
    }


def test_the_results_of_a_resumed_run_say_what_it_ran_and_which_figures_are_older(tmp_path, capsys):
    from grpo.observability.console import print_end

    print_end(_summary(tmp_path))
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [
        "Run finished: 100 steps in 00:07, policy version 100",
        "Held-out accuracy: 0.172 at step 0 -> 0.221 at step 10",
    ]
    # Resumed at step 93 with evaluation off: 7 steps ran, and both figures are older.
    print_end(_summary(tmp_path, resumed_at_step=93, evals_before_resume=2))
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [
        "Run finished: step 100 (7 steps this run, resumed from step 93) in 00:07, "
        "policy version 100",
        "Held-out accuracy: 0.172 at step 0 -> 0.221 at step 10, before this run's resume",
    ]
    # With evaluation on, this run's figures follow the older ones.
    evals = [(0, 0.172), (10, 0.221), (99, 0.3), (100, 0.31)]
    print_end(_summary(tmp_path, eval=evals, resumed_at_step=99, evals_before_resume=2))
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [
        "Run finished: step 100 (1 step this run, resumed from step 99) in 00:07, "
        "policy version 100",
        "Held-out accuracy: 0.172 at step 0 -> 0.221 at step 10 (before this run's resume) "
        "-> 0.300 at step 99 -> 0.310 at step 100",
    ]


def test_the_start_lines_name_the_wandb_run_a_resume_goes_on_in(tmp_path, monkeypatch):
    from grpo.observability.console import wandb_text
    from grpo.preflight import load_run_config

    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    saved = {"id": "abc123", "name": None, "project": "grpo-tiny", "first_record_offset": 0}
    (run_dir / "wandb_run.json").write_text(json.dumps(saved))
    overrides = [f"output_dir={run_dir}", "overwrite_output_dir=true"]
    fresh = load_run_config("tiny_arithmetic_cpu", overrides)
    assert wandb_text(fresh, run_dir) == (
        f"offline, project 'grpo-tiny', in {run_dir / 'wandb'} (upload with `wandb sync`)"
    )
    resumed = fresh.model_copy(update={"resume_from_checkpoint": True})
    assert wandb_text(resumed, run_dir).startswith(
        "offline, project 'grpo-tiny', run abc123 resumed"
    )
