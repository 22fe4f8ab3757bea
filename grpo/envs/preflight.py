"""Checks of an ``environment:`` config node that `grpo validate` runs before any actor starts.

Tools named by dotted path are imported and checked against their type hints here, so a typo
or an untyped parameter is one line at validation, not an error in a collector. No torch.
"""

from __future__ import annotations

from typing import Any

from grpo.envs.tools import CALL_FORMATS, Tool


def environment_problems(key: str, node: dict[str, Any]) -> list[str]:
    """Problems of an environment node, each as ``key: what is wrong``.

    Args:
        key (str): The node's config key (``environment``).
        node (dict): The node, interpolations resolved.

    Returns:
        list[str]: Empty when the tools import and take typed arguments.
    """
    problems = []
    call_format = node.get("call_format")
    if call_format is not None and call_format not in CALL_FORMATS:
        problems.append(
            f"{key}.call_format: {call_format!r} is not one of {', '.join(CALL_FORMATS)}"
        )
    tools = node.get("tools")
    if tools is None:
        return problems
    if not isinstance(tools, list) or not tools:
        return [
            *problems,
            f"{key}.tools: expected a list of dotted paths of functions, got {tools!r}",
        ]
    names: dict[str, int] = {}
    for index, spec in enumerate(tools):
        if not isinstance(spec, str):
            continue  # a _component_ node or an object: checked when it is built
        try:
            tool = Tool(spec)
        except Exception as error:  # an import error of the user's module, an untyped tool
            problems.append(f"{key}.tools[{index}]: {error}")
            continue
        if tool.name in names:
            problems.append(
                f"{key}.tools[{index}]: a second tool named {tool.name!r} "
                f"(tools[{names[tool.name]}])"
            )
        names[tool.name] = index
    return problems
