"""The ``grpo`` command, in the style of torchtune's ``tune``.

    grpo ls                                     recipes and their configs
    grpo run async_grpo --config NAME k=v ...   validate the config, then run the recipe
                                                (--verbose: every process's output on the
                                                terminal instead of OUTPUT_DIR/logs/)
    grpo validate NAME [k=v ...]                check a config without running anything
                [--gpu-memory 24GiB]            and its GPU memory plan (per role, per GPU)
    grpo cp NAME DEST [--force]                 copy a config or recipe to edit it
    grpo plot RUN_DIR                           write the standard plots of a run
    grpo eval CONFIG_OR_RUN_DIR [k=v ...]       evaluate a policy on the held-out set, no
              [--checkpoint PATH]               training: a table, and RUN_DIR/eval.json
    grpo export CHECKPOINT_DIR --peft OUT       a LoRA checkpoint's adapter as a PEFT folder,
                               --merged OUT     and/or merged into its base model
    grpo --version                              the installed package's version

A recipe is a Python file with a ``recipe_main(cfg)`` function: a name (``async_grpo``) means
``recipes/async_grpo.py`` in the repo (or ``$GRPO_RECIPES_DIR``), anything ending in ``.py`` is
a path. A config is a name (``configs/NAME.yaml``) or a path to a YAML file.

Exit status: 0 on success, 1 when a command could not do its job (a file would be
overwritten, a folder holds no metrics to plot, a run stopped on an error), 2 for bad usage or
any config problem, 130 after Ctrl-C (``128 + signal`` for a run a signal stopped).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

from grpo.config import ConfigError, configs_dir, list_configs, repo_root
from grpo.observability.logs import DriverLog
from grpo.preflight import load_run_config, used_output_dir_problem
from grpo.preflight.memory import (
    format_memory_plan,
    memory_problems,
    parse_size,
    run_memory_plan,
)
from grpo.preflight.versions import check_vllm_version
from grpo.recipe import add_verbose_flag, import_from_launch_folder, run_recipe, split_overrides

# A config names its recipe in its launch comment: "#   grpo run async_grpo --config ...".
_LAUNCH_LINE = re.compile(r"^#.*\bgrpo run\s+(\S+)\s+--config\b", re.MULTILINE)


class CommandError(Exception):
    """A command failed in an expected way; the message is printed, no traceback."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def recipes_dir() -> Path:
    """Folder of named recipes: ``$GRPO_RECIPES_DIR`` if set, else ``<repo>/recipes``."""
    return Path(os.environ.get("GRPO_RECIPES_DIR") or repo_root() / "recipes")


def list_recipes() -> list[str]:
    """Names of the recipes in `recipes_dir` (``*.py`` not starting with ``_``), sorted."""
    folder = recipes_dir()
    if not folder.is_dir():
        return []
    return sorted(path.stem for path in folder.glob("*.py") if not path.name.startswith("_"))


