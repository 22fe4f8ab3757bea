"""Reward functions and batched scoring with per-call timeouts.

A reward function scores one completion against its gold answer: called with
``(completion, answer)`` it returns a :class:`RewardResult` ``(reward, success)``. It has a
``name`` (its column in ``func_names`` and in the metrics) and a ``failure_reward`` (given when
a call raises, times out or kills its worker). There are two ways to write one, both defined at
module level so that worker processes can unpickle them:

1. A subclass of :class:`RewardFunction` that takes its options as keyword arguments::

       class ShortAnswerReward(RewardFunction):
           name = "short"

           def __init__(self, *, max_chars: int = 200, **kwargs):
               super().__init__(**kwargs)  # name=..., failure_reward=...
               self.max_chars = max_chars

           def __call__(self, completion: str, answer: str) -> RewardResult:
               short = len(completion) <= self.max_chars
               return RewardResult(float(short), short)

2. A plain function wrapped by :func:`reward_function`; its extra keyword arguments are its
   options, and calling the wrapped function with options only returns a configured copy::

       @reward_function(name="short", failure_reward=0.0)
       def short_reward(completion: str, answer: str, max_chars: int = 200):
           return RewardResult(float(len(completion) <= max_chars), len(completion) <= max_chars)

Configs build either with ``_component_`` (the keys are the options)::

    reward_functions:
      - _component_: grpo.rewards.MathCorrectnessReward
        partial_credit: 0.1
      - _component_: grpo.rewards.FormatReward
        think_required: false

:func:`batched_rewards` scores every (function, completion) pair in a :class:`RewardPool` of
worker processes, where a call that hangs is killed after its timeout and a call that crashes
its worker is counted; either gets the function's ``failure_reward``.

Modules: ``base`` (the contract), ``math`` (answer extraction, :class:`MathCorrectnessReward`),
``format`` (:class:`FormatReward`, :class:`TokenPresenceReward`), ``pool`` (reward calls
in the worker processes of `grpo.process_pool`), ``batch`` (:func:`batched_rewards`, :class:`RewardBatch`, :func:`total_reward`).
Group advantages live in `grpo.objective.advantages`, beside the loss.
"""

from grpo.rewards.base import (
    FunctionReward,
    RewardFn,
    RewardFunction,
    RewardResult,
    reward_function,
    reward_name,
)
from grpo.rewards.batch import RewardBatch, batched_rewards, total_reward
from grpo.rewards.format import FormatReward, TokenPresenceReward
from grpo.rewards.math import MathCorrectnessReward, extract_answer, normalize_gold_answer
from grpo.rewards.pool import RewardPool, default_reward_pool

__all__ = [
    "FormatReward",
    "FunctionReward",
    "MathCorrectnessReward",
    "RewardBatch",
    "RewardFn",
    "RewardFunction",
    "RewardPool",
    "RewardResult",
    "TokenPresenceReward",
    "batched_rewards",
    "default_reward_pool",
    "extract_answer",
    "normalize_gold_answer",
    "reward_function",
    "reward_name",
    "total_reward",
]
