"""Format rewards: the ``<think>...</think><answer>...</answer>`` layout, and a toy token reward."""

from __future__ import annotations

import re

from grpo.rewards.base import RewardFunction, RewardResult
from grpo.rewards.math import ANSWER_TAG_RE

# Text containing no <think>, </think>, <answer> or </answer> tag: rejects nested blocks.
_UNTAGGED = r"(?:(?!</?(?:think|answer)>).)*"
_THINK_BLOCK = rf"<think>{_UNTAGGED}</think>\s*"
_ANSWER_BLOCK = rf"<answer>(?P<answer>{_UNTAGGED})</answer>"


class FormatReward(RewardFunction):
    """Reward for the ``<think>...</think><answer>...</answer>`` format.

    The full format is one think block then one non-empty answer block, no tags nested, and
    scores ``format_reward`` (success); a non-empty ``<answer>`` block anywhere else scores
    ``answer_tag_reward``; else 0.0.

    Args:
        strict (bool): Require the blocks to be the whole completion.
    """

    name = "format"

    def __init__(
        self,
        *,
        think_required: bool = True,
        strict: bool = True,
        format_reward: float = 1.0,
        answer_tag_reward: float = 0.0,
        name: str | None = None,
        failure_reward: float = 0.0,
    ) -> None:
        super().__init__(name=name, failure_reward=failure_reward)
        self.think_required = think_required
        self.strict = strict
        self.format_reward = float(format_reward)
        self.answer_tag_reward = float(answer_tag_reward)
        think = _THINK_BLOCK if think_required else f"(?:{_THINK_BLOCK})?"
        pattern = think + _ANSWER_BLOCK
        self._pattern = re.compile(rf"\s*{pattern}\s*" if strict else pattern, re.DOTALL)

    def __call__(self, completion: str, answer: str) -> RewardResult:
        match = (
            self._pattern.fullmatch(completion) if self.strict else self._pattern.search(completion)
        )
        if match is not None and match.group("answer").strip():
            return RewardResult(self.format_reward, True)
        if any(content.strip() for content in ANSWER_TAG_RE.findall(completion)):
            return RewardResult(self.answer_tag_reward, False)
        return RewardResult(0.0, False)

    def __repr__(self) -> str:
        return (
            f"FormatReward(think_required={self.think_required}, strict={self.strict}, "
            f"format_reward={self.format_reward}, answer_tag_reward={self.answer_tag_reward})"
        )


class TokenPresenceReward(RewardFunction):
    """``reward`` if the completion contains ``token``, else ``absent_reward`` (a toy reward).

    Raises:
        ValueError: If ``token`` is empty.
    """

    name = "token_presence"

    def __init__(
        self,
        *,
        token: str,
        reward: float = 1.0,
        absent_reward: float = 0.0,
        name: str | None = None,
        failure_reward: float = 0.0,
    ) -> None:
        super().__init__(name=name, failure_reward=failure_reward)
        if not token:
            raise ValueError("TokenPresenceReward: token must be a non-empty string")
        self.token = token
        self.reward = float(reward)
        self.absent_reward = float(absent_reward)

    def __call__(self, completion: str, answer: str) -> RewardResult:
        present = self.token in completion
        return RewardResult(self.reward if present else self.absent_reward, present)
