"""Tools: plain Python functions with type hints, and the parsing of the model's calls to them.

A call's arguments are checked against the tool's type hints before it runs, so a bad call is an
error turn for the model, not an exception in a worker. Each call format is the one a family's
chat template teaches. Pure Python: tools are unpickled in worker processes.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

CALL_FORMATS = ("json", "llama3_json", "deepseek", "tag")

# Error kinds of a tool call, counted in the episode's stats and the collector's metrics.
PARSE_ERROR = "parse_error"
UNKNOWN_TOOL = "unknown_tool"
BAD_ARGUMENTS = "bad_arguments"
TIMEOUT = "timeout"
CRASH = "crash"
EXCEPTION = "exception"
TOOL_ERROR_KINDS = (PARSE_ERROR, UNKNOWN_TOOL, BAD_ARGUMENTS, TIMEOUT, CRASH, EXCEPTION)

_JSON_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)\n```(?:json)?\n(.*?)\n```<｜tool▁call▁end｜>",
    re.DOTALL,
)
_PYTHON_TAG = "<|python_tag|>"
# Where a turn in each format has made its calls: a policy turn stops there, so the results
# come before the model goes on (the tag format stops at each tool's closing tag).
_CALL_ENDS = {"json": ("</tool_call>",), "llama3_json": (), "deepseek": ("<｜tool▁calls▁end｜>",)}
_SIMPLE_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}


@dataclass
class ToolCall:
    """One call the model wrote: a tool name and its arguments, or why it does not parse."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # a parse error: the call is answered with it


def _import_function(dotted_path: str) -> Callable[..., Any]:
    module_name, _, attr = dotted_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"cannot import tool {dotted_path!r}: {error}") from error


class Tool:
    """A Python function the model may call, checked against its type hints.

    Args:
        fn (Callable | str): A module-level function (or its dotted path; ``async def`` too)
            whose parameters all have type hints among ``int``, ``float``, ``str``, ``bool``;
            ``str()`` of its return is the answer, its docstring's first line its description.
        name (str | None): Name the model calls it by; default the function's name.

    Raises:
        ValueError: If the function cannot be imported, is not module-level, or a parameter
            has no supported type hint (named).
    """

    def __init__(self, fn: Callable[..., Any] | str, name: str | None = None) -> None:
        if isinstance(fn, str):
            fn = _import_function(fn)
        if not callable(fn):
            raise ValueError(f"a tool must be a function, got {type(fn).__name__}")
        qualname = getattr(fn, "__qualname__", "")
        if "<locals>" in qualname or "<lambda>" in qualname:
            raise ValueError(
                f"tool {qualname!r} must be a module-level function: tools run in worker "
                "processes, which import it by name"
            )
        self.fn = fn
        self.name = name or fn.__name__
        hints = typing.get_type_hints(fn)
        self.parameters: dict[str, type] = {}
        self.required: list[str] = []
        for parameter in inspect.signature(fn).parameters.values():
            hint = hints.get(parameter.name)
            if hint not in _SIMPLE_TYPES:
                raise ValueError(
                    f"tool {self.name}: parameter {parameter.name!r} needs a type hint among "
                    f"int, float, str, bool (got {hint!r})"
                )
            self.parameters[parameter.name] = hint
            if parameter.default is inspect.Parameter.empty:
                self.required.append(parameter.name)
        if not self.parameters:
            raise ValueError(f"tool {self.name} takes no parameter; give it at least one")
        self.description = (inspect.getdoc(fn) or self.name).strip().splitlines()[0]

    def __repr__(self) -> str:
        return f"Tool({self.name})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as the function's import path: workers import it.
        return (Tool, (f"{self.fn.__module__}.{self.fn.__qualname__}", self.name))

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema chat templates render in their tool list."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": {
                        name: {"type": _SIMPLE_TYPES[hint]}
                        for name, hint in self.parameters.items()
                    },
                    "required": list(self.required),
                },
            },
        }

    def check_arguments(self, arguments: Mapping[str, Any]) -> str | None:
        """Why ``arguments`` cannot be passed to the tool, or None if they can."""
        if not isinstance(arguments, Mapping):
            return f"arguments of {self.name} must be an object, got {type(arguments).__name__}"
        unknown = sorted(set(arguments) - set(self.parameters))
        if unknown:
            return f"{self.name} takes no argument {unknown[0]!r}; it takes {list(self.parameters)}"
        missing = [name for name in self.required if name not in arguments]
        if missing:
            return f"{self.name} is missing the argument {missing[0]!r}"
        for name, value in arguments.items():
            hint = self.parameters[name]
            ok = isinstance(value, hint) and not (hint is not bool and isinstance(value, bool))
            if hint is float and isinstance(value, int) and not isinstance(value, bool):
                ok = True
            if not ok:
                article = "an" if _SIMPLE_TYPES[hint][0] in "aeiou" else "a"
                return (
                    f"argument {name!r} of {self.name} must be {article} "
                    f"{_SIMPLE_TYPES[hint]}, got {value!r}"
                )
        return None


