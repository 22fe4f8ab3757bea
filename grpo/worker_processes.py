"""What worker processes of a pool (rewards, tools) share: they never outlive their parent,
and a tool call stays within its memory cap.

Pure Python: worker initializers import it without torch.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
from collections.abc import Iterator
from typing import Any

# What this process's one forkserver imports before it forks any worker. The server is shared
# by every pool of the process (reward workers, tool workers) and only the first pool to start
# it decides what it preloads, so every pool asks for the same list: the reward package (torch,
# math-verify), which a reward worker would otherwise import anew after each restart.
FORKSERVER_PRELOAD = ["grpo.rewards"]


def worker_context(start_method: str | None, owner: str) -> multiprocessing.context.BaseContext:
    """The multiprocessing context of a worker pool: ``forkserver`` where available, else
    ``spawn``; never ``fork`` (forking a process that runs Ray or torch threads is unsafe).

    Args:
        start_method (str | None): ``"forkserver"``, ``"spawn"``, or None for the default.
        owner (str): The pool's name, for the error.

    Returns:
        multiprocessing.context.BaseContext: The context; a forkserver one preloads
        `FORKSERVER_PRELOAD` if this process has not started its server yet.

    Raises:
        ValueError: Another or an unavailable start method.
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


def exit_with_parent() -> None:
    """In a worker process, exit as soon as its parent does, even from inside a hanging call.

    A daemon thread waits on the parent; a call that never returns cannot keep the worker alive
    once the actor that started the pool is gone.
    """
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_when_parent_dies, args=(parent,), daemon=True).start()


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

    ``RLIMIT_DATA`` (heap and anonymous mappings) is lowered to what the process holds now
    plus ``memory_mb``, and restored after: an allocation past it fails inside the process
    (``MemoryError`` in Python) instead of taking memory from the actors beside it, and the
    libraries the worker loaded before stay usable. The address space is left alone:
    libraries map far more of it than they use. A no-op where ``VmData`` cannot be read.
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
