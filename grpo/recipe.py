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
    """Make the modules of the folder the run is launched from importable, as ``python -m``
    does.

    A config names the user's own tools, environments and reward functions by dotted path
    (``my_tools.convert`` for ``./my_tools.py``), but a console script's ``sys.path`` starts at
    the script's folder, not the working folder. Ray puts the driver's working folder on every
    actor's ``sys.path`` (on each node, at the same path), so the collectors and their tool
    workers import the same module. Appended: a local file never shadows an installed package.
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

    Config problems are printed to stderr without a traceback. An error inside the recipe
    stops the run with three lines on stderr (what stopped it, the log file that holds the
    traceback, the checkpoint to resume from: `grpo.observability.console.print_stopped`) and
    status 1; Ctrl-C before the recipe handles signals itself (while Ray starts) ends it with
    status 130 and no traceback. With ``overwrite_output_dir`` a run already in ``output_dir``
    is moved aside first (`grpo.run_folder.move_run_aside`). While it runs, this process's
    logging goes where the config's ``log_level`` says (`grpo.observability.logs.DriverLog`):
    ``<output_dir>/logs/driver.log``, and the terminal for the ``grpo`` logger's warnings
    (every logger's with ``log_level: debug``).

    Args:
        recipe_main (Recipe): The recipe's entry point.
        config (str | Path): Config name or path.
        overrides (Sequence[str]): ``key=value`` / ``~key`` overrides.
        prog (str): Program name used in error messages.
        driver_log (DriverLog | None): One the caller entered already (``grpo run`` does,
            before it imports the recipe, whose imports log); None enters one here.

    Returns:
        int: 0 on success, 2 on a config error, 1 when the recipe raised, 130 after Ctrl-C
        before the recipe handled signals, or the recipe's own status: its int return value,
        or the ``exit_code`` of the summary dict it returns (``128 + signal`` after Ctrl-C or
        SIGTERM stopped the run, 1 after it stopped on an error).
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
            # Ctrl-C before the recipe set its own handlers (while Ray starts, say): nothing
            # to save yet, and a traceback through Ray's start-up would explain nothing.
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

    Loads, validates and runs like ``grpo run``, then exits the process with the status.

    Args:
        recipe_main (Recipe): The recipe's entry point.
        argv (Sequence[str] | None): Arguments; None reads ``sys.argv[1:]``.

    Raises:
        SystemExit: Always, with the status of `run_recipe` (2 on a config error).

    Example:
        >>> if __name__ == "__main__":
        ...     run_recipe_cli(recipe_main)
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

    Args:
        parser (argparse.ArgumentParser): Reports a flag it does not know.
        overrides (Sequence[str]): The parsed ``overrides`` positionals.
        extra (Sequence[str]): argparse's leftovers.
        verbose (bool): ``--verbose`` was given: ``log_level=debug`` goes last, so it wins.

    Returns:
        list[str]: Every override, in order.
    """
    flags = [arg for arg in extra if arg.startswith("-")]
    if flags:
        parser.error(f"unrecognized arguments: {' '.join(flags)} (overrides are key=value)")
    return [*overrides, *extra, *(["log_level=debug"] if verbose else [])]


def parse(recipe_main: Recipe) -> Callable[..., Any]:
    """Decorator giving a recipe's main function the config command line, torchtune style.

    Called with no arguments (``recipe_main()`` in ``if __name__ == "__main__":``) it parses
    ``--config NAME key=value ...`` from ``sys.argv`` and exits with the status; called with a
    config (as ``grpo run`` does) it simply runs the recipe.

    Args:
        recipe_main (Recipe): The recipe's entry point, taking the config.

    Returns:
        Callable[..., Any]: The wrapped entry point.

    Example:
        >>> @parse
        ... def recipe_main(cfg: RunConfig) -> None:
        ...     ...
        >>> if __name__ == "__main__":
        ...     recipe_main()
    """

    @functools.wraps(recipe_main)
    def wrapper(cfg: RunConfig | None = None) -> Any:
        if cfg is not None:
            return recipe_main(cfg)
        run_recipe_cli(recipe_main)

    return wrapper
