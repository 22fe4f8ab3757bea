"""Groups on the driver: scored and kept per step, the reward distribution of the first
episodes, and the guard that stops a run whose groups all have equal rewards.

A task the model cannot yet score on (every answer wrong, or every try alike) gives groups
whose rewards are all equal: every advantage is zero and nothing is learned. The first
`FIRST_EPISODES` episodes' rewards are reported once (`GroupCounts.scored`): a warning on the
terminal, with what to change, when every group was equal; a line in the driver's log
otherwise.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from grpo.errors import NoInformativeGroupsError
from grpo.observability.metric_names import GROUPS_KEPT, GROUPS_SCORED, ZERO_VARIANCE_GROUPS

log = logging.getLogger("grpo")

# Episodes whose reward distribution is reported once, at the start of the run: enough groups
# to tell a task the model cannot score on from bad luck, few enough to come within a minute.
FIRST_EPISODES = 64
# Distinct reward values a distribution lists one by one; more are given as a range.
_VALUES_LISTED = 6
# What makes the groups of a task differ, for the warning and the error.
ADVICE = (
    "raise inference.group_size (more tries per prompt), add partial-credit or format rewards "
    "to reward_functions, start from a stronger model, or raise inference.temperature"
)


class RewardCounts:
    """Total rewards of scored groups: how many episodes had each value, how many groups had
    all their rewards equal (`grpo.objective.advantages.zero_variance_groups`).

    Example:
        >>> counts = RewardCounts()
        >>> counts.add([[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
        >>> counts.text()
        'mean 0.12, 1 of 2 groups differ (0.0: 7, 1.0: 1)'
    """

    def __init__(self) -> None:
        self.values: Counter[float] = Counter()
        self.episodes = 0
        self.groups = 0
        self.equal_groups = 0
        self.total = 0.0

    def add(self, group_rewards: Sequence[Sequence[float]]) -> None:
        """Count groups, each given as its episodes' total rewards."""
        for rewards in group_rewards:
            self.groups += 1
            self.equal_groups += len(set(rewards)) <= 1  # exactly equal, as the advantages
            self.episodes += len(rewards)
            self.total += float(sum(rewards))
            # Rounded for the text only; + 0.0 counts -0.0 as 0.0.
            self.values.update(round(float(reward), 3) + 0.0 for reward in rewards)

    @property
    def all_equal(self) -> bool:
        """Whether every group counted had equal rewards (and there was one)."""
        return self.groups > 0 and self.equal_groups == self.groups

    def text(self) -> str:
        """``mean 0.00, all 16 groups equal (0.0: 64)``: the mean, the groups, the values."""
        mean = self.total / max(self.episodes, 1)
        if self.all_equal:
            groups = f"all {self.groups} groups equal" if self.groups > 1 else "the one group equal"
        else:
            groups = f"{self.groups - self.equal_groups} of {self.groups} groups differ"
        if len(self.values) <= _VALUES_LISTED:
            values = ", ".join(f"{value}: {count}" for value, count in sorted(self.values.items()))
        else:
            values = f"{len(self.values)} values from {min(self.values)} to {max(self.values)}"
        return f"mean {mean:.2f}, {groups} ({values})"


class GroupCounts:
    """Groups scored, kept and with equal rewards per training step; the first episodes'
    rewards; the dynamic-sampling guard.

    The driver reports each reference call's groups (`scored`). Once `FIRST_EPISODES`
    episodes were scored it reports their reward distribution, once: a warning with `ADVICE`
    (what makes groups differ) when every group had equal rewards, else a line in the log.
    `step_metrics` returns the
    counts since the previous step and starts counting afresh, so the sum over steps is every
    group scored. With ``filtering`` (``ref.filter_zero_variance_groups``), groups with
    equal rewards are dropped before the buffer and the run keeps generating until a batch is
    full; if every group keeps having equal rewards, no batch ever fills. `check` turns that
    into an error instead of a silent hang: it raises once groups have come back
    uninformative, and none informative, for ``timeout_s`` seconds of waiting for a batch. A
    warning comes first, once per such streak, after a quarter of that time (unless the first
    episodes' report already warned during it). Streaks of a few
    batches' worth of dropped groups are normal once the policy is good at most prompts (each
    dropped group just costs a generation), so the warning is about time, not a count.

    Groups of episodes that mostly failed have equal rewards too (the few episodes left score
    alike, or all score a reward function's failure reward): when one of ``causes`` says many
    episodes were dropped or many reward calls failed, the warning and the error name that
    instead of the task.

    Args:
        filtering (bool): ``ref.filter_zero_variance_groups``.
        timeout_s (float): ``orchestration.equal_rewards_timeout_s``.
        causes (Sequence): Guards whose ``note()`` may explain equal rewards: the driver's
            `grpo.orchestrator.episode_drops.EpisodeDrops` and
            `grpo.orchestrator.reward_failures.RewardFailures`.
        first_episodes (int): Episodes whose reward distribution is reported.
    """

    def __init__(
        self,
        filtering: bool,
        timeout_s: float,
        causes: Sequence[Any] = (),
        first_episodes: int = FIRST_EPISODES,
    ) -> None:
        self.filtering = filtering
        self.timeout_s = timeout_s
        self.causes = tuple(causes)
        self.first_episodes = first_episodes
        # The first episodes' rewards, until reported; then None.
        self.first: RewardCounts | None = RewardCounts()
        # The rewards of the groups dropped in a row (`dropped_in_a_row`).
        self.streak = RewardCounts()
        self.scored_groups = 0
        self.kept_groups = 0
        self.zero_variance = 0
        # Groups dropped in a row since the last kept one, and when the first of them came.
        self.dropped_in_a_row = 0
        self._streak_since: float | None = None
        self._warned = False

    def scored(
        self,
        num_groups: int,
        num_zero_variance: int,
        num_dropped: int,
        group_rewards: Sequence[Sequence[float]] | None = None,
    ) -> None:
        """Count one reference call's groups.

        Args:
            num_groups (int): Groups it scored.
            num_zero_variance (int): Of them, groups whose rewards were all equal.
            num_dropped (int): Of those, groups it left out (all of them when filtering).
            group_rewards (Sequence | None): Each group's total rewards, one per episode
                (for the first episodes' report and the error); None: not known.
        """
        self.scored_groups += num_groups
        self.kept_groups += num_groups - num_dropped
        self.zero_variance += num_zero_variance
        if self.filtering and num_groups:
            if num_dropped < num_groups:
                self.dropped_in_a_row, self._streak_since, self._warned = 0, None, False
                self.streak = RewardCounts()
            else:
                if self._streak_since is None:
                    self._streak_since = time.monotonic()
                self.dropped_in_a_row += num_dropped
                self.streak.add(group_rewards or ())
        if self.first is not None and group_rewards:
            self.first.add(group_rewards)
            if self.first.episodes >= self.first_episodes:
                self._report_first()

    def _report_first(self) -> None:
        """Say what the first episodes scored, once: a warning when no group's rewards
        differed (with what to change, or the environment's failures when those explain it)."""
        first, self.first = self.first, None
        line = f"rewards of the first {first.episodes} episodes: {first.text()}"
        if not first.all_equal:
            log.info("%s", line)
            return
        dropped = self._cause()
        if dropped is not None:
            log.warning("%s; %s", line, dropped)
        elif self.filtering:
            log.warning(
                "%s. Every advantage is zero: nothing is learned from a group whose episodes "
                "all score alike. To make them differ, %s. ref.filter_zero_variance_groups=true "
                "drops such groups and generates more; the run stops after "
                "orchestration.equal_rewards_timeout_s (%g s) of waiting without a group whose "
                "rewards differ (ref.filter_zero_variance_groups=false trains on them instead, "
                "learning nothing from them).",
                line,
                ADVICE,
                self.timeout_s,
            )
        else:
            log.warning(
                "%s. Every advantage is zero: nothing is learned from a group whose episodes "
                "all score alike, and the run trains on such groups. To make them differ, %s.",
                line,
                ADVICE,
            )
        if self._streak_since is not None:
            self._warned = True  # this was the streak's warning

    def _cause(self) -> str | None:
        """The first of ``causes``' notes, or None."""
        return next((note for cause in self.causes if (note := cause.note()) is not None), None)

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
        dropped = self._cause()
        rewards = f"; rewards {self.streak.text()}" if self.streak.groups else ""
        if not self._warned and waited > self.timeout_s / 4:
            self._warned = True
            if dropped is not None:
                log.warning("no group with differing rewards for %.0f s: %s", waited, dropped)
            else:
                log.warning(
                    "no group with differing rewards for %.0f s of waiting: the last %d groups "
                    "all had equal rewards%s, and were dropped (ref.filter_zero_variance_groups="
                    "true); generating more. The run stops after "
                    "orchestration.equal_rewards_timeout_s (%g s).",
                    waited,
                    self.dropped_in_a_row,
                    rewards,
                    self.timeout_s,
                )
        if waited > self.timeout_s and dropped is not None:
            raise NoInformativeGroupsError(
                f"no training batch for {waited:.0f} s: every group had equal rewards "
                f"({self.dropped_in_a_row} groups in a row{rewards}) and {dropped}. Fix that "
                "first; ref.filter_zero_variance_groups=true drops such groups "
                f"(orchestration.equal_rewards_timeout_s={self.timeout_s:g})."
            )
        if waited > self.timeout_s:
            raise NoInformativeGroupsError(
                f"no training batch for {waited:.0f} s: every group had equal rewards "
                f"({self.dropped_in_a_row} groups in a row{rewards}), and "
                "ref.filter_zero_variance_groups=true drops such groups "
                f"(orchestration.equal_rewards_timeout_s={self.timeout_s:g}). Check that the "
                f"reward functions can tell this model's answers apart: {ADVICE}; or set "
                "ref.filter_zero_variance_groups=false to train on them (learning nothing "
                "from them)."
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
