"""A file of ``scripts/`` imported as a module (``scripts/`` is no package)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from grpo.config import repo_root

SCRIPTS = repo_root() / "scripts"


def load_script(name: str) -> ModuleType:
    """``scripts/NAME.py`` as the module ``NAME``.

    ``scripts/`` goes on ``sys.path`` first, as when a script runs, so it imports its
    neighbours (``bench_common``); the module is registered in ``sys.modules``, where dataclasses
    look their module up.
    """
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module
