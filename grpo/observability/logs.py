"""Where a run's output goes: the terminal gets progress and results, log files get the rest.

A run starts many processes that all print: vLLM reports its engine start and every weight
reload, Ray its cluster start, W&B its run folder, torch and torchao their import warnings.
With ``log_level: info`` (the default) the terminal shows what the recipe prints (a few lines at
the start, one progress bar, a summary), the ``grpo`` logger's warnings and errors, and nothing
else; the rest goes to ``<output_dir>/logs/``:

- ``driver.log``: the launching process's Python logging (Ray's start-up, library warnings,
  the ``grpo`` logger from INFO up).
- ``<actor>.log`` (``collector_0.log``, ``ref_actor_0.log``, ``trainer_0.log``,
  ``replay_buffer.log``, ``metric_logger.log``): everything the actor's process writes to its
  stdout and stderr from its constructor on: Python logging, vLLM, W&B, C++ warnings. A
  replaced actor appends to the file of the one it replaces; one whose constructor raised is
  not replaced (the run stops), so its file holds that traceback once.

``log_level: debug`` (``grpo run --verbose``) leaves every process's output on the terminal, as
Ray forwards it, and shows the ``grpo`` logger's debug messages as well.

This module imports neither torch nor Ray: the command line imports it before either.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

# The driver's log file, in `logs_dir`.
DRIVER_LOG = "driver.log"
# A record with this attribute true goes to the log file only, never to the terminal.
FILE_ONLY = "file_only"
# Terminal colour codes: Ray colours the header of the remote tracebacks its errors carry.
ANSI_CODE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def is_verbose(log_level: str) -> bool:
    """Whether a run's ``log_level`` asks for every process's output on the terminal.

    Args:
        log_level (str): The run config's ``log_level``.

    Returns:
        bool: True for ``debug``.
    """
    return log_level == "debug"


def logs_dir(run_dir: str | os.PathLike) -> Path:
    """The folder of a run's log files: ``<run_dir>/logs``."""
    return Path(run_dir) / "logs"


def actor_log_path(run_dir: str | os.PathLike, name: str) -> Path:
    """The log file of an actor: ``collector[0]`` -> ``<run_dir>/logs/collector_0.log``.

    Args:
        run_dir (str | os.PathLike): The run folder.
        name (str): The actor's name in messages (`grpo.orchestrator.supervisor.actor_name`).

    Returns:
        Path: The file (brackets are replaced: they need quoting in a shell).
    """
    return logs_dir(run_dir) / f"{re.sub(r'[^0-9A-Za-z_.-]+', '_', name).strip('_')}.log"


def redirect_output(path: str | os.PathLike) -> None:
    """Send this process's stdout, stderr and Python logging to ``path`` (appended).

    The file descriptors themselves are redirected, so output from C++ (torch, gloo), from
    child processes, and from loggers that hold on to ``sys.stdout`` (vLLM's handler does) lands
    there too. The root logger gets a handler at INFO if it has none. Logged messages lose
    their terminal colour codes (Ray's error headers have them), here and in Ray's own handler.

    Args:
        path (str | os.PathLike): The log file; its folder is created if missing.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        # Line by line: what a process printed just before it crashed is what explains it.
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler.addFilter(_PlainText())
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    # Ray logs through its own handler (its logger does not propagate), e.g. a constructor's
    # error with its traceback, whose header it colours for a terminal.
    for handler in logging.getLogger("ray").handlers:
        handler.addFilter(_PlainText())


class _PlainText(logging.Filter):
    """Drops terminal colour codes from a record's message: a log file is read as text."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "\x1b[" in message:
            record.msg, record.args = ANSI_CODE.sub("", message), None
        return True


def with_output_to(cls: type, path: str | os.PathLike) -> type:
    """A subclass of ``cls`` whose instances first send their process's output to ``path``.

    For classes that run as Ray actors: each actor has a process of its own, and the
    redirection happens before the class's own constructor runs (vLLM is imported there).

    Args:
        cls (type): The actor class.
        path (str | os.PathLike): Its log file (see `redirect_output`).

    Returns:
        type: A subclass with the same name, methods and documentation.
    """
    log_path = str(path)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        redirect_output(log_path)
        cls.__init__(self, *args, **kwargs)

    # Same name and qualified name: Ray and error messages show the class the user knows.
    namespace = {
        "__init__": __init__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
    }
    return type(cls.__name__, (cls,), namespace)


