"""Where a run's output goes: the terminal gets progress and results, log files get the rest.

With ``log_level: info`` the terminal shows what the recipe prints and the ``grpo`` logger's
warnings and errors; the driver's logging goes to ``<output_dir>/logs/driver.log`` and each
actor's stdout and stderr to ``<output_dir>/logs/<actor>.log`` (docs/metrics.md). With
``debug`` every process's output stays on the terminal. Imports neither torch nor Ray.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

from grpo.actor_class import with_constructor

DRIVER_LOG = "driver.log"
# A record with this attribute true goes to the log file only, never to the terminal.
FILE_ONLY = "file_only"
# Ray colours the header of the remote tracebacks its errors carry.
ANSI_CODE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def is_verbose(log_level: str) -> bool:
    """Whether ``log_level`` asks for every process's output on the terminal (``debug``)."""
    return log_level == "debug"


def logs_dir(run_dir: str | os.PathLike) -> Path:
    """The folder of a run's log files: ``<run_dir>/logs``."""
    return Path(run_dir) / "logs"


def actor_log_path(run_dir: str | os.PathLike, name: str) -> Path:
    """The log file of an actor: ``inference[0]`` -> ``<run_dir>/logs/inference_0.log``.

    Brackets are replaced: they need quoting in a shell.
    """
    return logs_dir(run_dir) / f"{re.sub(r'[^0-9A-Za-z_.-]+', '_', name).strip('_')}.log"


def redirect_output(path: str | os.PathLike) -> None:
    """Send this process's stdout, stderr and Python logging to ``path`` (appended).

    The file descriptors are redirected, so C++ output, child processes and loggers holding
    ``sys.stdout`` (vLLM's) land there too. Logged messages lose their colour codes.

    Args:
        path: The log file; its folder is created if missing.
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
    # Ray's logger does not propagate: its own handler needs the filter too.
    for handler in logging.getLogger("ray").handlers:
        handler.addFilter(_PlainText())


class _PlainText(logging.Filter):
    """Drops terminal colour codes from a record's message."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "\x1b[" in message:
            record.msg, record.args = ANSI_CODE.sub("", message), None
        return True


def with_output_to(cls: type, path: str | os.PathLike) -> type:
    """A subclass of ``cls`` whose instances first send their process's output to ``path``.

    For Ray actor classes: the redirection happens before the constructor imports vLLM.

    Args:
        cls: The actor class.
        path: Its log file (see `redirect_output`).

    Returns:
        type: A subclass with the same name, methods and documentation.
    """
    log_path = str(path)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        redirect_output(log_path)
        cls.__init__(self, *args, **kwargs)

    return with_constructor(cls, __init__)


def log_traceback(error: BaseException, message: str) -> None:
    """Log ``message`` and ``error``'s traceback to the driver's log file, not the terminal.

    Args:
        error: The error that stopped the run.
        message: The line the traceback follows.
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

    Entered before the config is loaded (validation's imports already log), it holds records
    until `start` knows the run's folder and ``log_level``, then routes them and every later one.
    A `FILE_ONLY` record goes to the file alone. Python warnings are captured while active.
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
            output_dir: The run folder.
            log_level: The run config's ``log_level``.

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
