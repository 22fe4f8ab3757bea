"""Automatic garbage collection paused while an actor's process imports and builds.

Importing torch, vLLM and torchtune creates millions of objects that live as long as the
process, and CPython runs a full collection, which scans every tracked object, each time the
objects that survived grow by a quarter. A run's actor processes therefore start with automatic
collection off (`pause_gc`, Ray's worker set-up hook for the run's job) and turn it back on
when the actor's constructor returns (`resumes_gc`), after freezing what exists by then into
the permanent generation, which later collections skip. Reference counting frees objects as
usual throughout: only cycles wait.

This module imports nothing but ``gc`` and `grpo.actor_class`: Ray runs the hook before the
worker imports anything else.
"""

from __future__ import annotations

import gc
from typing import Any

from grpo.actor_class import with_constructor

# Ray's ``runtime_env={"worker_process_setup_hook": ...}`` for the run's job: every worker
# process Ray starts for it runs this before its actor's class is imported.
PAUSE_GC_HOOK = "grpo.workers.gc_pause.pause_gc"


def pause_gc() -> None:
    """Turn automatic garbage collection off until `resume_gc`."""
    gc.disable()


def resume_gc() -> None:
    """Freeze every object alive now, so that later collections skip it, and turn automatic
    garbage collection on."""
    gc.freeze()
    gc.enable()


def resumes_gc(cls: type) -> type:
    """A subclass of ``cls`` whose constructor ends with `resume_gc`, also when it raises.

    Every actor class a run starts goes through it: its process started with `pause_gc`.

    Args:
        cls: The actor class.

    Returns:
        type: A subclass with the same name, methods and documentation.
    """

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            cls.__init__(self, *args, **kwargs)
        finally:
            resume_gc()

    return with_constructor(cls, __init__)
