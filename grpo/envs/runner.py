"""Tool calls in worker processes, each with a timeout: a tool that hangs or crashes costs one
error turn, never the collector.

Each call is its own pebble task with ``timeout=timeout_s``: pebble terminates the worker of a
call that overruns and starts a replacement, and reports a worker that died (a segfault, an
``os._exit``, the kernel's OOM killer) as ``ProcessExpired``. Each call may allocate at most
``memory_mb`` of data memory: past it an allocation raises ``MemoryError`` in the tool. Calls
of one round (every episode of a batch that called a tool) run concurrently on the workers, so
the round waits for its slowest call at most ``timeout_s``.

Pure Python: no torch, no Ray.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import multiprocessing
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import pebble

from grpo.envs.tools import CRASH, EXCEPTION, TIMEOUT, Tool
from grpo.worker_processes import exit_with_parent, memory_cap

# Beyond a call's timeout, for pebble to notice the overrun and stop the worker.
_STOP_GRACE_S = 5.0
# A tool's answer longer than this is cut: a runaway print must not flood the context.
MAX_RESULT_CHARS = 2000


class ToolOutcome(NamedTuple):
    """What one call returned: its text, or the error kind and message."""

    text: str
    error: str | None = None  # one of TIMEOUT, CRASH, EXCEPTION; None: it answered


def _call(
    tool: Tool, arguments: Mapping[str, Any], memory_mb: int | None
) -> tuple[str, str | None]:
    try:
        with memory_cap(memory_mb):
            result = tool.fn(**arguments)
    except Exception as error:
        return f"{type(error).__name__}: {error}"[:MAX_RESULT_CHARS], EXCEPTION
    return str(result)[:MAX_RESULT_CHARS], None


class ToolRunner:
    """Worker processes that run tool calls with a per-call timeout.

    Args:
        num_workers (int): Worker processes (calls of a round run this many at a time).
        start_method (str): ``"forkserver"`` or ``"spawn"``; never ``"fork"`` (the collector
            runs threads and an inference engine).
        memory_mb (int | None): Data memory one call may allocate (``RLIMIT_DATA`` while it
            runs); None: no cap.

    Example:
        >>> runner = ToolRunner()
        >>> runner.run([(Tool(calculator), {"expression": "2*3"})], timeout_s=5.0)
        [ToolOutcome(text='6', error=None)]
    """

    def __init__(
        self, num_workers: int = 2, start_method: str | None = None, memory_mb: int | None = 2048
    ) -> None:
        methods = multiprocessing.get_all_start_methods()
        if start_method is None:
            start_method = "forkserver" if "forkserver" in methods else "spawn"
        self._context = multiprocessing.get_context(start_method)
        self.num_workers = num_workers
        self.memory_mb = memory_mb
        self._workers: pebble.ProcessPool | None = None
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _pool(self) -> pebble.ProcessPool:
        if self._workers is None or not self._workers.active:
            self._workers = pebble.ProcessPool(
                max_workers=self.num_workers,
                initializer=exit_with_parent,
                context=self._context,
            )
        return self._workers

    def close(self) -> None:
        """Stop the workers."""
        with self._lock:
            if self._workers is not None:
                self._workers.stop()
                self._workers.join()
                self._workers = None

    def submit(
        self, tool: Tool, arguments: Mapping[str, Any], timeout_s: float
    ) -> concurrent.futures.Future:
        """Start one call; its future gives ``(text, error)`` (see `outcome`)."""
        with self._lock:
            return self._pool().schedule(
                _call, args=(tool, dict(arguments), self.memory_mb), timeout=timeout_s
            )

    @staticmethod
    def outcome(future: concurrent.futures.Future, timeout_s: float) -> ToolOutcome:
        """The `ToolOutcome` of a finished call's future (an unfinished one: a timeout)."""
        if not future.done():
            future.cancel()
            return ToolOutcome(f"no result within {timeout_s + _STOP_GRACE_S:.0f} s", TIMEOUT)
        try:
            text, error = future.result()
            return ToolOutcome(text, error)
        except concurrent.futures.TimeoutError:
            return ToolOutcome(f"the tool took longer than {timeout_s} s", TIMEOUT)
        except concurrent.futures.CancelledError:
            return ToolOutcome(f"no result within {timeout_s + _STOP_GRACE_S:.0f} s", TIMEOUT)
        except pebble.ProcessExpired as error:
            return ToolOutcome(f"the tool crashed (exit code {error.exitcode})", CRASH)
        except Exception as error:  # the tool could not be unpickled, a broken pool
            return ToolOutcome(f"{type(error).__name__}: {error}", EXCEPTION)

    def deadline(self, num_calls: int, timeout_s: float) -> float:
        """Seconds after which calls submitted together count as lost (pebble never reported
        them): every call overrunning, one round of workers after another."""
        rounds = -(-num_calls // self.num_workers)
        return 30.0 + rounds * (timeout_s + _STOP_GRACE_S)

    def run(
        self, calls: Sequence[tuple[Tool, Mapping[str, Any]]], timeout_s: float
    ) -> list[ToolOutcome]:
        """Run ``calls`` concurrently and wait for them; one outcome per call, in order.

        Args:
            calls (Sequence[tuple[Tool, Mapping]]): A tool and its checked arguments, per call.
            timeout_s (float): Limit of each call, from when a worker takes it.

        Returns:
            list[ToolOutcome]: The tool's text, or an error (timeout, crash of the worker, or an
            exception the tool raised, with its message).
        """
        futures = [self.submit(tool, arguments, timeout_s) for tool, arguments in calls]
        concurrent.futures.wait(futures, timeout=self.deadline(len(futures), timeout_s))
        outcomes = [self.outcome(future, timeout_s) for future in futures]
        if not all(future.done() for future in futures):
            self.restart()
        return outcomes

    def restart(self) -> None:
        """Stop the workers (a call was lost); the next call starts new ones."""
        with self._lock:
            if self._workers is not None:
                self._workers.stop()
                self._workers = None


_default_runners: dict[int | None, ToolRunner] = {}
_default_runner_lock = threading.Lock()


def default_tool_runner(memory_mb: int | None = 2048) -> ToolRunner:
    """The process-wide runner with ``memory_mb`` that environments use when given none
    (closed at exit)."""
    with _default_runner_lock:
        runner = _default_runners.get(memory_mb)
        if runner is None or runner._pid != os.getpid():
            runner = _default_runners[memory_mb] = ToolRunner(memory_mb=memory_mb)
            atexit.register(runner.close)
        return runner
