"""How a reward function's calls went in one generation batch, for the driver's guard.

A reward call that raises or times out scores the function's ``failure_reward`` and the run
goes on (`grpo.rewards.batched_rewards`). A function that fails nearly every call (a typo in
its body) would leave the run training on failure rewards alone: the environment counts each
batch's calls per function (`RewardCalls`), the collector hands them to the driver, and the
driver stops such a run, naming the function, the exception and its line
(`grpo.orchestrator.reward_failures`).

Pure Python: no torch, Ray or vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class RewardCalls:
    """One reward function's calls in one generation batch.

    Args:
        calls (int): Calls made (one per scored episode).
        timeouts (int): Of them, calls that overran ``reward_timeout_s``.
        exceptions (int): Of them, calls that raised, returned what is no reward, or whose
            worker died.
        reason (str | None): Why: the first exception (type, message and the line of the
            function's code that raised), else the first timeout; None when none failed.
    """

    calls: int
    timeouts: int = 0
    exceptions: int = 0
    reason: str | None = None

    @property
    def failed(self) -> int:
        """Calls that scored the failure reward."""
        return self.timeouts + self.exceptions

    def merged(self, other: RewardCalls) -> RewardCalls:
        """Both batches' calls together; the reason of an exception before a timeout's."""
        reason = self.reason if self.exceptions or not other.exceptions else other.reason
        return RewardCalls(
            self.calls + other.calls,
            self.timeouts + other.timeouts,
            self.exceptions + other.exceptions,
            reason or other.reason,
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> RewardCalls:
        return cls(**value)
