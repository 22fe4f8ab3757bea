"""Episodes the environment failed: scored or dropped, and why, said in full and said once.

An environment that raises ends that episode only. A broken one fails every episode the same
way, thousands of times an hour, so each distinct reason is logged once and then counted; the
driver stops a run whose environment fails nearly every episode. Pure Python.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# Re-exported: environments name their failures with these (`grpo.tracebacks`).
from grpo.tracebacks import cause_first as cause_first
from grpo.tracebacks import exception_name as exception_name
from grpo.tracebacks import failure_reason as _failure_reason
from grpo.tracebacks import last_frame as last_frame

log = logging.getLogger(__name__)

# This package's own frames are the machinery that called the environment, not where it raised.
_ENVS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def failure_reason(error: BaseException) -> str:
    """Why an episode failed: the exception and where in the environment's code it raised.

    Returns:
        str: e.g. ``KeyError: 'anwser' (at /home/me/my_env.py:31 in env_response:
        return state["anwser"])``.
    """
    return _failure_reason(error, machinery=(_ENVS_DIR,))


def scored_episodes(env: Any, episodes: Sequence[Any]) -> tuple[list[Any], list[dict[str, float]]]:
    """The episodes of a batch that go into their groups, and their rewards, in order.

    Failed episodes (``error``) are left out unless ``env.failed_episodes`` is ``"score"``:
    then each stays, marked ``failure_scored``, with `failure_rewards` and no success. A failed
    episode without a policy token, or whose reward names are unknown, is left out all the same.

    Returns:
        tuple: The episodes kept, in order, and one rewards dict per kept episode.
    """
    completed = [episode for episode in episodes if episode.error is None]
    rewards = env.score(completed) if completed else []
    failed = [episode for episode in episodes if episode.error is not None]
    if not failed or env.failed_episodes != "score":
        return completed, rewards
    failure = env.failure_rewards()
    if failure is None:
        names = list(rewards[0]) if rewards else env.reward_names()
        if names is None:
            return completed, rewards
        failure = dict.fromkeys(names, 0.0)
    by_episode = {id(episode): reward for episode, reward in zip(completed, rewards)}
    kept: list[Any] = []
    kept_rewards: list[dict[str, float]] = []
    for episode in episodes:
        if episode.error is None:
            kept_rewards.append(by_episode[id(episode)])
        elif sum(episode.turn_lengths) > 0:
            episode.failure_scored = True
            episode.successes = dict.fromkeys(failure, 0.0)
            kept_rewards.append(dict(failure))
        else:
            continue
        kept.append(episode)
    return kept, kept_rewards


@dataclass(frozen=True)
class BatchDrops:
    """One generation batch's episodes and those the environment failed, for the driver's guard.

    Args:
        dropped (int): Of ``episodes``, those the environment failed (dropped or ``scored``).
        reason (str | None): The most common reason among them (None when none failed).
        scored (int): Of the failed episodes, those kept in their groups with the failure
            rewards.
    """

    episodes: int
    dropped: int
    reason: str | None = None
    reason_count: int = 0
    scored: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> BatchDrops:
        return cls(**value)


class DroppedEpisodeLog:
    """Counts failed episodes by reason; logs each reason once, then its count now and then.

    A reason is logged in full the first time; later episodes failed for it are reported as one
    count per reason at most every ``every_s`` seconds (and on `flush`). Past ``max_reasons``
    distinct reasons, new ones are counted together as `OTHER_REASONS`. Thread-safe.

    Args:
        every_s (float): Least seconds between two reports of the same reason's count.
        clock (Callable[[], float]): The time (``time.monotonic``; tests pass their own).
    """

    OTHER_REASONS = "other reasons (only the first ones are logged in full)"

    def __init__(
        self,
        name: str,
        every_s: float = 30.0,
        max_reasons: int = 10,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.every_s = every_s
        self.max_reasons = max_reasons
        self._clock = clock
        self.totals: Counter[str] = Counter()
        self._unreported: Counter[str] = Counter()
        # What became of the episodes failed for each reason, as its latest batch said.
        self._fates: dict[str, str] = {}
        self._reported_at = clock()
        self._lock = threading.Lock()

    def record(self, episodes: Iterable[Any], environment: str = "the environment") -> BatchDrops:
        """Count one batch's failed episodes (``error`` set; ``failure_scored`` ones were kept)
        and log as the class says; ``environment`` names it in each reason's first line."""
        episodes = list(episodes)
        batch = Counter(e.error for e in episodes if e.error is not None)
        dropped = sum(batch.values())
        scored = sum(1 for e in episodes if e.error is not None and e.failure_scored)
        fate = "were dropped"
        if scored and scored == dropped:
            fate = "were scored with the failure reward"
        with self._lock:
            counts: Counter[str] = Counter()
            for reason, count in batch.most_common():
                seen = self.totals.keys() | counts.keys()
                if reason not in seen and len(seen) >= self.max_reasons:
                    reason = self.OTHER_REASONS
                counts[reason] += count
            for reason, count in counts.items():
                if reason not in self.totals:
                    log.warning(
                        "%s: %d of the %d episodes of a batch %s because %s failed "
                        "(later ones for the same reason are counted in a line every %.0f s): %s",
                        self.name,
                        count,
                        len(episodes),
                        fate,
                        environment,
                        self.every_s,
                        reason,
                    )
                else:
                    self._unreported[reason] += count
                self.totals[reason] += count
                self._fates[reason] = fate
            if self._clock() - self._reported_at >= self.every_s:
                self._report()
        if not batch:
            return BatchDrops(len(episodes), 0)
        reason, count = batch.most_common(1)[0]
        return BatchDrops(len(episodes), dropped, reason, count, scored)

    def flush(self) -> None:
        """Report the counts not reported yet now."""
        with self._lock:
            self._report()

    def _report(self) -> None:
        for reason, count in self._unreported.most_common():
            log.warning(
                "%s: %d more episodes %s for the same reason (%d in all): %s",
                self.name,
                count,
                self._fates.get(reason, "were dropped").removeprefix("were "),
                self.totals[reason],
                reason.splitlines()[0],
            )
        self._unreported.clear()
        self._reported_at = self._clock()
