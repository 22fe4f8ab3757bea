"""The guard that stops a run whose reward function fails nearly every call.

A reward call that raises or times out scores the function's ``failure_reward``, is counted
(``inference/reward_failures_func_<name>``) and the run goes on (`grpo.rewards.batched_rewards`):
a reward that fails now and then (a parser choking on odd output) must not stop a run. One
that fails nearly every call (a typo in its body, a checker that always hangs) trains the
policy on the failure reward alone, and nothing else would notice: batches keep coming and
steps keep training. Each collector reports its batches' calls per reward function
(`grpo.rewards.calls.RewardCalls`); this guard stops the run once nearly every call of one
function in the last few batches failed, naming the function, the exception and the line of
its code that raised (or that it timed out).

The thresholds mirror the environment's guard (`grpo.orchestrator.episode_drops`). Pure
Python; no Ray.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Any

from grpo.errors import RewardFailingError
from grpo.rewards.calls import RewardCalls

# The run stops when, over the last `MIN_BATCHES` batches that called a reward function (more,
# until they hold `MIN_CALLS` calls), at least `MIN_FAILED_FRACTION` of its calls failed.
MIN_BATCHES = 3
MIN_CALLS = 16
MIN_FAILED_FRACTION = 0.9
# Of a shorter window, this fraction failed is enough for other guards to name the reward
# function, not the task, as the likely cause (`note`).
NOTE_FRACTION = 0.5
# Batches remembered: enough to gather `MIN_CALLS` calls from batches of one episode.
_HISTORY = 64


class RewardFailures:
    """Reward calls per generation batch and function, and the guard on them.

    The driver reports every finished batch (`batch`, in the order they come back from any
    collector) and asks `check` after each.

    Args:
        output_hint (Callable[[int], str]): Where collector ``i``'s log is, for the message
            (`grpo.orchestrator.supervisor.ActorSupervisor.output_hint`).
        min_batches (int): Batches the window holds at least.
        min_calls (int): Calls of the function the window holds at least.
        min_fraction (float): Fraction of them failed that stops the run.
    """

    def __init__(
        self,
        output_hint: Callable[[int], str] = lambda index: "",
        min_batches: int = MIN_BATCHES,
        min_calls: int = MIN_CALLS,
        min_fraction: float = MIN_FAILED_FRACTION,
    ) -> None:
        self.output_hint = output_hint
        self.min_batches = min_batches
        self.min_calls = min_calls
        self.min_fraction = min_fraction
        # (collector index, its batch's calls by reward name), newest last.
        self._batches: deque[tuple[int, dict[str, RewardCalls]]] = deque(maxlen=_HISTORY)

    def batch(self, collector: int, calls: Mapping[str, Mapping[str, Any]] | None) -> None:
        """Count one generation batch of collector ``collector``.

        Args:
            collector (int): The collector's index.
            calls (Mapping | None): Its reward calls by reward name (`RewardCalls.as_dict`);
                None or empty for a batch that called no reward function.
        """
        made = {name: RewardCalls.from_dict(value) for name, value in (calls or {}).items()}
        made = {name: value for name, value in made.items() if value.calls}
        if made:
            self._batches.append((collector, made))

    def _window(self, name: str, min_batches: int | None = None) -> list[tuple[int, RewardCalls]]:
        """The newest batches that called ``name``, holding at least ``min_batches`` batches
        (default ``self.min_batches``) and ``min_calls`` calls; empty if all of them together
        hold fewer."""
        min_batches = self.min_batches if min_batches is None else min_batches
        window: list[tuple[int, RewardCalls]] = []
        calls = 0
        for collector, batch in reversed(self._batches):
            if name not in batch:
                continue
            window.append((collector, batch[name]))
            calls += batch[name].calls
            if len(window) >= min_batches and calls >= self.min_calls:
                return window
        return []

    def _names(self) -> list[str]:
        return list(dict.fromkeys(name for _, batch in self._batches for name in batch))

    def note(self) -> str | None:
        """Why other guards should blame a reward function: "N of the last M calls of reward
        function 'x' failed ...", when at least half of its newest calls (one batch, or more
        until ``min_calls``) failed, before this guard has seen enough batches to stop the run;
        else None."""
        for name in self._names():
            window = self._window(name, min_batches=1)
            if not window:
                continue
            calls = sum(made.calls for _, made in window)
            failed = sum(made.timeouts + made.exceptions for _, made in window)
            if failed < NOTE_FRACTION * calls:
                continue
            reason, collector = self._most_common(window)
            head = (reason or "no reason given").partition("\n")[0]
            return (
                f"{failed} of the last {calls} calls of reward function {name!r} failed, "
                f"scoring its failure_reward (most often: {head}; each reason is logged by the "
                f"collectors{self.output_hint(collector)})"
            )
        return None

    @staticmethod
    def _most_common(window: list[tuple[int, RewardCalls]]) -> tuple[str | None, int]:
        """Why most calls of the window failed (an exception before a timeout), and the
        collector that reported it most."""
        reasons: Counter[str] = Counter()
        reporters: Counter[tuple[str, int]] = Counter()
        raised = any(calls.exceptions for _, calls in window)
        for collector, calls in window:
            count = calls.exceptions if raised else calls.timeouts
            if calls.reason is not None and count:
                reasons[calls.reason] += count
                reporters[calls.reason, collector] += count
        if not reasons:
            return None, window[0][0]
        reason = reasons.most_common(1)[0][0]
        collector = max(
            (c for r, c in reporters if r == reason), key=lambda c: reporters[reason, c]
        )
        return reason, collector

    def check(self) -> None:
        """Raise if nearly every call of a reward function in the last batches failed.

        Raises:
            RewardFailingError: At least ``min_fraction`` of the calls of one reward function
                in the last ``min_batches`` batches that called it (at least ``min_calls``
                calls) raised or timed out; the message names the function, how many raised
                and how many timed out, and the most common reason in full (the exception,
                its message and the line of the function's code that raised).
        """
        for name in self._names():
            window = self._window(name)
            if not window:
                continue
            calls = sum(made.calls for _, made in window)
            timeouts = sum(made.timeouts for _, made in window)
            exceptions = sum(made.exceptions for _, made in window)
            if timeouts + exceptions < self.min_fraction * calls:
                continue
            reason, collector = self._most_common(window)
            how = [f"{exceptions} raised"] if exceptions else []
            how += [f"{timeouts} timed out (over reward_timeout_s)"] if timeouts else []
            # The first line says it all (the terminal shows it); a long reason follows whole.
            head, _, rest = (reason or "").partition("\n")
            raise RewardFailingError(
                f"reward function {name!r} failed nearly every call: {timeouts + exceptions} "
                f"of its {calls} calls in the last {len(window)} generation batches failed "
                f"({' and '.join(how)}): {head or 'no reason given'}. Each failed call scores "
                "the function's failure_reward; the first failure of each batch is logged by "
                f"the collectors{self.output_hint(collector)}. Fix the reward function and "
                f"start the run again (the run stops once {self.min_fraction:.0%} of at least "
                f"{self.min_calls} calls of a reward function in {self.min_batches} batches "
                "fail)." + (f"\nThe reason in full:\n{rest}" if rest else "")
            )
