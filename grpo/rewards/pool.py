"""Reward calls in worker processes, each with a timeout.

math-verify can hang, and callers run off the main thread where ``signal.alarm`` is
unavailable; so calls run in workers replaced when they overrun or die. Calls travel in chunks
(docs/benchmarks.md); a chunk that overruns or crashes is rerun call by call to find the
culprit. A reward function that cannot unpickle in a worker fails its own calls, not the pool.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import math
import os
import pickle
import threading
from collections.abc import Callable, Sequence
from typing import Any

from grpo.process_pool import STOP_GRACE_S, Job, TimedProcessPool, process_wide
from grpo.rewards.base import (
    FunctionReward,
    RewardFunction,
    as_reward_function,
    call_reward,
    reward_failure_reason,
    short_error,
)

logger = logging.getLogger(__name__)

# One call: (index of the reward function, completion, answer, the example's columns it takes).
Call = tuple[int, str, str, dict[str, Any]]
# Outcome of a call: (reward, success, error kind "timeout" | "exception" | None, message).
Outcome = tuple[float, bool, str | None, str | None]


def _quiet_math_verify() -> None:
    """Silence math-verify's "timeout is disabled" warning: the pool bounds the time."""
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)


@functools.lru_cache(maxsize=64)
def _load_reward(pickled: bytes) -> RewardFunction:
    # Cached: every call of a batch brings the same bytes.
    return pickle.loads(pickled)


def _score(
    pickled_fn: bytes, completion: str, answer: str, columns: dict[str, Any] | None = None
) -> Outcome:
    """One reward call in a worker; exceptions come back as outcomes, not as pool errors."""
    try:
        reward_fn = _load_reward(pickled_fn)
    except Exception as error:
        return 0.0, False, "exception", f"cannot load reward function: {short_error(error)}"
    try:
        reward, success = call_reward(reward_fn, completion, answer, columns)
    except Exception as error:
        return 0.0, False, "exception", reward_failure_reason(error)
    return reward, success, None, None


def _score_chunk(pickled_fns: Sequence[bytes], calls: Sequence[Call]) -> list[Outcome]:
    """Several reward calls in one worker task, in order."""
    return [
        _score(pickled_fns[fn_index], completion, answer, columns)
        for fn_index, completion, answer, columns in calls
    ]


def _module_of(reward_fn: RewardFunction) -> str:
    fn = reward_fn.fn if isinstance(reward_fn, FunctionReward) else reward_fn
    return getattr(fn, "__module__", None) or type(fn).__module__


def _modules_of(reward_fns: Sequence[RewardFunction]) -> set[str]:
    """The modules the workers import for ``reward_fns`` (not a script's ``__main__``)."""
    return {_module_of(fn) for fn in reward_fns} - {"__main__", "builtins"}


