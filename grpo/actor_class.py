"""Subclasses of actor classes that wrap the constructor and keep the class's name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def with_constructor(cls: type, __init__: Callable[..., None]) -> type:
    """A subclass of ``cls`` whose constructor is ``__init__`` (which calls ``cls.__init__``).

    Args:
        cls: The actor class.
        __init__: The new constructor, ``(self, *args, **kwargs)``.

    Returns:
        type: A subclass with the same name, methods and documentation.
    """
    # Same name and qualified name: Ray and error messages show the class the user knows.
    namespace: dict[str, Any] = {
        "__init__": __init__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
    }
    return type(cls.__name__, (cls,), namespace)
