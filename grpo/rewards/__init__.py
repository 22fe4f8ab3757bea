"""Reward functions and batched scoring with per-call timeouts.

A reward function scores one completion against its gold answer under a ``name`` and gives
its ``failure_reward`` when a call raises, times out or kills its worker. The forms a reward
may take and how configs name them are in docs/data-and-rewards.md; :func:`batched_rewards`
scores a batch in a :class:`RewardPool` of worker processes.
"""

from grpo.rewards.base import (
    BatchedFunctionReward,
    FunctionReward,
    RewardFn,
    RewardFunction,
    RewardResult,
    as_reward_function,
    build_reward_function,
    reward_function,
    reward_name,
)
from grpo.rewards.batch import RewardBatch, batched_rewards, total_reward
from grpo.rewards.calls import RewardCalls
from grpo.rewards.format import FormatReward, TokenPresenceReward
from grpo.rewards.math import MathCorrectnessReward, extract_answer, normalize_gold_answer
from grpo.rewards.pool import RewardPool, default_reward_pool

__all__ = [
    "BatchedFunctionReward",
    "FormatReward",
    "FunctionReward",
    "MathCorrectnessReward",
    "RewardBatch",
    "RewardCalls",
    "RewardFn",
    "RewardFunction",
    "RewardPool",
    "RewardResult",
    "TokenPresenceReward",
    "as_reward_function",
    "batched_rewards",
    "build_reward_function",
    "default_reward_pool",
    "extract_answer",
    "normalize_gold_answer",
    "reward_function",
    "reward_name",
    "total_reward",
]
