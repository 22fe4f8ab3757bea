"""Tool calls in worker processes, each with a timeout: a tool that hangs or crashes costs one
error turn, never the collector.

Each call is its own pebble task with ``timeout=timeout_s``. The timeout counts from when a
worker takes the call, not from when it was submitted: a call that waits in the queue behind
other episodes' calls waits as long as it must and then gets its full time. pebble stops the
worker of a call that overruns (that worker only: the other calls, of this episode or any
other, go on) and starts a replacement, and reports a worker that died (a segfault, an
``os._exit``, the kernel's OOM killer) as ``ProcessExpired``. Each call may allocate at most
``memory_mb`` of data memory: past it an allocation raises ``MemoryError`` in the tool. How long
each call waited for a worker is kept (`ToolJob.queue_wait_s`): a pool too small for the load
shows there, not as timeouts.

A tool may be an ``async def`` function: the worker runs the coroutine to its end
(``asyncio.run``) and its return value is the answer.

Pure Python: no torch, no Ray.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import inspect
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import pebble

from grpo.envs.tools import CRASH, EXCEPTION, TIMEOUT, Tool
from grpo.worker_processes import exit_with_parent, memory_cap, worker_context

# Beyond a call's timeout, for pebble to notice the overrun and stop the worker (it sends
# SIGTERM and waits up to 3 s before SIGKILL).
_STOP_GRACE_S = 5.0
# A call still queued this long after every call ahead of it could have run to its timeout
# was lost by the pool (it never happens with a healthy pebble pool; the bound keeps a rollout
# from waiting forever if it does).
_QUEUE_SLACK_S = 30.0
# A tool's answer longer than this is cut: a runaway print must not flood the context.
MAX_RESULT_CHARS = 2000
# How often a wait re-reads deadlines that move (a call's deadline is set when it starts).
_POLL_S = 0.1


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
            if inspect.iscoroutine(result):  # an async tool: its value is what it returns
                result = asyncio.run(result)
    except Exception as error:
        return f"{type(error).__name__}: {error}"[:MAX_RESULT_CHARS], EXCEPTION
    return str(result)[:MAX_RESULT_CHARS], None


class ToolJob:
    """One submitted call: its future, and when it was submitted and taken by a worker.

    Args:
        future (pebble.ProcessFuture): The call's future; its result is ``(text, error)``.
        timeout_s (float): The call's limit, from when a worker takes it.
        queue_bound_s (float): How long it may wait for a worker before it counts as lost.
    """

    def __init__(self, future: Any, timeout_s: float, queue_bound_s: float) -> None:
        self.future = future
        self.timeout_s = timeout_s
        self.submitted_at = time.monotonic()
        self.started_at: float | None = None  # time.monotonic() when a worker took it
        self._queue_bound_s = queue_bound_s
        # pebble marks a future running (`set_running_or_notify_cancel`, as every Executor
        # does when work starts) when a worker acknowledges the task: the moment its timeout
        # starts counting. Hooking it gives the call's start without polling.
        mark_running = future.set_running_or_notify_cancel

        def started() -> bool:
            running = mark_running()
            if running and self.started_at is None:
                self.started_at = time.monotonic()
            return running

        future.set_running_or_notify_cancel = started
        self._observe_start()  # a worker may have taken it before the hook was set

    def _observe_start(self) -> None:
        if self.started_at is None and (self.future.running() or self.future.done()):
            self.started_at = time.monotonic()

    @property
    def queue_wait_s(self) -> float | None:
        """Seconds the call waited for a worker; None if no worker took it."""
        if self.started_at is None:
            return None
        return max(self.started_at - self.submitted_at, 0.0)

    def deadline(self) -> float:
        """``time.monotonic()`` after which the unfinished call counts as lost: its timeout
        and pebble's grace after it started, or the queue bound while it waits."""
        self._observe_start()
        if self.started_at is not None:
            return self.started_at + self.timeout_s + _STOP_GRACE_S
        return self.submitted_at + self._queue_bound_s

    def outcome(self) -> ToolOutcome:
        """The call's `ToolOutcome`. An unfinished call is lost: it is cancelled (which stops
        its worker only) and answered with an error."""
        future = self.future
        if not future.done():
            self._observe_start()
            started = self.started_at is not None
            future.cancel()
            if started:
                return ToolOutcome(
                    f"no result within {self.timeout_s + _STOP_GRACE_S:.0f} s of its start",
                    TIMEOUT,
                )
            return ToolOutcome("the tool's worker pool lost the call before it ran", CRASH)
        try:
            text, error = future.result()
            return ToolOutcome(text, error)
        except concurrent.futures.TimeoutError:
            return ToolOutcome(f"the tool took longer than {self.timeout_s} s", TIMEOUT)
        except concurrent.futures.CancelledError:  # the runner was closed under it
            return ToolOutcome("the tool's workers were stopped before it finished", CRASH)
        except pebble.ProcessExpired as error:
            return ToolOutcome(f"the tool crashed (exit code {error.exitcode})", CRASH)
        except Exception as error:  # the tool could not be unpickled, a broken pool
            return ToolOutcome(f"{type(error).__name__}: {error}", EXCEPTION)