def check_tools(
    tools: Sequence[Tool | Callable[..., Any] | str | Mapping[str, Any]],
    locate: Callable[[str], Any] | None = None,
) -> tuple[dict[str, Tool], list[str]]:
    """Tools by name, and every problem of the specs that cannot be tools.

    Specs are functions, dotted paths or `Tool` objects; a ``_component_`` mapping is skipped
    (checked when it is built).

    Args:
        locate (Callable[[str], Any] | None): Imports a dotted path, raising with a message
            that names it; None: a plain import.

    Returns:
        tuple: ``{name: Tool}`` of the good specs, and problems as ``tools[i]: what is wrong``.
    """
    by_name: dict[str, Tool] = {}
    index_of: dict[str, int] = {}
    problems: list[str] = []
    for index, spec in enumerate(tools):
        if isinstance(spec, Mapping):
            continue
        try:
            if isinstance(spec, str) and locate is not None:
                spec = locate(spec)
            tool = spec if isinstance(spec, Tool) else Tool(spec)
        except Exception as error:  # an import error of the user's module, an untyped tool
            problems.append(f"tools[{index}]: {error}")
            continue
        if tool.name in by_name:
            problems.append(
                f"tools[{index}]: a second tool named {tool.name!r} (tools[{index_of[tool.name]}])"
            )
            continue
        by_name[tool.name] = tool
        index_of[tool.name] = index
    return by_name, problems


def resolve_tools(tools: Sequence[Tool | Callable[..., Any] | str]) -> dict[str, Tool]:
    """Tools by name, from functions, dotted paths or `Tool` objects.

    Raises:
        ValueError: A tool that `Tool` refuses, or two tools with one name (see `check_tools`).
    """
    by_name, problems = check_tools(tools)
    if problems:
        raise ValueError(problems[0])
    return by_name


def call_stop_strings(call_format: str, tool_names: Sequence[str]) -> tuple[str, ...]:
    """Stop strings that end a policy turn once it has made its calls in ``call_format``.

    Llama 3's calls need none: the model ends such a turn with ``<|eom_id|>`` or
    ``<|eot_id|>``, stop tokens of its own.
    """
    if call_format == "tag":
        return tuple(f"</{name}>" for name in tool_names)
    return _CALL_ENDS[call_format]


def call_format_problem(call_format: str, tool: Tool) -> str | None:
    """Why the model could not call ``tool`` in ``call_format``, or None if it can.

    The ``"tag"`` format passes only the first parameter, so a tool that requires another could
    never be called correctly.
    """
    if call_format != "tag":
        return None
    first = next(iter(tool.parameters))
    others = [name for name in tool.required if name != first]
    if not others:
        return None
    return (
        f"call_format: tag passes the text inside <{tool.name}>...</{tool.name}> as the "
        f"tool's first parameter ({first!r}) only, but {tool.name} also requires "
        f"{', '.join(map(repr, others))}; use call_format: json (or the format of your "
        "model's chat template), or give those parameters defaults"
    )


def _call_from_payload(payload: Any, arguments_key: str) -> ToolCall:
    """A call from a decoded JSON object ``{"name", arguments_key: {...}}``."""
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCall(
            None, error=f'a tool call needs {{"name": ..., "{arguments_key}": {{...}}}}'
        )
    arguments = payload.get(arguments_key, payload.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return ToolCall(payload["name"], arguments if isinstance(arguments, dict) else {"": arguments})


def parse_tool_calls(text: str, call_format: str, tools: Mapping[str, Tool]) -> list[ToolCall]:
    """The tool calls in an assistant turn's text, in order.

    Returns:
        list[ToolCall]: Empty when the turn calls no tool; a call that does not parse has its
        ``error`` set.
    """
    if call_format == "json":
        calls = []
        for body in _JSON_CALL.findall(text):
            try:
                calls.append(_call_from_payload(json.loads(body), "arguments"))
            except json.JSONDecodeError as error:
                calls.append(ToolCall(None, error=f"the tool call is not valid JSON: {error}"))
        return calls
    if call_format == "llama3_json":
        # A turn that is a JSON object is a call; any other turn is the answer.
        body = text.strip().removeprefix(_PYTHON_TAG).strip()
        if not body.startswith("{"):
            return []
        try:
            return [_call_from_payload(json.loads(body), "parameters")]
        except json.JSONDecodeError as error:
            return [ToolCall(None, error=f"the tool call is not valid JSON: {error}")]
    if call_format == "deepseek":
        calls = []
        for kind, name, body in _DEEPSEEK_CALL.findall(text):
            if kind.strip() != "function":
                calls.append(ToolCall(None, error=f"unknown tool call type {kind.strip()!r}"))
                continue
            try:
                arguments = json.loads(body)
            except json.JSONDecodeError as error:
                calls.append(ToolCall(None, error=f"the tool call is not valid JSON: {error}"))
                continue
            calls.append(
                _call_from_payload({"name": name.strip(), "arguments": arguments}, "arguments")
            )
        return calls
    if call_format == "tag":
        if not tools:
            return []
        names = "|".join(re.escape(name) for name in tools)
        calls = []
        for name, body in re.findall(rf"<({names})>(.*?)</\1>", text, flags=re.DOTALL):
            first, hint = next(iter(tools[name].parameters.items()))
            value: Any = body.strip()
            if hint in (int, float):
                try:
                    value = hint(value)
                except ValueError:
                    pass  # left a string: the argument check reports it
            calls.append(ToolCall(name, {first: value}))
        return calls
    raise ValueError(f"call_format must be one of {CALL_FORMATS}, got {call_format!r}")
