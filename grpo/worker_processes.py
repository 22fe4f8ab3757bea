"""What every worker process of a pool (rewards, tools) does first: never outlive its parent.

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
