"""A component's options: declared once, on its constructor or factory, and checked from there.

An option is a keyword argument typed ``Annotated[type, Field(...)]`` (alone or ``| None``),
of an environment's constructor or a dataset factory. The component (`checked_options` on an
``__init__``, `checked_arguments` on a function) and ``grpo validate`` (`grpo.preflight`) check
values with `option_problems`, strictly like every config section, so both refuse the same
values with the same words. A subclass inherits its bases' options; its own declaration wins.
"""

from __future__ import annotations

import collections.abc
import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import ConfigDict, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

Init = TypeVar("Init", bound=Callable[..., None])
Function = TypeVar("Function", bound=Callable[..., Any])

_STRICT = ConfigDict(strict=True, arbitrary_types_allowed=True)
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
_NAMES = {int: "an int", float: "a number", str: "a string", bool: "true or false"}
_PLURALS = {int: "ints", float: "numbers", str: "strings", bool: "booleans"}


def option_declarations(component: Any) -> dict[str, Any]:
    """The options of a class (its ``__init__`` and its bases') or of a function, by name.

    The first class in the method resolution order that declares a name wins.
    """
    if inspect.isclass(component):
        functions = [
            klass.__dict__["__init__"]
            for klass in component.__mro__
            if klass is not object and "__init__" in klass.__dict__
        ]
    elif callable(component):
        functions = [component]
    else:
        return {}
    declared: dict[str, Any] = {}
    for function in functions:
        for name, hint in _hints(function).items():
            if name not in declared and _is_option(hint):
                declared[name] = hint
    return declared


def option_problems(component: Any, values: Mapping[str, Any]) -> list[str]:
    """What is wrong with the values of a component's options, one line per option.

    Keyword arguments in ``values`` that are no option are ignored.

    Returns:
        list[str]: ``name: expected <type and bounds>, got <value>``, in the order of
        ``values``.
    """
    declared = option_declarations(component)
    problems = []
    for name, value in values.items():
        hint = declared.get(name)
        if hint is None:
            continue
        try:
            TypeAdapter(hint, config=_STRICT).validate_python(value)
        except ValidationError:
            problems.append(f"{name}: expected {describe(hint)}, got {value!r}")
    return problems


def checked_options(init: Init) -> Init:
    """Decorate an ``__init__`` to check its options' values before it runs.

    Raises:
        ValueError: From the decorated ``__init__``, naming the class and each bad option.
    """
    signature = inspect.signature(init)

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        # Only what the caller gave: the declared defaults are the author's.
        given = {name: value for name, value in bound.arguments.items() if name != "self"}
        problems = option_problems(init, given)
        if problems:
            raise ValueError(f"{type(self).__name__}: {'; '.join(problems)}")
        init(self, *args, **kwargs)

    return checked  # type: ignore[return-value]


def checked_arguments(function: Function) -> Function:
    """Decorate a factory (a dataset's) to check its options' values before it runs.

    Raises:
        ValueError: From the decorated function, naming it and each bad option.
    """
    signature = inspect.signature(function)

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        given = dict(signature.bind(*args, **kwargs).arguments)
        problems = option_problems(function, given)
        if problems:
            raise ValueError(f"{function.__name__}: {'; '.join(problems)}")
        return function(*args, **kwargs)

    return checked  # type: ignore[return-value]


def describe(hint: Any) -> str:
    """An option's type and bounds in words: ``an int >= 1 or null``, ``one of json, tag``."""
    parts = _union_parts(hint)
    words = [_describe_one(part) for part in parts if part is not type(None)]
    if type(None) in parts:
        words.append("null")
    return " or ".join(words)


def _describe_one(hint: Any) -> str:
    bounds = []
    if typing.get_origin(hint) is Annotated:
        hint, *metadata = typing.get_args(hint)
        for item in metadata:
            for constraint in item.metadata if isinstance(item, FieldInfo) else [item]:
                bounds += [
                    f"{sign} {getattr(constraint, attr)}"
                    for attr, sign in _BOUNDS
                    if getattr(constraint, attr, None) is not None
                ]
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            return describe(hint)
    origin = typing.get_origin(hint) or hint
    if origin is Literal:
        return "one of " + ", ".join(str(choice) for choice in typing.get_args(hint))
    if origin in (list, tuple, collections.abc.Sequence):
        element = (typing.get_args(hint) or (Any,))[0]
        name = "a list of " + _PLURALS.get(element, "values")
    elif origin in (dict, collections.abc.Mapping):
        name = "a mapping"
    else:
        name = _NAMES.get(origin, getattr(origin, "__name__", str(origin)))
    return " ".join([name, ", ".join(bounds)]) if bounds else name


def _union_parts(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _is_option(hint: Any) -> bool:
    """Whether a hint declares an option: ``Annotated[T, Field(...)]``, alone or ``| None``."""
    return any(
        typing.get_origin(part) is Annotated
        and any(isinstance(item, FieldInfo) for item in typing.get_args(part)[1:])
        for part in _union_parts(hint)
    )


def _hints(function: Any) -> dict[str, Any]:
    """A function's parameter hints, evaluated; one that does not evaluate is left out."""
    function = inspect.unwrap(function)
    try:
        hints = typing.get_type_hints(function, include_extras=True)
    except Exception:  # one hint names what its module imports only for type checkers
        hints = {}
        namespace = getattr(function, "__globals__", {})
        for name, raw in getattr(function, "__annotations__", {}).items():
            try:
                hints[name] = eval(raw, namespace) if isinstance(raw, str) else raw
            except Exception:  # not an option this module can read: left unchecked
                continue
    hints.pop("return", None)
    return hints
