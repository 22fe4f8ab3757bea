"""Reward functions as users write them, some broken on purpose, for tests and drills (in the
package because worker processes import them by name)."""

from __future__ import annotations

from typing import Any


def misspelt_short(completion: str, answer: str) -> tuple[float, bool]:
    """A plain per-sample reward with a typo in its body: every call raises NameError."""
    return float(len(completon) < 50), True  # noqa: F821 (the typo)


def plain_float(completion: str, answer: str) -> float:
    """A plain per-sample reward that returns a float: 1 if the answer is in the completion."""
    return float(answer in completion)


def short_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """A batched reward as TRL writes them: 1 for a completion under 50 characters."""
    return [float(len(completion) < 50) for completion in completions]
