"""What a ``reward_functions`` node may name, and which keys it may set: one rule for
``grpo validate`` (which reads the function's source, or imports it) and for the run (which
builds it, `grpo.rewards.build_reward_function`), so the two never disagree.

A node names a class (built with the node's keys, a `grpo.rewards.RewardFunction` subclass
as a rule), a function decorated with ``grpo.rewards.reward_function``, or a plain function
in one of two forms, told apart by its first parameter:

* per sample, ``fn(completion, answer, **columns)``, returning a float, a bool, a
  ``(reward, success)`` tuple or a ``RewardResult``;
* batched, as TRL writes them, ``fn(completions, prompts=..., **columns)`` (or ``prompts``
  first), returning a list of floats.

A plain function of neither form is a factory when the node gives every parameter it
requires; otherwise it is refused in one line that says what to write.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Collection, Sequence
from typing import Literal

Form = Literal["per_sample", "batched"]

# The first parameter of a per-sample function, and those of a batched one (TRL's names).
PER_SAMPLE_FIRST = "completion"
BATCHED_FIRST = ("completions", "prompts")
# Parameters a batched call fills itself: not options, not columns.
BATCHED_FILLED = frozenset(BATCHED_FIRST)
# Keys every reward function node may set.
COMMON_OPTIONS = ("name", "failure_reward")
# The key of a reward function node: ``reward_functions[0]``, ``environment.reward_functions[1]``.
REWARD_NODE_KEY = re.compile(r"(^|\.)reward_functions\[\d+\]$")

WHAT_TO_WRITE = (
    "write fn(completion, answer, **columns) returning a float, a bool or (reward, success); "
    "TRL's fn(completions, **kwargs) returning a list of floats; or a "
    "grpo.rewards.RewardFunction subclass"
)

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def is_reward_node_key(key: str) -> bool:
    """Whether a config key holds one reward function's node."""
    return bool(REWARD_NODE_KEY.search(key))


def scoring_form(parameters: Sequence[inspect.Parameter], decorated: bool = False) -> Form | None:
    """How a function scores, read from its parameters; None if it is neither form.

    Args:
        decorated (bool): It is wrapped by ``reward_function``, which makes any function that
            is not batched a per-sample one (its first two parameters are the completion and
            the answer, whatever their names).

    Returns:
        "per_sample", "batched" or None.
    """
    positional = [p.name for p in parameters if p.kind in _POSITIONAL]
    keyword_only = [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
    first = positional[0] if positional else None
    if first in BATCHED_FIRST or (first is None and "completions" in keyword_only):
        return "batched"
    if first == PER_SAMPLE_FIRST or decorated:
        return "per_sample"
    return None


def option_parameters(
    parameters: Sequence[inspect.Parameter], form: Form
) -> tuple[list[inspect.Parameter], bool]:
    """The parameters a node's keys (or an example's columns) may fill, and whether the
    function takes ``**kwargs``.

    Per sample: every keyword parameter after the completion and the answer. Batched: every
    keyword parameter but ``completions`` and ``prompts``.
    """
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    if form == "per_sample":
        rest = list(parameters)[2:]
    else:
        rest = [p for p in parameters if p.name not in BATCHED_FILLED]
    return [p for p in rest if p.kind in _KEYWORD], takes_any


def option_names(parameters: Sequence[inspect.Parameter], form: Form) -> set[str] | None:
    """Keys a node naming this function may set; None when it takes ``**kwargs`` (any)."""
    options, takes_any = option_parameters(parameters, form)
    if takes_any:
        return None
    return {*COMMON_OPTIONS, *(p.name for p in options)}


def _shown(target: str, parameters: Sequence[inspect.Parameter]) -> str:
    names = []
    for parameter in parameters:
        prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
        names.append(prefix.get(parameter.kind, "") + parameter.name)
    return f"{target}({', '.join(names)})"


def plain_function_problem(
    target: str, parameters: Sequence[inspect.Parameter], keys: Collection[str]
) -> str | None:
    """Why a plain function named by a reward function node cannot be used, or None.

    ``keys`` are the node's keys other than ``_component_``.

    Returns:
        str | None: One line saying what to write; None for a function that scores (either
        form) or a factory the node gives every required parameter.
    """
    if scoring_form(parameters) is not None:
        return None
    required = [
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    missing = [name for name in required if name not in keys]
    if not missing:
        return None  # a factory: called with the node's keys, it returns the reward function
    return f"{_shown(target, parameters)} is not a reward function: {WHAT_TO_WRITE}"


def function_parameters(component: object) -> list[inspect.Parameter] | None:
    """The parameters of an imported plain function; None for anything else (a class, a
    decorated reward function, a callable object: those are built by calling them)."""
    if not inspect.isfunction(component):
        return None
    return list(inspect.signature(component).parameters.values())


def reward_node_check(
    target: str, parameters: Sequence[inspect.Parameter], decorated: bool, keys: Collection[str]
) -> tuple[str | None, set[str] | None]:
    """Whether a reward function node naming a function is usable, and the keys it may set.

    Returns:
        tuple: The problem (one line, see `plain_function_problem`) or None, and the keys the
        node may set (None: any, or refused).
    """
    form = scoring_form(parameters, decorated)
    takes_answer = len([p for p in parameters if p.kind in _POSITIONAL]) >= 2 or any(
        p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters
    )
    if form == "per_sample" and not decorated and not takes_answer:
        # Called as fn(completion, answer): every call would raise.
        return f"{_shown(target, parameters)} takes no answer: {WHAT_TO_WRITE}", None
    if form is not None:
        return None, option_names(parameters, form)
    problem = plain_function_problem(target, parameters, keys)
    if problem is not None:
        return problem, None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None, None
    return None, {p.name for p in parameters if p.kind in _KEYWORD}
