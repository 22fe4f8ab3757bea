"""The single-turn environment (a run's when it names none): one sampled response per episode,
scored by the run's reward functions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grpo.config.sections import REWARD_TIMEOUT_S
from grpo.envs.base import Episode, Message, MultiTurnEnv
from grpo.envs.protocol import EngineContext, Environment


class SingleTurnEnv(MultiTurnEnv):
    """One policy turn per episode, scored by reward functions.

    Raises:
        ValueError: Without reward functions (nothing would score the episodes).
    """

    def __init__(
        self, reward_functions: Sequence[Any] = (), reward_timeout_s: float = REWARD_TIMEOUT_S
    ):
        if not reward_functions:
            raise ValueError(
                "reward_functions: a run without an environment scores each response with its "
                "reward functions; give at least one"
            )
        super().__init__(
            reward_functions=reward_functions, max_turns=1, reward_timeout_s=reward_timeout_s
        )

    def response_budget(self, max_tokens_per_turn: int) -> int | None:
        """One turn's tokens."""
        return max_tokens_per_turn

    def start(self, context: EngineContext) -> None:
        """Keep the engine's context (there are no environment turns to render)."""
        Environment.start(self, context)

    def env_response(
        self, messages: list[Message], state: dict[str, Any], episode: Episode
    ) -> list[Message] | None:
        """Never asked: an episode ends after its one turn."""
        return None
