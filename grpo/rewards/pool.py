"""Reward calls on a `grpo.process_pool.TimedProcessPool`, each with a timeout.

Parsers such as math-verify can hang on adversarial input, and the caller is usually a Ray
actor method running on a non-main thread, where ``signal.alarm`` timeouts are unavailable. So
the calls run in worker processes with ``timeout=timeout_s``: the worker of a call that
overruns is stopped and replaced, and a call whose worker died is reported.
:func:`~grpo.rewards.batched_rewards` gives such calls the function's ``failure_reward`` and
counts them.

Calls go to the workers in chunks, one task per chunk (a task per call adds a process round
trip to each call, as costly as a math-verify check itself: 64 completions x 2 rewards on 2
workers took 29 ms one task per call, 16 ms in chunks). A chunk must finish
within one call's timeout; one that does not, or whose worker dies, is run again one call per
task, so the call that hung or crashed is found and counted exactly as if every call had had its
own task. Reward functions that are slow but within their timeout would make every chunk overrun;
the pool notices (a chunk that overran, none of whose calls did on its own) and halves its chunk
size for later runs.

Reward functions travel to the workers pickled, as bytes that the task itself unpickles: a
function that cannot load in a worker (a module missing there) fails its own calls, not the
pool. The workers import the modules of the reward functions the pool has run before taking a
call, so a worker (a replacement too) does not spend a call's timeout on imports; a batch that
brings a module the workers have not imported restarts them with it (once per new module).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import math
import os
import pickle
import threading
from collections.abc import Sequence
from typing import Any

from grpo.process_pool import STOP_GRACE_S, Job, TimedProcessPool, process_wide
from grpo.rewards.base import (
    FunctionReward,
    RewardFunction,
    call_reward,
    reward_failure_reason,
    short_error,
)

logger = logging.getLogger(__name__)

# One call: (index of the reward function, completion, answer, the example's columns it takes).
Call = tuple[int, str, str, dict[str, Any]]
# Outcome of a call: (reward, success, error kind "timeout" | "exception" | None, message). The
# message of an exception is made where it raised, in the worker: it names the line of the
# reward function's code (`grpo.rewards.base.reward_failure_reason`).
Outcome = tuple[float, bool, str | None, str | None]


def _quiet_math_verify() -> None:
    """Initializer of a worker: timeouts are ours; silence math-verify's one-time "timeout is
    disabled" warning."""
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
    """Several reward calls in one worker task, in order (see the module docstring)."""
    return [
        _score(pickled_fns[fn_index], completion, answer, columns)
        for fn_index, completion, answer, columns in calls
    ]


def _module_of(reward_fn: RewardFunction) -> str:
    fn = reward_fn.fn if isinstance(reward_fn, FunctionReward) else reward_fn
    return getattr(fn, "__module__", None) or type(fn).__module__


class RewardPool:
    """Worker processes that run reward calls with a per-call timeout.

    Workers are forked from a ``forkserver`` that has imported `grpo.rewards` (and so torch
    and math-verify), so a replacement for a killed worker starts in milliseconds, plus the
    time to re-import the parent's main script, which every spawn or forkserver child does (so
    a script that makes a pool needs the ``if __name__ == "__main__":`` guard). Workers start
    in the background on first use: start-up never counts against a call's timeout. The pool
    is safe to use from any thread; calls are serialised.

    Args:
        num_workers (int | None): Worker processes; defaults to ``min(4, os.cpu_count())``.
        start_method (str | None): ``"forkserver"`` (default where available) or ``"spawn"``.
            Not ``"fork"``: forking a process that runs Ray or torch threads is unsafe.
        startup_timeout_s (float): Allowance for the workers to start and import the reward
            functions' modules, within the bound on a whole :meth:`run`.
        max_calls_per_task (int): Most calls sent to a worker as one task. 1 gives every call
            its own task (no chunks).

    Raises:
        ValueError: On a bad ``num_workers``, ``start_method`` or ``max_calls_per_task``.

    Example:
        >>> with RewardPool(num_workers=2) as pool:
        ...     batch = batched_rewards([FormatReward()], ["<answer>1</answer>"], ["1"], pool=pool)
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

    def run(
        self, reward_fns: Sequence[RewardFunction], calls: list[Call], timeout_s: float
    ) -> list[Outcome]:
        """Run calls on the workers; one outcome per call, in call order.

        Args:
            reward_fns (Sequence[RewardFunction]): The functions the calls index.
            calls (list[Call]): ``(function index, completion, answer, columns)`` per call.
            timeout_s (float): Per-call limit in seconds, timed from when a worker takes it.

        Returns:
            list[Outcome]: ``(reward, success, error kind or None, error message or None)``.

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
        modules = {_module_of(fn) for fn in reward_fns} - {"__main__", "builtins"}
        with self._lock:
            if not self.pool.usable:
                raise RuntimeError(
                    "RewardPool.run: the pool is closed or belongs to another process"
                )
            try:
                # The workers import the functions' modules before their first call.
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
        # Bound the wait by the worst case, every call hanging, so that a task the pool loses
        # (a worker stopped just as it took its next task never reports it) cannot hang the
        # caller; such a call counts as a timeout and the workers are restarted.
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
    """The process-wide pool used by :func:`~grpo.rewards.batched_rewards` when none is given.

    Started on first use and closed at interpreter exit.
    """
    return process_wide("rewards", RewardPool)
