"""The `grpo` command: ls, cp, validate, run, plot; in-process through `main`, plus one
subprocess run of the installed console script."""

from __future__ import annotations

import json
import runpy
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from grpo.cli import list_recipes, main, recipes_dir
from grpo.config import configs_dir, list_configs, repo_root

# Every component is `builtins.dict`: it imports instantly and takes any keyword.
DICT = "builtins.dict"

# A recipe that records the config it was given, resolved, as JSON in output_dir.
RECIPE_SOURCE = '''
import json
from pathlib import Path

from grpo.recipe import parse


@parse
def recipe_main(cfg):
    """Write the config this recipe received."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "received.json").write_text(json.dumps(cfg.model_dump()))
    return 0


if __name__ == "__main__":
    recipe_main()
'''


def small_config(model_dir: Path, output_dir: Path) -> dict:
    component = {"_component_": DICT}
    return {
        "base_model_path": str(model_dir),
        "output_dir": str(output_dir),
        "target_tokens_per_batch": 128,
        "ray": {"num_cpus": 4, "num_gpus": 0},
        "orchestration": {"num_steps": 2, "replay_buffer_size": 16},
        "inference": {"group_size": 4, "max_prompt_tokens": 16, "max_generated_tokens": 8},
        "training": {
            "batch_size": 8,
            "optimizer": {"_component_": DICT, "lr": 0.1},
            "loss": {"_component_": DICT, "kl_estimator": "k3"},
        },
        "reward_functions": [component],
        "dataset": {"_component_": DICT, "size": 4},
        "metric_logger": {"_component_": DICT, "log_dir": "${output_dir}"},
    }


# A recipe that leaves what a run leaves (a metrics file) and returns a summary; seed 130
# plays a run that Ctrl-C stopped.
LEDGER_RECIPE_SOURCE = """
from pathlib import Path


def recipe_main(cfg):
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.jsonl", "a") as metrics:
        metrics.write('{"seed": %d}\\n' % cfg.seed)
    return {"steps": 1, "exit_code": 130} if cfg.seed == 130 else {"steps": 1}
"""


# A recipe that stops on an error the way an actor's does (a remote traceback, coloured, in
# the message), after saving a checkpoint when the seed says so; seed 130 plays Ctrl-C.
FAILING_RECIPE_SOURCE = """
from pathlib import Path

from grpo.errors import ActorFailedError


def recipe_main(cfg):
    if cfg.seed == 130:
        raise KeyboardInterrupt
    out = Path(cfg.output_dir)
    if cfg.seed == 2:
        (out / "checkpoints" / "step_000002").mkdir(parents=True)
        (out / "checkpoints" / "latest").write_text("step_000002")
    raise ActorFailedError(
        "inference[0] failed: \\x1b[36mray::SyncLLMCollector.generate_batch_with_state()"
        "\\x1b[39m (pid=12)\\n  File \\"/x/env.py\\", line 3, in env_response\\n"
        "KeyError: 'anwser'"
    )
"""


@pytest.fixture
def workspace(tmp_path, monkeypatch, fake_model_dir):
    """Temporary recipes and configs folders, with one recipe and two configs."""
    recipes = tmp_path / "recipes"
    configs = tmp_path / "configs"
    recipes.mkdir()
    configs.mkdir()
    (recipes / "record.py").write_text(RECIPE_SOURCE)
    (recipes / "_helpers.py").write_text("")  # private: not a recipe
    config = small_config(fake_model_dir, tmp_path / "out")
    text = yaml.safe_dump(config)
    (configs / "small.yaml").write_text(f"# To launch:\n#   grpo run record --config small\n{text}")
    (configs / "orphan.yaml").write_text(text)
    monkeypatch.setenv("GRPO_RECIPES_DIR", str(recipes))
    monkeypatch.setenv("GRPO_CONFIGS_DIR", str(configs))
    return tmp_path


def received(workspace: Path) -> dict:
    return json.loads((workspace / "out" / "received.json").read_text())


# ------------------------------------------------------------------------------ ls


