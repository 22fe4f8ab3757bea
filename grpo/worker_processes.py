"""What every worker process of a pool (rewards, tools) does first: never outlive its parent,
and (tools) stay within a memory limit.

Pure Python: worker initializers import it without torch.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from typing import Any


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


def limit_memory(memory_mb: int | None) -> None:
    """Cap this process's data memory (heap and anonymous mappings: ``RLIMIT_DATA``).

    An allocation past the cap fails inside the process (``MemoryError`` in Python) instead of
    taking memory from the actors beside it. The address space is left alone: libraries map
    far more of it than they use.
    """
    if memory_mb is None:
        return
    import resource

    limit = int(memory_mb) * 2**20
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def start_tool_worker(memory_mb: int | None) -> None:
    """A tool worker's initializer: `exit_with_parent`, then `limit_memory`."""
    exit_with_parent()
    limit_memory(memory_mb)
