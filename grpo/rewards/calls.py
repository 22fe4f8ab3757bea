"""How a reward function's calls went in one generation batch, for the driver, which stops a
run whose reward fails nearly every call. Pure Python: no torch, Ray or vLLM."""

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
        exceptions (int): Of them, calls that raised, returned no reward, or whose worker died.
        reason (str | None): The first exception (with the line that raised), else the first
            timeout; None when none failed.
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
