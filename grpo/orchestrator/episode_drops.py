"""The guard that stops a run whose environment fails nearly every episode.

An environment that raises ends that episode and the run goes on (`grpo.envs.rollout`); the
episode is dropped, or kept in its group with the failure rewards (``failed_episodes: score``),
and counts as failed either way. One
that raises on nearly every episode (a typo in its code, a tool server that is down) leaves
nothing to train on, and the loop would wait forever: batches keep coming back, so the stall
check never fires, and with dynamic sampling the few episodes that got through have equal
rewards, which `GroupCounts` would blame on the rewards. Each collector reports its batches'
episodes, those dropped and their most common reason (`grpo.envs.dropped.BatchDrops`); this
guard stops the run once the last few batches dropped nearly all of theirs.

The threshold is a fraction, not "all": an environment that always raises still lets through
the episodes that end before reaching the raising line (a first turn cut at its token limit),
and those train on nothing. Pure Python; no Ray.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Any

from grpo.envs.dropped import BatchDrops
from grpo.errors import EnvironmentFailingError

# The run stops when, over the last `MIN_BATCHES` batches (more, until they hold
# `MIN_EPISODES` episodes), at least `MIN_DROPPED_FRACTION` of the episodes were dropped.
MIN_BATCHES = 3
MIN_EPISODES = 16
MIN_DROPPED_FRACTION = 0.9
# Of a shorter window, this fraction dropped is enough for other guards to name the
# environment, not the rewards, as the likely cause (`note`).
NOTE_FRACTION = 0.5
# Batches remembered: enough to gather `MIN_EPISODES` from batches of one episode.
_HISTORY = 64


class EpisodeDrops:
    """Dropped episodes per generation batch, and the guard on them.

    The driver reports every finished batch (`batch`, in the order they come back from any
    collector) and asks `check` while it waits for training data.

    Args:
        output_hint (Callable[[int], str]): Where collector ``i``'s log is, for the message
            (`grpo.orchestrator.supervisor.ActorSupervisor.output_hint`).
        min_batches (int): Batches the window holds at least.
        min_episodes (int): Episodes the window holds at least.
        min_fraction (float): Fraction of them dropped that stops the run.
    """

    def __init__(
        self,
        output_hint: Callable[[int], str] = lambda index: "",
        min_batches: int = MIN_BATCHES,
        min_episodes: int = MIN_EPISODES,
        min_fraction: float = MIN_DROPPED_FRACTION,
    ) -> None:
        self.output_hint = output_hint
        self.min_batches = min_batches
        self.min_episodes = min_episodes
        self.min_fraction = min_fraction
        # (collector index, its batch), newest last.
        self._batches: deque[tuple[int, BatchDrops]] = deque(maxlen=_HISTORY)

    def batch(self, collector: int, drops: Mapping[str, Any] | None) -> None:
        """Count one generation batch of collector ``collector``.

        Args:
            collector (int): The collector's index.
            drops (Mapping | None): Its `BatchDrops` as a dict; None for a batch without an
                environment (single-turn sampling drops no episode).
        """
        if drops is None:
            return
        batch = BatchDrops.from_dict(drops)
        if batch.episodes:
            self._batches.append((collector, batch))

    def _window(self, min_batches: int, min_episodes: int) -> list[tuple[int, BatchDrops]]:
        """The newest batches holding at least ``min_batches`` batches and ``min_episodes``
        episodes; empty if all of them together hold fewer."""
        window: list[tuple[int, BatchDrops]] = []
        episodes = 0
        for collector, batch in reversed(self._batches):
            window.append((collector, batch))
            episodes += batch.episodes
            if len(window) >= min_batches and episodes >= min_episodes:
                return window
        return []

    @staticmethod
    def _counts(window: list[tuple[int, BatchDrops]]) -> tuple[int, int]:
        episodes = sum(batch.episodes for _, batch in window)
        return sum(batch.dropped for _, batch in window), episodes

    @staticmethod
    def _fate(window: list[tuple[int, BatchDrops]]) -> str:
        """What became of the window's failed episodes, as the messages say it."""
        dropped = sum(batch.dropped - batch.scored for _, batch in window)
        return "were dropped" if dropped else "were scored with the failure reward"

    @staticmethod
    def _most_common(window: list[tuple[int, BatchDrops]]) -> tuple[str, int, int]:
        """The reason most episodes of the window were dropped for, their number, and the
        collector that reported it most."""
        reasons: Counter[str] = Counter()
        reporters: Counter[tuple[str, int]] = Counter()
        for collector, batch in window:
            if batch.reason is not None:
                reasons[batch.reason] += batch.reason_count
                reporters[batch.reason, collector] += batch.reason_count
        reason, count = reasons.most_common(1)[0]
        collector = max(
            (c for r, c in reporters if r == reason), key=lambda c: reporters[reason, c]
        )
        return reason, count, collector

    def check(self) -> None:
        """Raise if the environment failed nearly every episode of the last batches.

        Raises:
            EnvironmentFailingError: At least ``min_fraction`` of the episodes of the last
                ``min_batches`` batches (at least ``min_episodes`` episodes) failed (dropped,
                or scored with the failure rewards); the
                message names the most common reason in full and the log that counts them all.
        """
        window = self._window(self.min_batches, self.min_episodes)
        if not window:
            return
        dropped, episodes = self._counts(window)
        if dropped < self.min_fraction * episodes:
            return
        reason, count, collector = self._most_common(window)
        # The first line says it all (the terminal shows it); a long reason follows whole.
        head, _, rest = reason.partition("\n")
        raise EnvironmentFailingError(
            f"the environment failed nearly every episode: {dropped} of the {episodes} episodes "
            f"of the last {len(window)} generation batches {self._fate(window)} because it raised "
            f"({count} of them: {head}). Each reason is logged once, with its count, by the "
            f"collectors{self.output_hint(collector)}. Fix the environment and start the run again "
            f"(the run stops once {self.min_fraction:.0%} of at least {self.min_episodes} "
            f"episodes in {self.min_batches} batches fail, scored or dropped)."
            + (f"\nThe reason in full:\n{rest}" if rest else "")
        )

    def note(self) -> str | None:
        """Why other guards should blame the environment: "N of the last M episodes were
        dropped (or scored with the failure reward) ...", when at least half of the newest few
        failed; else None."""
        window = self._window(1, self.min_episodes)
        if not window:
            window = list(reversed(self._batches))
        if not window:
            return None
        dropped, episodes = self._counts(window)
        if not dropped or dropped < NOTE_FRACTION * episodes:
            return None
        reason, _, collector = self._most_common(window)
        return (
            f"{dropped} of the last {episodes} episodes {self._fate(window)} because the "
            f"environment raised (most often: {reason.splitlines()[0]}; each reason is logged by the "
            f"collectors{self.output_hint(collector)})"
        )
