"""Checks of an ``environment:`` config node that `grpo validate` runs before any actor starts.

Tools named by dotted path are imported and checked against their type hints here, so a typo
or an untyped parameter is one line at validation, not an error in a collector. No torch.
"""

from __future__ import annotations

from typing import Any

from grpo.envs.tools import call_format_problem, check_tools


def environment_problems(key: str, node: dict[str, Any]) -> list[str]:
    """Problems of an environment node, each as ``key: what is wrong``.

    Args:
        key (str): The node's config key (``environment``).
        node (dict): The node, interpolations resolved.

    Returns:
        list[str]: Empty when the tools import and take typed arguments (for a verifiers
        environment: when the extra is installed and its modules import).
    """
    if node.get("_component_") == "grpo.envs.verifiers_env":
        from grpo.envs.verifiers_adapter import verifiers_problems

        return verifiers_problems(key, node)
    problems = []
    call_format = node.get("call_format")
    if call_format is not None and (problem := call_format_problem(call_format)):
        problems.append(f"{key}.call_format: {problem}")
    tools = node.get("tools")
    if tools is None:
        return problems
    if not isinstance(tools, list) or not tools:
        return [
            *problems,
            f"{key}.tools: expected a list of dotted paths of functions, got {tools!r}",
        ]
    _, tool_problems = check_tools(tools)
    return problems + [f"{key}.{problem}" for problem in tool_problems]
