"""Tool calls in worker processes: a tool that hangs or crashes costs one error turn, never the
collector.

A call's timeout counts from when a worker takes it, an overrun stops its own worker only, and
past ``memory_mb`` of data an allocation raises ``MemoryError`` in the tool.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from grpo.envs.tools import CRASH, EXCEPTION, TIMEOUT, Tool
from grpo.process_pool import STOP_GRACE_S, Job, TimedProcessPool, process_wide, wait_for_jobs

# A tool's answer longer than this is cut: a runaway print must not flood the context.
MAX_RESULT_CHARS = 2000


class ToolOutcome(NamedTuple):
    """What one call returned: its text, or the error kind and message."""

    text: str
    error: str | None = None  # one of TIMEOUT, CRASH, EXCEPTION; None: it answered


def _call(tool: Tool, arguments: Mapping[str, Any]) -> str:
    """One tool call in a worker (within the pool's memory cap): its answer, cut."""
    result = tool.fn(**arguments)
    if inspect.iscoroutine(result):  # an async tool: its value is what it returns
        result = asyncio.run(result)
    return str(result)[:MAX_RESULT_CHARS]


def tool_outcome(job: Job) -> ToolOutcome:
    """The `ToolOutcome` of a submitted call: the tool's text, or an error the model can read.
    An unfinished call is cancelled (which stops its worker only)."""
    outcome = job.outcome()
    if outcome.kind == "value":
        return ToolOutcome(outcome.value)
    if outcome.kind in ("exception", "memory"):
        return ToolOutcome(str(outcome.error)[:MAX_RESULT_CHARS], EXCEPTION)
    if outcome.kind == "timeout":
        return ToolOutcome(f"the tool took longer than {job.timeout_s} s", TIMEOUT)
    if outcome.kind == "crash":
        return ToolOutcome(f"the tool crashed (exit code {outcome.exitcode})", CRASH)
    if outcome.kind == "cancelled":  # the runner was closed under it
        return ToolOutcome("the tool's workers were stopped before it finished", CRASH)
    if job.started_at is not None:  # lost while it ran
        return ToolOutcome(
            f"no result within {job.timeout_s + STOP_GRACE_S:.0f} s of its start", TIMEOUT
        )
    return ToolOutcome("the tool's worker pool lost the call before it ran", CRASH)


class ToolRunner:
    """Worker processes that run tool calls with a per-call timeout.

    Args:
        num_workers (int): Worker processes (this many calls run at a time).
        start_method (str): ``"forkserver"`` or ``"spawn"``; never ``"fork"`` (the collector
            runs threads and an inference engine).
        memory_mb (int | None): Data memory one call may allocate (``RLIMIT_DATA``); None: no
            cap.

    Raises:
        ValueError: ``num_workers`` is not an int >= 1.
    """

    def __init__(
        self, num_workers: int = 2, start_method: str | None = None, memory_mb: int | None = 2048
    ) -> None:
        self.pool = TimedProcessPool(
            num_workers, name="ToolRunner", start_method=start_method, memory_mb=memory_mb
        )

    @property
    def num_workers(self) -> int:
        return self.pool.num_workers

    @property
    def memory_mb(self) -> int | None:
        return self.pool.memory_mb

    def close(self) -> None:
        """Stop the workers. Calls still queued or running are cancelled (answered with an
        error), so nothing waits on them; a later call starts new workers."""
        self.pool.stop()

    def submit(self, tool: Tool, arguments: Mapping[str, Any], timeout_s: float) -> Job:
        """Queue one call with its checked arguments; `tool_outcome` gives its outcome once its
        future is done. ``timeout_s`` counts from when a worker takes it.

        Raises:
            RuntimeError: The runner was made by another process.
        """
        return self.pool.submit(_call, tool, dict(arguments), timeout_s=timeout_s)

    def run(
        self, calls: Sequence[tuple[Tool, Mapping[str, Any]]], timeout_s: float
    ) -> list[ToolOutcome]:
        """Run ``calls`` concurrently and wait for them; one outcome per call, in order.

        ``timeout_s`` limits each call, from when a worker takes it.
        """
        jobs = [self.submit(tool, arguments, timeout_s) for tool, arguments in calls]
        wait_for_jobs(jobs)
        return [tool_outcome(job) for job in jobs]


def default_tool_runner(memory_mb: int | None = 2048, num_workers: int = 2) -> ToolRunner:
    """The process-wide runner with ``memory_mb`` and ``num_workers`` that environments use
    when given none (closed at exit)."""
    return process_wide(
        ("tools", memory_mb, num_workers),
        lambda: ToolRunner(num_workers=num_workers, memory_mb=memory_mb),
    )
