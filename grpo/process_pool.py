"""Worker processes that run calls, each with a timeout: a call that hangs or crashes costs its
own outcome, never the caller. Reward functions and tools run on it.

A call's timeout counts from when a worker takes it, so queueing never eats it; the queue wait
is kept (`Job.queue_wait_s`). An overrunning call's worker alone is stopped and replaced.
Workers are never forked from a caller running Ray or torch threads, so a script that makes a
pool needs the ``__main__`` guard; they never outlive their parent.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import importlib
import multiprocessing
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Any, Literal, NamedTuple, Protocol, TypeVar

import pebble

# The one forkserver is shared by every pool and only the first to start it decides what it
# preloads, so every pool asks for this list (else each restarted worker imports the reward
# code again). It imports no torch: two forkservers start with every run (the collector's and
# the reference actor's), and workers that call a reward or a tool never need it.
FORKSERVER_PRELOAD = ["grpo.rewards"]
# Beyond a call's timeout, for pebble to notice the overrun (it checks every 0.1 s) and stop
# the worker (SIGTERM, SIGKILL after 3 s).
STOP_GRACE_S = 5.0
# Beyond the time every call ahead could take: a call still queued then was lost by the pool
# (never with a healthy pebble pool; the bound keeps a caller from waiting forever).
_QUEUE_SLACK_S = 30.0
# How often a wait re-reads deadlines that move (a call's deadline is set when it starts).
_POLL_S = 0.1

OutcomeKind = Literal["value", "timeout", "crash", "exception", "memory", "cancelled", "lost"]


class JobOutcome(NamedTuple):
    """How one call ended.

    ``kind`` is one of:

    * ``"value"``: it returned ``value``.
    * ``"timeout"``: it overran its timeout and its worker was stopped.
    * ``"crash"``: its worker died (``exitcode``).
    * ``"exception"``: it raised, or could not run (an argument that does not unpickle in the
      worker, a broken pool); ``error`` is ``"TypeName: message"``.
    * ``"memory"``: it raised ``MemoryError`` (past the pool's memory cap, where it has one);
      ``error`` as for ``"exception"``.
    * ``"cancelled"``: the workers were stopped under it (`TimedProcessPool.stop`).
    * ``"lost"``: no result by its deadline (`Job.deadline`); `Job.started_at` says whether a
      worker had taken it.
    """

    kind: OutcomeKind
    value: Any = None
    error: str | None = None
    exitcode: int | None = None


class _Raised(NamedTuple):
    """What a call raised, as it comes back from the worker: the exception itself might not
    unpickle in the parent."""

    kind: OutcomeKind
    error: str


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _process_alive(pid: int) -> bool:
    """Whether a process with this pid runs (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_orphaned_folders(prefix: str, root: str | os.PathLike | None = None) -> list[str]:
    """Delete the folders ``{prefix}{pid}-*`` in ``root`` whose pid runs no process.

    A process that keeps files in a folder named after its pid deletes them itself, unless it
    is killed; the next process of its kind to start calls this.

    Args:
        prefix: The folders' common prefix.
        root: Where they are; None: the temporary directory.

    Returns:
        list[str]: The paths of the folders deleted.
    """
    folder_name = re.compile(rf"{re.escape(prefix)}(\d+)-[A-Za-z0-9_]+")
    try:
        entries = list(os.scandir(root or tempfile.gettempdir()))
    except OSError:
        return []
    removed = []
    for entry in entries:
        match = folder_name.fullmatch(entry.name)
        if match and entry.is_dir() and not _process_alive(int(match[1])):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _worker_context(start_method: str | None, owner: str) -> multiprocessing.context.BaseContext:
    """The multiprocessing context of a pool: ``forkserver`` where available, else ``spawn``.

    Raises:
        ValueError: Another or an unavailable start method (``fork`` among them: forking a
            process that runs Ray or torch threads is unsafe).
    """
    methods = multiprocessing.get_all_start_methods()
    if start_method is None:
        start_method = "forkserver" if "forkserver" in methods else "spawn"
    if start_method not in ("forkserver", "spawn") or start_method not in methods:
        raise ValueError(
            f"{owner}: start_method must be 'forkserver' or 'spawn' (available: {methods}), "
            f"got {start_method!r}"
        )
    context = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        context.set_forkserver_preload(FORKSERVER_PRELOAD)
    return context


def _exit_when_parent_dies(parent: Any) -> None:
    parent.join()
    os._exit(1)


def _do_nothing() -> None:
    """A call that only makes the workers start (`TimedProcessPool.start`)."""


def _start_worker(initializer: Callable[[], None] | None, modules: Sequence[str]) -> None:
    """Initializer of a worker process: exit with the parent, run the pool's initializer and
    import its modules before taking any call.

    Never raises: pebble would restart a worker whose initializer fails, forever; a module
    that does not import makes the calls that need it fail instead.
    """
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_when_parent_dies, args=(parent,), daemon=True).start()
    if initializer is not None:
        try:
            initializer()
        except Exception:
            pass
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:
            pass


def _data_bytes() -> int | None:
    """This process's data segment (``VmData``), what ``RLIMIT_DATA`` is checked against."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@contextlib.contextmanager
def memory_cap(memory_mb: int | None) -> Iterator[None]:
    """Within the block, this process may allocate at most ``memory_mb`` more data memory.

    Lowers ``RLIMIT_DATA``, not the address space, which libraries map far more of than they
    use. A no-op where ``VmData`` cannot be read.

    Args:
        memory_mb: The allowance; None: no cap.
    """
    held = _data_bytes() if memory_mb is not None else None
    if held is None:
        yield
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = held + int(memory_mb) * 2**20
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _run_capped(fn: Callable[..., Any], args: tuple[Any, ...], memory_mb: int | None) -> Any:
    """One call in a worker, within the pool's memory cap; what it raises comes back as a
    `_Raised`, described once the cap is lifted (a call that filled its allowance leaves no
    room to format its error in)."""
    try:
        with memory_cap(memory_mb):
            return fn(*args)
    except MemoryError as error:
        return _Raised("memory", _describe(error))
    except Exception as error:
        return _Raised("exception", _describe(error))


class Job:
    """One submitted call: its future, and when it was submitted and taken by a worker.

    Args:
        timeout_s: The call's limit, from when a worker takes it.
        queue_bound_s: How long it may wait for a worker before it counts as lost.
    """

    def __init__(self, future: Any, timeout_s: float, queue_bound_s: float) -> None:
        self.future = future
        self.timeout_s = timeout_s
        self.submitted_at = time.monotonic()
        self.started_at: float | None = None  # time.monotonic() when a worker took it
        self._queue_bound_s = queue_bound_s
        # pebble marks a future running when a worker takes the task, the moment its timeout
        # starts: hooking it gives the start without polling.
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
            return self.started_at + self.timeout_s + STOP_GRACE_S
        return self.submitted_at + self._queue_bound_s

    def outcome(self) -> JobOutcome:
        """The call's `JobOutcome`. An unfinished call is lost: it is cancelled (which stops
        its worker only) and its outcome is ``"lost"``."""
        future = self.future
        if not future.done():
            self._observe_start()
            future.cancel()
            return JobOutcome("lost")
        try:
            value = future.result()
        except concurrent.futures.TimeoutError:
            return JobOutcome("timeout")
        except concurrent.futures.CancelledError:
            return JobOutcome("cancelled")
        except pebble.ProcessExpired as error:
            return JobOutcome("crash", exitcode=error.exitcode)
        except Exception as error:  # the call could not run: unpickling, a broken pool
            return JobOutcome("exception", error=_describe(error))
        if isinstance(value, _Raised):
            return JobOutcome(value.kind, error=value.error)
        return JobOutcome("value", value=value)


def jobs_deadline(jobs: Sequence[Job]) -> float:
    """When the last unfinished job of ``jobs`` counts as lost (`Job.deadline`); it moves
    later when a queued job starts. ``time.monotonic()`` if every job is done."""
    deadlines = [job.deadline() for job in jobs if not job.future.done()]
    return max(deadlines) if deadlines else time.monotonic()


def wait_for_jobs(jobs: Sequence[Job]) -> None:
    """Block until every job is done or lost (`jobs_deadline`)."""
    futures = [job.future for job in jobs]
    while True:
        left = jobs_deadline(jobs) - time.monotonic()
        if left <= 0 or all(future.done() for future in futures):
            return
        # Short waits: a queued job's start moves the deadline.
        concurrent.futures.wait(futures, timeout=min(left, _POLL_S))


class TimedProcessPool:
    """Worker processes that run calls with a per-call timeout; safe to use from any thread.

    Args:
        start_method: ``"forkserver"`` (default where available) or ``"spawn"``.
        memory_mb: Data memory one call may allocate; None: no cap.
        initializer: Module-level function each worker runs once before its first call (its
            exceptions are ignored).

    Raises:
        ValueError: ``num_workers`` is not an int >= 1, or a bad ``start_method``.
    """

    def __init__(
        self,
        num_workers: int,
        name: str,
        start_method: str | None = None,
        memory_mb: int | None = None,
        initializer: Callable[[], None] | None = None,
    ) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"{name}: num_workers must be an int >= 1, got {num_workers!r}")
        self._context = _worker_context(start_method, name)
        self.num_workers = num_workers
        self.name = name
        self.memory_mb = memory_mb
        self._initializer = initializer
        self._modules: frozenset[str] = frozenset()
        self._workers: pebble.ProcessPool | None = None
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._closed = False
        # Calls submitted and not finished; a done-callback (pebble's thread) removes them.
        self._in_flight: set[Job] = set()
        self._in_flight_lock = threading.Lock()

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._closed

    @property
    def usable(self) -> bool:
        """Whether calls may be submitted: not closed, and made by this process (a copy
        inherited from a parent process has no workers of its own)."""
        return not self._closed and os.getpid() == self._pid

    def preload(self, modules: Iterable[str]) -> None:
        """Have every worker import ``modules`` before it takes a call, so no call spends its
        timeout on imports. Running workers without them are stopped (their calls cancelled).
        """
        with self._lock:
            modules = frozenset(modules)
            if modules <= self._modules:
                return
            self._modules |= modules
            self._stop_workers()
        self._cancel_in_flight()

    def start(self, timeout_s: float) -> None:
        """Start the workers now rather than with the first call: one call that does nothing,
        waited for (at most ``timeout_s`` once a worker takes it)."""
        wait_for_jobs([self.submit(_do_nothing, timeout_s=timeout_s)])

    def submit(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Job:
        """Queue the call ``fn(*args)``; its `Job` gives the outcome once its future is done.

        Args:
            fn: A module-level function (it and ``args`` travel pickled).
            *args: Its arguments.
            timeout_s: Limit of the call, from when a worker takes it.

        Returns:
            Job: The call's future, start time and deadline.

        Raises:
            RuntimeError: The pool is closed or belongs to another process.
        """
        with self._in_flight_lock:
            ahead = sum(job.timeout_s + STOP_GRACE_S for job in self._in_flight)
        with self._lock:
            if not self.usable:
                raise RuntimeError(f"{self.name}: the pool is closed or belongs to another process")
            future = self._running_workers().schedule(
                _run_capped, args=(fn, args, self.memory_mb), timeout=timeout_s
            )
        job = Job(future, timeout_s, queue_bound_s=_QUEUE_SLACK_S + ahead)
        with self._in_flight_lock:
            self._in_flight.add(job)
        # Added outside the lock: on a finished future the callback runs here, at once.
        future.add_done_callback(lambda _: self._finished(job))
        return job

    def _finished(self, job: Job) -> None:
        with self._in_flight_lock:
            self._in_flight.discard(job)

    def _running_workers(self) -> pebble.ProcessPool:
        """The pebble pool, started anew if it never ran, was stopped or broke."""
        if self._workers is None or not self._workers.active:
            self._workers = pebble.ProcessPool(
                max_workers=self.num_workers,
                initializer=_start_worker,
                initargs=(self._initializer, sorted(self._modules)),
                context=self._context,
            )
        return self._workers

    def stop(self) -> None:
        """Stop the workers (pebble kills any that do not exit within 3 s of SIGTERM). Calls
        still queued or running are cancelled, so nothing waits on them; the next `submit`
        starts new workers."""
        with self._lock:
            self._stop_workers()
        self._cancel_in_flight()

    def close(self) -> None:
        """Stop the workers for good: `submit` refuses calls from now on."""
        self._closed = True
        self.stop()

    def _stop_workers(self) -> None:
        if self._workers is not None:
            self._workers.stop()
            self._workers.join()
            self._workers = None

    def _cancel_in_flight(self) -> None:
        with self._in_flight_lock:
            unfinished = list(self._in_flight)
        for job in unfinished:
            job.future.cancel()

    def __enter__(self) -> TimedProcessPool:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class PoolFront(Protocol):
    """What `process_wide` keeps: an object that runs its calls on `pool`."""

    pool: TimedProcessPool

    def close(self) -> None: ...


Front = TypeVar("Front", bound=PoolFront)
_process_wide: dict[Hashable, Any] = {}
_process_wide_lock = threading.Lock()


def process_wide(key: Hashable, make: Callable[[], Front]) -> Front:
    """The one front (a reward pool, a tool runner) that ``make`` built for ``key`` in this
    process; built anew once its pool is no longer `TimedProcessPool.usable`. Closed at exit.

    Args:
        key: What tells fronts apart (their kind and options).
        make: Builds the front.
    """
    with _process_wide_lock:
        front = _process_wide.get(key)
        if front is None or not front.pool.usable:
            front = _process_wide[key] = make()
            atexit.register(front.close)
        return front
