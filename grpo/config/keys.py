"""The run config's keys by dotted path: defaults, lookups and did-you-mean hints."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig
from pydantic.fields import FieldInfo

from grpo.config.run import RunConfig
from grpo.config.schema import (
    REQUIRED,
    Section,
    component_spec,
    default_of,
    is_open_mapping,
    optional_section_type,
    section_type,
)

# Below a component node or a free-form mapping: any key may exist there.
OPEN = object()


def fill_defaults(node: DictConfig, model: type[Section] = RunConfig) -> None:
    """Set absent keys of a loaded config to their declared default, sections included.

    Component nodes are never merged into: a node the config sets replaces the default whole.

    Args:
        node (DictConfig): The config (or a section of it), changed in place.
        model (type[Section]): The section class `node` holds.
    """
    for key, info in model.model_fields.items():
        nested = section_type(info)
        if nested is not None:
            child = node._get_node(key) if key in node else None
            if child is None or child._is_none():  # absent, or an empty `inference:` line
                node[key] = {}
                child = node._get_node(key)
            if isinstance(child, DictConfig):
                fill_defaults(child, nested)
        elif key not in node:
            default = default_of(info)
            if default is not REQUIRED:
                node[key] = default


def schema_at(parts: Sequence[str]) -> Any:
    """What a dotted key is: a section class, a `FieldInfo`, `OPEN`, or None if unknown.

    Args:
        parts (Sequence[str]): The key's parts (``["training", "optimizer", "lr"]``).

    Returns:
        Any: The section class or field the key names; `OPEN` below a component node or a
        free-form mapping; None for a key the schema does not know.
    """
    current: Any = RunConfig
    for part in parts:
        if current is OPEN:
            return OPEN
        if isinstance(current, type) and issubclass(current, Section):
            info = current.model_fields.get(part)
            if info is None:
                return None
            current = optional_section_type(info) or info
        elif isinstance(current, FieldInfo) and (
            component_spec(current) is not None or is_open_mapping(current)
        ):
            return OPEN
        else:  # below a plain value
            return None
    return current


def may_hold_keys(spec: Any) -> bool:
    """Whether a mapping may be created at a key with this `schema_at` answer."""
    if spec is OPEN or (isinstance(spec, type) and issubclass(spec, Section)):
        return True
    if isinstance(spec, FieldInfo):
        component = component_spec(spec)
        return (component is not None and not component.many) or is_open_mapping(spec)
    return False


def all_schema_keys(model: type[Section] = RunConfig, prefix: str = "") -> list[str]:
    """Every declared dotted key: sections, their options, and the documented keywords of
    their component nodes (``training.optimizer.lr``)."""
    keys = []
    for key, info in model.model_fields.items():
        keys.append(prefix + key)
        nested = section_type(info)
        if nested is not None:
            keys.extend(all_schema_keys(nested, f"{prefix}{key}."))
        component = component_spec(info)
        if component is not None and component.args is not None and not component.many:
            keys.extend(f"{prefix}{key}.{name}" for name in component.args.model_fields)
    return keys


def siblings_at(parts: Sequence[str]) -> list[str]:
    """Declared keys of the section at `parts` (empty below anything else)."""
    spec = schema_at(parts) if parts else RunConfig
    if isinstance(spec, type) and issubclass(spec, Section):
        return list(spec.model_fields)
    return []


def suggest(prefix: str, key: str, siblings: Sequence[str]) -> str:
    """A ``; did you mean ...?`` hint for an unknown key, or ``""``.

    Args:
        prefix (str): The dotted path of the key's parent with a trailing dot (``""`` at top).
        key (str): The unknown key.
        siblings (Sequence[str]): Keys that exist beside it.

    Returns:
        str: The hint, starting with ``; ``, or an empty string.
    """
    same_name = [path for path in all_schema_keys() if path.rsplit(".", 1)[-1] == key]
    # The same name deeper in this section (``training.lr`` -> ``training.optimizer.lr``) is
    # a surer guess than a look-alike beside it (``training.lora``).
    below = [path for path in same_name if path.startswith(prefix)]
    if below:
        return f"; did you mean {' or '.join(below)}?"
    close = difflib.get_close_matches(key, list(siblings), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {prefix}{close[0]}?"
    if same_name:
        return f"; did you mean {' or '.join(same_name)}?"
    return ""