class RewardPool:
    """Worker processes that run reward calls with a per-call timeout.

    Workers fork from a ``forkserver`` that has imported `grpo.rewards`, and re-import the
    parent's main script (a script that makes a pool needs the ``if __name__ == "__main__":``
    guard). Start-up never counts against a call's timeout. Safe from any thread; calls are
    serialised.

    Args:
        num_workers (int | None): Worker processes; defaults to ``min(4, os.cpu_count())``.
        start_method (str | None): ``"forkserver"`` (default where available) or ``"spawn"``.
            Not ``"fork"``: forking a process that runs Ray or torch threads is unsafe.
        max_calls_per_task (int): Most calls sent to a worker as one task (1: no chunks).

    Raises:
        ValueError: On a bad ``num_workers``, ``start_method`` or ``max_calls_per_task``.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        start_method: str | None = None,
        startup_timeout_s: float = 60.0,
        max_calls_per_task: int = 64,
    ) -> None:
        if num_workers is None:
            num_workers = min(4, os.cpu_count() or 1)
        if max_calls_per_task < 1:
            raise ValueError(
                f"RewardPool: max_calls_per_task must be >= 1, got {max_calls_per_task}"
            )
        self.pool = TimedProcessPool(
            num_workers,
            name="RewardPool",
            start_method=start_method,
            initializer=_quiet_math_verify,
        )
        self.num_workers = num_workers
        self.startup_timeout_s = startup_timeout_s
        self.max_calls_per_task = max_calls_per_task
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self.pool.closed

    def close(self) -> None:
        """Stop the workers (pebble kills any that do not exit within 3 s of SIGTERM)."""
        with self._lock:
            self.pool.close()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def start(self, reward_fns: Sequence[RewardFunction | Callable[..., Any]]) -> None:
        """Start the workers now, with the modules of ``reward_fns`` imported, instead of on
        the first `run` (which then waits for neither).

        Raises:
            RuntimeError: If the pool is closed or belongs to another process.
        """
        modules = _modules_of([as_reward_function(fn) for fn in reward_fns])
        with self._lock:
            if not self.pool.usable:
                raise RuntimeError(
                    "RewardPool.start: the pool is closed or belongs to another process"
                )
            self.pool.preload(modules)
            self.pool.start(self.startup_timeout_s)

    def run(
        self, reward_fns: Sequence[RewardFunction], calls: list[Call], timeout_s: float
    ) -> list[Outcome]:
        """Run calls on the workers; one outcome per call, in call order. Each call has
        ``timeout_s`` seconds from when a worker takes it.

        Raises:
            ValueError: If ``timeout_s`` is not positive.
            RuntimeError: If the pool is closed or belongs to another process.
            pickle.PicklingError: If a reward function cannot be pickled.
        """
        if timeout_s <= 0:
            raise ValueError(f"RewardPool.run: timeout_s must be > 0, got {timeout_s}")
        try:
            pickled_fns = [pickle.dumps(fn) for fn in reward_fns]
        except Exception as error:
            raise pickle.PicklingError(
                "reward functions must be picklable (module-level classes or functions) to run "
                f"in worker processes: {short_error(error)}"
            ) from error
        modules = _modules_of(reward_fns)
        with self._lock:
            if not self.pool.usable:
                raise RuntimeError(
                    "RewardPool.run: the pool is closed or belongs to another process"
                )
            try:
                # Imported before the first call, so a worker spends no call's timeout on them.
                self.pool.preload(modules)
                return self._run_chunked(pickled_fns, calls, timeout_s)
            except BaseException:
                # Interrupted: workers still on these calls would hold up the next run.
                self.pool.stop()
                raise

    def _run_chunked(
        self, pickled_fns: list[bytes], calls: list[Call], timeout_s: float
    ) -> list[Outcome]:
        """Chunks first; the calls of a chunk that overran or crashed again, one per task."""
        outcomes: list[Outcome | None] = [None] * len(calls)
        retry: list[int] = []
        chunk_size = min(self.max_calls_per_task, math.ceil(len(calls) / self.num_workers))
        if chunk_size > 1:
            starts = range(0, len(calls), chunk_size)
            jobs = [
                self.pool.submit(
                    _score_chunk,
                    pickled_fns,
                    calls[start : start + chunk_size],
                    timeout_s=timeout_s,
                )
                for start in starts
            ]
            overran: list[int] = []
            for start, result in zip(starts, self._collect(jobs, timeout_s)):
                indices = range(start, min(start + chunk_size, len(calls)))
                if isinstance(result, list):
                    for index, outcome in zip(indices, result):
                        outcomes[index] = outcome
                    continue
                retry.extend(indices)
                if result[2] == "timeout":
                    overran.extend(indices)
        else:
            retry = list(range(len(calls)))
            overran = []
        if retry:
            jobs = [
                self.pool.submit(
                    _score,
                    pickled_fns[calls[i][0]],
                    calls[i][1],
                    calls[i][2],
                    calls[i][3],
                    timeout_s=timeout_s,
                )
                for i in retry
            ]
            for index, outcome in zip(retry, self._collect(jobs, timeout_s)):
                outcomes[index] = outcome
            self._shrink_chunks_if_slow(overran, outcomes, chunk_size)
        return outcomes  # type: ignore[return-value]

    def _shrink_chunks_if_slow(
        self, overran: list[int], outcomes: list[Outcome | None], chunk_size: int
    ) -> None:
        # A chunk that overran although none of its calls did alone: the functions are slow,
        # not hanging. Smaller chunks stop every later run from paying a timeout.
        if overran and all(outcomes[i][2] != "timeout" for i in overran):  # type: ignore[index]
            self.max_calls_per_task = max(1, chunk_size // 2)
            logger.info(
                "RewardPool: a chunk of calls overran one call's timeout although no call did "
                "alone (slow reward functions); %d calls per task from now on",
                self.max_calls_per_task,
            )

    def _collect(self, jobs: list[Job], timeout_s: float) -> list[Any]:
        """Each job's result (an outcome, or a chunk's list of them), or an error outcome."""
        # Bound the wait by the worst case (every call hanging), so that a task the pool loses
        # (a worker stopped just as it took it) cannot hang the caller.
        rounds = math.ceil(len(jobs) / self.num_workers)
        limit_s = self.startup_timeout_s + rounds * (timeout_s + STOP_GRACE_S)
        concurrent.futures.wait([job.future for job in jobs], timeout=limit_s)
        outcomes: list[Any] = []
        lost = 0
        for job in jobs:
            outcome = job.outcome()
            if outcome.kind == "value":
                outcomes.append(outcome.value)
            elif outcome.kind == "lost":
                lost += 1
                outcomes.append((0.0, False, "timeout", f"no result within {limit_s:.0f} s"))
            elif outcome.kind == "timeout":
                outcomes.append((0.0, False, "timeout", f"no result within {timeout_s} s"))
            elif outcome.kind == "crash":
                message = f"worker process exited with code {outcome.exitcode}"
                outcomes.append((0.0, False, "exception", message))
            elif outcome.kind == "cancelled":
                message = "the workers were stopped before it finished"
                outcomes.append((0.0, False, "exception", message))
            else:  # a broken pool, restarted on the next submit
                outcomes.append((0.0, False, "exception", str(outcome.error)[:500]))
        if lost:
            logger.warning("RewardPool: %d call(s) lost by the workers; restarting them", lost)
            self.pool.stop()
        return outcomes


def default_reward_pool() -> RewardPool:
    """The process-wide pool, started on first use and closed at interpreter exit."""
    return process_wide("rewards", RewardPool)