def test_ls_groups_configs_under_their_recipe(workspace, capsys):
    assert main(["ls"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["RECIPE", "CONFIG"]
    assert lines[1].split() == ["record", "small"]
    assert lines[2].split() == ["<no", "recipe>", "orphan"]
    assert len(lines) == 3


def test_ls_lists_the_repo_recipes_and_configs(capsys):
    assert recipes_dir() == repo_root() / "recipes"
    assert main(["ls"]) == 0
    out = capsys.readouterr().out
    for name in list_recipes() + list_configs():
        assert name in out
    assert "async_grpo" in list_recipes()


# ------------------------------------------------------------------------------ cp


def test_cp_copies_and_refuses_to_overwrite(workspace, tmp_path, capsys):
    destination = tmp_path / "mine.yaml"
    assert main(["cp", "small", str(destination)]) == 0
    assert destination.read_text() == (workspace / "configs" / "small.yaml").read_text()

    destination.write_text("edited")
    assert main(["cp", "small", str(destination)]) == 1
    assert "--force" in capsys.readouterr().err
    assert destination.read_text() == "edited"  # untouched

    assert main(["cp", "small", str(destination), "--force"]) == 0
    assert destination.read_text() == (workspace / "configs" / "small.yaml").read_text()


def test_cp_into_a_folder_or_without_suffix(workspace, tmp_path):
    folder = tmp_path / "copies"
    folder.mkdir()
    assert main(["cp", "record", str(folder)]) == 0
    assert (folder / "record.py").read_text() == RECIPE_SOURCE
    assert main(["cp", "small", str(tmp_path / "nested" / "run")]) == 0
    assert (tmp_path / "nested" / "run.yaml").is_file()


def test_cp_unknown_name(workspace, capsys):
    assert main(["cp", "smal", "x.yaml"]) == 2
    assert "did you mean 'small'" in capsys.readouterr().err.lower()


# ------------------------------------------------------------------------------ validate


def test_validate_ok(workspace, capsys):
    assert main(["validate", "small", "inference.group_size=8"]) == 0
    assert capsys.readouterr().out.strip() == "Config is well-formed!"


def test_validate_reports_every_problem(workspace, capsys):
    status = main(["validate", "small", "inference.group_size=1", "inference.top_p=0"])
    assert status == 2
    err = capsys.readouterr().err
    assert "inference.group_size: must be >= 2" in err
    assert "inference.top_p: must be > 0, got 0" in err
    assert "Traceback" not in err


def test_validate_the_demo_config_imports_no_component(tmp_path):
    """grpo validate checks every component from its source: no torch, Ray or vLLM import,
    and so no import-time warnings before the verdict."""
    code = (
        "import sys; from grpo.cli import main; "
        f"status = main(['validate', 'tiny_arithmetic_cpu', 'output_dir={tmp_path}/run']); "
        "print(status, sorted(m for m in ('torch', 'ray', 'vllm', 'math_verify') "
        "if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.splitlines() == ["Config is well-formed!", "0 []"], result
    assert result.stderr == ""


def test_validate_unknown_config_lists_names(workspace, capsys):
    assert main(["validate", "nope"]) == 2
    err = capsys.readouterr().err
    assert "orphan" in err and "small" in err


# ------------------------------------------------------------------------------ run


def test_run_recipe_by_name_with_overrides(workspace):
    status = main(["run", "record", "--config", "small", "inference.group_size=8", "seed=5"])
    assert status == 0
    cfg = received(workspace)
    assert cfg["inference"]["group_size"] == 8
    assert cfg["seed"] == 5
    assert cfg["metric_logger"]["log_dir"] == cfg["output_dir"]  # interpolation resolved
    assert cfg["inference"]["top_p"] == 1.0  # schema default filled


def test_run_verbose_flag_is_log_level_debug(workspace):
    assert main(["run", "record", "--config", "small", "seed=5"]) == 0
    assert received(workspace)["log_level"] == "info"
    assert (workspace / "out" / "logs" / "driver.log").is_file()
    assert main(["run", "record", "--config", "small", "seed=5", "--verbose"]) == 0
    assert received(workspace)["log_level"] == "debug"
    assert main(["run", "record", "-v", "--config", "small", "log_level=info"]) == 0
    assert received(workspace)["log_level"] == "debug"  # the flag wins over an override


def test_run_recipe_by_path_and_config_by_path(workspace, tmp_path):
    recipe = tmp_path / "elsewhere" / "my_recipe.py"
    recipe.parent.mkdir()
    shutil.copy(workspace / "recipes" / "record.py", recipe)
    config = workspace / "configs" / "orphan.yaml"
    assert main(["run", str(recipe), "--config", str(config), "~training.loss.kl_estimator"]) == 0
    assert "kl_estimator" not in received(workspace)["training"]["loss"]


def test_run_config_error_exits_2_without_running(workspace, capsys):
    status = main(["run", "record", "--config", "small", "inference.grup_size=4"])
    assert status == 2
    err = capsys.readouterr().err
    assert "did you mean inference.group_size?" in err and "Traceback" not in err
    assert not (workspace / "out" / "received.json").exists()

    assert main(["run", "record", "--config", "small", "training.batch_size=0"]) == 2
    assert "training.batch_size: must be >= 1" in capsys.readouterr().err


def test_a_used_output_dir_is_refused_unless_resumed_or_moved_aside(workspace, capsys):
    (workspace / "recipes" / "ledger.py").write_text(LEDGER_RECIPE_SOURCE)
    out = workspace / "out"
    assert main(["run", "ledger", "--config", "small", "seed=1"]) == 0
    capsys.readouterr()
    # A second fresh run would mix its metrics with the first one's: refused, in one line.
    for command in (["run", "ledger", "--config", "small"], ["validate", "small"]):
        assert main([*command, "seed=2"]) != 0
        err = capsys.readouterr().err
        assert f"output_dir: {out} already holds a run (metrics.jsonl)" in err, err
        assert "resume_from_checkpoint=true" in err and "overwrite_output_dir=true" in err
        assert "Traceback" not in err
    assert (out / "metrics.jsonl").read_text() == '{"seed": 1}\n'
    # Moved aside, not deleted; the new run starts in an empty folder.
    assert main(["run", "ledger", "--config", "small", "seed=3", "overwrite_output_dir=true"]) == 0
    assert "aside to" in capsys.readouterr().out
    (old,) = workspace.glob("out.old-*")
    assert (old / "metrics.jsonl").read_text() == '{"seed": 1}\n'
    assert (out / "metrics.jsonl").read_text() == '{"seed": 3}\n'
    # Resuming continues the run in place.
    checkpoint = out / "checkpoints" / "step_000001"
    checkpoint.mkdir(parents=True)
    (checkpoint / "state.json").write_text("{}")
    (out / "checkpoints" / "latest").write_text(checkpoint.name)
    assert (
        main(["run", "ledger", "--config", "small", "seed=4", "resume_from_checkpoint=true"]) == 0
    )
    assert (out / "metrics.jsonl").read_text() == '{"seed": 3}\n{"seed": 4}\n'
    assert len(list(workspace.glob("out.old-*"))) == 1


def test_a_run_stopped_by_a_signal_exits_with_its_status(workspace):
    (workspace / "recipes" / "ledger.py").write_text(LEDGER_RECIPE_SOURCE)
    # 128 + SIGINT, as a shell reports it: a script can tell it from a finished run (0).
    assert main(["run", "ledger", "--config", "small", "seed=130"]) == 130
    assert main(["run", "ledger", "--config", "small", "overwrite_output_dir=true"]) == 0


def test_a_run_stopped_by_an_error_says_why_in_a_line_and_keeps_the_traceback(workspace, capsys):
    (workspace / "recipes" / "failing.py").write_text(FAILING_RECIPE_SOURCE)
    out = workspace / "out"
    assert main(["run", "failing", "--config", "small", "seed=1"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "Run stopped: inference[0] failed: ray::SyncLLMCollector.generate_batch_with_state() "
        "(pid=12) ... KeyError: 'anwser'",
        f"Traceback: {out / 'logs' / 'driver.log'} (each process's output: {out / 'logs'}/)",
        "Resume from: the start (no checkpoint saved yet)",
    ]
    driver_log = (out / "logs" / "driver.log").read_text()
    assert "run stopped: inference[0] failed" in driver_log
    assert "Traceback (most recent call last)" in driver_log and "ActorFailedError" in driver_log

    # With a checkpoint saved, the last line names it.
    assert main(["run", "failing", "--config", "small", "seed=2", "overwrite_output_dir=true"]) == 1
    checkpoint = out / "checkpoints" / "step_000002"
    assert f"Resume from: {checkpoint} (resume_from_checkpoint=true)" in capsys.readouterr().err


def test_ctrl_c_before_the_run_handles_signals_exits_130_without_a_traceback(workspace, capsys):
    (workspace / "recipes" / "failing.py").write_text(FAILING_RECIPE_SOURCE)
    assert main(["run", "failing", "--config", "small", "seed=130"]) == 130
    assert capsys.readouterr().err == "grpo run: interrupted\n"


def test_run_unknown_recipe_and_missing_recipe_main(workspace, tmp_path, capsys):
    assert main(["run", "recrod", "--config", "small"]) == 2
    assert "did you mean 'record'" in capsys.readouterr().err.lower()
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    assert main(["run", str(empty), "--config", "small"]) == 2
    assert "recipe_main" in capsys.readouterr().err


def test_run_rejects_unknown_flags(workspace):
    with pytest.raises(SystemExit) as info:
        main(["run", "record", "--config", "small", "--steps", "3"])
    assert info.value.code == 2


def test_recipe_file_runs_as_a_script(workspace, monkeypatch):
    # `python recipes/record.py --config small key=value`, through its __main__ block.
    recipe = workspace / "recipes" / "record.py"
    monkeypatch.setattr(sys, "argv", [str(recipe), "--config", "small", "seed=7"])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(recipe), run_name="__main__")
    assert info.value.code == 0
    assert received(workspace)["seed"] == 7


# ------------------------------------------------------------------------------ plot


def test_plot_calls_plot_run(workspace, tmp_path, monkeypatch, capsys):
    calls = []
    fake = types.ModuleType("grpo.observability.plotting")
    fake.plot_run = lambda run_dir: calls.append(Path(run_dir)) or [Path(run_dir) / "a.png"]
    monkeypatch.setitem(sys.modules, "grpo.observability.plotting", fake)
    assert main(["plot", str(tmp_path)]) == 0
    assert calls == [tmp_path]
    assert str(tmp_path / "a.png") in capsys.readouterr().out


def test_plot_errors(workspace, tmp_path, monkeypatch, capsys):
    assert main(["plot", str(tmp_path / "no_run")]) == 2
    assert "does not exist" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "grpo.observability.plotting", None)  # import fails
    assert main(["plot", str(tmp_path)]) == 1
    assert "plotting is unavailable" in capsys.readouterr().err


def test_plot_a_folder_without_metrics_says_so_in_a_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"grpo plot: error: no metrics file at {tmp_path / 'metrics.jsonl'}: expected the "
        "metrics.jsonl that MetricLogger writes in the run folder\n"
    )
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["plot", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (
        f"grpo plot: error: no metrics to plot in {tmp_path / 'metrics.jsonl'}\n"
    )


def test_version_prints_the_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"grpo {version('grpo')}\n"


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "run" in capsys.readouterr().out


# ------------------------------------------------------------------------------ console script


def test_console_script_validate(workspace):
    script = Path(sys.executable).parent / "grpo"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "grpo"]
    config = str(workspace / "configs" / "small.yaml")
    ok = subprocess.run([*command, "validate", config], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "Config is well-formed!" in ok.stdout
    bad = subprocess.run(
        [*command, "validate", config, "inference.temperature=-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert "inference.temperature: must be > 0" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_configs_dir_follows_environment(workspace):
    assert configs_dir() == workspace / "configs"
    assert list_configs() == ["orphan", "small"]
