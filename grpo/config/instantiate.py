"""Build ``_component_`` nodes: import the dotted path, call it with the node's keywords."""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from grpo.config.errors import InstantiationError


def locate(path: str) -> Any:
    """Import the object at a dotted path (``torch.optim.AdamW``).

    Raises:
        InstantiationError: Naming the path, what could not be found, and a close name if any.
    """
    parts = path.split(".")
    if not all(parts):
        raise InstantiationError(f"{path!r} is not a dotted import path")
    obj: Any = None
    for depth, part in enumerate(parts):
        prefix = ".".join(parts[: depth + 1])
        if depth and hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        if depth and not isinstance(obj, ModuleType):
            raise InstantiationError(
                f"cannot import {path!r}: {'.'.join(parts[:depth])} has no attribute "
                f"{part!r}{_close_attr(obj, part)}"
            )
        try:
            obj = importlib.import_module(prefix)
        except ModuleNotFoundError as exc:
            if exc.name != prefix:  # the module exists but one of its imports failed
                raise InstantiationError(
                    f"cannot import {path!r}: importing {prefix} failed: {exc}"
                ) from exc
            where = (
                f"module {'.'.join(parts[:depth])} has no {part!r}"
                if depth
                else f"no module named {part!r}"
            )
            hint = _close_attr(obj, part) if depth else ""
            raise InstantiationError(f"cannot import {path!r}: {where}{hint}") from None
        except Exception as exc:
            raise InstantiationError(
                f"cannot import {path!r}: importing {prefix} failed: {type(exc).__name__}: {exc}"
            ) from exc
    return obj


def _close_attr(obj: Any, name: str) -> str:
    candidates = [attr for attr in dir(obj) if not attr.startswith("_")]
    if isinstance(obj, ModuleType) and hasattr(obj, "__path__"):
        import pkgutil

        candidates += [info.name for info in pkgutil.iter_modules(obj.__path__)]
    close = difflib.get_close_matches(name, candidates, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _node_key(node: Any) -> str:
    """Dotted key of an OmegaConf node within its config (``reward_functions[1]``), or ""."""
    parts: list[str] = []
    try:
        while node._get_parent() is not None:
            parent, key = node._get_parent(), node._key()
            parts.append(f"[{key}]" if isinstance(parent, ListConfig) else f".{key}")
            node = parent
    except AttributeError:  # a plain dict: messages then name the component only
        return ""
    return "".join(reversed(parts)).lstrip(".")


def instantiate(
    node: DictConfig | Mapping[str, Any] | None,
    *args: Any,
    _key_: str | None = None,
    _wrap_: Callable[[Any], Any] | None = None,
    **kwargs: Any,
) -> Any:
    """Build the object a ``_component_`` node describes.

    The other keys of the node are keyword arguments; nested ``_component_`` nodes (in values
    or lists) are built first; `kwargs` override the node's keys. Values reach the component as
    plain Python dicts and lists with interpolations resolved.

    Args:
        node (DictConfig | Mapping[str, Any] | None): The node; None returns None, so optional
            components (``lr_scheduler: null``) need no special case.
        _key_ (str | None): The node's config key for messages (``training.optimizer``); an
            OmegaConf node knows its own.
        _wrap_ (Callable | None): Applied to the imported object before it is called (the
            node's own, not nested ones'): a reward function node makes a plain scoring
            function configurable (`grpo.rewards.build_reward_function`).
        **kwargs (Any): Keyword arguments that take precedence over the node's.

    Raises:
        InstantiationError: If the node has no ``_component_``, the path does not import, or
            the keyword arguments do not fit its signature; the message names the config key
            and the component. An exception raised inside the component propagates with a
            note naming both.
    """
    if node is None:
        return None
    key = _key_ or _node_key(node)
    if isinstance(node, (DictConfig, ListConfig)):
        try:
            plain = OmegaConf.to_container(node, resolve=True)
        except Exception as exc:
            raise InstantiationError(f"{key or 'config'}: {str(exc).splitlines()[0]}") from None
    else:
        plain = dict(node)
    return _build(plain, key, args, kwargs, _wrap_)


def _build(
    node: Any, key: str, args: tuple, kwargs: dict, wrap: Callable[[Any], Any] | None = None
) -> Any:
    if not isinstance(node, Mapping) or "_component_" not in node:
        raise InstantiationError(
            f"{_at(key)}cannot instantiate {node!r}: expected a mapping with a _component_ key"
        )
    target = node["_component_"]
    if not isinstance(target, str):
        raise InstantiationError(
            f"{_at(key, '_component_')}expected a dotted import path, got {target!r}"
        )
    try:
        component = locate(target)
    except InstantiationError as exc:
        raise InstantiationError(f"{_at(key, '_component_')}{exc}") from None
    if wrap is not None:
        component = wrap(component)
    node_kwargs = {
        name: _build_nested(value, f"{key}.{name}" if key else name)
        for name, value in node.items()
        if name != "_component_"
    }
    node_kwargs.update(kwargs)
    try:
        signature = inspect.signature(component)
    except (TypeError, ValueError):  # some builtins have no signature; let the call decide
        signature = None
    if signature is not None:
        try:
            signature.bind(*args, **node_kwargs)
        except TypeError as exc:
            accepted = keyword_names(component)
            unknown = [
                name for name in node_kwargs if accepted is not None and name not in accepted
            ]
            if unknown:
                details = []
                for name in unknown:
                    close = difflib.get_close_matches(name, sorted(accepted or ()), n=1)
                    details.append(
                        f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                    )
                detail = f"unexpected argument {', '.join(details)}"
            else:
                detail = str(exc)
            raise InstantiationError(f"{_at(key)}cannot call {target}: {detail}") from None
    try:
        return component(*args, **node_kwargs)
    except Exception as exc:
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(f"while instantiating {target}" + (f" (config key {key})" if key else ""))
        raise


def _at(key: str, child: str = "") -> str:
    """Message prefix naming the config key (``training.loss: ``), empty if unknown."""
    full = ".".join(part for part in (key, child) if part)
    return f"{full}: " if full else ""


def _build_nested(value: Any, key: str) -> Any:
    if isinstance(value, Mapping) and "_component_" in value:
        return _build(value, key, (), {})
    if isinstance(value, list):
        return [_build_nested(item, f"{key}[{index}]") for index, item in enumerate(value)]
    return value


def keyword_names(component: Any) -> set[str] | None:
    """Keyword names `component` accepts, or None if it takes **kwargs or has no signature."""
    try:
        signature = inspect.signature(component)
    except (TypeError, ValueError):
        return None
    names = set()
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            return None
        if parameter.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        ):
            names.add(parameter.name)
    return names
