"""How a component declares its options: typed dataclasses whose fields carry a doc and a check.

Every section of a run config (``inference:``, ``ref:``, ``training:``, ...) is a kw-only
dataclass that lives next to the component it configures (`grpo.workers.collector` declares
`InferenceConfig`, and so on). Each option is declared once, with `option` (a plain value),
`component` (a ``_component_`` node built by `grpo.config.instantiate`) or `component_list`:

    @dataclass(kw_only=True)
    class InferenceConfig(ConfigSection):
        \"\"\"Generation (vLLM collectors)\"\"\"

        group_size: int = option(8, "Responses per prompt.", check=at_least(2))

The annotation gives the accepted types (``float`` accepts ints, ``bool`` is never a number),
the first argument the one default, and ``check`` the range. From these declarations come the
checks of a YAML config (`grpo.config.validation`), the defaults `load_config` fills in, the
README reference (`grpo.config.reference`), and the checks a typed section runs when it is
built in code (`ConfigSection.__post_init__`).

The `Field` / `Component` / `ComponentList` / `Section` specs below are what the declarations
are read into (`section_of`); the validator walks those.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from grpo.config.errors import ConfigError


class _Sentinel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


REQUIRED = _Sentinel("required")
# Default of a documented component keyword: whatever the component's own signature says.
COMPONENT_DEFAULT = _Sentinel("component default")
# Marks a value whose interpolation failed; the failure is already reported.
UNRESOLVED = _Sentinel("unresolved")

NUMBER = (int, float)
NONE = type(None)

Check = Callable[[Any], "str | None"]

# --------------------------------------------------------------------------------------------
# Specs the validator walks
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """A plain value.

    Args:
        types (tuple[type, ...]): Accepted Python types (``NoneType`` for null). ``float``
            accepts ints; ``bool`` is never taken for a number.
        doc (str): One-line description.
        default (Any): Default filled in when the key is absent; `REQUIRED` if none.
        check (Check | None): Returns what is wrong with a non-null value of the right type,
            or None.
    """

    types: tuple[type, ...]
    doc: str
    default: Any = REQUIRED
    check: Check | None = None


@dataclass(frozen=True)
class Component:
    """A ``_component_`` node built with `grpo.config.instantiate`.

    Args:
        doc (str): One-line description.
        default (Any): Node used when the key is absent: a dict, None (optional), or `REQUIRED`.
        kwargs (Mapping[str, Field]): Documented keyword arguments, checked when present.
            Any other keyword is checked against the component's signature.
    """

    doc: str
    default: Any = REQUIRED
    kwargs: Mapping[str, Field] = field(default_factory=dict)


@dataclass(frozen=True)
class ComponentList:
    """A list of ``_component_`` nodes (e.g. reward functions)."""

    doc: str
    default: Any = REQUIRED


@dataclass(frozen=True)
class Section:
    """A mapping of known keys."""

    doc: str
    fields: Mapping[str, Field | Component | ComponentList | Section]


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def at_least(minimum: float) -> Check:
    """A check that a number is ``>= minimum``."""
    return lambda value: None if value >= minimum else f"must be >= {minimum}, got {value}"


def greater_than(bound: float) -> Check:
    """A check that a number is ``> bound``."""
    return lambda value: None if value > bound else f"must be > {bound}, got {value}"


def one_of(*choices: str) -> Check:
    """A check that a value is one of `choices`, with a did-you-mean hint."""

    def check(value: Any) -> str | None:
        if value in choices:
            return None
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"must be one of {', '.join(choices)}; got {value!r}{hint}"

    return check


def in_unit_interval(value: float) -> str | None:
    """A check that a number is in ``(0, 1]``."""
    return None if 0 < value <= 1 else f"must be in (0, 1], got {value}"


POSITIVE = at_least(1)
NON_NEGATIVE = at_least(0)
# The keys of grpo.models.DTYPES (not imported: this module must stay free of torch).
DTYPE = one_of("fp32", "bf16", "float32", "bfloat16")

# --------------------------------------------------------------------------------------------
# Declaring options
# --------------------------------------------------------------------------------------------


def _default_kwargs(default: Any) -> dict[str, Any]:
    if default is REQUIRED:
        return {}
    if isinstance(default, (dict, list)):  # mutable: each instance gets its own copy
        return {"default_factory": lambda: copy.deepcopy(default)}
    return {"default": default}


def option(default: Any = REQUIRED, doc: str = "", *, check: Check | None = None) -> Any:
    """Declare a plain option of a config section.

    Args:
        default (Any): The option's one default; `REQUIRED` if the config must set it.
        doc (str): One-line description (shown in the README reference and ``grpo validate``).
        check (Check | None): Range or choice check of a non-null value.

    Returns:
        Any: A dataclass field.
    """
    return field(**_default_kwargs(default), metadata={"doc": doc, "check": check})


def component(
    default: Any = REQUIRED, doc: str = "", *, kwargs: Mapping[str, Field] | None = None
) -> Any:
    """Declare a ``_component_`` option (built with `grpo.config.instantiate` where it is used).

    Args:
        default (Any): Default node (a dict with ``_component_``), None (optional, off) or
            `REQUIRED`.
        doc (str): One-line description.
        kwargs (Mapping[str, Field] | None): Documented keyword arguments, checked when present
            (use `keyword` to declare them).

    Returns:
        Any: A dataclass field.
    """
    spec = Component(doc, default, dict(kwargs or {}))
    return field(**_default_kwargs(default), metadata={"doc": doc, "spec": spec})


def component_list(doc: str) -> Any:
    """Declare a required, non-empty list of ``_component_`` nodes.

    Args:
        doc (str): One-line description.

    Returns:
        Any: A dataclass field.
    """
    return field(metadata={"doc": doc, "spec": ComponentList(doc)})


def keyword(types: tuple[type, ...], doc: str, check: Check | None = None) -> Field:
    """A documented keyword of a component (its default is the component's own).

    Args:
        types (tuple[type, ...]): Accepted types.
        doc (str): One-line description.
        check (Check | None): Range or choice check.

    Returns:
        Field: The keyword's spec.
    """
    return Field(types, doc, COMPONENT_DEFAULT, check)


def section(cls: type) -> Any:
    """Declare a nested section whose options are those of the dataclass `cls`."""
    return field(default_factory=cls)


# --------------------------------------------------------------------------------------------
# Reading declarations into specs
# --------------------------------------------------------------------------------------------


def _accepted_types(hint: Any) -> tuple[type, ...]:
    """``int | None`` -> (int, NoneType); ``float`` -> (int, float); ``dict[str, Any]`` -> (dict,)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        parts = typing.get_args(hint)
    else:
        parts = (hint,)
    accepted: list[type] = []
    for part in parts:
        part = typing.get_origin(part) or part
        if part is float:
            accepted += [int, float]
        elif part is not None:
            accepted.append(part)
        else:
            accepted.append(NONE)
    return tuple(dict.fromkeys(accepted))


def _field_default(spec: dataclasses.Field) -> Any:
    if spec.default is not dataclasses.MISSING:
        return spec.default
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return REQUIRED


@functools.cache
def section_of(cls: type) -> Section:
    """The spec of a config dataclass: its options, nested sections and components.

    Args:
        cls (type): A dataclass declared with `option`, `component`, `component_list` and
            `section` fields.

    Returns:
        Section: The spec, with the first line of the class docstring as its title.
    """
    hints = typing.get_type_hints(cls)
    fields: dict[str, Field | Component | ComponentList | Section] = {}
    for spec in dataclasses.fields(cls):
        hint = hints[spec.name]
        if dataclasses.is_dataclass(hint):
            fields[spec.name] = section_of(hint)
        elif "spec" in spec.metadata:
            fields[spec.name] = spec.metadata["spec"]
        else:
            fields[spec.name] = Field(
                _accepted_types(hint),
                spec.metadata.get("doc", ""),
                _field_default(spec),
                spec.metadata.get("check"),
            )
    title = (cls.__doc__ or cls.__name__).strip().splitlines()[0].rstrip(".")
    return Section(title, fields)


def type_name(types_: tuple[type, ...]) -> str:
    """Readable name of accepted types (``int or null``, ``number``)."""
    names = {
        int: "int",
        float: "float",
        bool: "bool",
        str: "string",
        dict: "mapping",
        list: "list",
        NONE: "null",
    }
    if int in types_ and float in types_:
        types_ = tuple(t for t in types_ if t is not int)
        names = {**names, float: "number"}
    return " or ".join(names.get(t, t.__name__) for t in types_)


def type_ok(value: Any, types_: tuple[type, ...]) -> bool:
    """Whether `value` is one of `types_` (ints count as floats; bools never as numbers)."""
    if isinstance(value, bool):
        return bool in types_
    if isinstance(value, int) and float in types_:
        return True
    return isinstance(value, types_)


def field_problem(spec: Field, value: Any) -> str | None:
    """What is wrong with `value` for the option `spec` (type, then range), or None."""
    if value is None and spec.default is REQUIRED:
        return "required, got null"
    if not type_ok(value, spec.types):
        return f"expected {type_name(spec.types)}, got {value!r}"
    if value is not None and spec.check is not None:
        return spec.check(value)
    return None


class ConfigSection:
    """Base of typed config sections: building one checks every option and names each problem.

    Raises:
        ConfigError: From ``__init__``, listing every option whose value has the wrong type or
            is out of range, each as ``ClassName.option: what is wrong``.
    """

    def __post_init__(self) -> None:
        problems = []
        for key, spec in section_of(type(self)).fields.items():
            if isinstance(spec, Field):
                problem = field_problem(spec, getattr(self, key))
                if problem:
                    problems.append(f"{type(self).__name__}.{key}: {problem}")
        if problems:
            raise ConfigError(problems)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> Any:
        """Build the section (and its nested sections) from a validated mapping.

        Args:
            values (Mapping[str, Any]): Plain values, e.g. ``OmegaConf.to_container(cfg.inference)``.

        Returns:
            Any: An instance of `cls`; keys the section does not declare are ignored.
        """
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for spec in dataclasses.fields(cls):
            if spec.name not in values:
                continue
            value, hint = values[spec.name], hints[spec.name]
            if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
                value = hint.from_mapping(value)
            kwargs[spec.name] = value
        return cls(**kwargs)


@functools.cache
def run_schema() -> Section:
    """The spec of a whole run config (`grpo.config.run.RunConfig`).

    Returns:
        Section: Top-level options, one nested section per component.
    """
    # Imported on first use, not at import time: the component modules that declare the
    # sections import grpo.config themselves (for `instantiate`).
    from grpo.config.run import RunConfig

    return section_of(RunConfig)
