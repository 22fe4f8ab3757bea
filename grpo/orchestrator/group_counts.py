"""Dynamic sampling's bookkeeping on the driver: groups scored and kept per step, and the guard
that stops a run whose groups all have equal rewards."""

from __future__ import annotations

import logging
import time
from typing import Any

from grpo.errors import NoInformativeGroupsError
from grpo.observability.metric_names import GROUPS_KEPT, GROUPS_SCORED, ZERO_VARIANCE_GROUPS

log = logging.getLogger("grpo")


class GroupCounts:
    """Groups scored, kept and with equal rewards per training step; the dynamic-sampling guard.

    The driver reports each reference call's groups (`scored`). `step_metrics` returns the
    counts since the previous step and starts counting afresh, so the sum over steps is every
    group scored. With ``filtering`` (``ref.filter_zero_variance_groups``), groups with
    equal rewards are dropped before the buffer and the run keeps generating until a batch is
    full; if every group keeps having equal rewards, no batch ever fills. `check` turns that
    into an error instead of a silent hang: it raises once groups have come back
    uninformative, and none informative, for ``timeout_s`` seconds of waiting for a batch. A
    warning comes first, once per such streak, after a quarter of that time. Streaks of a few
    batches' worth of dropped groups are normal once the policy is good at most prompts (each
    dropped group just costs a generation), so the warning is about time, not a count.

    Groups of episodes that mostly failed have equal rewards too (the few episodes left score
    alike): when ``episode_drops`` says many episodes were dropped, the warning and the error
    name that instead of the rewards.

    Args:
        filtering (bool): ``ref.filter_zero_variance_groups``.
        timeout_s (float): ``orchestration.stall_timeout_s``.
        episode_drops: The driver's `grpo.orchestrator.episode_drops.EpisodeDrops` (its
            ``note()``), or None.
    """

    def __init__(self, filtering: bool, timeout_s: float, episode_drops: Any = None) -> None:
        self.filtering = filtering
        self.timeout_s = timeout_s
        self.episode_drops = episode_drops
        self.scored_groups = 0
        self.kept_groups = 0
        self.zero_variance = 0
        # Groups dropped in a row since the last kept one, and when the first of them came.
        self.dropped_in_a_row = 0
        self._streak_since: float | None = None
        self._warned = False

    def scored(self, num_groups: int, num_zero_variance: int, num_dropped: int) -> None:
        """Count one reference call's groups.

        Args:
            num_groups (int): Groups it scored.
            num_zero_variance (int): Of them, groups whose rewards were all equal.
            num_dropped (int): Of those, groups it left out (all of them when filtering).
        """
        self.scored_groups += num_groups
        self.kept_groups += num_groups - num_dropped
        self.zero_variance += num_zero_variance
        if not self.filtering or not num_groups:
            return
        if num_dropped < num_groups:
            self.dropped_in_a_row, self._streak_since, self._warned = 0, None, False
            return
        if self._streak_since is None:
            self._streak_since = time.monotonic()
        self.dropped_in_a_row += num_dropped

    def check(self, waiting_since: float) -> None:
        """Raise if the driver waited for a batch while only uninformative groups came.

        Args:
            waiting_since (float): ``time.monotonic()`` when the driver began waiting for the
                current batch; only time spent waiting counts (evaluation, checkpoints and
                training steps in between do not).

        Raises:
            NoInformativeGroupsError: Groups came back, every one with equal rewards, and
                none with differing rewards, for ``timeout_s`` seconds of waiting.
        """
        if self._streak_since is None:
            return
        waited = time.monotonic() - max(self._streak_since, waiting_since)
        dropped = self.episode_drops.note() if self.episode_drops is not None else None
        if not self._warned and waited > self.timeout_s / 4:
            self._warned = True
            if dropped is not None:
                log.warning("no group with differing rewards for %.0f s: %s", waited, dropped)
            else:
                log.warning(
                    "no group with differing rewards for %.0f s of waiting: the last %d groups "
                    "all had equal rewards and were dropped (ref.filter_zero_variance_groups="
                    "true); generating more. The run stops after "
                    "orchestration.stall_timeout_s (%g s).",
                    waited,
                    self.dropped_in_a_row,
                    self.timeout_s,
                )
        if waited > self.timeout_s and dropped is not None:
            raise NoInformativeGroupsError(
                f"no training batch for {waited:.0f} s: every group had equal rewards "
                f"({self.dropped_in_a_row} groups in a row) and {dropped}. Fix the environment; "
                f"ref.filter_zero_variance_groups=true drops such groups "
                f"(orchestration.stall_timeout_s={self.timeout_s:g})."
            )
        if waited > self.timeout_s:
            raise NoInformativeGroupsError(
                f"no training batch for {waited:.0f} s: every group had equal rewards "
                f"({self.dropped_in_a_row} groups in a row), and "
                "ref.filter_zero_variance_groups=true drops such groups "
                f"(orchestration.stall_timeout_s={self.timeout_s:g}). Check that the reward "
                "functions can tell this model's answers apart, raise inference.temperature or "
                "inference.group_size, or set ref.filter_zero_variance_groups=false."
            )

    def step_metrics(self) -> dict[str, float]:
        """The counts since the previous call (one training step), then zero them.

        Returns:
            dict[str, float]: `GROUPS_SCORED`, `GROUPS_KEPT` (passed on to the buffer) and
            `ZERO_VARIANCE_GROUPS` (equal rewards; dropped when filtering, else kept).
        """
        metrics = {
            GROUPS_SCORED: float(self.scored_groups),
            GROUPS_KEPT: float(self.kept_groups),
            ZERO_VARIANCE_GROUPS: float(self.zero_variance),
        }
        self.scored_groups = self.kept_groups = self.zero_variance = 0
        return metrics
