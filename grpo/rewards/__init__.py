"""Reward functions and batched scoring with per-call timeouts.

A reward function scores one completion against its gold answer. It has a ``name`` (its
column in ``func_names`` and in the metrics) and a ``failure_reward`` (given when a call
raises, times out or kills its worker). There are three ways to write one, each at module
level so that worker processes can import it:

1. A plain function, as a config names it, no decorator needed. Per sample, it takes the
   completion and the gold answer first and returns a float (success: reward above 0), a
   bool, a ``(reward, success)`` tuple or a :class:`RewardResult`::

       def short(completion: str, answer: str, max_chars: int = 200) -> float:
           return float(len(completion) <= max_chars)

   Or batched, as TRL writes them (first parameter ``completions`` or ``prompts``), returning
   one float per completion; ``None`` for a completion means the function does not apply to
   it (it adds 0 and is no failure)::

       def short_reward(completions: list[str], **kwargs) -> list[float]:
           return [float(len(c) <= 200) for c in completions]

   Each call scores one completion within the per-call timeout, so ``completions`` holds one
   completion (its text, as TRL gives a plain-text dataset's), ``prompts`` its prompt as the
   model saw it, and every other column a list of its one value
   (:class:`BatchedFunctionReward`).

2. A subclass of :class:`RewardFunction` that takes its options as keyword arguments::

       class ShortAnswerReward(RewardFunction):
           name = "short"

           def __init__(self, *, max_chars: int = 200, **kwargs):
               super().__init__(**kwargs)  # name=..., failure_reward=...
               self.max_chars = max_chars

           def __call__(self, completion: str, answer: str) -> RewardResult:
               short = len(completion) <= self.max_chars
               return RewardResult(float(short), short)

3. A function wrapped by :func:`reward_function`, to give it a name or failure reward of its
   own; calling the wrapped function with options only returns a configured copy::

       @reward_function(name="short", failure_reward=0.0)
       def short_reward(completion: str, answer: str, max_chars: int = 200):
           return RewardResult(float(len(completion) <= max_chars), len(completion) <= max_chars)

A function receives the example's other dataset columns as keyword arguments when it takes
them, by name or with ``**kwargs`` (``def score(completion, answer, metadata)`` gets the
row's ``metadata``; ``question`` and the rendered ``prompt`` are columns too); a parameter a
config sets is an option, not a column. Configs build any of them with ``_component_`` (the
other keys are options, and ``name`` / ``failure_reward``); ``grpo validate`` and the run
accept and refuse the same nodes (`grpo.config.reward_forms`, :func:`build_reward_function`)::

    reward_functions:
      - _component_: grpo.rewards.MathCorrectnessReward
        partial_credit: 0.1
      - _component_: my_rewards.short
        max_chars: 120

:func:`batched_rewards` scores every (function, completion) pair in a :class:`RewardPool` of
worker processes, where a call that hangs is killed after its timeout and a call that crashes
its worker is counted; either gets the function's ``failure_reward``, and a call that raises
is named by its exception and the line of the function's code that raised. A function that
fails nearly every call stops the run (`grpo.orchestrator.reward_failures`, fed by
:class:`RewardCalls`).

Modules: ``base`` (the contract), ``math`` (answer extraction, :class:`MathCorrectnessReward`),
``format`` (:class:`FormatReward`, :class:`TokenPresenceReward`), ``pool`` (reward calls
in the worker processes of `grpo.process_pool`), ``batch`` (:func:`batched_rewards`,
:class:`RewardBatch`, :func:`total_reward`), ``calls`` (:class:`RewardCalls`, a batch's
calls for the driver's guard). Group advantages live in `grpo.objective.advantages`, beside
the loss.
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
