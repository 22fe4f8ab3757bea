"""Build a run's environment from its config: the ``environment:`` node, or the single-turn
environment of the run's reward functions when it names none."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from grpo.envs.protocol import Environment


def build_environment(
    environment: Any, reward_functions: Sequence[Any], reward_timeout_s: float
) -> Environment:
    """The run's environment, built from its ``_component_`` node if need be.

    The node gets the run's ``reward_functions`` and ``reward_timeout_s`` unless it names its
    own; without a node the environment is a `grpo.envs.SingleTurnEnv` of the run's rewards.

    Raises:
        ConfigError: If it cannot be built, naming the key and the reason.
        TypeError: If ``environment`` is an object that is no `Environment`.
    """
    from grpo.config import ConfigError, instantiate

    if environment is None:
        from grpo.envs.single_turn import SingleTurnEnv

        functions = _built_rewards(reward_functions, "reward_functions")
        try:
            return SingleTurnEnv(functions, reward_timeout_s=reward_timeout_s)
        except ValueError as error:
            raise ConfigError(str(error)) from error
    if isinstance(environment, Mapping):
        node = dict(environment)
        own = "reward_functions" in node
        node.setdefault("reward_functions", list(reward_functions))
        node.setdefault("reward_timeout_s", reward_timeout_s)
        if isinstance(node["reward_functions"], Sequence):
            # By the rule for reward functions: a plain function scores, it is not called with
            # the node's keys.
            where = "environment.reward_functions" if own else "reward_functions"
            node["reward_functions"] = _built_rewards(node["reward_functions"], where)
        try:
            environment = instantiate(node, _key_="environment")
        except ConfigError:
            raise
        except Exception as error:  # the environment's own check of its arguments
            raise ConfigError(f"environment: {error}") from error
    if not isinstance(environment, Environment):
        raise TypeError(
            f"environment: {type(environment).__name__} is not a grpo.envs.Environment "
            "(subclass MultiTurnEnv, ToolEnv or Environment)"
        )
    return environment


def _built_rewards(reward_functions: Sequence[Any], key: str) -> list[Any]:
    """Reward functions built from their nodes (`grpo.rewards.build_reward_function`); built
    ones as they are."""
    from grpo.rewards import build_reward_function

    return [
        build_reward_function(fn, f"{key}[{index}]") if isinstance(fn, Mapping) else fn
        for index, fn in enumerate(reward_functions)
    ]
