"""reasoning-gym's own score of a response, as a reward function; reasoning-gym (the ``hub``
extra) is imported when a call scores."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from grpo.rewards.base import RewardFunction, RewardResult

# The name the score is logged and weighed under (``ref.reward_weights``).
REWARD_NAME = "reasoning_gym"


@functools.lru_cache(maxsize=64)
def _scorer(task: str, config_json: str) -> Any:
    """The ``score_answer`` of a task built with its config, once per worker process."""
    from reasoning_gym import create_dataset

    return create_dataset(task, size=1, seed=0, **json.loads(config_json)).score_answer


class ReasoningGymReward(RewardFunction):
    """reasoning-gym's own score of a response: its task's ``score_answer`` on the last
    ``<answer>...</answer>`` block.

    Args:
        config (Mapping | None): Per task, the reasoning-gym config its scorer is built with;
            None: each task's defaults.
    """

    name = REWARD_NAME

    def __init__(self, *, config: Mapping[str, Mapping[str, Any]] | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.config = {task: dict(options) for task, options in (config or {}).items()}

    def __call__(
        self,
        completion: str,
        answer: str,
        question: str = "",
        metadata: Mapping[str, Any] | None = None,
        task: str = "",
    ) -> RewardResult:
        """Score one response.

        Raises:
            ValueError: If the example names no task.
        """
        if not task:
            raise ValueError("ReasoningGymReward scores rows with a 'task' column")
        from reasoning_gym.utils import extract_answer

        config = json.dumps(self.config.get(task, {}), sort_keys=True)
        entry = {"question": question, "answer": answer, "metadata": dict(metadata or {})}
        score = float(_scorer(task, config)(extract_answer(completion), entry))
        return RewardResult(score, score >= 1.0)
