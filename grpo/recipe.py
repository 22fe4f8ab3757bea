"""Run a recipe from the command line: load and check the config, call the recipe's main."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any, NoReturn

from grpo.config import ConfigError, RunConfig, resolve_path
from grpo.observability.logs import DriverLog
from grpo.preflight import load_run_config, used_output_dir_problem
from grpo.run_folder import move_run_aside

Recipe = Callable[[RunConfig], Any]


def import_from_launch_folder() -> None:
    """Make the launch folder's modules importable, as ``python -m`` does.

    A config names the user's own components by dotted path, but a console script's
    ``sys.path`` starts at the script's folder. Appended, so a local file never shadows an
    installed package; Ray puts the same folder on every actor's path.
    """
    folder = os.getcwd()
    if "" not in sys.path and folder not in sys.path:
        sys.path.append(folder)


def run_recipe(
    recipe_main: Recipe,
    config: str | Path,
    overrides: Sequence[str] = (),
    prog: str = "grpo run",
    driver_log: DriverLog | None = None,
) -> int:
    """Load and validate a config, then call ``recipe_main(cfg)``.

    Config problems and recipe errors are printed without a traceback (the latter's goes
    to the log file). With ``overwrite_output_dir`` an earlier run is moved aside first.

    Args:
        driver_log: One the caller entered already; None enters one here.

    Returns:
        int: 0 on success, 2 on a config error, 1 when the recipe raised, 130 after Ctrl-C
        before the recipe handled signals, or the recipe's own status (its int return, or
        its summary's ``exit_code``).
    """
    with nullcontext(driver_log) if driver_log else DriverLog() as driver_log:
        cfg = None
        try:
            cfg = load_run_config(config, overrides, check_components=True, import_components=True)
            if problem := used_output_dir_problem(cfg):
                raise ConfigError(problem)
            if cfg.overwrite_output_dir and not cfg.resume_from_checkpoint:
                moved = move_run_aside(resolve_path(cfg.output_dir))
                if moved is not None:
                    print(f"Moved the earlier run in {cfg.output_dir} aside to {moved}")
            driver_log.start(cfg.output_dir, cfg.log_level)
            result = recipe_main(cfg)
        except ConfigError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            # Before the recipe's handlers: nothing to save; Ray's traceback explains nothing.
            print(f"{prog}: interrupted", file=sys.stderr)
            return 130
        except Exception as error:
            if cfg is None or driver_log.path is None:
                raise  # before the run folder exists: nowhere else to put the traceback
            from grpo.observability.console import print_stopped  # tqdm: only when needed

            print_stopped(error, cfg.output_dir, cfg.log_level)
            return 1
    if isinstance(result, dict):  # a summary; a run a signal stopped says its exit code
        return int(result.get("exit_code", 0))
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def run_recipe_cli(recipe_main: Recipe, argv: Sequence[str] | None = None) -> NoReturn:
    """Command line of a recipe file: ``python recipes/x.py --config NAME key=value ...``.

    Raises:
        SystemExit: Always, with the status of `run_recipe`.
    """
    parser = argparse.ArgumentParser(
        description=recipe_main.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="config name (configs/NAME.yaml) or path")
    add_verbose_flag(parser)
    parser.add_argument("overrides", nargs="*", help="key=value or ~key overrides")
    args, extra = parser.parse_known_args(argv)
    overrides = split_overrides(parser, args.overrides, extra, verbose=args.verbose)
    import_from_launch_folder()
    sys.exit(run_recipe(recipe_main, args.config, overrides, prog=parser.prog))


def add_verbose_flag(parser: argparse.ArgumentParser) -> None:
    """``--verbose`` / ``-v``: the ``log_level=debug`` override (see `split_overrides`)."""
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show every process's output (vLLM, Ray, W&B) on the terminal instead of "
        "OUTPUT_DIR/logs/; the same as log_level=debug",
    )


def split_overrides(
    parser: argparse.ArgumentParser,
    overrides: Sequence[str],
    extra: Sequence[str],
    verbose: bool = False,
) -> list[str]:
    """Overrides after ``--config`` land in argparse's leftovers; accept those, reject flags.

    With ``verbose``, ``log_level=debug`` goes last, so it wins.
    """
    flags = [arg for arg in extra if arg.startswith("-")]
    if flags:
        parser.error(f"unrecognized arguments: {' '.join(flags)} (overrides are key=value)")
    return [*overrides, *extra, *(["log_level=debug"] if verbose else [])]


def parse(recipe_main: Recipe) -> Callable[..., Any]:
    """Decorator giving a recipe's main function the config command line, torchtune style.

    Called with no arguments it parses ``--config NAME key=value ...`` from ``sys.argv`` and
    exits with the status; called with a config it runs the recipe.
    """

    @functools.wraps(recipe_main)
    def wrapper(cfg: RunConfig | None = None) -> Any:
        if cfg is not None:
            return recipe_main(cfg)
        run_recipe_cli(recipe_main)

    return wrapper
