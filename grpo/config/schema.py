"""How a config section declares its options: pydantic models, and how the rest reads them.

Every section of a run config (``inference:``, ``ref:``, ``training:``, ...) is a `Section`:
a frozen pydantic model that forbids unknown keys and takes values strictly (``3`` is no
``bool``, ``"3"`` no ``int``; an int is a float). One option is one line, its docstring below:

    class InferenceConfig(Section):
        \"\"\"Generation (vLLM collectors).\"\"\"

        group_size: int = Field(8, ge=2)
        \"\"\"Responses per prompt; advantages are normalised within a group.\"\"\"

A ``_component_`` node is annotated with `Component` (``Component(OptimizerArgs)`` documents
and checks some of its keywords), a list of them with `ComponentList`. This module and the
sections import pydantic and typing only: checking a config never loads torch, Ray or vLLM.
"""

from __future__ import annotations

import copy
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError, PydanticUndefined


class _Sentinel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


REQUIRED = _Sentinel("required")
# Default of a documented component keyword: whatever the component's own signature says.
COMPONENT_DEFAULT = _Sentinel("component default")


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are typed strictly."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        use_attribute_docstrings=True,
        arbitrary_types_allowed=True,
    )


class ComponentArgs(BaseModel):
    """Documented keyword arguments of a component; only the keys a node sets are checked.

    Its fields default to `COMPONENT_DEFAULT` (the component's own default applies), or to
    the default component's defaults where the config reads a value a node leaves unset
    (`grpo.config.sections.LossArgs`); keys it does not declare are checked against the
    component's signature instead.
    """

    model_config = ConfigDict(extra="allow", strict=True, use_attribute_docstrings=True)


@dataclass(frozen=True)
class ComponentSpec:
    """Marks a field as a ``_component_`` node (or, with ``many``, a non-empty list of them).

    Args:
        args (type[ComponentArgs] | None): Its documented keyword arguments.
        many (bool): A list of nodes rather than one.
    """

    args: type[ComponentArgs] | None = None
    many: bool = False


def _check_node(node: Any) -> dict[str, Any]:
    if not isinstance(node, dict) or "_component_" not in node:
        raise PydanticCustomError(
            "component",
            "expected a mapping with a _component_ key (a dotted import path), got {node}",
            {"node": repr(node)},
        )
    target = node["_component_"]
    if not isinstance(target, str) or not target:
        raise PydanticCustomError(
            "component",
            "_component_: expected a dotted import path, got {target}",
            {"target": repr(target)},
        )
    return node


def _check_node_list(nodes: Any) -> list[dict[str, Any]]:
    # Whether a list may be empty is the section's to say (reward_functions: only beside an
    # environment that scores its episodes itself).
    if not isinstance(nodes, list):
        raise PydanticCustomError("component", "expected a list of _component_ nodes")
    return nodes


def Component(args: type[ComponentArgs] | None = None) -> Any:  # noqa: N802 (a type factory)
    """The annotated type of a ``_component_`` node field, with its documented keywords."""
    return Annotated[Any, AfterValidator(_check_node), ComponentSpec(args)]


ComponentList = Annotated[Any, AfterValidator(_check_node_list), ComponentSpec(many=True)]
"""The type of a field holding a list of ``_component_`` nodes."""

# --------------------------------------------------------------------------------------------
# Reading declarations (for loading, overrides, validation and the reference)
# --------------------------------------------------------------------------------------------


def section_type(info: FieldInfo) -> type[Section] | None:
    """The nested section class of a field, or None."""
    annotation = info.annotation
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation
    return None


def optional_section_type(info: FieldInfo) -> type[Section] | None:
    """The section class of a field, optional ones included (``LoRAConfig | None``), or None."""
    for part in _union_parts(info.annotation):
        if isinstance(part, type) and issubclass(part, Section):
            return part
    return None


def component_spec(info: FieldInfo) -> ComponentSpec | None:
    """The `ComponentSpec` of a component field (optional ones too), or None."""
    metadata = list(info.metadata)
    for part in _union_parts(info.annotation):
        if typing.get_origin(part) is Annotated:
            metadata += part.__metadata__
    for item in metadata:
        if isinstance(item, ComponentSpec):
            return item
    return None


def default_of(info: FieldInfo) -> Any:
    """A field's default (a fresh copy), or `REQUIRED`."""
    if info.default_factory is not None:
        return info.default_factory()  # type: ignore[call-arg]
    if info.default is PydanticUndefined:
        return REQUIRED
    return copy.deepcopy(info.default)


def _union_parts(annotation: Any) -> tuple[Any, ...]:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return typing.get_args(annotation)
    return (annotation,)


def is_open_mapping(info: FieldInfo) -> bool:
    """Whether a field holds a free-form mapping (any key may be set below it)."""
    return any(
        part is dict or typing.get_origin(part) is dict for part in _union_parts(info.annotation)
    )


def type_name(annotation: Any) -> str:
    """Readable name of a field's type: ``int or null``, ``number``, ``one of k1, k2, k3``."""
    names = []
    for part in _union_parts(annotation):
        origin = typing.get_origin(part) or part
        if origin is Literal:
            names.append("one of " + ", ".join(str(choice) for choice in typing.get_args(part)))
        elif origin is Annotated:
            names.append(type_name(typing.get_args(part)[0]))
        else:
            names.append(
                {
                    int: "int",
                    float: "number",
                    bool: "bool",
                    str: "string",
                    dict: "mapping",
                    list: "list",
                    type(None): "null",
                    Any: "any",
                }.get(origin, getattr(origin, "__name__", str(origin)))
            )
    return " or ".join(dict.fromkeys(names))


def constraints_of(info: FieldInfo) -> str:
    """The range of a field as text (``>= 1``, ``> 0, <= 1``), or an empty string."""
    parts = []
    for item in info.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{sign} {value}")
    return ", ".join(parts)
