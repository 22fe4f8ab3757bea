"""Checks of an ``environment:`` config node that `grpo validate` runs before any actor starts.

Options are checked against the constructor's own declarations and tools against their type
hints, so a bad value is one line at validation, not an error in a collector. No torch.
"""

from __future__ import annotations

import importlib
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any

from grpo.config.options import option_problems
from grpo.config.run import value_at
from grpo.envs.protocol import Environment
from grpo.envs.tools import call_format_problem, check_tools


def environment_problems(
    key: str, node: dict[str, Any], locate: Callable[[str], Any] | None = None
) -> list[str]:
    """Problems of an environment node, each as ``key: what is wrong``.

    Args:
        key (str): The node's config key (``environment``).
        node (dict): The node, interpolations resolved.
        locate (Callable[[str], Any] | None): Imports a tool's dotted path (`check_tools`).
    """
    if node.get("_component_") == "grpo.envs.verifiers_env":
        from grpo.envs.verifiers_adapter import verifiers_problems

        return verifiers_problems(key, node)
    problems = []
    component = _component(node.get("_component_"), locate)
    if component is not None:
        arguments = {name: value for name, value in node.items() if name != "_component_"}
        problems += [f"{key}.{problem}" for problem in option_problems(component, arguments)]
    if not problems and component is not None:
        from grpo.envs.reasoning_gym import ReasoningGymEnv, task_problems

        if inspect.isclass(component) and issubclass(component, ReasoningGymEnv):
            # Task names and configs, checked by reasoning-gym itself (did-you-mean).
            problems += task_problems(node.get("tasks"), f"{key}.tasks")
        from grpo.envs.textarena_env import TextArenaEnv, game_problems

        if inspect.isclass(component) and issubclass(component, TextArenaEnv):
            # The game's name (did-you-mean) and that it starts with one player.
            problems += game_problems(node.get("game"), f"{key}.game")
        from grpo.envs.agent_env import AgentEnv, agent_problem

        if inspect.isclass(component) and issubclass(component, AgentEnv):
            # The agent imports, is an async def and takes (client, example).
            if (problem := agent_problem(node.get("agent"))) is not None:
                problems.append(f"{key}.agent: {problem}")
    tools = node.get("tools")
    if tools is None:
        return problems
    if not isinstance(tools, list) or not tools:
        return [
            *problems,
            f"{key}.tools: expected a list of dotted paths of functions, got {tools!r}",
        ]
    by_name, tool_problems = check_tools(tools, locate)
    call_format = node.get("call_format", _default(component, "call_format"))
    for tool in by_name.values():
        if problem := call_format_problem(call_format, tool):
            tool_problems.append(problem)
    return problems + [f"{key}.{problem}" for problem in tool_problems]


def _default(component: Any, name: str) -> Any:
    """The default of the component's keyword ``name``, or None."""
    try:
        parameter = inspect.signature(component).parameters.get(name)
    except (TypeError, ValueError):  # no component, or no signature to read
        return None
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return None
    return parameter.default


def environment_class(
    node: Any, locate: Callable[[str], Any] | None = None
) -> type[Environment] | None:
    """The `Environment` class an ``environment:`` node builds: its ``_component_``, or the
    return annotation of a factory (``grpo.envs.verifiers_env`` -> `VerifiersEnv`).

    Returns:
        type[Environment] | None: None without a node, or when the component does not import
        or names no environment class (the component check reports that).
    """
    if not isinstance(node, Mapping):
        return None
    component = _component(node.get("_component_"), locate)
    if component is not None and not inspect.isclass(component):
        try:
            component = typing.get_type_hints(component).get("return")
        except Exception:  # unresolvable annotations: nothing to read
            return None
    if inspect.isclass(component) and issubclass(component, Environment):
        return component
    return None


def brings_held_out_rows(node: Any, locate: Callable[[str], Any] | None = None) -> bool:
    """Whether an ``environment:`` node generates held-out rows of its own (its class
    `Environment.brings_held_out`, with an ``eval_size`` above 0): the held-out set of a run
    whose ``eval_dataset`` is null."""
    environment = environment_class(node, locate)
    return environment is not None and _held_out_rows(environment, node)


def _held_out_rows(environment: type[Environment], node: Mapping[str, Any]) -> bool:
    """`brings_held_out_rows` of a node whose class is known."""
    return (
        environment.brings_held_out
        and node.get("eval_size", _default(environment, "eval_size")) != 0
    )