def jobs_deadline(jobs: Sequence[ToolJob]) -> float:
    """When the last unfinished job of ``jobs`` counts as lost (`ToolJob.deadline`); it moves
    later when a queued job starts. ``time.monotonic()`` if every job is done."""
    deadlines = [job.deadline() for job in jobs if not job.future.done()]
    return max(deadlines) if deadlines else time.monotonic()


def wait_for_jobs(jobs: Sequence[ToolJob]) -> None:
    """Block until every job is done or lost (`jobs_deadline`)."""
    futures = [job.future for job in jobs]
    while True:
        left = jobs_deadline(jobs) - time.monotonic()
        if left <= 0 or all(future.done() for future in futures):
            return
        # Short waits: a queued job's start moves the deadline.
        concurrent.futures.wait(futures, timeout=min(left, _POLL_S))


class ToolRunner:
    """Worker processes that run tool calls with a per-call timeout.

    Calls from every episode share the workers; a call waits in a queue while they are busy,
    and its timeout starts when a worker takes it.

    Args:
        num_workers (int): Worker processes (this many calls run at a time).
        start_method (str): ``"forkserver"`` or ``"spawn"``; never ``"fork"`` (the collector
            runs threads and an inference engine).
        memory_mb (int | None): Data memory one call may allocate (``RLIMIT_DATA`` while it
            runs); None: no cap.

    Raises:
        ValueError: ``num_workers`` is not an int >= 1.

    Example:
        >>> runner = ToolRunner()
        >>> runner.run([(Tool(calculator), {"expression": "2*3"})], timeout_s=5.0)
        [ToolOutcome(text='6', error=None)]
    """

    def __init__(
        self, num_workers: int = 2, start_method: str | None = None, memory_mb: int | None = 2048
    ) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        self._context = worker_context(start_method, "ToolRunner")
        self.num_workers = num_workers
        self.memory_mb = memory_mb
        self._workers: pebble.ProcessPool | None = None
        self._lock = threading.Lock()
        self._pid = os.getpid()
        # Calls submitted and not finished; a done-callback (pebble's thread) removes them.
        self._in_flight: set[ToolJob] = set()
        self._in_flight_lock = threading.Lock()

    def _pool(self) -> pebble.ProcessPool:
        if self._workers is None or not self._workers.active:
            self._workers = pebble.ProcessPool(
                max_workers=self.num_workers,
                initializer=exit_with_parent,
                context=self._context,
            )
        return self._workers

    def close(self) -> None:
        """Stop the workers. Calls still queued or running are cancelled (answered with an
        error), so nothing waits on them."""
        with self._lock:
            if self._workers is not None:
                self._workers.stop()
                self._workers.join()
                self._workers = None
        with self._in_flight_lock:
            unfinished = list(self._in_flight)
        for job in unfinished:
            job.future.cancel()

    def submit(self, tool: Tool, arguments: Mapping[str, Any], timeout_s: float) -> ToolJob:
        """Queue one call; its `ToolJob` gives the outcome once its future is done.

        Args:
            tool (Tool): The tool.
            arguments (Mapping): Its checked arguments.
            timeout_s (float): Limit of the call, from when a worker takes it.

        Returns:
            ToolJob: The call's future, start time and deadline.
        """
        with self._in_flight_lock:
            # Every call ahead of this one, run one after another to its timeout: past that
            # (and a slack for starting workers) a call still queued was lost by the pool.
            ahead = sum(job.timeout_s + _STOP_GRACE_S for job in self._in_flight)
        with self._lock:
            future = self._pool().schedule(
                _call, args=(tool, dict(arguments), self.memory_mb), timeout=timeout_s
            )
        job = ToolJob(future, timeout_s, queue_bound_s=_QUEUE_SLACK_S + ahead)
        with self._in_flight_lock:
            self._in_flight.add(job)
        # Added outside the lock: on a finished future the callback runs here, at once.
        future.add_done_callback(lambda _: self._finished(job))
        return job

    def _finished(self, job: ToolJob) -> None:
        with self._in_flight_lock:
            self._in_flight.discard(job)

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
        jobs = [self.submit(tool, arguments, timeout_s) for tool, arguments in calls]
        wait_for_jobs(jobs)
        return [job.outcome() for job in jobs]


_default_runners: dict[tuple[int | None, int], ToolRunner] = {}
_default_runner_lock = threading.Lock()


def default_tool_runner(memory_mb: int | None = 2048, num_workers: int = 2) -> ToolRunner:
    """The process-wide runner with ``memory_mb`` and ``num_workers`` that environments use
    when given none (closed at exit)."""
    with _default_runner_lock:
        key = (memory_mb, num_workers)
        runner = _default_runners.get(key)
        if runner is None or runner._pid != os.getpid():
            runner = _default_runners[key] = ToolRunner(
                num_workers=num_workers, memory_mb=memory_mb
            )
            atexit.register(runner.close)
        return runner