def log_traceback(error: BaseException, message: str) -> None:
    """Log ``message`` and ``error``'s traceback to the driver's log file, not the terminal.

    For a run that stopped on an error: the terminal says what stopped it in a line, the
    file keeps the whole traceback (`grpo.observability.console.print_stopped`).

    Args:
        error (BaseException): The error that stopped the run.
        message (str): The line the traceback follows.
    """
    logging.getLogger("grpo").error(message, exc_info=error, extra={FILE_ONLY: True})


def _for_terminal(record: logging.LogRecord) -> bool:
    return not getattr(record, FILE_ONLY, False)


class _Buffer(logging.Handler):
    """Holds records until the run's mode says where they go."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class _Terminal(logging.Handler):
    """Writes records to stderr through ``tqdm.write``, so a progress bar is not torn apart."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


def _is_grpo(record: logging.LogRecord) -> bool:
    return record.name == "grpo" or record.name.startswith("grpo.")


class DriverLog:
    """The launching process's logging for one run, undone when the run ends.

    Entered before the config is loaded (imports during validation already log: torchao warns
    about its C++ extensions), it holds records until `start` knows the run's mode and folder,
    then sends them, and every later one, where that mode says:

    - info: everything from INFO up to ``<output_dir>/logs/driver.log``; the ``grpo`` logger's
      warnings and errors to the terminal as well.
    - debug: the same file; on the terminal, warnings and errors of every logger plus every
      record of the ``grpo`` logger, debug included.

    In both, a record logged with `FILE_ONLY` (`log_traceback`) goes to the file alone.

    Python warnings go through logging (`logging.captureWarnings`) while it is active.

    Example:
        >>> with DriverLog() as driver_log:
        ...     cfg = load_config("tiny_arithmetic_cpu")
        ...     driver_log.start(cfg.output_dir, cfg.log_level)
        ...     recipe_main(cfg)
    """

    def __init__(self) -> None:
        self._buffer = _Buffer()
        self._handlers: list[logging.Handler] = []
        self._saved: dict[str, Any] = {}
        self.path: Path | None = None

    def __enter__(self) -> DriverLog:
        root, grpo_logger, ray_logger = (logging.getLogger(n) for n in ("", "grpo", "ray"))
        self._saved = {
            "root_level": root.level,
            "grpo_level": grpo_logger.level,
            "ray_propagate": ray_logger.propagate,
        }
        root.addHandler(self._buffer)
        root.setLevel(logging.INFO)
        logging.captureWarnings(True)
        return self

    def start(self, output_dir: str | Path, log_level: str = "info") -> Path:
        """Route the held records and every later one as the config's ``log_level`` says.

        Args:
            output_dir (str | Path): The run folder (``output_dir``).
            log_level (str): The run config's ``log_level``.

        Returns:
            Path: The driver's log file.
        """
        verbose = is_verbose(log_level)
        folder = logs_dir(Path(output_dir).expanduser().resolve())
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / DRIVER_LOG
        to_file = logging.FileHandler(self.path, encoding="utf-8")
        to_file.setFormatter(logging.Formatter(_FORMAT))
        terminal = _Terminal()
        if verbose:
            terminal.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            terminal.addFilter(lambda r: r.levelno >= logging.WARNING or _is_grpo(r))
            logging.getLogger("grpo").setLevel(logging.DEBUG)
        else:
            terminal.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
            terminal.addFilter(lambda r: r.levelno >= logging.WARNING and _is_grpo(r))
        terminal.addFilter(_for_terminal)
        root = logging.getLogger()
        root.removeHandler(self._buffer)
        self._handlers = [to_file, terminal]
        for handler in self._handlers:
            root.addHandler(handler)
        for record in self._buffer.records:
            for handler in self._handlers:
                if record.levelno >= handler.level:
                    handler.handle(record)
        self._buffer.records.clear()
        return self.path

    def __exit__(self, *exc_info: object) -> None:
        root = logging.getLogger()
        for handler in [self._buffer, *self._handlers]:
            root.removeHandler(handler)
            handler.close()
        self._handlers = []
        logging.captureWarnings(False)
        root.setLevel(self._saved["root_level"])
        logging.getLogger("grpo").setLevel(self._saved["grpo_level"])
        logging.getLogger("ray").propagate = self._saved["ray_propagate"]