def data_problems(
    values: Mapping[str, Any], locate: Callable[[str], Any] | None = None
) -> list[str]:
    """What a run with an environment lacks or has too much of, by what its class says it
    brings (`Environment.brings_tasks`, ``brings_held_out``, ``scored_by_reward_functions``):
    ``dataset``, ``eval_dataset`` for ``eval_every_n_steps``, and ``reward_functions``.

    Args:
        values (Mapping): The run config as plain values; ``environment`` is a node.

    Returns:
        list[str]: Each problem as ``key: what is wrong``; [] when the component does not
        import (the component check reports that).
    """
    node = values.get("environment")
    environment = environment_class(node, locate)
    if environment is None:
        return []
    path = node["_component_"]
    problems = []
    if values.get("dataset") is None and not environment.brings_tasks:
        problems.append(
            f"dataset: required key is missing (environment._component_ {path} plays the "
            "dataset's rows; only an environment with its own tasks, such as "
            "grpo.envs.ReasoningGymEnv, runs without one)"
        )
    if values.get("dataset") is not None and environment.brings_tasks:
        # Its rows carry the task and metadata its scorer reads; a dataset's would not (a
        # verifiers taskset's would be played as the tasks at their indices).
        problems.append(
            f"dataset: environment._component_ {path} generates its own tasks, which are the "
            "data; set dataset: null (or dataset=null on the command line)"
        )
    evaluates = value_at(values, "eval_every_n_steps", (int,)) is not None
    if evaluates and environment.brings_tasks and not environment.brings_held_out:
        # Evaluation plays held-out rows beside the training tasks; it has none, and an
        # eval_dataset's rows would lack what its scorer reads.
        problems.append(
            f"eval_every_n_steps: held-out evaluation scores eval_dataset's examples, but "
            f"environment._component_ {path} plays only its own tasks, which have no "
            "held-out split here; set eval_every_n_steps: null (their reward is in the "
            "training metrics)"
        )
    elif evaluates and values.get("eval_dataset") is None:
        if not environment.brings_held_out:
            problems.append("eval_every_n_steps: set, but eval_dataset is null")
        elif not _held_out_rows(environment, node):
            problems.append(
                "eval_every_n_steps: set, but environment.eval_size is 0 and eval_dataset is "
                "null: there is no held-out row to evaluate on; give eval_size > 0 (or "
                "eval_every_n_steps: null)"
            )
    if values.get("reward_functions") == [] and environment.scored_by_reward_functions:
        problems.append(
            f"reward_functions: empty, but environment._component_ {path} scores its episodes "
            "with them; give at least one"
        )
    return problems


def bound_advice(environment: Any, locate: Callable[[str], Any] | None = None) -> str:
    """The keys that bound a sequence's length, for a run with ``environment`` (a node, or
    None): the episode budget only where the environment has one (a `MultiTurnEnv`'s
    ``max_episode_tokens``)."""
    if not isinstance(environment, Mapping):
        return "inference.max_prompt_tokens"
    from grpo.envs.base import MultiTurnEnv

    kind = environment_class(environment, locate)
    if kind is not None and not issubclass(kind, MultiTurnEnv):
        return "inference.engine_args.max_model_len"
    return (
        "environment.max_episode_tokens and inference.max_prompt_tokens, or "
        "inference.engine_args.max_model_len"
    )


def _component(path: Any, locate: Callable[[str], Any] | None) -> Any:
    """The environment class (or factory) a node names, or None if it does not import.

    Whether it imports is the component check's to report.
    """
    if not isinstance(path, str) or "." not in path:
        return None
    try:
        if locate is not None:
            return locate(path)
        module, _, attribute = path.rpartition(".")
        return getattr(importlib.import_module(module), attribute)
    except Exception:  # a missing or broken module: reported by the component check
        return None


def chat_template_problems(
    key: str,
    template: dict[str, Any],
    environment: dict[str, Any],
    base_model_path: str | None = None,
) -> list[str]:
    """Whether environment turns can extend the sampled tokens with a chat prompt template.

    Loads the model folder's tokenizer (no torch model) and checks its chat template for the
    roles the environment answers with; plain templates need no check.

    Args:
        template (dict): The node; checked when it is a ``grpo.data.ChatTemplate``.
        base_model_path (str | None): The model folder when the template names none.
    """
    component = template.get("_component_")
    if not isinstance(component, str) or component.rpartition(".")[2] != "ChatTemplate":
        return []
    model_dir = template.get("model_dir", base_model_path)
    kwargs = template.get("chat_template_kwargs") or {}
    if not isinstance(model_dir, str) or not isinstance(kwargs, dict):
        return []  # reported by the template's own checks
    from grpo.envs.render import ENV_ROLES, chat_template_problem
    from grpo.models.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(model_dir)
    except (OSError, ValueError):
        return []  # a missing or broken folder is the model check's to report
    environment_class = _component(environment.get("_component_"), None)
    roles = getattr(environment_class, "env_roles", ENV_ROLES)
    problem = chat_template_problem(tokenizer, kwargs, roles)
    return [] if problem is None else [f"{key}: {problem}"]
