"""Reward functions the reward pool's tests run in worker processes, broken in the ways a
user's can be. Workers import this module by name: it imports no torch (nor the test modules,
which do), so a worker that restarts after a timeout takes milliseconds, as in a run."""

from __future__ import annotations

import os
import time

from grpo.rewards import RewardFunction, RewardResult, reward_function


class SleepyReward(RewardFunction):
    """Hangs (sleeping) on completions containing HANG."""

    name = "sleepy"
    failure_reward = -1.0

    def __call__(self, completion: str, answer: str) -> RewardResult:
        if "HANG" in completion:
            time.sleep(120)
        return RewardResult(0.25, True)


class SpinningReward(RewardFunction):
    """Hangs in a pure-Python busy loop on completions containing SPIN."""

    name = "spinning"
    failure_reward = -3.0

    def __call__(self, completion: str, answer: str) -> RewardResult:
        while "SPIN" in completion:
            pass
        return RewardResult(0.75, True)


class SlowReward(RewardFunction):
    """Takes 0.3 s per call: within a 1 s timeout alone, over it four at a time."""

    name = "slow"

    def __call__(self, completion: str, answer: str) -> RewardResult:
        time.sleep(0.3)
        return RewardResult(float(len(completion)), True)


class RaisingReward(RewardFunction):
    """Raises on completions containing BOOM."""

    name = "raising"
    failure_reward = -2.0

    def __call__(self, completion: str, answer: str) -> RewardResult:
        if "BOOM" in completion:
            raise RuntimeError("boom")
        return RewardResult(0.5, False)


class CrashingReward(RewardFunction):
    """Kills its own process on completions containing CRASH."""

    name = "crashing"
    failure_reward = -4.0

    def __call__(self, completion: str, answer: str) -> RewardResult:
        if "CRASH" in completion:
            os._exit(3)
        return RewardResult(1.0, True)


def _refuse_to_load() -> None:
    raise ImportError("this reward cannot be loaded in a worker")


class UnloadableReward(RewardFunction):
    """Pickles in the parent but fails to unpickle (like a module missing in the worker)."""

    name = "unloadable"
    failure_reward = -5.0

    def __call__(self, completion: str, answer: str) -> RewardResult:
        return RewardResult(1.0, True)

    def __reduce__(self):
        return (_refuse_to_load, ())


@reward_function(name="has_digit", failure_reward=-1.0)
def has_digit_reward(completion: str, answer: str, bonus: float = 1.0) -> tuple[float, bool]:
    found = any(character.isdigit() for character in completion)
    return (bonus if found else 0.0), found