def find_recipe(name_or_path: str) -> Path:
    """Turn a recipe name (``async_grpo``) or a ``.py`` path into the path of an existing file.

    Raises:
        CommandError: If there is no such recipe; the message lists the known ones.
    """
    known = list_recipes()
    listing = ", ".join(known) or f"none in {recipes_dir()}"
    if name_or_path.endswith(".py") or os.sep in name_or_path or "/" in name_or_path:
        path = Path(name_or_path).expanduser()
        if path.is_file():
            return path
        raise CommandError(f"recipe file {name_or_path} not found. Recipes: {listing}", 2)
    path = recipes_dir() / f"{name_or_path}.py"
    if path.is_file():
        return path
    close = difflib.get_close_matches(name_or_path, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise CommandError(f"unknown recipe {name_or_path!r}.{hint} Recipes: {listing}", 2)


def load_recipe_main(path: Path):
    """Import a recipe file by path and return its ``recipe_main``.

    Raises:
        CommandError: If the file has no callable ``recipe_main``.
    """
    module_name = f"grpo_recipe_{re.sub(r'[^0-9a-zA-Z_]', '_', path.stem)}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise CommandError(f"cannot import recipe {path}", 2)
    module: ModuleType = importlib.util.module_from_spec(spec)
    # Registered before running it, so dataclasses and pickling inside the recipe can find it.
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    recipe_main = getattr(module, "recipe_main", None)
    if not callable(recipe_main):
        raise CommandError(f"recipe {path} defines no recipe_main(cfg) function", 2)
    return recipe_main


def _config_recipe(path: Path) -> str | None:
    match = _LAUNCH_LINE.search(path.read_text(encoding="utf-8", errors="replace"))
    return match.group(1) if match else None


def _run_cmd(args: argparse.Namespace) -> int:
    # Entered before the recipe is imported: its imports log (torchao warns about its C++
    # extensions), and those records belong in the run's driver.log, not on the terminal.
    with DriverLog() as driver_log:
        recipe_main = load_recipe_main(find_recipe(args.recipe))
        return run_recipe(
            recipe_main, args.config, args.overrides, prog="grpo run", driver_log=driver_log
        )


def _validate_cmd(args: argparse.Namespace) -> int:
    # With --gpu-memory the run is planned for GPUs of that size, usually from another machine
    # (a laptop): this one's Ray cluster, the weights and the datasets are not the run's.
    planning = args.gpu_memory is not None
    cfg = load_run_config(
        args.config, args.overrides, check_components=True, this_machine=not planning
    )
    if problem := used_output_dir_problem(cfg):  # what `grpo run` would refuse at start
        raise ConfigError(problem)
    if warning := check_vllm_version():  # may work; was not tested
        print(f"grpo validate: warning: {warning}", file=sys.stderr)
    try:
        plan = run_memory_plan(cfg, args.gpu_memory)
    except ValueError as exc:  # a config.json without the sizes (a stand-in model folder)
        print(f"GPU memory plan: none ({exc})")
        plan = None
    if plan is not None:
        print(format_memory_plan(plan))
        if problems := memory_problems(plan):
            if len(problems) == 1:
                raise CommandError(problems[0])
            lines = "\n".join(f"  - {problem}" for problem in problems)
            raise CommandError(f"{len(problems)} roles do not fit their GPUs:\n{lines}")
    if planning:
        print(
            "Planned from the model's config.json alone. Not checked with --gpu-memory: this "
            "machine's Ray cluster, the model's weights, tokenizer and chat template, the "
            "datasets' files (run `grpo validate` without it where the run starts)."
        )
    print("Config is well-formed!")
    return 0


def _gpu_memory(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ls_cmd(args: argparse.Namespace) -> int:
    recipes = list_recipes()
    by_recipe: dict[str, list[str]] = {name: [] for name in recipes}
    unassigned: list[str] = []
    for name in list_configs():
        recipe = _config_recipe(configs_dir() / f"{name}.yaml")
        if recipe:
            by_recipe.setdefault(recipe, []).append(name)
        else:
            unassigned.append(name)
    rows = []
    for recipe, configs in by_recipe.items():
        shown = recipe if recipe in recipes else f"{recipe} (missing)"
        rows += [(shown if i == 0 else "", config) for i, config in enumerate(configs or ["<>"])]
    rows += [("<no recipe>" if i == 0 else "", c) for i, c in enumerate(unassigned)]
    width = max([len("RECIPE"), *(len(recipe) for recipe, _ in rows)]) + 2
    print(f"{'RECIPE':<{width}}CONFIG")
    for recipe, config in rows:
        print(f"{recipe:<{width}}{config}")
    return 0


def _cp_cmd(args: argparse.Namespace) -> int:
    name = args.name
    candidates = []
    if not name.endswith(".yaml") and (recipes_dir() / f"{name.removesuffix('.py')}.py").is_file():
        candidates.append(recipes_dir() / f"{name.removesuffix('.py')}.py")
    if (
        not name.endswith(".py")
        and (configs_dir() / f"{name.removesuffix('.yaml')}.yaml").is_file()
    ):
        candidates.append(configs_dir() / f"{name.removesuffix('.yaml')}.yaml")
    if not candidates:
        known = list_recipes() + list_configs()
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise CommandError(f"no recipe or config named {name!r}.{hint} See `grpo ls`.", 2)
    if len(candidates) > 1:
        raise CommandError(
            f"{name!r} is both a recipe and a config; write {name}.py or {name}.yaml", 2
        )
    source = candidates[0]
    destination = Path(args.destination).expanduser()
    if destination.is_dir() or args.destination.endswith(("/", os.sep)):
        destination = destination / source.name
    elif destination.suffix != source.suffix:
        destination = destination.with_name(destination.name + source.suffix)
    if destination.exists() and not args.force:
        raise CommandError(f"{destination} already exists; use --force to overwrite it")
    destination.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, destination)
    print(f"Copied {source} to {destination}")
    return 0


def _plot_cmd(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir).expanduser()
    if not run_dir.is_dir():
        raise CommandError(f"run folder {run_dir} does not exist", 2)
    try:
        # Imported here: matplotlib is slow to import and only this command needs it.
        from grpo.observability.plotting import plot_run
    except ImportError as exc:
        raise CommandError(f"plotting is unavailable: {exc}") from None
    try:
        written = plot_run(run_dir)
    except FileNotFoundError as exc:  # no metrics.jsonl: not a run folder, or a run not started
        raise CommandError(str(exc)) from None
    if not written:
        raise CommandError(f"no metrics to plot in {run_dir / 'metrics.jsonl'}")
    for path in written:
        print(path)
    return 0


def _export_cmd(args: argparse.Namespace) -> int:
    if args.peft is None and args.merged is None:
        raise CommandError("give --peft OUT_DIR and/or --merged OUT_DIR", 2)
    if not Path(args.checkpoint_dir).exists():
        raise CommandError(f"checkpoint folder {args.checkpoint_dir} does not exist", 2)
    # Imported here: it loads torch, which the other commands do without.
    import logging

    # torchao warns at import about its C++ extensions, which nothing here uses.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    from grpo.export import ExportError, export_checkpoint

    try:
        written = export_checkpoint(
            args.checkpoint_dir,
            peft_dir=args.peft,
            merged_dir=args.merged,
            overwrite=args.overwrite,
        )
    except ExportError as exc:
        raise CommandError(str(exc)) from None
    for path in written:
        print(path)
    return 0


def _saved_config(run_dir: Path) -> Path:
    """The config a run folder's run ran with: the metric logger's copy, else its latest
    checkpoint's."""
    from grpo.run_folder import CHECKPOINTS_DIR, CONFIG_FILE, LATEST_FILE

    latest = run_dir / CHECKPOINTS_DIR / LATEST_FILE
    candidates = [run_dir / CONFIG_FILE]
    if latest.is_file():
        candidates.append(run_dir / CHECKPOINTS_DIR / latest.read_text().strip() / CONFIG_FILE)
    for path in candidates:
        if path.is_file():
            return path
    raise CommandError(f"{run_dir} holds no run config ({CONFIG_FILE}); give the config", 2)


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """Send this process's stdout and stderr (the file descriptors: vLLM's C++ and its logger
    too) to ``path`` while the block runs, then give the terminal back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def _eval_cmd(args: argparse.Namespace) -> int:
    target = Path(args.config_or_run_dir)
    run_dir = target if target.is_dir() else None
    config = _saved_config(target) if run_dir is not None else args.config_or_run_dir
    # The run's own resume setting is not this command's business: it trains nothing.
    overrides = ["resume_from_checkpoint=false", *args.overrides]
    cfg = load_run_config(config, overrides, check_components=True)
    from grpo.envs.preflight import brings_held_out_rows  # no torch

    if cfg.eval_dataset is None and not brings_held_out_rows(cfg.environment):
        raise ConfigError("eval_dataset: null; grpo eval evaluates on the held-out set")
    checkpoint = args.checkpoint
    if checkpoint is not None and not Path(checkpoint).is_dir():
        raise CommandError(f"--checkpoint: {checkpoint} is not a folder", 2)
    if checkpoint is None and run_dir is not None and (run_dir / "final").is_dir():
        checkpoint = str(run_dir / "final")
    if checkpoint is not None and cfg.training.lora is None:
        if not (Path(checkpoint) / "config.json").is_file():
            raise CommandError(
                f"--checkpoint: {checkpoint} has no config.json (a LoRA adapter needs a config "
                "with training.lora)",
                2,
            )
    import json

    from grpo.orchestrator.evaluation import evaluate_policy, format_evaluation

    out_dir = run_dir or Path(cfg.output_dir)
    log_path = out_dir / "logs" / "eval.log"
    print(f"Evaluating; vLLM's output goes to {log_path}", file=sys.stderr)
    try:
        with _output_to(log_path):  # the terminal gets the table, not the engine's log
            metrics, results = evaluate_policy(cfg, checkpoint)
    except ValueError as exc:  # an empty held-out set, an environment with its own tasks
        raise CommandError(str(exc).splitlines()[0]) from None
    report = {
        "policy": checkpoint or cfg.base_model_path,
        "metrics": metrics,
        "examples": results,
    }
    (out_dir / "eval.json").write_text(json.dumps(report, indent=1))
    print(f"Policy: {report['policy']}")
    print(format_evaluation(metrics))
    print(f"Wrote {out_dir / 'eval.json'}")
    return 0


def package_version() -> str:
    """The installed ``grpo`` package's version ("unknown" when run from an uninstalled tree)."""
    try:
        return importlib.metadata.version("grpo")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The ``grpo`` argument parser with its subcommands."""
    parser = argparse.ArgumentParser(
        prog="grpo",
        description="Asynchronous GRPO training: run recipes, manage and check configs.",
        epilog="Example: grpo run async_grpo --config tiny_arithmetic_cpu orchestration.num_steps=5",
    )
    parser.add_argument("--version", action="version", version=f"grpo {package_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = commands.add_parser(
        "run",
        help="run a recipe with a config",
        description="Load and validate a config, then call the recipe's recipe_main(cfg).",
        epilog="Example: grpo run async_grpo --config tiny_arithmetic_cpu inference.group_size=4",
    )
    run.add_argument("recipe", help="recipe name (see `grpo ls`) or path to a .py file")
    run.add_argument("--config", required=True, help="config name or path to a YAML file")
    add_verbose_flag(run)
    run.add_argument("overrides", nargs="*", help="key.sub=value or ~key overrides")
    run.set_defaults(func=_run_cmd, takes_overrides=True)

    validate = commands.add_parser(
        "validate",
        help="check a config without running anything",
        description="Load a config with overrides and report every problem at once.",
    )
    validate.add_argument("config", help="config name or path to a YAML file")
    validate.add_argument("overrides", nargs="*", help="key.sub=value or ~key overrides")
    validate.add_argument(
        "--gpu-memory",
        type=_gpu_memory,
        metavar="SIZE",
        help="memory of each GPU, e.g. 24GiB or 80GB: the placement's memory plan is checked "
        "against it (default: this machine's GPUs; none: the plan is only printed). Plans a "
        "run on other machines: only the model's config.json is read (a folder holding just "
        "it will do), and this machine's Ray cluster is not checked",
    )
    validate.set_defaults(func=_validate_cmd, takes_overrides=True)

    ls = commands.add_parser(
        "ls",
        help="list recipes and their configs",
        description="List recipes and the configs written for them (a config names its "
        "recipe in its `grpo run RECIPE --config ...` comment).",
    )
    ls.set_defaults(func=_ls_cmd)

    cp = commands.add_parser(
        "cp",
        help="copy a config or recipe to edit it",
        description="Copy a named config or recipe to a file or folder.",
        epilog="Example: grpo cp tiny_arithmetic_cpu my_run.yaml",
    )
    cp.add_argument("name", help="config or recipe name (see `grpo ls`)")
    cp.add_argument("destination", help="file or existing folder")
    cp.add_argument("--force", action="store_true", help="overwrite the destination")
    cp.set_defaults(func=_cp_cmd)

    plot = commands.add_parser(
        "plot",
        help="plot the metrics of a run",
        description="Write the standard plots of a run (rewards, loss, KL, lag, ...) as PNGs.",
    )
    plot.add_argument("run_dir", help="the run's output_dir (holds metrics.jsonl)")
    plot.set_defaults(func=_plot_cmd)

    evaluate = commands.add_parser(
        "eval",
        help="evaluate a policy on the held-out set without training",
        description="Evaluate a policy folder (the base model, a checkpoint, final/, a LoRA "
        "checkpoint with a training.lora config) on the config's held-out set, as the "
        "training loop evaluates (eval_* keys): a table on the terminal and eval.json in the "
        "run folder (the run dir given, or the config's output_dir).",
        epilog="Example: grpo eval runs/x --checkpoint runs/x/checkpoints/step_000100 "
        "eval_samples_per_example=4 eval_temperature=1.0",
    )
    evaluate.add_argument(
        "config_or_run_dir", help="config name or YAML path, or a run folder (its saved config)"
    )
    evaluate.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="policy folder to evaluate (default: a run folder's final/, else the base model)",
    )
    evaluate.add_argument("overrides", nargs="*", help="key.sub=value or ~key overrides")
    evaluate.set_defaults(func=_eval_cmd, takes_overrides=True)

    export = commands.add_parser(
        "export",
        help="export a LoRA checkpoint as a PEFT adapter or a merged model",
        description="Write a LoRA checkpoint's adapter as a PEFT folder (vLLM, PEFT) and/or "
        "merged into its base model as a Hugging Face folder.",
        epilog="Example: grpo export runs/x/checkpoints/step_100 --merged exports/step_100",
    )
    export.add_argument(
        "checkpoint_dir", help="checkpoint folder of a training.lora run, or a PEFT folder"
    )
    export.add_argument("--peft", metavar="OUT_DIR", help="write the PEFT adapter folder here")
    export.add_argument("--merged", metavar="OUT_DIR", help="write the merged model folder here")
    export.add_argument(
        "--overwrite", action="store_true", help="replace existing non-empty output folders"
    )
    export.set_defaults(func=_export_cmd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``grpo`` console script; returns the exit status."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "takes_overrides", False):
        args.overrides = split_overrides(
            parser, args.overrides, extra, verbose=getattr(args, "verbose", False)
        )
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    import_from_launch_folder()  # configs may name ./my_tools.py as my_tools
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"grpo {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except CommandError as exc:
        print(f"grpo {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C while a recipe imports, say: no traceback
        print(f"grpo {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
